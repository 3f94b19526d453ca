"""A VAE whose loss is summed over the batch (binary cross-entropy with reduction='sum' plus the KL term), as
pytorch/examples' vae/main.py@0c1654d writes it, on synthetic images (a low-rank generator through a sigmoid):
a healthy run whose gradient norms are in the thousands because the loss is a sum over 128 x 784 values, while
the loss falls at every quarter of the run. --lr 0.02 is the broken variant: Adam at 20x the example's learning
rate.
Expected: healthy run: no warning or critical (a norm in the thousands is the guide's question, not harm);
exit 0."""
import argparse

import torch
import torch.nn.functional as F
from _truth import Truth, flat_params, grad_norm, update_ratio

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--steps", type=int, default=60)
a = p.parse_args()


class VAE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(784, 400)
        self.fc21 = torch.nn.Linear(400, 20)
        self.fc22 = torch.nn.Linear(400, 20)
        self.fc3 = torch.nn.Linear(20, 400)
        self.fc4 = torch.nn.Linear(400, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        return mu + torch.randn_like(std) * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    bce = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


torch.manual_seed(0)
gen = torch.randn(8, 784) * 1.5
data = torch.sigmoid(torch.randn(2048, 8) @ gen)  # pixel intensities in (0, 1), 8 latent factors
model = VAE()
optimizer = torch.optim.Adam(model.parameters(), lr=a.lr)
truth = Truth()
for step in range(1, a.steps + 1):
    idx = torch.randint(0, len(data), (128,))
    x = data[idx]
    optimizer.zero_grad()
    recon, mu, logvar = model(x)
    loss = loss_function(recon, x, mu, logvar)
    loss.backward()
    before = flat_params(model.parameters())
    norm = grad_norm(model.parameters())
    optimizer.step()
    truth.add(step=step, norm=norm, loss=loss.item(), update=update_ratio(before, flat_params(model.parameters())))
print("done")
