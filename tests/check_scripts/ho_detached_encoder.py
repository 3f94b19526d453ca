"""Two optimizers: an encoder and a head, each with its own optimizer. By mistake the encoder's features are
cut from the head's loss from step 1: detached (its gradients stay None), or with --zeros rounded
(torch.round's derivative is 0: every encoder gradient is exactly 0). The head learns.
Expected: a critical zero_grads finding naming the encoder's optimizer (not the head's), exit 1."""
import sys

import torch
from _truth import Truth, grad_norm

zeros = "--zeros" in sys.argv
torch.manual_seed(0)
encoder = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
head = torch.nn.Linear(16, 3)
enc_opt = torch.optim.Adam(encoder.parameters(), lr=1e-3)
head_opt = torch.optim.SGD(head.parameters(), lr=1e-2)
x = torch.randn(128, 10)
y = torch.randint(0, 3, (128,))
truth = Truth()
for step in range(1, 21):
    enc_opt.zero_grad(set_to_none=not zeros)
    head_opt.zero_grad()
    feats = encoder(x).round() if zeros else encoder(x).detach()  # the slip (round: derivative 0)
    loss = torch.nn.functional.cross_entropy(head(feats), y)
    loss.backward()
    truth.add(opt="encoder", norm=grad_norm(encoder.parameters()), loss=loss.item())
    truth.add(opt="head", norm=grad_norm(head.parameters()), loss=loss.item())
    enc_opt.step()
    head_opt.step()
print("done")
