"""Gradient accumulation (4 micro-batches per step), plain or AMP, clipped in the right or a wrong place:
  --clip window       clip once per window, before the step (correct)
  --clip micro        clip after every micro-batch backward (partial gradients)
  --clip after-step   clip after optimizer.step()
  --clip fused        fastgrad.scaler_unscale_and_clip once per window (correct)
  --amp               GradScaler("cpu") + bf16 autocast, unscale_ before the clip"""
import argparse

import torch
from _truth import Truth, grad_norm

import fastgrad

p = argparse.ArgumentParser()
p.add_argument("--clip", choices=["window", "fused", "micro", "after-step"], default="window")
p.add_argument("--amp", action="store_true")
p.add_argument("--steps", type=int, default=25)
a = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", enabled=a.amp)
accum = 4
w = torch.randn(16, 4)
truth, step_loss = Truth(), 0.0  # the step's loss: the (divided) micro-batch losses added up
for i in range(a.steps * accum):
    x = torch.randn(32, 16)
    y = (x @ w).argmax(1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.amp):
        loss = torch.nn.functional.cross_entropy(model(x), y) / accum
    scaler.scale(loss).backward()
    step_loss += loss.item()
    if a.clip == "micro":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if (i + 1) % accum == 0:
        if a.clip == "window":
            scaler.unscale_(opt)
            truth.add(norm=grad_norm(model.parameters()), loss=step_loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif a.clip == "fused":
            fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0)
        scaler.step(opt)
        scaler.update()
        if a.clip == "after-step":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
