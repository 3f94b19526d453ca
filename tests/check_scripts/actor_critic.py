"""Actor-critic with two optimizers: the actor's policy-gradient loss is signed, the critic's value loss
(MSE to returns) rises about 4x while the returns grow, then falls below its start once the critic catches
up (as a PPO critic's does). Expected: no loss_diverging (judged over the whole run), exit 0."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
actor = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
critic = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
actor_opt = torch.optim.Adam(actor.parameters(), lr=3e-3)
critic_opt = torch.optim.Adam(critic.parameters(), lr=3e-2)
truth = Truth()
for it in range(1, 81):
    s = torch.randn(128, 6)
    dist = torch.distributions.Categorical(logits=actor(s))
    a = dist.sample()
    scale = 5.0 + 25.0 * min(it, 30) / 30  # the returns grow as the policy improves, then level off
    ret = scale * (1.0 + 0.1 * torch.randn(128)) + (a == 1).float()
    value = critic(s).squeeze(1)
    adv = (ret - value).detach()
    actor_loss = -(dist.log_prob(a) * adv).mean() - 0.01 * dist.entropy().mean()
    actor_opt.zero_grad()
    actor_loss.backward()
    truth.add(opt="actor", norm=grad_norm(actor.parameters()), loss=actor_loss.item())
    actor_opt.step()
    critic_loss = torch.nn.functional.mse_loss(value, ret)
    critic_opt.zero_grad()
    critic_loss.backward()
    truth.add(opt="critic", norm=grad_norm(critic.parameters()), loss=critic_loss.item())
    critic_opt.step()
print("done")
