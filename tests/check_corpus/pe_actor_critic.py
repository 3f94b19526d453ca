"""Modelled on pytorch/examples@77f55b912142e11fcfdf5b530231fb9c52f181e8 reinforcement_learning/actor_critic.py:
one Policy with a shared affine1 (4 -> 128, relu), an action_head (softmax) and a value_head; per episode the
normalised discounted returns, advantage = R - value.item(), loss = sum(-log_prob * advantage) +
sum(smooth_l1_loss(value, R)), optimizer.zero_grad(), backward, Adam(lr=3e-2).step(). The environment:
CartPole's physics (tests/check_corpus/_corpus.py), episodes capped at 200 steps; a fixed number of episodes.

--lr 3: the learning rate 100x the default."""
import argparse
from collections import namedtuple

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
parser.add_argument("--lr", type=float, default=3e-2)
args = parser.parse_args()

env = CartPole(seed=args.seed)
torch.manual_seed(args.seed)
SavedAction = namedtuple("SavedAction", ["log_prob", "value"])


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.action_head = nn.Linear(128, 2)
        self.value_head = nn.Linear(128, 1)
        self.saved_actions = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.affine1(x))
        action_prob = F.softmax(self.action_head(x), dim=-1)
        state_values = self.value_head(x)
        return action_prob, state_values


model = Policy()
optimizer = optim.Adam(model.parameters(), lr=args.lr)
eps = np.finfo(np.float32).eps.item()
rec = Recorder()
rec.watch(optimizer, model=model)


def select_action(state):
    state = torch.from_numpy(state).float()
    probs, state_value = model(state)
    m = Categorical(probs)
    action = m.sample()
    model.saved_actions.append(SavedAction(m.log_prob(action), state_value))
    return action.item()


def finish_episode():
    R = 0
    saved_actions = model.saved_actions
    policy_losses, value_losses, returns = [], [], []
    for r in model.rewards[::-1]:
        R = r + args.gamma * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    for (log_prob, value), R in zip(saved_actions, returns):
        advantage = R - value.item()
        policy_losses.append(-log_prob * advantage)
        value_losses.append(F.smooth_l1_loss(value.view(-1), torch.tensor([R])))
    optimizer.zero_grad()
    loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
    loss.backward()
    rec.loss(loss)
    optimizer.step()
    del model.rewards[:]
    del model.saved_actions[:]


def main():
    running_reward = 10
    for i_episode in range(1, args.episodes + 1):
        state = env.reset()
        ep_reward = 0
        for t in range(1, 10000):
            action = select_action(state)
            state, reward, done = env.step([action])
            model.rewards.append(float(reward[0]))
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
