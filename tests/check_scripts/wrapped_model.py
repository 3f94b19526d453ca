"""A model trained through a wrapper that forwards to it (DataParallel here; DDP, torch.compile and Lightning
Fabric wrap the same way): its parameters are named as in the model the script wrote."""
import torch
import torch.nn as nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
model = nn.DataParallel(net)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(30):
    x = torch.randn(16, 6)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
