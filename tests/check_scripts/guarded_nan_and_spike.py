"""A small regression trained with fastgrad.StepGuard, NaN gradients at steps 6 and 7 and a 1000x loss spike
at step 12: the guard skips those three steps, so the run stays healthy; the check must say so (no critical
`nonfinite_history`, a `guard_skipped` warning with the steps), not blame the optimizer for stepping on NaN."""

import torch

import fastgrad
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
guard = fastgrad.StepGuard(opt, 1.0, skip_factor=10.0, warmup_steps=3)
x, y = torch.randn(64, 8), torch.randn(64, 1)
truth = Truth()
for step in range(1, 16):
    loss = torch.nn.functional.mse_loss(model(x), y)
    if step == 12:
        loss = loss * 1000.0
    loss.backward()
    if step in (6, 7):
        model[0].weight.grad[0, 0] = float("nan")
    truth.add(norm=grad_norm(model.parameters()), loss=float(loss.detach()))
    guard.clip_()
    opt.step()
    opt.zero_grad()
truth.meta["skipped"] = guard.state()["skipped_steps"]
truth.write()
