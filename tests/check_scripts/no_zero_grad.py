"""A loop that never zeroes its gradients: each step adds to all the previous ones. Expected: critical
no_zero_grad, exit 1."""
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(30):
    x = torch.randn(64, 16)
    y = x[:, :1]
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
