"""clip_grad_norm_(..., max_norm=0): every gradient is scaled to zero, so nothing learns. The parameters are
not frozen and no unit is dead: the clip is the cause."""
import torch
from _truth import Truth

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
truth = Truth()
for step in range(1, 11):
    x = torch.randn(32, 8)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    loss.backward()
    raw = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.0)
    truth.add(step=step, raw=float(raw), loss=loss.item())
    opt.step()
print("done")
