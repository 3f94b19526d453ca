"""A hand-written update (no torch.optim), word_language_model style: model.zero_grad(), backward, clip,
p.data.add_(p.grad, alpha=-lr)."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
lr, truth = 0.05, Truth()
w = torch.randn(8, 1)
for step in range(1, 26):
    x = torch.randn(32, 8)
    model.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), x @ w)
    loss.backward()
    raw = torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
    truth.add(step=step, raw=float(raw), norm=grad_norm(model.parameters()), loss=loss.item())
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
print("done")
