"""The clip placed between zero_grad() and backward() (a pattern of public TCN scripts): every gradient is None
when it runs, so it clips nothing and each step is taken unclipped. Expected: clip_after_step, titled as a clip
before backward(). ``--sum``: the loss summed over a large batch and scaled, so norms in the hundreds and more reach
the update the clip was meant to bound: the explosion follows the misplaced clip and does not ask for a clip.

The truth (FG_TRUTH): per step the loss and the float64 norm the update used (unclipped)."""
import sys

import torch

from _truth import Truth, grad_norm

SUM = "--sum" in sys.argv
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
truth = Truth()
for step in range(1, 31):
    x, y = torch.randn(256, 10), torch.randn(256, 1)
    opt.zero_grad()
    out = model(x)
    loss = torch.nn.functional.mse_loss(out, y, reduction="sum" if SUM else "mean") * (10.0 if SUM else 1.0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)   # before backward(): every gradient is None
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    opt.step()
print("done")
