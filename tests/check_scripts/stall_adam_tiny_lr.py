"""A 4-class classifier trained by Adam at lr 1e-9: the weights barely move, so the loss wanders around its
start, ln(4), with the noise of fresh batches. Expected: a stall finding (at chance level, the learning rate
1e-09 and the update/weight ratio in its evidence), never critical, exit 0."""
import torch
from _truth import Truth, flat_params, grad_norm, update_ratio

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-9)
w = torch.randn(16, 4)
truth = Truth()
for step in range(1, 81):
    x = torch.randn(64, 16)
    y = (x @ w).argmax(1)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    before = flat_params(model.parameters())
    opt.step()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item(),
              update=update_ratio(before, flat_params(model.parameters())))
print("done")
