"""Modelled on vwxyzjn/cleanrl@fe8d8a03c41a7ef5b523e2e354bd01c363e786bb cleanrl/dqn.py: a QNetwork MLP
(120-84, relu), Adam(lr 2.5e-4), a target network copied from it, a replay buffer, epsilon-greedy actions on a
linear schedule, and after learning_starts every train_frequency steps: the TD target from the target network
under no_grad, F.mse_loss(td_target, old_val), zero_grad, backward, step; the target network refreshed every
target_network_frequency steps (tau 1). The environment: CartPole's physics (tests/check_corpus/_corpus.py).
Tiny: 1100 environment steps, 60 updates.

--learning-rate 0.25: the learning rate 1000x the default (the source's own flag)."""
import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from _corpus import CartPole, Recorder

p = argparse.ArgumentParser()
p.add_argument("--learning-rate", type=float, default=2.5e-4)
p.add_argument("--total-timesteps", type=int, default=1100)
args = p.parse_args()
args.buffer_size, args.gamma, args.tau, args.target_network_frequency = 1000, 0.99, 1.0, 100
args.batch_size, args.start_e, args.end_e, args.exploration_fraction = 64, 1.0, 0.05, 0.5
args.learning_starts, args.train_frequency = 500, 10


class QNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.network = nn.Sequential(nn.Linear(4, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 2))

    def forward(self, x):
        return self.network(x)


def linear_schedule(start_e, end_e, duration, t):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


random.seed(1)
np.random.seed(1)
torch.manual_seed(1)
envs = CartPole(n=1, seed=1)
q_network = QNetwork()
optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
target_network = QNetwork()
target_network.load_state_dict(q_network.state_dict())
rec = Recorder()
rec.watch(optimizer, model=q_network)
rb_obs = np.zeros((args.buffer_size, 4), np.float32)
rb_next = np.zeros((args.buffer_size, 4), np.float32)
rb_act = np.zeros((args.buffer_size, 1), np.int64)
rb_rew = np.zeros(args.buffer_size, np.float32)
rb_done = np.zeros(args.buffer_size, np.float32)
n_stored = 0

obs = envs.reset()
for global_step in range(args.total_timesteps):
    epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step)
    if random.random() < epsilon:
        actions = np.array([random.randrange(2)])
    else:
        q_values = q_network(torch.Tensor(obs))
        actions = torch.argmax(q_values, dim=1).numpy()
    next_obs, rewards, terminations = envs.step(actions)
    i = n_stored % args.buffer_size
    rb_obs[i], rb_next[i], rb_act[i] = obs[0], next_obs[0], actions[0]
    rb_rew[i], rb_done[i] = rewards[0], terminations[0]
    n_stored += 1
    obs = next_obs
    if global_step > args.learning_starts:
        if global_step % args.train_frequency == 0:
            idx = np.random.randint(0, min(n_stored, args.buffer_size), size=args.batch_size)
            with torch.no_grad():
                target_max, _ = target_network(torch.from_numpy(rb_next[idx])).max(dim=1)
                dones = torch.from_numpy(rb_done[idx])
                td_target = torch.from_numpy(rb_rew[idx]) + args.gamma * target_max * (1 - dones)
            old_val = q_network(torch.from_numpy(rb_obs[idx])).gather(1, torch.from_numpy(rb_act[idx])).squeeze()
            loss = F.mse_loss(td_target, old_val)
            optimizer.zero_grad()
            loss.backward()
            rec.loss(loss)
            optimizer.step()
        if global_step % args.target_network_frequency == 0:
            for target_network_param, q_network_param in zip(target_network.parameters(), q_network.parameters()):
                target_network_param.data.copy_(
                    args.tau * q_network_param.data + (1.0 - args.tau) * target_network_param.data)
print("done")
