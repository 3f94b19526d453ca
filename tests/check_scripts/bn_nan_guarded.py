"""A CNN with BatchNorm in training mode; batch 6 (or the second argument's) holds a NaN. By default guarded by fastgrad's StepGuard
without the model: the guard skips that step (the weights stay finite), but the forward pass in training mode
already wrote the NaN into the BatchNorm's running_mean and running_var, so the model evaluates to NaN from then
on. Expected: check names the buffers that turned non-finite and never says the run is protected.

``model``: the guard is given ``model=model``, which puts the buffers back on the skipped step: the run is
protected and check says so. ``unguarded``: no guard (torch's clip_grad_norm_ in its place), the NaN reaches
the weights and the buffers alike.

The truth (FG_TRUTH): per step the loss and the float64 norm, and at the end the names of the non-finite
buffers and whether the model's evaluation output is finite, read with plain calls."""
import sys

import torch
import torch.nn as nn

import fastgrad
from _truth import Truth, grad_norm

variant = sys.argv[1] if len(sys.argv) > 1 else "guarded"
nan_step = int(sys.argv[2]) if len(sys.argv) > 2 else 6
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
guard = None
if variant != "unguarded":
    guard = fastgrad.StepGuard(opt, max_norm=1.0, model=model if variant == "model" else None)
truth = Truth()
for step in range(1, 13):
    x = torch.randn(16, 3, 8, 8)
    if step == nan_step:
        x[3, 0, 2, 2] = float("nan")
    y = torch.randint(0, 4, (16,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    truth.add(step=step, loss=loss.item(), norm=grad_norm(model.parameters()))
    if guard is not None:
        guard.clip_()
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
truth.meta["bad_buffers"] = [n for n, b in model.named_buffers()
                             if b.is_floating_point() and not torch.isfinite(b).all()]
truth.meta["skipped"] = guard.state()["skipped_steps"] if guard is not None else 0
model.eval()
with torch.no_grad():
    truth.meta["eval_finite"] = bool(torch.isfinite(model(torch.randn(4, 3, 8, 8))).all())
truth.write()
print("done")
