"""Cross-entropy classification with Adam at lr=0.5, no clipping: the loss jumps from chance level (1.6) to
20 within two steps, then stays 2-5x above its start for most of the run and ends ~1.7x above it: the run never
learns. Expected: a loss finding that says the loss rose and never came back, after the first update that
rewrote the weights (the learning rate's), no advice to raise a learning rate."""
import sys

import torch
from _truth import Truth, grad_norm

lr = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                            torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))
opt = torch.optim.Adam(model.parameters(), lr=lr)
x = torch.randn(512, 20)
y = torch.randint(0, 5, (512,))
truth = Truth()
for step in range(1, 61):
    i = torch.randint(0, 512, (64,))
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    opt.step()
print("done")
