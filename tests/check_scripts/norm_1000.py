"""A healthy run where one step's norm passes 1000 (a corrupt batch at --bad, default step 14) and then
recovers. --amp: the same under a GradScaler (fp32, no clip), whose advice must unscale before clipping."""
import argparse

import torch
from _truth import Truth, grad_norm

p = argparse.ArgumentParser()
p.add_argument("--bad", type=int, default=14)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--amp", action="store_true")
a = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", enabled=a.amp)
w = torch.randn(8, 1)
truth = Truth()
for step in range(1, a.steps + 1):
    x = torch.randn(32, 8)
    y = x @ w
    if step == a.bad:
        y = y * 1e4  # the corrupt batch
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if a.amp:
        scaler.unscale_(opt)
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    scaler.step(opt)
    scaler.update()
    if step == a.bad:
        with torch.no_grad():  # the script restores its weights after the bad batch (keeps the rest healthy)
            for q, s in zip(model.parameters(), saved):
                q.copy_(s)
    saved = [q.detach().clone() for q in model.parameters()]
print("done")
