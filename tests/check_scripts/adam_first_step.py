"""Adam on a small MLP regression whose weights start at a tenth of torch's default scale: Adam's first step
moves every weight by about the learning rate, which on weights this small is several times their own size (an
update/weight ratio above 1, once). ``--lr 0.05``: the run learns past it. ``--lr 0.5``: the loss blows up from
that step, falls back, and ends above where it began.

The truth (FG_TRUTH): per step the loss, the lr and the whole model's update/weight ratio (float64)."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from _truth import Truth, flat_params, update_ratio

ap = argparse.ArgumentParser()
ap.add_argument("--lr", type=float, default=0.05)
a = ap.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
with torch.no_grad():
    for p in model.parameters():
        p.mul_(0.1)
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
teacher = torch.randn(20, 8)
truth = Truth()
for step in range(1, 61):
    x = torch.randn(64, 20)
    loss = F.mse_loss(model(x), torch.tanh(x @ teacher))
    opt.zero_grad()
    loss.backward()
    before = flat_params(model.parameters())
    opt.step()
    truth.add(step=step, loss=loss.item(), lr=opt.param_groups[0]["lr"],
              update=update_ratio(before, flat_params(model.parameters())))
print("done")
