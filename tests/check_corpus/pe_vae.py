"""Modelled on pytorch/examples@77f55b912142e11fcfdf5b530231fb9c52f181e8 vae/main.py: the VAE of fc1 -> (fc21,
fc22) -> reparameterize -> fc3 -> fc4 -> sigmoid, its loss the reconstruction BCE *summed* over the batch and
pixels plus the KL divergence (also summed), Adam(lr=1e-3), zero_grad/backward/step per batch. Data: 8x8
"digits" (16x16: ten fixed random patterns with pixel noise, in [0, 1]), sizes 256 -> 64 -> 8, batches of 128.

--bug zero-init: the encoder's entry layer fc1 is zero-initialised (the zero-init trick meant for the output
layer, applied to the wrong one); relu(0) has derivative 0 in torch, so fc1 never receives a gradient, nor do
fc21/fc22's weights (their input is all zero), from the first step to the last.
--lr 0.1: the learning rate 100x the default."""
import argparse

import torch
import torch.utils.data
from _corpus import Recorder
from torch import nn, optim
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--bug", choices=["none", "zero-init"], default="none")
args = parser.parse_args()
torch.manual_seed(args.seed)

gen = torch.Generator().manual_seed(5)
protos = (torch.rand(10, 256, generator=gen) > 0.7).float()
labels = torch.randint(0, 10, (2560,), generator=gen)
images = (protos[labels] * 0.9 + 0.1 * torch.rand(2560, 256, generator=gen)).clamp(0, 1)
train_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels),
                                           batch_size=args.batch_size, shuffle=True,
                                           generator=torch.Generator().manual_seed(0))


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 64)
        self.fc21 = nn.Linear(64, 8)
        self.fc22 = nn.Linear(64, 8)
        self.fc3 = nn.Linear(8, 64)
        self.fc4 = nn.Linear(64, 256)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 256))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


model = VAE()
if args.bug == "zero-init":
    nn.init.zeros_(model.fc1.weight)
    nn.init.zeros_(model.fc1.bias)
optimizer = optim.Adam(model.parameters(), lr=args.lr)
rec = Recorder()
rec.watch(optimizer, model=model)


def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 256), reduction="sum")
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def train(epoch):
    model.train()
    train_loss = 0
    for batch_idx, (data, _) in enumerate(train_loader):
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data)
        loss = loss_function(recon_batch, data, mu, logvar)
        loss.backward()
        rec.loss(loss)
        train_loss += loss.item()
        optimizer.step()
    print(f"====> Epoch: {epoch} Average loss: {train_loss / len(train_loader.dataset):.4f}")


for epoch in range(1, args.epochs + 1):
    train(epoch)
