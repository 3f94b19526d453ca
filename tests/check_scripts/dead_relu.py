"""ReLUs killed by large negative biases: most gradient values are exactly zero. Expected: warning dead
naming the hidden layers, exit 0."""
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                            torch.nn.Linear(128, 1))
with torch.no_grad():
    model[0].bias.fill_(-4.0)
    model[2].bias.fill_(-4.0)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    x = torch.randn(64, 16)
    y = torch.randn(64, 1)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
