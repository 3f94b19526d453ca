"""Gradient accumulation over a window of 4 micro-batches whose losses are not divided by 4: each
``F.cross_entropy`` output goes straight to backward(), so each step's gradient is the sum of the 4 micro-batch
gradients, 4x their mean, as if the learning rate were 4x larger. ``--divided``: the same loop with
``loss / ACCUM`` (clean). Expected: a finding that names the loss summed over the window, with the window.

The truth (FG_TRUTH): per step the window's summed loss and the float64 norm of the gradients the step used."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from _truth import Truth, grad_norm

divided = "--divided" in sys.argv
torch.manual_seed(0)
ACCUM, C = 4, 5
teacher = torch.randn(16, C)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, C))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
truth = Truth()
for step in range(1, 41):
    opt.zero_grad()
    total = 0.0
    for micro in range(ACCUM):
        x = torch.randn(32, 16)
        y = (x @ teacher).argmax(-1)
        loss = F.cross_entropy(model(x), y)
        if divided:
            loss = loss / ACCUM
        loss.backward()
        total += loss.item()
    truth.add(step=step, loss=total, norm=grad_norm(model.parameters()))
    opt.step()
print("done")
