"""Modelled on pytorch/examples@77f55b912142e11fcfdf5b530231fb9c52f181e8 mnist/main.py: Net of conv1, relu,
conv2, relu, max_pool2d, dropout, fc1, relu, dropout, fc2, log_softmax; F.nll_loss; Adadelta(lr=1.0) with
StepLR(step_size=1, gamma=0.7) per epoch; zero_grad/backward/step per batch. Data: 12x12 8-bit images of ten
classes (a fixed template per class plus noise), scaled to [0, 1] and normalised by their mean and standard
deviation as the source's transforms do; smaller layers.

--lr 100: the learning rate 100x the default (the source's own flag)."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from _corpus import Recorder
from torch.optim.lr_scheduler import StepLR

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=1.0)
parser.add_argument("--gamma", type=float, default=0.7)
parser.add_argument("--seed", type=int, default=1)
args = parser.parse_args()
torch.manual_seed(args.seed)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = torch.flatten(x, 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


gen = torch.Generator().manual_seed(11)
templates = torch.rand(10, 1, 12, 12, generator=gen) * 255
ys = torch.randint(0, 10, (20 * args.batch_size,), generator=gen)
xs = (templates[ys] + 40 * torch.randn(len(ys), 1, 12, 12, generator=gen)).clamp(0, 255).round() / 255
xs = (xs - xs.mean()) / xs.std()
train_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=args.batch_size,
                                           shuffle=True, generator=torch.Generator().manual_seed(0))
model = Net()
optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
rec = Recorder()
rec.watch(optimizer, model=model)


def train(epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        rec.loss(loss)
        optimizer.step()
    print(f"Train Epoch: {epoch} Loss: {loss.item():.6f}")


scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
for epoch in range(1, args.epochs + 1):
    train(epoch)
    scheduler.step()
