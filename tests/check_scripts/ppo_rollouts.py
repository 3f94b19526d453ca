"""An on-policy agent's critic, as PPO fits it: each iteration collects a rollout by calling its models with
gradients off, then fits the critic to that rollout's returns for several epochs of minibatches, the first in
the order collected. The returns grow as the episodes lengthen, and the states that start the long episodes
(early in the rollout) have returns far above the rest: the first pass over a new rollout meets them, and its
losses and norms jump with the data. ``--env`` registers a module named ``gymnasium`` first (the tests have no
gym installed); ``--grad-rollout`` collects the rollout with gradients on (no rollout to read)."""
import sys
import types

import torch
import torch.nn as nn

if "--env" in sys.argv:
    sys.modules.setdefault("gymnasium", types.ModuleType("gymnasium"))
torch.manual_seed(0)
T, B, EPOCHS = 1024, 32, 4
actor = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
critic = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.Adam(critic.parameters(), lr=3e-3)
for it in range(6):
    states = torch.randn(T, 4)
    with torch.set_grad_enabled("--grad-rollout" in sys.argv):
        for t in range(0, T, 8):                # acting: one call per step of 8 environments
            actor(states[t:t + 8])
    returns = (5.0 + 2.0 * it) * (1.0 + 0.3 * states[:, :1] + 0.3 * torch.randn(T, 1))
    returns[64:72] *= 3.0                        # the long episodes' first states: the third batch ...
    returns[96:128] *= 6.0                       # ... and the fourth
    for epoch in range(EPOCHS):
        perm = torch.arange(T) if epoch == 0 else torch.randperm(T)
        for i in range(0, T, B):
            idx = perm[i:i + B]
            loss = (critic(states[idx]) - returns[idx]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
