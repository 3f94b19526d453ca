"""An MLP classifier over 4 classes whose labels are drawn independently of its inputs, its head initialised
large so that its first loss is well above chance: Adam brings the loss down to ln(4) = 1.386, the score of a
uniform guess, and no lower. That fall is the head unlearning its initial bias, not learning the input.
``--learnable``: the labels a fixed function of the inputs; the loss falls far below chance (clean). Expected:
a stall at chance level, not a healthy run.

The truth (FG_TRUTH): per step the loss and the float64 norm; chance = ln(4)."""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from _truth import Truth, grad_norm

learnable = "--learnable" in sys.argv
torch.manual_seed(0)
C = 4
teacher = torch.randn(16, C)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, C))
with torch.no_grad():
    model[2].weight.mul_(4.0)   # a confident head: its first loss is above chance
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
truth = Truth()
truth.meta["chance"] = math.log(C)
for step in range(1, 81):
    x = torch.randn(64, 16)
    y = (x @ teacher).argmax(-1) if learnable else torch.randint(0, C, (64,))
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    truth.add(step=step, loss=loss.item(), norm=grad_norm(model.parameters()))
    opt.step()
print("done")
