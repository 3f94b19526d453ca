"""Gradient accumulation over 4 micro-batches with the clip inside the micro-batch loop (after every
backward): partial sums are clipped and later micro-batches added unclipped. Expected: clip_partial at every
step (a warning), exit 0."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
data = [(torch.randn(16, 10), torch.randn(16, 1)) for _ in range(48)]
truth = Truth()
for i, (x, y) in enumerate(data):
    loss = torch.nn.functional.mse_loss(model(x), y) / 4
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the slip: inside the window
    if (i + 1) % 4 == 0:
        truth.add(step=(i + 1) // 4, norm=grad_norm(model.parameters()))
        opt.step()
        opt.zero_grad()
print("done")
