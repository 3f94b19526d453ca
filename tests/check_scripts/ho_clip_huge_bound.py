"""A regression on targets of scale ~100 clipped at max_norm=1e6: the gradient norm peaks above 100 (a few
hundred) but the clip never acts. Expected: exploding as a warning, no wording that says the update was
bounded by the clip, max_norm quoted as 1e6."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-5)
x = torch.randn(128, 8)
y = 400.0 * torch.randn(128, 1)
truth = Truth()
for step in range(1, 21):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e6)
    truth.add(step=step, norm=float(total), loss=loss.item())
    opt.step()
print("done")
