"""A body and a head under one optimizer. With --detach the body's features reach the loss through
.detach() (the slip: the body runs at every step, but no gradient comes back to it); with --no-grad they are
computed under torch.no_grad(); with --unused an extra layer is built, handed to the optimizer and never
called. The truth records, per step and by plain reads, which parameters had no gradient and whether the body
ran. Expected: never_learns names the body as cut off from the loss (its modules ran) and the extra layer as
never used, each with its own advice."""
import sys

import torch
from _truth import Truth

detach, no_grad, unused = "--detach" in sys.argv, "--no-grad" in sys.argv, "--unused" in sys.argv
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
        self.head = torch.nn.Linear(32, 3)
        self.aux = torch.nn.Linear(32, 32) if unused else None   # built, stepped, never called

    def forward(self, x):
        if no_grad:
            with torch.no_grad():
                h = self.body(x)
        else:
            h = self.body(x)
        return self.head(h.detach() if detach else h)


model = Net()
ran = []
model.body.register_forward_hook(lambda *_: ran.append(True))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
x = torch.randn(256, 12)
y = (x[:, :3] @ torch.randn(3, 3)).argmax(1)
truth = Truth()
for step in range(1, 31):
    ran.clear()
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    truth.add(loss=loss.item(), body_ran=bool(ran),
              no_grad=[n for n, p in model.named_parameters() if p.grad is None])
    opt.step()
print("done")
