"""A model wrapped in torch.compile (the eager backend: what is compiled does not matter here, the wrapper
does), trained 30 steps with a clip. Expected: every step checked, healthy, and none of torch's warnings
about global module hooks in the output (check's own hooks would trigger one per compiled call)."""
import torch
from _truth import Truth, grad_norm

truth = Truth()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
compiled = torch.compile(model, backend="eager")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x, y = torch.randn(256, 16), torch.randn(256, 1)
for step in range(30):
    loss = torch.nn.functional.mse_loss(compiled(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
