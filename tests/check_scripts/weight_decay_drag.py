"""An MLP regression trained with AdamW at lr 2e-3 and weight_decay=100: lr x weight_decay = 0.2, so the decay
alone shrinks the weights by a fifth each step and drags them to zero whatever the gradient says.
``--usual``: weight_decay=0.01, the usual pull of 2e-5 a step (clean). Expected: a finding that names the weight
decay, with the pull and the weights' fall.

The truth (FG_TRUTH): per step the loss and the float64 norm of every weight after the step."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from _truth import Truth, flat_params

usual = "--usual" in sys.argv
torch.manual_seed(0)
teacher = torch.randn(16, 4)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01 if usual else 100.0)
truth = Truth()
truth.add(step=0, weights=float(flat_params(model.parameters()).norm()))
for step in range(1, 61):
    x = torch.randn(64, 16)
    loss = F.mse_loss(model(x), x @ teacher)
    opt.zero_grad()
    loss.backward()
    opt.step()
    truth.add(step=step, loss=loss.item(), weights=float(flat_params(model.parameters()).norm()))
print("done")
