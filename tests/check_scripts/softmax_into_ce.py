"""A classifier whose model ends in Softmax, its probabilities fed to F.cross_entropy, which applies its own
log-softmax: the loss cannot go below -1 + ln(e + K - 1) (1.46 for K = 10 classes, reached only by a one-hot
output) and the gradients shrink as the probabilities saturate. The data is separable: the same model on its
logits drives the loss towards 0 (``--logits``). Expected: a finding that names the probabilities fed to a
cross-entropy, not "low, fine while the loss decreases", and no norm spike. ``--by-hand``: the probabilities
made without a softmax module (exp over its sum), the same defect; ``--log-probs``: a log_softmax fed to the
cross-entropy, which is harmless (log_softmax of log-probabilities returns them): clean, like ``--logits``.

The truth (FG_TRUTH): per step the loss, the float64 norm and the floor."""
import math
import sys

import torch
import torch.nn as nn

from _truth import Truth, grad_norm

by_hand, log_probs = "--by-hand" in sys.argv, "--log-probs" in sys.argv
logits = "--logits" in sys.argv or by_hand or log_probs
torch.manual_seed(0)
K = 10
centers = torch.randn(K, 20) * 3
layers = [nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, K)]
model = nn.Sequential(*layers) if logits else nn.Sequential(*layers, nn.Softmax(dim=1))
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
truth = Truth()
truth.meta["floor"] = -1 + math.log(math.e + K - 1)
for step in range(1, 101):
    y = torch.randint(0, K, (128,))
    x = centers[y] + torch.randn(128, 20)
    out = model(x)
    if by_hand:
        out = out.exp() / out.exp().sum(1, keepdim=True)
    elif log_probs:
        out = torch.log_softmax(out, dim=1)
    loss = nn.functional.cross_entropy(out, y)
    opt.zero_grad()
    loss.backward()
    truth.add(step=step, loss=loss.item(), norm=grad_norm(model.parameters()))
    opt.step()
print("done")
