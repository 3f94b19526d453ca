"""A hand-written update (no torch.optim), word_language_model style: model.zero_grad(), backward, clip,
p.data.add_(p.grad, alpha=-lr).

``--drop-grads``: no zero_grad() at all; the update drops each gradient itself once used (``p.grad = None``), as
hand-written momentum loops do, so nothing is left to read after the last step. ``--max-norm``: the clip's bound
(0: a clip that zeroes every gradient). ``--clip-first``: the clip runs before backward() (the slip): it finds
no gradient (zero_grad() set them to None, or the update dropped them) and bounds nothing. ``--idle-clip``:
besides the clip, each step also clips a second model that this loop never trains (updates that take turns
do so): that call finds no gradient, by design. ``--zero``: how the gradients are cleared when not by
``model.zero_grad()`` (``call``, the default): ``hand`` (``p.grad.zero_()`` after each update, as a loop over
raw tensors does), ``never`` (the slip: every backward adds to all the ones before), ``every2`` (zeroed by hand
every second backward: a window of two micro-batches)."""
import argparse

import torch
from _truth import Truth, grad_norm

ap = argparse.ArgumentParser()
ap.add_argument("--drop-grads", action="store_true")
ap.add_argument("--max-norm", type=float, default=2.0)
ap.add_argument("--clip-first", action="store_true")
ap.add_argument("--idle-clip", action="store_true")
ap.add_argument("--zero", choices=["call", "hand", "never", "every2"], default="call")
a = ap.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
lr, truth = 0.05, Truth()
idle = torch.nn.Linear(4, 4)   # trained elsewhere, in a real loop: here its gradients stay None
w = torch.randn(8, 1)
for step in range(1, 26):
    x = torch.randn(32, 8)
    if not a.drop_grads and a.zero == "call":
        model.zero_grad()
    left = grad_norm(model.parameters())   # what this backward adds to
    if a.clip_first:
        present = sum(p.grad is not None for p in model.parameters())   # what the clip finds
        raw = torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_norm)
    loss = torch.nn.functional.mse_loss(model(x), x @ w)
    loss.backward()
    if not a.clip_first:
        present = sum(p.grad is not None for p in model.parameters())
        raw = torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_norm)
    if a.idle_clip:
        torch.nn.utils.clip_grad_norm_(idle.parameters(), a.max_norm)
    truth.add(step=step, raw=float(raw), norm=grad_norm(model.parameters()), loss=loss.item(), clip_found=present,
              left=left)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
        if a.drop_grads:
            p.grad = None
        elif a.zero == "hand" or (a.zero == "every2" and step % 2 == 0):
            p.grad.zero_()
print("done")
