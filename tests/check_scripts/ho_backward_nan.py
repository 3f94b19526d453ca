"""A pairwise-distance loss with sqrt: the distance of each point to itself is sqrt(0) = 0, finite in the
forward pass, but sqrt's derivative at 0 is inf and inf * 0 = NaN in backward. The loss and every module
output stay finite at step 1; the gradients are NaN. Expected: born in backward at step 1."""
import torch
from _truth import Truth

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x = torch.randn(32, 8)
truth = Truth()
for step in range(1, 6):
    opt.zero_grad()
    z = model(x)
    d = ((z[:, None, :] - z[None, :, :]) ** 2).sum(-1).sqrt()  # includes d(i, i) = sqrt(0)
    loss = (1.0 - d).clamp_min(0).mean()
    finite_loss = bool(torch.isfinite(loss))
    loss.backward()
    truth.add(step=step, loss=loss.item(), loss_finite=finite_loss,
              grads_finite=all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
    opt.step()
print("done")
