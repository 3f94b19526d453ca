"""A schedule meant per epoch but stepped per batch: LambdaLR(0.1 ** step) divides the learning rate by 10 at
every step, so it collapses from 0.05 to 1e-25 and the loss stops improving after a few steps. ``--negative``:
a linear decay over 10 steps stepped for 40, which drives the learning rate below zero (gradient ascent: the
loss rises). Expected: a finding that names the schedule's learning rate (as it was at the steps in question)
and never advice to multiply it up.

The truth (FG_TRUTH): per step the loss, the float64 norm and the lr in force at that step's update."""
import sys

import torch
import torch.nn as nn

from _truth import Truth, grad_norm

negative = "--negative" in sys.argv
torch.manual_seed(0)
w_true = torch.randn(16, 1)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
sched = torch.optim.lr_scheduler.LambdaLR(opt, (lambda s: 1.0 - s / 10) if negative else (lambda s: 0.1 ** s))
truth = Truth()
for step in range(1, 41):
    x = torch.randn(64, 16)
    y = x @ w_true + 0.1 * torch.randn(64, 1)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    truth.add(step=step, loss=loss.item(), norm=grad_norm(model.parameters()), lr=opt.param_groups[0]["lr"])
    opt.step()
    sched.step()  # per batch: the bug
print("done")
