"""A small ReLU + max-pool CNN on 10 classes whose labels do not depend on the images, trained by SGD: the
loss sits at chance, ln(10) = 2.303, for the whole run. Expected: a stall finding that names the chance level,
not `mostly_zero` (about half the gradient values of a ReLU + max-pool CNN are zero: that is ordinary), exit 0."""
import argparse

import torch
from _truth import Truth, grad_norm

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.01)
a = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 10))
opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
truth = Truth()
for step in range(1, 61):
    x = torch.randn(32, 1, 16, 16)
    y = torch.randint(0, 10, (32,))
    opt.zero_grad()
    loss = torch.nn.CrossEntropyLoss()(model(x), y)
    loss.backward()
    g = [p.grad.reshape(-1) for p in model.parameters()]
    zero = float(sum((t == 0).sum() for t in g)) / sum(t.numel() for t in g)
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item(), zero_fraction=zero)
    opt.step()
print("done")
