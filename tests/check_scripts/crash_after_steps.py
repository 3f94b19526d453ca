"""Trains three steps, then fails like a real script does (a shape bug). Expected: exit 3 and a report of
the three steps."""
import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
model(torch.randn(4, 7))  # the bug
