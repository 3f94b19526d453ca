"""A classifier whose loss is negated before backward(): ``loss = -F.cross_entropy(...) / 2``, so every step
climbs the cross-entropy. ``--maximize``: the loss as returned, but an optimizer built with ``maximize=True``
(the same ascent). ``--amp``: the negated loss through a GradScaler (the sign read off the loss it was
handed, not off the scaled product). ``--fixed``: the loss as returned, a plain optimizer (clean). ``--adversarial``: a task loss
minus a weighted adversarial cross-entropy (meant that way: one loss function kept, one negated; clean).
Expected: ``gradient_ascent`` first, naming the negation or the flag, with the cross-entropy's rise as its harm.

The truth (FG_TRUTH): per step the cross-entropy (as the loss function returns it, whatever sign the script
backpropagates) and the float64 norm of the gradients the step used."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from _truth import Truth, grad_norm

mode = next((a[2:] for a in sys.argv[1:] if a.startswith("--")), "negated")
torch.manual_seed(0)
C = 5
teacher = torch.randn(16, C)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, C))
adversary = nn.Linear(32, 2)
params = list(model.parameters()) + (list(adversary.parameters()) if mode == "adversarial" else [])
opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, maximize=mode == "maximize")
scaler = torch.amp.GradScaler("cpu", enabled=mode == "amp")
truth = Truth()
for step in range(1, 41):
    x = torch.randn(32, 16)
    y = (x @ teacher).argmax(-1)
    ce = F.cross_entropy(model(x), y)
    if mode in ("negated", "amp"):
        loss = -ce / 2
    elif mode == "adversarial":
        loss = ce - 0.1 * F.cross_entropy(adversary(model[1](model[0](x))), (x[:, 0] > 0).long())
    else:
        loss = ce
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    truth.add(step=step, loss=float(ce.detach()), norm=grad_norm(params))
    scaler.step(opt)
    scaler.update()
print("done")
