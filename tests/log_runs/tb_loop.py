"""A plain training loop on a tiny regression model that logs each step's loss, gradient norm (what
clip_grad_norm_ returned) and learning rate three ways: a TensorBoard SummaryWriter in OUT/tb, a CSV with the
usual names (OUT/log.csv) and a CSV with names of its own (OUT/custom.csv: it, objective, gnorm, eta).
``--lr 2`` makes the loss diverge; ``--nan-at N`` feeds a NaN batch at step N."""

import argparse
import csv
import os

import torch

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--nan-at", type=int, default=0)
p.add_argument("--no-tb", action="store_true")
a = p.parse_args()

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(net.parameters(), lr=a.lr)
w = torch.randn(8, 1)
os.makedirs(a.out, exist_ok=True)
writer = None
if not a.no_tb:
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(os.path.join(a.out, "tb"))
plain = csv.writer(open(os.path.join(a.out, "log.csv"), "w", newline=""))
plain.writerow(["global_step", "train/loss", "train/grad_norm", "lr", "epoch"])
own = csv.writer(open(os.path.join(a.out, "custom.csv"), "w", newline=""))
own.writerow(["it", "objective", "gnorm", "eta"])
for step in range(1, a.steps + 1):
    x = torch.randn(8, 8)
    y = x @ w + 0.1 * torch.randn(8, 1)
    if step == a.nan_at:
        x[0, 0] = float("nan")
    loss = torch.nn.functional.mse_loss(net(x), y)
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9)
    opt.step()
    lr = opt.param_groups[0]["lr"]
    if writer is not None:
        writer.add_scalar("train/loss", loss.item(), step)
        writer.add_scalar("train/grad_norm", norm.item(), step)
        writer.add_scalar("train/lr", lr, step)
    plain.writerow([step, loss.item(), norm.item(), lr, 0])
    own.writerow([step, loss.item(), norm.item(), lr])
if writer is not None:
    writer.close()
