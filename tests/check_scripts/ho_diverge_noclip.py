"""A supervised regression MLP with Adam at a learning rate far too high (default 0.3) and no clipping: the loss
climbs from ~1 by orders of magnitude and stays up (finite) for the whole run. Expected: the first update, which
rewrote the weights, first and the divergence following from it, advice to lower the learning rate, and no finding advising to raise any learning rate."""
import sys

import torch
from _truth import Truth, grad_norm

lr = float(sys.argv[1]) if len(sys.argv) > 1 else 0.3
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=lr)
x = torch.randn(512, 20)
y = x[:, :1] + 0.1 * torch.randn(512, 1)
truth = Truth()
for step in range(1, 61):
    i = torch.randint(0, 512, (64,))
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x[i]), y[i])
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    opt.step()
print("done")
