"""Modelled on pytorch/examples@77f55b912142e11fcfdf5b530231fb9c52f181e8 mnist_rnn/main.py: an RNN classifier
reading an image row by row (nn.LSTM, batch_first), the last step's output through BatchNorm1d, dropout, fc1,
relu, dropout, fc2, log_softmax; F.nll_loss; Adadelta(lr=0.1) with StepLR(step_size=1, gamma=0.7) per epoch.
Data: 12x12 images of ten classes (a fixed random template per class plus noise), 64 per batch.

--freeze rnn: the recurrent layer is frozen (requires_grad=False, a line left from a fine-tuning run) while the
optimizer still holds its parameters: only the classifier head after it trains."""
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
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--gamma", type=float, default=0.7)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--freeze", choices=["none", "rnn"], default="none")
args = parser.parse_args()
torch.manual_seed(args.seed)
S = 12


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(input_size=S, hidden_size=32, batch_first=True)
        self.batchnorm = nn.BatchNorm1d(32)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, input):
        input = input.reshape(-1, S, S)
        output, hidden = self.rnn(input)
        output = output[:, -1, :]
        output = self.batchnorm(output)
        output = self.dropout1(output)
        output = F.relu(self.fc1(output))
        output = self.dropout2(output)
        return F.log_softmax(self.fc2(output), dim=1)


gen = torch.Generator().manual_seed(11)
templates = torch.randn(10, S, S, generator=gen)
ys = torch.randint(0, 10, (20 * args.batch_size,), generator=gen)
xs = templates[ys] + 0.5 * torch.randn(len(ys), S, S, generator=gen)
train_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs.unsqueeze(1), ys),
                                           batch_size=args.batch_size, shuffle=True,
                                           generator=torch.Generator().manual_seed(0))

model = Net()
if args.freeze == "rnn":
    for p in model.rnn.parameters():
        p.requires_grad = False
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
