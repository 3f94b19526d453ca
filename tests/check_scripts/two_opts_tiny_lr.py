"""Two models, each with its own optimizer, stepped in one loop (as a GAN's pair or an actor-critic's), one
regression each. ``--tiny``: the second optimizer's learning rate is 1e-9 (Adam), so its updates move its
weights by about 1e-8 of their size and its loss does not fall; the first learns. Expected with ``--tiny``:
``update_tiny`` for the second optimizer, a warning, its advice in the script's own names; without: nothing.

The truth (FG_TRUTH): per step each model's loss and the update/weight ratio of each optimizer's step."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from _truth import Truth, flat_params, update_ratio

tiny = "--tiny" in sys.argv
torch.manual_seed(0)
w1, w2 = torch.randn(8, 1), torch.randn(8, 1)
first = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
second = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
opt_first = torch.optim.Adam(first.parameters(), lr=1e-2)
opt_second = torch.optim.Adam(second.parameters(), lr=1e-9 if tiny else 1e-2)
truth = Truth()
for step in range(1, 61):
    x = torch.randn(64, 8)
    loss1 = F.mse_loss(first(x), x @ w1)
    opt_first.zero_grad()
    loss1.backward()
    b1 = flat_params(first.parameters())
    opt_first.step()
    loss2 = F.mse_loss(second(x), x @ w2)
    opt_second.zero_grad()
    loss2.backward()
    b2 = flat_params(second.parameters())
    opt_second.step()
    truth.add(step=step, loss1=loss1.item(), loss2=loss2.item(),
              update1=update_ratio(b1, flat_params(first.parameters())),
              update2=update_ratio(b2, flat_params(second.parameters())))
print("done")
