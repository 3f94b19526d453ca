"""REINFORCE on a cart-pole, as pytorch/examples' reinforcement_learning/reinforce.py@0c1654d writes it
(a 4-128-2 policy, Adam at 1e-2, returns discounted by 0.99 and normalised, one update per episode; the
example's dropout left out, and the episode's log-probabilities computed in one batched forward pass after it
rather than one per step, the same gradient), with the environment written out (the classic cart-pole equations, Euler steps, a pole that falls
past 12 degrees or a cart past 2.4 ends the episode, 200 steps at most). The policy learns: episodes get
longer, and because the loss is a sum over the episode's steps its gradient norm rises as it learns.
Expected: no warning or critical (a rising norm while the returns grow is how this objective learns); exit 0."""
import argparse
import math

import torch
import torch.nn.functional as F
from _truth import Truth, grad_norm

p = argparse.ArgumentParser()
p.add_argument("--episodes", type=int, default=100)
p.add_argument("--lr", type=float, default=1e-2)
a = p.parse_args()


class CartPole:
    """The cart-pole dynamics (Barto, Sutton and Anderson 1983) with the constants everyone uses."""

    def __init__(self, gen):
        self.gen = gen

    def reset(self):
        self.s = [float(v) for v in (torch.rand(4, generator=self.gen) * 0.1 - 0.05)]
        return self.s

    def step(self, action):
        x, x_dot, th, th_dot = self.s
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(th), math.sin(th)
        temp = (force + 0.05 * th_dot ** 2 * sin) / 1.1
        th_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos ** 2 / 1.1))
        x_acc = temp - 0.05 * th_acc * cos / 1.1
        x, x_dot = x + 0.02 * x_dot, x_dot + 0.02 * x_acc
        th, th_dot = th + 0.02 * th_dot, th_dot + 0.02 * th_acc
        self.s = [x, x_dot, th, th_dot]
        return self.s, abs(x) > 2.4 or abs(th) > 12 * 2 * math.pi / 360


class Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = torch.nn.Linear(4, 128)
        self.affine2 = torch.nn.Linear(128, 2)

    def forward(self, x):
        return F.softmax(self.affine2(F.relu(self.affine1(x))), dim=1)


torch.manual_seed(1)
env = CartPole(torch.Generator().manual_seed(1))
policy = Policy()
optimizer = torch.optim.Adam(policy.parameters(), lr=a.lr)
eps = torch.finfo(torch.float32).eps
truth = Truth()
for episode in range(1, a.episodes + 1):
    state, states, actions, rewards = env.reset(), [], [], []
    for t in range(200):
        states.append(state)
        with torch.no_grad():
            probs = policy(torch.tensor(state).unsqueeze(0))[0]
        action = int(torch.rand((), generator=env.gen) < probs[1])
        actions.append(action)
        state, done = env.step(action)
        rewards.append(1.0)
        if done:
            break
    R, returns = 0.0, []
    for r in rewards[::-1]:
        R = r + 0.99 * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    optimizer.zero_grad()
    probs = policy(torch.tensor(states))
    log_probs = torch.log(probs.gather(1, torch.tensor(actions)[:, None])[:, 0])
    loss = (-log_probs * returns).sum()
    loss.backward()
    truth.add(step=episode, norm=grad_norm(policy.parameters()), loss=loss.item(), length=len(rewards))
    optimizer.step()
print("done")
