"""Modelled on vwxyzjn/cleanrl@fe8d8a03c41a7ef5b523e2e354bd01c363e786bb cleanrl/ppo.py: an Agent of separate
critic and actor MLPs (64-64 tanh, orthogonal layer_init, actor head std 0.01), Adam(lr 2.5e-4, eps 1e-5) with
the learning rate annealed linearly per iteration, rollouts of num_steps x num_envs, GAE(0.99, 0.95), then
update_epochs over shuffled minibatches: normalised advantages, clipped surrogate (0.2), clipped value loss,
entropy bonus (0.01), vf_coef 0.5, zero_grad, backward, clip_grad_norm_(0.5), step. The environment:
CartPole's physics vectorised (tests/check_corpus/_corpus.py). Tiny sizes: 4 envs, 32 steps, 4 iterations.

--bug reward-norm: the rollout's rewards standardised before GAE, (r - mean) / std, with no epsilon: CartPole
pays 1 at every step, so std is 0 and every reward is 0/0 = NaN; the advantages, the loss, the gradients and
from the first step on the weights are NaN."""
import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from _corpus import CartPole, Recorder
from torch.distributions.categorical import Categorical

p = argparse.ArgumentParser()
p.add_argument("--learning-rate", type=float, default=2.5e-4)
p.add_argument("--num-envs", type=int, default=4)
p.add_argument("--num-steps", type=int, default=32)
p.add_argument("--num-iterations", type=int, default=4)
p.add_argument("--bug", choices=["none", "reward-norm"], default="none")
args = p.parse_args()
args.gamma, args.gae_lambda, args.num_minibatches, args.update_epochs = 0.99, 0.95, 4, 4
args.clip_coef, args.ent_coef, args.vf_coef, args.max_grad_norm = 0.2, 0.01, 0.5, 0.5
args.batch_size = args.num_envs * args.num_steps
args.minibatch_size = args.batch_size // args.num_minibatches


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(layer_init(nn.Linear(4, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)),
                                    nn.Tanh(), layer_init(nn.Linear(64, 1), std=1.0))
        self.actor = nn.Sequential(layer_init(nn.Linear(4, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)),
                                   nn.Tanh(), layer_init(nn.Linear(64, 2), std=0.01))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


random.seed(1)
np.random.seed(1)
torch.manual_seed(1)
envs = CartPole(n=args.num_envs, seed=1)
agent = Agent()
optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
rec = Recorder()
rec.watch(optimizer, model=agent)

obs = torch.zeros((args.num_steps, args.num_envs, 4))
actions = torch.zeros((args.num_steps, args.num_envs))
logprobs = torch.zeros((args.num_steps, args.num_envs))
rewards = torch.zeros((args.num_steps, args.num_envs))
dones = torch.zeros((args.num_steps, args.num_envs))
values = torch.zeros((args.num_steps, args.num_envs))
next_obs = torch.Tensor(envs.reset())
next_done = torch.zeros(args.num_envs)

for iteration in range(1, args.num_iterations + 1):
    frac = 1.0 - (iteration - 1.0) / args.num_iterations
    optimizer.param_groups[0]["lr"] = frac * args.learning_rate
    for step in range(0, args.num_steps):
        obs[step] = next_obs
        dones[step] = next_done
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[step] = value.flatten()
        actions[step] = action
        logprobs[step] = logprob
        state, reward, done = envs.step(action.numpy())
        rewards[step] = torch.tensor(reward).view(-1)
        next_obs, next_done = torch.Tensor(state), torch.Tensor(done.astype(np.float32))

    if args.bug == "reward-norm":
        rewards = (rewards - rewards.mean()) / rewards.std()
    with torch.no_grad():
        next_value = agent.get_value(next_obs).reshape(1, -1)
        advantages = torch.zeros_like(rewards)
        lastgaelam = 0
        for t in reversed(range(args.num_steps)):
            if t == args.num_steps - 1:
                nextnonterminal, nextvalues = 1.0 - next_done, next_value
            else:
                nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
            delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
            advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
        returns = advantages + values

    b_obs, b_logprobs = obs.reshape((-1, 4)), logprobs.reshape(-1)
    b_actions, b_advantages = actions.reshape(-1), advantages.reshape(-1)
    b_returns, b_values = returns.reshape(-1), values.reshape(-1)
    b_inds = np.arange(args.batch_size)
    for epoch in range(args.update_epochs):
        np.random.shuffle(b_inds)
        for start in range(0, args.batch_size, args.minibatch_size):
            mb_inds = b_inds[start:start + args.minibatch_size]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
            logratio = newlogprob - b_logprobs[mb_inds]
            ratio = logratio.exp()
            mb_advantages = b_advantages[mb_inds]
            mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
            pg_loss1 = -mb_advantages * ratio
            pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = torch.max(pg_loss1, pg_loss2).mean()
            newvalue = newvalue.view(-1)
            v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
            v_clipped = b_values[mb_inds] + torch.clamp(newvalue - b_values[mb_inds], -args.clip_coef, args.clip_coef)
            v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
            v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
            entropy_loss = entropy.mean()
            loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
            optimizer.zero_grad()
            loss.backward()
            rec.loss(loss)
            rec.before_clip(agent.parameters())
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
    print(f"iteration {iteration}: v_loss {v_loss.item():.4f} pg_loss {pg_loss.item():.4f}")
