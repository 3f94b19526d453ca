"""model.zero_grad() is called once before the loop and never again: every step's gradients are the sum of
all previous ones. Expected: no_zero_grad (critical) naming nearly every step, exit 1."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
model.zero_grad()
truth = Truth()
for step in range(1, 21):
    x, y = torch.randn(32, 10), torch.randn(32, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    opt.step()
print("done")
