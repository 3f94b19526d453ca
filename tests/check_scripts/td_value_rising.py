"""Fitted value iteration on a squared TD error: V(s) regressed onto r + gamma * V_target(s'), the target network
copied every 10 steps, the rewards growing as the (simulated) agent improves. The targets grow with the
returns, so the loss and its gradient norm rise steadily (about 120x and 40x) while the critic tracks them: no NaN,
no jump, no update near the size of the weights. Expected: loss_diverging at most a notice, exit 0.

The truth (FG_TRUTH), recorded with plain reads: per step the loss, the float64 norm and the update/weight ratio.
Tested in tests/test_check_misjudged.py (the target network is what tells the rise from a divergence).

``--copy`` picks how the target follows the critic: ``state_dict`` (``load_state_dict`` every 10 steps), ``data``
(``tp.data.copy_(p.data)`` every 10 steps) or ``polyak-data`` (``tp.data.copy_(tau * p.data + (1 - tau) *
tp.data)`` every step). Writes through ``.data`` bump no version counter, as in much public RL code."""
import argparse
import copy

import torch
import torch.nn as nn

from _truth import Truth, flat_params, grad_norm, update_ratio

ap = argparse.ArgumentParser()
ap.add_argument("--copy", choices=["state_dict", "data", "polyak-data"], default="state_dict")
args = ap.parse_args()
torch.manual_seed(0)
v = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
target = copy.deepcopy(v)
opt = torch.optim.Adam(v.parameters(), lr=3e-3)
gamma = 0.95
truth = Truth()
for it in range(1, 121):
    s, s2 = torch.randn(128, 8), torch.randn(128, 8)
    r = (1.0 + it / 8) * (1.0 + 0.1 * torch.randn(128, 1))
    with torch.no_grad():
        tgt = r + gamma * target(s2)
    loss = ((v(s) - tgt) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    n, before = grad_norm(v.parameters()), flat_params(v.parameters())
    opt.step()
    truth.add(step=it, loss=loss.item(), norm=n, update=update_ratio(before, flat_params(v.parameters())))
    if args.copy == "polyak-data":
        for tp, p in zip(target.parameters(), v.parameters()):
            tp.data.copy_(0.1 * p.data + 0.9 * tp.data)
    elif it % 10 == 0 and args.copy == "data":
        for tp, p in zip(target.parameters(), v.parameters()):
            tp.data.copy_(p.data)
    elif it % 10 == 0:
        target.load_state_dict(v.state_dict())
print("done")
