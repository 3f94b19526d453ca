"""An ordinary LeNet-style classifier (conv, ReLU, max-pool twice, then a ReLU hidden layer) trained one sample
at a time with SGD, as many tutorials do: about half of the gradient values are exactly zero (the ReLUs that
are off for that sample and the positions max-pool did not pick pass no gradient). That is how this
architecture works. Expected: no `mostly_zero`, no warning, exit 0."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(1, 6, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(6, 16, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 120), torch.nn.ReLU(), torch.nn.Linear(120, 10))
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
proto = torch.randn(10, 1, 28, 28)
truth = Truth()
for step in range(1, 41):
    y = torch.randint(0, 10, (1,))
    x = proto[y] + 0.5 * torch.randn(1, 1, 28, 28)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item(), zero_fraction=float((g == 0).double().mean()))
    opt.step()
print("done")
