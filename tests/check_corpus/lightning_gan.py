"""Modelled on Lightning-AI/pytorch-lightning@215acdc3efa4b096c80ab2d0263cab20d2f06f54
examples/pytorch/domain_templates/generative_adversarial_net.py: a LightningModule with manual optimization
(automatic_optimization = False), a Generator of Linear/BatchNorm1d(eps 0.8)/LeakyReLU(0.2) blocks ending in
Tanh and a Discriminator MLP, binary_cross_entropy_with_logits; per batch toggle_optimizer(opt_g), g_loss,
opt_g.zero_grad(), manual_backward, opt_g.step(), untoggle; then the same for opt_d with the average of the real
and fake losses; two Adam optimizers (lr 2e-4, betas (0.5, 0.999)); a Trainer on CPU. Data: 8x8 one-channel
"images" (a few fixed patterns plus noise); smaller layers than the template.

--bug no-zero-grad-d: the discriminator's opt_d.zero_grad() left out (manual optimization leaves zeroing to the
script): the discriminator's gradients are summed over every batch so far."""
import argparse
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from _corpus import Recorder

warnings.filterwarnings("ignore")
import lightning as L  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.0002)
parser.add_argument("--bug", choices=["none", "no-zero-grad-d"], default="none")
args = parser.parse_args()
L.seed_everything(0, verbose=False)
img_shape, latent_dim = (1, 8, 8), 16
rec = Recorder()


class Generator(nn.Module):
    def __init__(self):
        super().__init__()

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(*block(latent_dim, 32, normalize=False), *block(32, 64), nn.Linear(64, 64),
                                   nn.Tanh())

    def forward(self, z):
        return self.model(z).view(z.size(0), *img_shape)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2, inplace=True), nn.Linear(64, 32),
                                   nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 1))

    def forward(self, img):
        return self.model(img.view(img.size(0), -1))


class GAN(L.LightningModule):
    def __init__(self, lr=0.0002, b1=0.5, b2=0.999):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator()
        self.discriminator = Discriminator()

    def forward(self, z):
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch):
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], latent_dim).type_as(imgs)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        rec.loss(g_loss, "G")
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        if args.bug != "no-zero-grad-d":
            opt_d.zero_grad()
        self.manual_backward(d_loss)
        rec.loss(d_loss, "D")
        opt_d.step()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        lr, b1, b2 = self.hparams.lr, self.hparams.b1, self.hparams.b2
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        rec.watch(opt_g, "G", self.generator)
        rec.watch(opt_d, "D", self.discriminator)
        return opt_g, opt_d


g = torch.Generator().manual_seed(1)
patterns = torch.rand(3, 1, 8, 8, generator=g) * 2 - 1
ys = torch.randint(0, 3, (960,), generator=g)
imgs = (patterns[ys] + 0.1 * torch.randn(960, 1, 8, 8, generator=g)).clamp(-1, 1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(imgs, ys), batch_size=32)
model = GAN(lr=args.lr)
trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, loader)
