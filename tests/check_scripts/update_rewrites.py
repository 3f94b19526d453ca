"""SGD at lr=0.8 on a small regression from a small initialisation: some of the first updates are as large as
the weights themselves (update/weight ratio at or above 1), then the loss settles: no NaN. Expected: a finding of its own for the update that rewrote the
weights, with the learning rate of that step.

The truth (FG_TRUTH): per step the loss, the float64 norm, the lr and the whole model's update/weight ratio."""
import torch
import torch.nn as nn

from _truth import Truth, flat_params, grad_norm, update_ratio

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
with torch.no_grad():
    for p in model.parameters():
        p.mul_(0.05)
opt = torch.optim.SGD(model.parameters(), lr=0.8)
w_true = torch.randn(8, 1)
truth = Truth()
for step in range(1, 31):
    x = torch.randn(64, 8)
    y = torch.tanh(x @ w_true)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    n, before = grad_norm(model.parameters()), flat_params(model.parameters())
    opt.step()
    truth.add(step=step, loss=loss.item(), norm=n, lr=opt.param_groups[0]["lr"],
              update=update_ratio(before, flat_params(model.parameters())))
print("done")
