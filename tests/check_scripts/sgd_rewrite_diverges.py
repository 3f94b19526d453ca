"""SGD at lr=8 on a small MLP regression, the update bounded by a clip at max_norm=1: the first update moves the
weights by about twice their own size, and the loss is 100x its start at the next step and stays far up to the
end (finite: the clip bounds every update). The update that replaced the weights came first; the divergence
follows from it. ``--lr 0.5``: the same run, healthy.

The truth (FG_TRUTH): per step the loss, the lr and the whole model's update/weight ratio (float64)."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from _truth import Truth, flat_params, update_ratio

ap = argparse.ArgumentParser()
ap.add_argument("--lr", type=float, default=8.0)
a = ap.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=a.lr)
w_true = torch.randn(8, 1)
truth = Truth()
for step in range(1, 41):
    x = torch.randn(64, 8)
    loss = F.mse_loss(model(x), torch.tanh(x @ w_true))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = flat_params(model.parameters())
    opt.step()
    truth.add(step=step, loss=loss.item(), lr=opt.param_groups[0]["lr"],
              update=update_ratio(before, flat_params(model.parameters())))
print("done")
