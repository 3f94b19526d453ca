"""Modelled on pytorch/examples@77f55b912142e11fcfdf5b530231fb9c52f181e8 dcgan/main.py: a Generator of
ConvTranspose2d/BatchNorm2d/ReLU ending in Tanh and a Discriminator of Conv2d/BatchNorm2d/LeakyReLU(0.2) ending
in Sigmoid, both initialised by weights_init (N(0, 0.02) convs, N(1, 0.02) BatchNorm), BCELoss, two Adam
optimizers (lr 2e-4, betas (0.5, 0.999)); per batch netD.zero_grad(), errD_real.backward(),
errD_fake.backward() on fake.detach(), optimizerD.step(), then netG.zero_grad(), errG.backward(),
optimizerG.step(). Data: 16x16 one-channel images of a bright blob at a random place (synthetic, in [-1, 1]);
three layers each instead of five.

--bug g-detached: the generator's step reuses the discriminator's line, netD(fake.detach()), so errG never
reaches netG (its gradients stay None; optimizerG steps on nothing).
--lr 0.02: both learning rates 100x the default (the source's own flag)."""
import argparse

import torch
import torch.nn as nn
import torch.optim as optim
from _corpus import Recorder

parser = argparse.ArgumentParser()
parser.add_argument("--batchSize", type=int, default=32)
parser.add_argument("--nz", type=int, default=16)
parser.add_argument("--ngf", type=int, default=8)
parser.add_argument("--ndf", type=int, default=8)
parser.add_argument("--niter", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.0002)
parser.add_argument("--beta1", type=float, default=0.5)
parser.add_argument("--manualSeed", type=int, default=999)
parser.add_argument("--bug", choices=["none", "g-detached"], default="none")
opt = parser.parse_args()
torch.manual_seed(opt.manualSeed)
nz, ngf, ndf, nc = opt.nz, opt.ngf, opt.ndf, 1


def blobs(n, gen):
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    c = torch.rand(n, 2, generator=gen) * 10 + 3
    d2 = (yy - c[:, 0, None, None]) ** 2 + (xx - c[:, 1, None, None]) ** 2
    return (2 * torch.exp(-d2 / 8.0) - 1).unsqueeze(1)


gen = torch.Generator().manual_seed(3)
dataloader = [(blobs(opt.batchSize, gen), None) for _ in range(40)]


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


netG = Generator()
netG.apply(weights_init)
netD = Discriminator()
netD.apply(weights_init)
criterion = nn.BCELoss()
real_label, fake_label = 1, 0
optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
rec = Recorder()
rec.watch(optimizerD, "D", netD)
rec.watch(optimizerG, "G", netG)

for epoch in range(opt.niter):
    for i, data in enumerate(dataloader, 0):
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        real_cpu = data[0]
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        rec.loss(errD_real, "D")
        noise = torch.randn(batch_size, nz, 1, 1)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        rec.loss(errD_fake, "D")
        errD = errD_real + errD_fake
        optimizerD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)
        output = netD(fake.detach() if opt.bug == "g-detached" else fake)
        errG = criterion(output, label)
        errG.backward()
        rec.loss(errG, "G")
        optimizerG.step()
        print("[%d/%d] Loss_D: %.4f Loss_G: %.4f" % (i, len(dataloader), errD.item(), errG.item()))
