"""A healthy loop: zero_grad, backward, clip, step. Expected: exit 0, no warning."""
import argparse

import torch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                            torch.nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
w = torch.randn(16, 4)
for step in range(a.steps):
    x = torch.randn(64, 16)
    y = (x @ w).argmax(1)
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
print("done", a.steps)
