"""A linear regression whose inputs have X^T X / n = I, trained by full-batch SGD at lr 1.0: the mean squared
error's Hessian is 2I, so each step reflects the weights through the optimum (w - w* -> -(w - w*)) and the loss
never moves. Expected: a stall finding (a warning: the loss is flat), never critical, exit 0; the summary says
the loss has not improved and the learning rate is in the evidence."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
n, d = 64, 8
q, _ = torch.linalg.qr(torch.randn(n, d, dtype=torch.float64))
x = (q * n ** 0.5).float()                       # x^T x / n = I
w_true = torch.randn(d, 1)
y = x @ w_true + 0.3 * torch.randn(n, 1)
model = torch.nn.Linear(d, 1, bias=False)
torch.nn.init.normal_(model.weight, std=3.0)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
truth = Truth()
for step in range(1, 61):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item(), lr=opt.param_groups[0]["lr"])
    opt.step()
print("done")
