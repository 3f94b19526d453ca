"""A classifier whose model ends in Softmax, its probabilities fed to F.cross_entropy, which applies its own
log-softmax: the loss cannot go below -1 + ln(e + K - 1) (1.46 for K = 10 classes, reached only by a one-hot
output) and the gradients shrink as the probabilities saturate. The data is separable: the same model on its
logits drives the loss towards 0 (``--logits``). Expected: a finding that names the probabilities fed to a
cross-entropy, not "low, fine while the loss decreases", and no norm spike.

The truth (FG_TRUTH): per step the loss, the float64 norm and the floor.

Not yet met by check (issue 55, item 2): a reproduction without a test of its own."""
import math
import sys

import torch
import torch.nn as nn

from _truth import Truth, grad_norm

logits = "--logits" in sys.argv
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
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    truth.add(step=step, loss=loss.item(), norm=grad_norm(model.parameters()))
    opt.step()
print("done")
