"""Modelled on pytorch/examples@77f55b912142e11fcfdf5b530231fb9c52f181e8 word_language_model/main.py and model.py:
an RNNModel (embedding encoder, 2-layer LSTM, linear decoder, log_softmax + NLLLoss), batchify/bptt batches
with the hidden state repackaged, model.zero_grad(), clip_grad_norm_(0.25), then the hand-written update
p.data.add_(p.grad, alpha=-lr) with lr 20 (no torch.optim), lr /= 4 after an epoch whose validation loss did
not improve. Data: a synthetic corpus drawn from a fixed random Markov chain (30 words). Tiny sizes.

--lr 2000: the learning rate 100x the default (the source's own flag)."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from _corpus import Recorder

parser = argparse.ArgumentParser()
parser.add_argument("--model", type=str, default="LSTM", choices=["LSTM", "GRU", "RNN_TANH", "RNN_RELU"])
parser.add_argument("--lr", type=float, default=20)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch_size", type=int, default=16)
parser.add_argument("--bptt", type=int, default=20)
parser.add_argument("--emsize", type=int, default=32)
parser.add_argument("--nhid", type=int, default=32)
parser.add_argument("--nlayers", type=int, default=3)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=1111)
args = parser.parse_args()
torch.manual_seed(args.seed)

# ---- a corpus: a Markov chain whose rows are peaked, so there is something to learn
ntokens = 30
gen = torch.Generator().manual_seed(7)
trans = torch.distributions.Dirichlet(torch.full((ntokens,), 0.03)).sample((ntokens,))


def draw(n):
    out = [int(torch.randint(ntokens, (1,), generator=gen))]
    for _ in range(n - 1):
        out.append(int(torch.multinomial(trans[out[-1]], 1, generator=gen)))
    return torch.tensor(out)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


train_data = batchify(draw(16 * 20 * 20 + 1), args.batch_size)
val_data = batchify(draw(10 * 20 * 3 + 1), 10)


class RNNModel(nn.Module):
    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ["LSTM", "GRU"]:
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        else:
            nonlinearity = {"RNN_TANH": "tanh", "RNN_RELU": "relu"}[rnn_type]
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        w = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (w.new_zeros(self.nlayers, bsz, self.nhid), w.new_zeros(self.nlayers, bsz, self.nhid))
        return w.new_zeros(self.nlayers, bsz, self.nhid)


model = RNNModel(args.model, ntokens, args.emsize, args.nhid, args.nlayers, args.dropout)
criterion = nn.NLLLoss()
rec = Recorder(layers=args.nlayers > 2)


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)


def evaluate(data_source):
    model.eval()
    total = 0.0
    hidden = model.init_hidden(10)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total += len(data) * criterion(output, targets).item()
    return total / (len(data_source) - 1)


def train():
    model.train()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        rec.loss(loss)
        rec.before_clip(model.parameters())
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        rec.row(model.parameters(), model=model, lr=lr)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)


lr = args.lr
best_val_loss = None
for epoch in range(1, args.epochs + 1):
    train()
    val_loss = evaluate(val_data)
    print(f"| end of epoch {epoch:3d} | valid loss {val_loss:5.2f}")
    if not best_val_loss or val_loss < best_val_loss:
        best_val_loss = val_loss
    else:
        lr /= 4.0
