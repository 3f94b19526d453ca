"""A value network fitted to returns that grow step by step, as an agent's do while its episodes lengthen: its
loss rises and its norms pass 100 with no other harm. ``--env`` registers a module named ``gymnasium`` first (the
tests have no gym installed): check reads the import of an RL environment package as the mark of such a run."""
import sys
import types

import torch
import torch.nn as nn

if "--env" in sys.argv:
    sys.modules.setdefault("gymnasium", types.ModuleType("gymnasium"))
torch.manual_seed(0)
critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(critic.parameters(), lr=1e-5)
for step in range(120):
    obs = torch.randn(64, 4)
    returns = (20.0 + step) * (1.0 + 0.1 * obs[:, :1])      # the returns grow as the episodes lengthen
    loss = (critic(obs) - returns).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
