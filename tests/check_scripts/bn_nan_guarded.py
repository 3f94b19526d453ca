"""A CNN with BatchNorm in training mode, guarded by fastgrad's StepGuard; batch 6 holds a NaN. The guard skips
that step (the weights stay finite), but the forward pass in training mode already wrote the NaN into the
BatchNorm's running_mean and running_var, so the model evaluates to NaN from then on. Expected: check names
the buffers that turned non-finite and never says the run is protected.

The truth (FG_TRUTH): per step the loss and the float64 norm, and at the end the names of the non-finite
buffers, read with plain calls.

Not yet met by check (issue 55, item 2): a reproduction without a test of its own."""
import torch
import torch.nn as nn

import fastgrad
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
guard = fastgrad.StepGuard(opt, max_norm=1.0)
truth = Truth()
for step in range(1, 13):
    x = torch.randn(16, 3, 8, 8)
    if step == 6:
        x[3, 0, 2, 2] = float("nan")
    y = torch.randint(0, 4, (16,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    truth.add(step=step, loss=loss.item(), norm=grad_norm(model.parameters()))
    guard.clip_()
    opt.step()
truth.meta["bad_buffers"] = [n for n, b in model.named_buffers()
                             if b.is_floating_point() and not torch.isfinite(b).all()]
truth.meta["skipped"] = guard.state()["skipped_steps"]
print("done")
