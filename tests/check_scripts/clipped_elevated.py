"""A regression trained with clip_grad_norm_(max_norm=5.0) at every step, with one outlier batch (targets 30x)
at step 30: a gradient-norm spike. Expected: no advice to add a clip (the script clips): the advice names
its bound, 5, and says at how many steps it acted."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
w = torch.randn(8, 1)
truth = Truth()
for step in range(1, 41):
    x = torch.randn(64, 8)
    y = x @ w * (30.0 if step == 30 else 1.0)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
    opt.step()
print("done")
