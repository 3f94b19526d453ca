"""A learning rate far too high with the usual clip at 1.0: after the first step the true gradient norm is
~1e28, every gradient value finite, but the float32 sum of squares overflows, the clip returns inf and its
coefficient (1.0 / inf = 0) zeroes every gradient at every later step. Expected: the explosion (overflow) is
named, not "clip at a positive bound", right after its cause, the clipped update of step 1 that rewrote the
weights (lr 1e6 x a unit gradient), and the clip's zeros are not "dead parameters"."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e6)
x = torch.randn(128, 16) * 3
y = torch.randn(128, 1)
truth = Truth()
for step in range(1, 31):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    raw = grad_norm(model.parameters())  # float64: no overflow
    finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    truth.add(step=step, norm=raw, clip_return=float(total), finite_grads=finite, loss=loss.item(),
              used=grad_norm(model.parameters()))
    opt.step()
print("done")
