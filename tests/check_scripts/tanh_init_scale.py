"""A deep tanh MLP (8 hidden layers) on a teacher's classes, its Linear weights drawn with std = SCALE / sqrt(fan_in).
``--scale 6``: most tanh outputs start on the flat tails (an exploding initialisation); ``--scale 1``: in range.
``--grow-at K``: the weights multiplied by 6 after step K: saturated later, not at the initialisation.
``--act sigmoid``: sigmoid activations instead.

The truth (FG_TRUTH), from a plain forward hook: per activation module, the share of its outputs at the first
forward whose slope is below 2% of the activation's largest (float64); per step the loss."""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _truth import Truth

ap = argparse.ArgumentParser()
ap.add_argument("--scale", type=float, default=6.0)
ap.add_argument("--grow-at", type=int, default=0)
ap.add_argument("--act", default="tanh")
a = ap.parse_args()
torch.manual_seed(0)
Act = nn.Sigmoid if a.act == "sigmoid" else nn.Tanh
layers = []
for i in range(8):
    layers += [nn.Linear(12 if i == 0 else 32, 32), Act()]
model = nn.Sequential(*layers, nn.Linear(32, 5))
for m in model:
    if isinstance(m, nn.Linear) and m.out_features == 32:
        nn.init.normal_(m.weight, std=a.scale / math.sqrt(m.in_features))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
teacher = torch.randn(12, 5)
truth = Truth()
shares = {}


def record(mod, args, out):
    y = out.detach().double()
    slope = 4 * y * (1 - y) if isinstance(mod, nn.Sigmoid) else 1 - y * y
    shares[name_of[mod]] = float((slope < 0.02).double().mean())


name_of = {m: n for n, m in model.named_modules()}
hooks = [m.register_forward_hook(record) for m in model if isinstance(m, Act)]
for step in range(1, 31):
    x = torch.randn(64, 12)
    loss = F.cross_entropy(model(x), (x @ teacher).argmax(-1))
    if step == 1:
        for h in hooks:
            h.remove()
        truth.meta["saturated"] = dict(shares)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == a.grow_at:
        with torch.no_grad():
            for m in model:
                if isinstance(m, nn.Linear):
                    m.weight.mul_(6.0)
    truth.add(step=step, loss=loss.item())
print("done")
