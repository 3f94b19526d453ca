"""Modelled on pytorch/examples@77f55b912142e11fcfdf5b530231fb9c52f181e8 reinforcement_learning/reinforce.py: a
Policy of affine1 (4 -> 128), dropout 0.6, relu, affine2 (-> 2), softmax; actions sampled from Categorical;
at the end of each episode the discounted returns are normalised, policy_loss = sum(-log_prob * R) over the
episode, optimizer.zero_grad(), backward, Adam(lr=1e-2).step(). The environment: CartPole's physics
(tests/check_corpus/_corpus.py), episodes capped at 200 steps; a fixed number of episodes.

The loss is a sum over an episode whose length grows as the policy learns: the gradient norm grows with it.

--bug no-zero-grad: optimizer.zero_grad() left out, so every episode's gradient is added to all before it."""
import argparse
from collections import deque

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from _corpus import CartPole, Recorder
from torch.distributions import Categorical

parser = argparse.ArgumentParser()
parser.add_argument("--gamma", type=float, default=0.99)
parser.add_argument("--seed", type=int, default=543)
parser.add_argument("--episodes", type=int, default=60)
parser.add_argument("--bug", choices=["none", "no-zero-grad"], default="none")
args = parser.parse_args()

env = CartPole(seed=args.seed)
torch.manual_seed(args.seed)


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)
        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        return F.softmax(self.affine2(x), dim=1)


policy = Policy()
optimizer = optim.Adam(policy.parameters(), lr=1e-2)
eps = np.finfo(np.float32).eps.item()
rec = Recorder()
rec.watch(optimizer, model=policy)


def select_action(state):
    state = torch.from_numpy(state).float()
    probs = policy(state)
    m = Categorical(probs)
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))
    return action.item()


def finish_episode():
    R = 0
    policy_loss = []
    returns = deque()
    for r in policy.rewards[::-1]:
        R = r + args.gamma * R
        returns.appendleft(R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    for log_prob, R in zip(policy.saved_log_probs, returns):
        policy_loss.append(-log_prob * R)
    if args.bug != "no-zero-grad":
        optimizer.zero_grad()
    policy_loss = torch.cat(policy_loss).sum()
    policy_loss.backward()
    rec.loss(policy_loss)
    optimizer.step()
    del policy.rewards[:]
    del policy.saved_log_probs[:]


def main():
    running_reward = 10
    for i_episode in range(1, args.episodes + 1):
        state = env.reset()
        ep_reward = 0
        for t in range(1, 10000):
            action = select_action(state)
            state, reward, done = env.step([action])
            policy.rewards.append(float(reward[0]))
            ep_reward += float(reward[0])
            if done[0]:
                break
        running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward
        finish_episode()
        rec.note(episode_len=t)
        if i_episode % 10 == 0:
            print(f"Episode {i_episode}\tLast reward: {ep_reward:.2f}\tAverage reward: {running_reward:.2f}")


if __name__ == "__main__":
    main()
