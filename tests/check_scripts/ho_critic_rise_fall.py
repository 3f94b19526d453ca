"""Actor-critic: the critic's value loss rises by an order of magnitude or more while the returns grow faster
than the critic follows, then falls far below its peak once the returns level off and the critic catches up;
the actor's loss is signed. Expected: no critical/warning loss_diverging on the critic (a rise that comes back
down), exit 0."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(2)
actor = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
critic = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
aopt = torch.optim.Adam(actor.parameters(), lr=1e-3)
copt = torch.optim.Adam(critic.parameters(), lr=1e-2)
truth = Truth()
for it in range(1, 161):
    s = torch.randn(64, 4)
    dist = torch.distributions.Categorical(logits=actor(s))
    a = dist.sample()
    scale = 1.0 + 19.0 * min(it, 40) / 40  # returns grow 20x over 40 iterations, then level off
    ret = scale * (1.0 + 0.05 * torch.randn(64)) + 0.5 * a.float()
    v = critic(s).squeeze(1)
    aloss = -(dist.log_prob(a) * (ret - v).detach()).mean()
    aopt.zero_grad()
    aloss.backward()
    truth.add(opt="actor", norm=grad_norm(actor.parameters()), loss=aloss.item())
    aopt.step()
    closs = torch.nn.functional.mse_loss(v, ret)
    copt.zero_grad()
    closs.backward()
    truth.add(opt="critic", norm=grad_norm(critic.parameters()), loss=closs.item())
    copt.step()
print("done")
