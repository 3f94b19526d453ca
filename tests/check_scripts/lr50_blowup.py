"""A count regression with torch's Poisson NLL loss (log-rate outputs) trained by SGD at lr 50: the first update
(gradient norm about 2) throws the weights far out of range, the next step's log-rates pass 88 and the
library loss's exp overflows to inf while every module output is finite. Expected: the learning rate is
blamed (quoted in the markdown), not a hand-written loss's log(0)."""
import torch
from _truth import Truth, flat_params, grad_norm, update_ratio

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=50.0)
w = torch.randn(16, 1) * 0.3
truth = Truth()
for step in range(1, 11):
    x = torch.randn(128, 16)
    y = torch.poisson((x @ w).exp())
    opt.zero_grad()
    loss = torch.nn.functional.poisson_nll_loss(model(x), y)
    loss.backward()
    before = flat_params(model.parameters())
    opt.step()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item(),
              update=update_ratio(before, flat_params(model.parameters())))
print("done")
