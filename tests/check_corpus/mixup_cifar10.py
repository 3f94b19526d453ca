"""Modelled on facebookresearch/mixup-cifar10@1fe8c5edea624aa6733b0895d1a9b9c97d203c56 train.py and
models/lenet.py: mixup_data (lam ~ Beta(alpha, alpha), inputs mixed with a permutation of the batch) and
mixup_criterion (lam * CE(pred, y_a) + (1 - lam) * CE(pred, y_b)), SGD(lr 0.1, momentum 0.9, weight decay
1e-4), zero_grad/backward/step per batch, no clip; a LeNet (two conv + max-pool, three linear layers). Data:
12x12 RGB images of ten classes (a fixed template per class plus noise), normalised per channel.

--lr 10: the learning rate 100x the default (the source's own flag)."""
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from _corpus import Recorder

parser = argparse.ArgumentParser()
parser.add_argument("--lr", default=0.1, type=float)
parser.add_argument("--seed", default=1, type=int)
parser.add_argument("--batch-size", default=64, type=int)
parser.add_argument("--epoch", default=3, type=int)
parser.add_argument("--decay", default=1e-4, type=float)
parser.add_argument("--alpha", default=1.0, type=float)
args = parser.parse_args()
torch.manual_seed(args.seed)
np.random.seed(args.seed)


class LeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.conv2 = nn.Conv2d(6, 16, 3)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 24)
        self.fc3 = nn.Linear(24, 10)

    def forward(self, x):
        out = F.max_pool2d(F.relu(self.conv1(x)), 2)
        out = F.max_pool2d(F.relu(self.conv2(out)), 2)
        out = out.view(out.size(0), -1)
        out = F.relu(self.fc1(out))
        out = F.relu(self.fc2(out))
        return self.fc3(out)


g = torch.Generator().manual_seed(2)
templates = torch.rand(10, 3, 12, 12, generator=g)
ys = torch.randint(0, 10, (20 * args.batch_size,), generator=g)
xs = (templates[ys] + 0.3 * torch.randn(len(ys), 3, 12, 12, generator=g)).clamp(0, 1)
xs = (xs - xs.mean((0, 2, 3), keepdim=True)) / xs.std((0, 2, 3), keepdim=True)
trainloader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=args.batch_size,
                                          shuffle=True, generator=torch.Generator().manual_seed(0))
net = LeNet()
criterion = nn.CrossEntropyLoss()
optimizer = optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.decay)
rec = Recorder()
rec.watch(optimizer, model=net)


def mixup_data(x, y, alpha=1.0):
    lam = np.random.beta(alpha, alpha) if alpha > 0 else 1
    index = torch.randperm(x.size()[0])
    mixed_x = lam * x + (1 - lam) * x[index, :]
    return mixed_x, y, y[index], lam


def mixup_criterion(criterion, pred, y_a, y_b, lam):
    return lam * criterion(pred, y_a) + (1 - lam) * criterion(pred, y_b)


def train(epoch):
    net.train()
    train_loss = 0
    for batch_idx, (inputs, targets) in enumerate(trainloader):
        inputs, targets_a, targets_b, lam = mixup_data(inputs, targets, args.alpha)
        outputs = net(inputs)
        loss = mixup_criterion(criterion, outputs, targets_a, targets_b, lam)
        train_loss += loss.item()
        optimizer.zero_grad()
        loss.backward()
        rec.loss(loss)
        optimizer.step()
    print(f"Epoch: {epoch} Loss: {train_loss / (batch_idx + 1):.3f}")


for epoch in range(args.epoch):
    train(epoch)
