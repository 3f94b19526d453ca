"""A regression whose hidden ReLU layer is dead from the start (its bias at -20, its inputs of unit scale): no
unit ever fires, so its weights, its bias and the output layer's weights get an exactly zero gradient at every
step, and only the output bias learns: the loss stays at the targets' variance. The cause is the tensors that
never learn; the stall is their effect. Expected: never_learns first, the stall said to follow from it, and no
advice to raise (or lower) the learning rate.

The truth (FG_TRUTH): per step the loss, the float64 norm and the names of the tensors whose gradient is zero."""
import torch
import torch.nn as nn

from _truth import Truth, grad_norm

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
with torch.no_grad():
    model[0].bias.fill_(-20.0)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
w = torch.randn(16, 1)
truth = Truth()
for step in range(1, 41):
    x = torch.randn(128, 16)
    y = x @ w
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    zero = [n for n, p in model.named_parameters() if not p.grad.any()]
    truth.add(step=step, loss=loss.item(), norm=grad_norm(model.parameters()), zero=zero)
    opt.step()
print("done")
