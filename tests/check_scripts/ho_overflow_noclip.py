"""A learning rate far too high and NO clip: the true gradient norm passes float32's sum-of-squares range
(above ~1.8e19) with every gradient value finite, then the weights go to inf/NaN. Expected: the update of step 1
that rewrote the weights (a norm of 1.5 at lr 1e5) first, then the largest explosion (exploding, critical) it
caused, with the norm's real size; then the NaN/Inf history."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e5)
x = torch.randn(128, 16) * 3
y = torch.randn(128, 1)
truth = Truth()
for step in range(1, 21):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    truth.add(step=step, norm=grad_norm(model.parameters()), finite_grads=finite, loss=loss.item())
    opt.step()
print("done")
