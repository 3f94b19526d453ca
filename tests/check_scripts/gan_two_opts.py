"""Two alternating optimizers (GAN-like): the discriminator's and the generator's gradient norms differ by
~10x by design, so one merged series would see a "spike" at every hand-over."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
G = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
D = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
bce = torch.nn.functional.binary_cross_entropy_with_logits
truth = Truth()
for it in range(30):
    real = torch.randn(64, 2) * 0.5 + 2.0
    fake = G(torch.randn(64, 4))
    D.zero_grad()
    loss_d = 0.5 * (bce(D(real), torch.ones(64, 1)) + bce(D(fake.detach()), torch.zeros(64, 1)))
    loss_d.backward()
    truth.add(opt="D", norm=grad_norm(D.parameters()), loss=loss_d.item())
    opt_d.step()
    G.zero_grad()
    loss_g = 10.0 * bce(D(fake), torch.ones(64, 1))  # a loss weight: the generator's norms run ~10x higher
    loss_g.backward()
    truth.add(opt="G", norm=grad_norm(G.parameters()), loss=loss_g.item())
    opt_g.step()
print("done")
