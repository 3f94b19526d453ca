"""A deep sigmoid MLP: the early layers' gradients vanish. Expected: warning depth_vanishing naming the
first layers, exit 0 (warnings only)."""
import torch

torch.manual_seed(0)
layers = []
for i in range(16):
    layers += [torch.nn.Linear(32, 32), torch.nn.Sigmoid()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(20):
    x = torch.randn(64, 32)
    y = torch.randn(64, 1)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
