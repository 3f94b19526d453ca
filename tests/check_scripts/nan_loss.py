"""A custom loss with an unguarded log: the loss turns NaN while every gradient stays finite
(d log(u)/du = 1/u). Expected: critical nonfinite_loss, the LogLoss module named by the watcher."""
import torch

torch.manual_seed(0)


class LogLoss(torch.nn.Module):
    def forward(self, pred, target):
        return torch.log(pred - target + 1.0).mean()  # NaN once some pred - target < -1


model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
criterion = LogLoss()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(30):
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True) * 0.1
    opt.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    opt.step()
