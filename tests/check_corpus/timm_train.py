"""Modelled on huggingface/pytorch-image-models@aa4b5850c1543fa488abf260f18390eda46cf85d train.py
(train_one_epoch), timm/utils/cuda.py (NativeScaler) and timm/utils/clip_grad.py (dispatch_clip_grad): autocast
(float16) around the forward and a label-smoothing cross-entropy (0.1); the loss scaler's call of
scaler.scale(loss).backward(), then, at an update, scaler.unscale_(optimizer) before dispatch_clip_grad(mode
"norm", clip_grad 1.0), scaler.step, scaler.update; optimizer.zero_grad() after the update; the scheduler
stepped per update (cosine, linear warm-up); an EMA of the weights updated after each step; SGD with nesterov
momentum 0.9 and weight decay. The model is a small ResNet-style CNN (BasicBlocks with BatchNorm); the data are
8x8 RGB images of four classes (a fixed template per class plus noise).

--bug clip-before-unscale: the clip is called before scaler.unscale_ (a port of the loop that reordered the
two lines): it clips the gradients still multiplied by the loss scale (65536), so the update is ~1/65536 of
the intended one and the run barely moves.
--bug nan-image: one corrupt image (NaN pixels) in the batch of update 12: the scaler sees inf/NaN gradients,
skips that step and halves its scale; the weights are untouched and the run goes on."""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from _corpus import Recorder

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--clip-grad", type=float, default=1.0)
parser.add_argument("--updates", type=int, default=40)
parser.add_argument("--bug", choices=["none", "clip-before-unscale", "nan-image"], default="none")
args = parser.parse_args()
torch.manual_seed(42)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        return F.relu(x + shortcut)


class ResNet(nn.Module):
    def __init__(self, num_classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(x.mean((2, 3)))


class NativeScaler:
    def __init__(self):
        self._scaler = torch.amp.GradScaler("cpu")

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, need_update=True):
        self._scaler.scale(loss).backward()
        if need_update:
            if clip_grad is not None:
                if args.bug == "clip-before-unscale":
                    dispatch_clip_grad(parameters, clip_grad)
                    self._scaler.unscale_(optimizer)
                else:
                    self._scaler.unscale_(optimizer)
                    dispatch_clip_grad(parameters, clip_grad)
            scale = self._scaler.get_scale()
            self._scaler.step(optimizer)
            self._scaler.update()
            if self._scaler.get_scale() < scale:
                rec.skipped(scale=scale)


def dispatch_clip_grad(parameters, value, mode="norm", norm_type=2.0):
    if mode == "norm":
        rec.before_clip(parameters)
        torch.nn.utils.clip_grad_norm_(parameters, value, norm_type=norm_type)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(parameters, value)


class ModelEma:
    def __init__(self, model, decay=0.99):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.lerp_(m, 1.0 - self.decay)
            else:
                e.copy_(m)


g = torch.Generator().manual_seed(0)
templates = torch.randn(4, 3, 8, 8, generator=g)
loader = []
for i in range(args.updates):
    y = torch.randint(0, 4, (32,), generator=g)
    x = templates[y] + 0.7 * torch.randn(32, 3, 8, 8, generator=g)
    if args.bug == "nan-image" and i == 11:
        x[5] = float("nan")
    loader.append((x, y))

model = ResNet()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=2e-5)
rec = Recorder()
rec.watch(optimizer, model=model)
loss_scaler = NativeScaler()
model_ema = ModelEma(model)
warmup, total = 5, args.updates


def lr_at(update):
    if update < warmup:
        return args.lr * (update + 1) / warmup
    return 0.5 * args.lr * (1 + math.cos(math.pi * (update - warmup) / (total - warmup)))


train_loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
model.train()
optimizer.zero_grad()
num_updates = 0
for batch_idx, (input, target) in enumerate(loader):
    with torch.autocast("cpu", dtype=torch.float16):
        output = model(input)
        loss = train_loss_fn(output, target)
    rec.loss(loss)
    loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=list(model.parameters()))
    num_updates += 1
    optimizer.zero_grad()
    model_ema.update(model)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr_at(num_updates)
    if batch_idx % 10 == 0:
        print(f"Train: [{batch_idx}/{len(loader)}] Loss: {loss.item():#.3g}")
rec.truth.meta["buffers_finite"] = all(bool(torch.isfinite(b).all()) for b in model.buffers() if b.is_floating_point())
rec.truth.write()  # an in-process run's truth file is not rewritten at exit
