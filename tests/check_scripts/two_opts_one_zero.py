"""Two optimizers (actor and critic); from its second step the actor's gradients are exactly zero in every
tensor (its zero_grad(set_to_none=False) moved between backward() and step(): a refactoring slip). The critic
learns normally. Expected: a critical zero_grads finding about the actor only, exit 1."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
actor = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
critic = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
actor_opt = torch.optim.Adam(actor.parameters(), lr=1e-3)
critic_opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
truth = Truth()
for it in range(1, 31):
    s = torch.randn(64, 6)
    dist = torch.distributions.Categorical(logits=actor(s))
    a = dist.sample()
    ret = 1.0 + (a == 1).float()
    value = critic(s).squeeze(1)
    actor_loss = -(dist.log_prob(a) * (ret - value).detach()).mean()
    actor_loss.backward()
    if it > 1:
        actor_opt.zero_grad(set_to_none=False)  # the slip: after backward, before step
    truth.add(opt="actor", norm=grad_norm(actor.parameters()), loss=actor_loss.item())
    actor_opt.step()
    actor_opt.zero_grad()
    critic_loss = torch.nn.functional.mse_loss(value, ret)
    critic_opt.zero_grad()
    critic_loss.backward()
    truth.add(opt="critic", norm=grad_norm(critic.parameters()), loss=critic_loss.item())
    critic_opt.step()
print("done")
