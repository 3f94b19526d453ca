"""An absurd learning rate: the loss rises by orders of magnitude but stays finite over the run, and the
gradient norm stays under 1000 (only the loss rule can see it)."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=1.5)
x = torch.randn(256, 8)
y = x @ torch.randn(8, 1)
truth = Truth()
for step in range(1, 7):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    opt.step()
print("done")
