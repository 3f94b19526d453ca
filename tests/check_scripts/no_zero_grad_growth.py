"""A classifier (its cross-entropy summed over the batch) whose loop calls optimizer.zero_grad() once, before
the loop, instead of at every step: from the second step on every backward() adds to the gradients of all the
steps before it, so the norm the optimizer steps on grows about a hundredfold over the run (from ~1e3 to ~1e5)
while each batch's own gradient stays near its first level. Expected: no_zero_grad first (the cause, critical); the norm's growth reported after it and
said to follow from it; exit 1."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=2e-7)
w = torch.randn(32, 10)
truth = Truth()
optimizer.zero_grad()  # the slip: once, before the loop
for step in range(1, 121):
    x = 3.0 * torch.randn(1024, 32)
    y = (x @ w).argmax(1)
    loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    own = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)  # this batch's gradient alone
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item(),
              own=float(torch.cat([g.double().reshape(-1) for g in own]).norm()))
    optimizer.step()
print("done")
