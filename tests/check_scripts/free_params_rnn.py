"""A healthy recurrent model with parameters that are small by construction: a learned initial state (its
gradient passes through every time step of a contracting recurrence) and a scalar output gain. Neither is a
layer of the stack, so neither is "vanishing across depth". Expected: no depth_vanishing, exit 0."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)


class TinyRNN(torch.nn.Module):
    def __init__(self, d=8, h=32):
        super().__init__()
        self.start = torch.nn.Parameter(torch.zeros(1, h))  # the learned initial state
        self.gain = torch.nn.Parameter(torch.ones(()))      # a scalar output gain
        self.xh = torch.nn.Linear(d, h)
        self.hh = torch.nn.Linear(h, h, bias=False)
        self.head = torch.nn.Linear(h, 1)
        with torch.no_grad():
            self.hh.weight.mul_(0.3)  # a contracting recurrence: the start state's influence fades

    def forward(self, x):  # x: (batch, time, d)
        h = self.start.expand(x.shape[0], -1)
        for t in range(x.shape[1]):
            h = torch.tanh(self.xh(x[:, t]) + self.hh(h))
        return self.gain * self.head(h)


model = TinyRNN()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
truth = Truth()
for step in range(1, 31):
    x = torch.randn(32, 40, 8)
    y = x[:, -3:, :2].sum((1, 2))[:, None] * 0.3
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item(),
              start=float(model.start.grad.norm()), head=float(model.head.weight.grad.norm()))
    opt.step()
print("done")
