"""A Wasserstein GAN with weight clipping (the original recipe: RMSprop, 5 critic steps per generator step, the
critic's weights clipped to [-0.01, 0.01]). The critic's loss is mean D(fake) - mean D(real): the bias of its
output layer adds the same constant to both means, which cancel, so its gradient is exactly zero by
construction at every critic step. Nothing is dead and nothing is wrong. Expected: a notice that names the
bias as a parameter the loss does not depend on, no initialisation advice, exit 0.

The truth (FG_TRUTH), recorded with plain reads: per critic step the loss, the critic's float64 norm and the
names of its parameters whose gradient is exactly zero."""
import torch
import torch.nn as nn

from _truth import Truth, grad_norm

torch.manual_seed(0)
critic = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
gen = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))
opt_d = torch.optim.RMSprop(critic.parameters(), lr=5e-4)
opt_g = torch.optim.RMSprop(gen.parameters(), lr=5e-4)
truth = Truth()
step = 0
for it in range(12):
    for _ in range(5):
        real = torch.randn(64, 2) * 0.5 + torch.tensor([2.0, -1.0])
        fake = gen(torch.randn(64, 4)).detach()
        loss_d = critic(fake).mean() - critic(real).mean()
        opt_d.zero_grad()
        loss_d.backward()
        step += 1
        zero = [n for n, p in critic.named_parameters() if p.grad is not None and not p.grad.any()]
        truth.add(step=step, loss=loss_d.item(), norm=grad_norm(critic.parameters()), zero=zero)
        opt_d.step()
        for p in critic.parameters():
            p.data.clamp_(-0.01, 0.01)
    loss_g = -critic(gen(torch.randn(64, 4))).mean()
    opt_g.zero_grad()
    loss_g.backward()
    opt_g.step()
print("done")
