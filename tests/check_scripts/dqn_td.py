"""A DQN-like TD update: Huber loss against bootstrapped targets r + gamma * max Q_target(s'), with rewards
whose scale grows as the agent improves. The TD loss rises about 20x over the run while the gradient norms
stay modest and nearly level (Huber's gradient is bounded): not a divergence. Expected: loss_diverging at
most a notice, exit 0."""
import copy

import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
q = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
target = copy.deepcopy(q)
opt = torch.optim.Adam(q.parameters(), lr=1e-3)
gamma = 0.99
truth = Truth()
for it in range(1, 121):
    s, a, s2 = torch.randn(64, 8), torch.randint(0, 4, (64,)), torch.randn(64, 8)
    r = torch.rand(64) * (1.0 + it / 10)
    with torch.no_grad():
        tgt = r + gamma * target(s2).max(1).values
    pred = q(s).gather(1, a[:, None]).squeeze(1)
    loss = torch.nn.functional.smooth_l1_loss(pred, tgt)
    opt.zero_grad()
    loss.backward()
    truth.add(step=it, norm=grad_norm(q.parameters()), loss=loss.item())
    opt.step()
    if it % 10 == 0:
        target.load_state_dict(q.state_dict())
print("done")
