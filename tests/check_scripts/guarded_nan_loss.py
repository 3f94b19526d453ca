"""A regression trained with fastgrad.StepGuard whose batch at step 21 (1-based; `step == 20` of the 0-based loop)
holds a NaN: the loss and the gradients of that step are NaN and the guard keeps the step out of the weights
and the optimizer. Expected: the run is reported as protected (no claim that the optimizer stepped on garbage
or that every gradient stayed finite), exit 0."""
import torch

import fastgrad
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
guard = fastgrad.StepGuard(opt, 1.0)
w = torch.randn(8, 1)
truth = Truth()
for step in range(40):
    x = torch.randn(64, 8)
    y = x @ w
    if step == 20:
        x[3, 2] = float("nan")
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    truth.add(step=step + 1, norm=grad_norm(model.parameters()), loss=float(loss.detach()))
    guard.clip_()
    opt.step()
truth.meta["skipped"] = guard.state()["skipped_steps"]
truth.write()
print("done")
