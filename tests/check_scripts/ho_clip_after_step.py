"""The clip runs after optimizer.step() (and zero_grad at the top of the loop): the step is taken
unclipped. Expected: clip_after_step (a warning) at every step but the last, exit 0."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 10), torch.randn(64, 1)
truth = Truth()
for step in range(1, 16):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    opt.step()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # the slip: after the step
print("done")
