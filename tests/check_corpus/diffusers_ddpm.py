"""Modelled on huggingface/diffusers@58eb52c0803ea9af3abec60841c2a093bdf1f951
examples/unconditional_image_generation/train_unconditional.py, with the accelerator's calls written as the
plain torch they stand for: a UNet predicting the noise ("epsilon") from noisy images and random timesteps, the
DDPM forward process add_noise(clean, noise, t) on a linear beta schedule (1e-4 .. 0.02, 1000 steps), F.mse_loss
on the noise, AdamW(betas (0.95, 0.999), weight decay 1e-6, eps 1e-8), a cosine schedule with warm-up stepped
per update, clip_grad_norm_(1.0) before optimizer.step(), then lr_scheduler.step() and optimizer.zero_grad(); an
EMA of the weights. The UNet is a small one written here (time embedding, down and up residual blocks with
GroupNorm and SiLU, a skip connection); the data are 8x8 RGB images of smooth random gradients in [-1, 1].

--bug clip-after-step: the clip moved below optimizer.step(): the step consumes the unclipped gradients and
the clip then rescales gradients that zero_grad() throws away."""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _corpus import Recorder

parser = argparse.ArgumentParser()
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--lr_warmup_steps", type=int, default=5)
parser.add_argument("--max_train_steps", type=int, default=40)
parser.add_argument("--bug", choices=["none", "clip-after-step"], default="none")
args = parser.parse_args()
torch.manual_seed(0)


class DDPMScheduler:
    def __init__(self, num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02):
        self.num_train_timesteps = num_train_timesteps
        self.betas = torch.linspace(beta_start, beta_end, num_train_timesteps)
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, dim=0)

    def add_noise(self, original, noise, timesteps):
        a = self.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        return a.sqrt() * original + (1 - a).sqrt() * noise


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half) / half)
    args_ = t.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(args_), torch.cos(args_)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.norm1 = nn.GroupNorm(4, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(tdim, cout)
        self.norm2 = nn.GroupNorm(4, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.shortcut(x)


class UNet2DModel(nn.Module):
    def __init__(self, ch=16, tdim=32):
        super().__init__()
        self.tdim = tdim
        self.time_embedding = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.down = ResBlock(ch, ch, tdim)
        self.downsample = nn.Conv2d(ch, ch, 3, stride=2, padding=1)
        self.mid = ResBlock(ch, 2 * ch, tdim)
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
        self.up = ResBlock(3 * ch, ch, tdim)
        self.conv_norm_out = nn.GroupNorm(4, ch)
        self.conv_out = nn.Conv2d(ch, 3, 3, padding=1)

    def forward(self, sample, timesteps):
        temb = self.time_embedding(timestep_embedding(timesteps, self.tdim))
        h0 = self.down(self.conv_in(sample), temb)
        h = self.mid(self.downsample(h0), temb)
        h = self.up(torch.cat([self.upsample(h), h0], dim=1), temb)
        return self.conv_out(F.silu(self.conv_norm_out(h)))


g = torch.Generator().manual_seed(1)
yy, xx = torch.meshgrid(torch.linspace(-1, 1, 8), torch.linspace(-1, 1, 8), indexing="ij")
train_dataloader = []
for _ in range(args.max_train_steps):
    w = torch.randn(16, 3, 2, generator=g)
    train_dataloader.append(torch.tanh(w[..., 0, None, None] * yy + w[..., 1, None, None] * xx))

model = UNet2DModel()
ema_model = copy.deepcopy(model).requires_grad_(False)
noise_scheduler = DDPMScheduler()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.95, 0.999), weight_decay=1e-6,
                              eps=1e-08)
rec = Recorder()
rec.watch(optimizer, model=model)


def cosine_with_warmup(step):
    if step < args.lr_warmup_steps:
        return step / max(1, args.lr_warmup_steps)
    progress = (step - args.lr_warmup_steps) / max(1, args.max_train_steps - args.lr_warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup)
global_step = 0
for step, clean_images in enumerate(train_dataloader):
    noise = torch.randn(clean_images.shape)
    bsz = clean_images.shape[0]
    timesteps = torch.randint(0, noise_scheduler.num_train_timesteps, (bsz,)).long()
    noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
    model_output = model(noisy_images, timesteps)
    loss = F.mse_loss(model_output.float(), noise.float())
    loss.backward()
    rec.loss(loss)
    if args.bug == "none":
        rec.before_clip(model.parameters())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if args.bug == "clip-after-step":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    lr_scheduler.step()
    optimizer.zero_grad()
    with torch.no_grad():
        decay = min(0.999, (1 + global_step) / (10 + global_step))
        for e, p in zip(ema_model.parameters(), model.parameters()):
            e.lerp_(p, 1 - decay)
    global_step += 1
    if step % 10 == 0:
        print(f"step {step}: loss {loss.item():.4f} lr {lr_scheduler.get_last_lr()[0]:.2e}")
