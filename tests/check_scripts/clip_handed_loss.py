"""A clip handed the loss instead of the parameters (``clip_grad_norm_(loss, 0.1)``, a pattern of public RL
scripts): a computed tensor keeps no ``.grad``, so the clip bounds nothing and each step is taken unclipped.
Expected: clip_not_params, naming the call and the tensor, and no clip_after_step. ``--what``: ``loss`` (the
default), ``detached`` (the loss's detached copy: a leaf that requires no grad), ``params`` (the parameters:
the healthy loop, norms above the bound, clipped), ``frozen`` (a frozen head's parameters, which hold no
gradient either: a parameter all the same, so not this finding).

The truth (FG_TRUTH): per step the float64 norm the update used and whether any clipped tensor held a .grad."""
import sys

import torch

from _truth import Truth, grad_norm

WHAT = sys.argv[sys.argv.index("--what") + 1] if "--what" in sys.argv else "loss"
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
head = torch.nn.Linear(32, 1).requires_grad_(False)
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
truth = Truth()
for step in range(1, 31):
    x = torch.randn(64, 10)
    y = x[:, :1] * 3.0 + 0.1 * torch.randn(64, 1)
    loss = torch.nn.functional.mse_loss(net(x), y)
    opt.zero_grad()
    loss.backward()
    handed = {"loss": [loss], "detached": [loss.detach()], "params": list(net.parameters()),
              "frozen": list(head.parameters())}[WHAT]
    with torch.no_grad():
        held = any(t.is_leaf and t.grad is not None for t in handed)
    torch.nn.utils.clip_grad_norm_(handed[0] if len(handed) == 1 else handed, 0.1)
    truth.add(step=step, norm=grad_norm(net.parameters()), held=held, loss=loss.item())
    opt.step()
print("done")
