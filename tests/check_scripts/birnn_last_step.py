"""A bidirectional LSTM tagger-style classifier that reads its output only at the last time step
(``out[-1]``): there the reverse direction has taken a single step from its zero initial state, so its
recurrent weight (``weight_hh_l0_reverse``) multiplies zeros and gets an exactly zero gradient at every step,
while its input weight learns. Expected: never_learns names that tensor as the reverse half read at the last
step (not a dead ReLU), with advice that reads the final hidden state. ``--whole`` reads ``h_n`` instead (both
directions after the whole sequence): every tensor learns and there is no such finding.

The truth (FG_TRUTH): per step the loss, the float64 norm and the names of the tensors whose gradient is zero."""
import sys

import torch
import torch.nn as nn

from _truth import Truth, grad_norm

WHOLE = "--whole" in sys.argv


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, bidirectional=True)
        self.head = nn.Linear(32, 3)

    def forward(self, x):                        # x: (time, batch, features)
        out, (h_n, _) = self.lstm(x)
        if WHOLE:
            return self.head(torch.cat([h_n[-2], h_n[-1]], dim=1))
        return self.head(out[-1])


torch.manual_seed(0)
net = Net()
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
truth = Truth()
for step in range(1, 31):
    x = torch.randn(7, 32, 8)
    y = (x[0, :, 0] > 0).long() + (x[-1, :, 0] > 0).long()   # needs the first and the last token
    loss = nn.functional.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    zero = [n for n, p in net.named_parameters() if not p.grad.any()]
    truth.add(step=step, loss=loss.item(), norm=grad_norm(net.parameters()), zero=zero)
    opt.step()
print("done")
