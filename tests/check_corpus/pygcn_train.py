"""Modelled on tkipf/pygcn@1600b5b748b3976413d1e307540ccc62605b4d6d pygcn/train.py, models.py and layers.py: a
two-layer GCN of GraphConvolution layers (support = input @ weight, output = spmm(adj, support) + bias, uniform
init by 1/sqrt(out_features)), relu and dropout 0.5 between them, log_softmax, nll_loss on the training nodes;
full-batch training, Adam(lr 0.01, weight_decay 5e-4), optimizer.zero_grad() at the top of train(epoch). Data:
a synthetic citation-like graph (nodes of 4 classes, edges mostly within a class, sparse bag-of-words
features with class-specific words), the adjacency symmetrically row-normalised with self-loops as
pygcn/utils.py does, as a sparse tensor.

--bug no-zero-grad: optimizer.zero_grad() left out of train(): each epoch's full-batch gradient is added to the
sum of all earlier ones."""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from _corpus import Recorder
from torch.nn.parameter import Parameter

parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--epochs", type=int, default=60)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--weight_decay", type=float, default=5e-4)
parser.add_argument("--hidden", type=int, default=16)
parser.add_argument("--dropout", type=float, default=0.5)
parser.add_argument("--bug", choices=["none", "no-zero-grad"], default="none")
args = parser.parse_args()
np.random.seed(args.seed)
torch.manual_seed(args.seed)


def load_data(n=200, nfeat=100, nclass=4):
    rng = np.random.RandomState(0)
    labels = rng.randint(0, nclass, n)
    words = rng.rand(nclass, nfeat) < 0.08
    features = ((rng.rand(n, nfeat) < 0.03) | (words[labels] & (rng.rand(n, nfeat) < 0.5))).astype(np.float32)
    features /= np.maximum(features.sum(1, keepdims=True), 1)
    adj = np.zeros((n, n), np.float32)
    for _ in range(600):
        i = rng.randint(n)
        same = np.flatnonzero(labels == labels[i]) if rng.rand() < 0.85 else np.arange(n)
        j = rng.choice(same)
        adj[i, j] = adj[j, i] = 1
    adj += np.eye(n, dtype=np.float32)
    adj /= adj.sum(1, keepdims=True)
    adj_t = torch.sparse_coo_tensor(np.array(adj.nonzero()), adj[adj.nonzero()], (n, n),
                                    check_invariants=True).coalesce()
    return adj_t, torch.from_numpy(features), torch.from_numpy(labels).long(), torch.arange(0, 60)


class GraphConvolution(nn.Module):
    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        self.weight = Parameter(torch.FloatTensor(in_features, out_features))
        self.bias = Parameter(torch.FloatTensor(out_features)) if bias else None
        stdv = 1.0 / math.sqrt(self.weight.size(1))
        self.weight.data.uniform_(-stdv, stdv)
        if self.bias is not None:
            self.bias.data.uniform_(-stdv, stdv)

    def forward(self, input, adj):
        output = torch.spmm(adj, torch.mm(input, self.weight))
        return output + self.bias if self.bias is not None else output


class GCN(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout):
        super().__init__()
        self.gc1 = GraphConvolution(nfeat, nhid)
        self.gc2 = GraphConvolution(nhid, nclass)
        self.dropout = dropout

    def forward(self, x, adj):
        x = F.relu(self.gc1(x, adj))
        x = F.dropout(x, self.dropout, training=self.training)
        return F.log_softmax(self.gc2(x, adj), dim=1)


adj, features, labels, idx_train = load_data()
model = GCN(nfeat=features.shape[1], nhid=args.hidden, nclass=int(labels.max()) + 1, dropout=args.dropout)
optimizer = optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
rec = Recorder()
rec.watch(optimizer, model=model)


def train(epoch):
    model.train()
    if args.bug != "no-zero-grad":
        optimizer.zero_grad()
    output = model(features, adj)
    loss_train = F.nll_loss(output[idx_train], labels[idx_train])
    loss_train.backward()
    rec.loss(loss_train)
    optimizer.step()
    if epoch % 20 == 0:
        print(f"Epoch: {epoch + 1:04d} loss_train: {loss_train.item():.4f}")


for epoch in range(args.epochs):
    train(epoch)
