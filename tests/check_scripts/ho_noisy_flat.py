"""A healthy run whose loss is noisy but flat: labels that carry no signal (the model cannot do better than
chance) and small random batches, so the loss wanders around ln(10) with occasional high batches. Expected:
not diverging, not critical, exit 0."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
truth = Truth()
for step in range(1, 201):
    x = torch.randn(8, 16)
    y = torch.randint(0, 10, (8,))
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    opt.step()
print("done")
