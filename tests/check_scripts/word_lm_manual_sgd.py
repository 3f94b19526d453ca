"""A word-level language model trained the way pytorch/examples' word_language_model/main.py@0c1654d trains
it: an Embedding + 2-layer LSTM + Linear decoder, no torch.optim: model.zero_grad(), backward,
clip_grad_norm_(model.parameters(), args.clip), then p.data.add_(p.grad, alpha=-lr) for every parameter, the
hidden state carried across batches (detached). The corpus is synthetic (a random first-order Markov chain over
200 words). At the example's --lr 20 it learns; --lr 2000 is the broken variant: the loss jumps and climbs.
Expected (--lr 2000): the loss's divergence, critical; advice that lowers the script's own `lr` (there is no
optimizer) and never suggests LeakyReLU (an LSTM has no ReLU); exit 1."""
import argparse

import torch
from _truth import Truth, grad_norm

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=20.0)
p.add_argument("--clip", type=float, default=0.25)
p.add_argument("--steps", type=int, default=40)
args = p.parse_args()


class RNNModel(torch.nn.Module):
    def __init__(self, ntoken, ninp=32, nhid=32, nlayers=2):
        super().__init__()
        self.encoder = torch.nn.Embedding(ntoken, ninp)
        self.rnn = torch.nn.LSTM(ninp, nhid, nlayers)
        self.decoder = torch.nn.Linear(nhid, ntoken)
        self.nlayers, self.nhid = nlayers, nhid

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return self.decoder(output).view(-1, self.decoder.out_features), hidden

    def init_hidden(self, bsz):
        w = next(self.parameters())
        return (w.new_zeros(self.nlayers, bsz, self.nhid), w.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    return tuple(v.detach() for v in h)


torch.manual_seed(1111)
ntokens, bptt, batch_size = 200, 20, 10
trans = torch.softmax(3.0 * torch.randn(ntokens, ntokens), 1)  # each word has a few likely successors
words = [0]
for _ in range(batch_size * bptt * args.steps):
    words.append(int(torch.multinomial(trans[words[-1]], 1)))
data = torch.tensor(words[:batch_size * (len(words) // batch_size)]).view(batch_size, -1).t().contiguous()

model = RNNModel(ntokens)
criterion = torch.nn.NLLLoss()
lr = args.lr
truth = Truth()
hidden = model.init_hidden(batch_size)
for batch, i in enumerate(range(0, data.size(0) - 1, bptt), 1):
    seq_len = min(bptt, len(data) - 1 - i)
    source, targets = data[i:i + seq_len], data[i + 1:i + 1 + seq_len].reshape(-1)
    model.zero_grad()
    hidden = repackage_hidden(hidden)
    output, hidden = model(source, hidden)
    loss = criterion(torch.log_softmax(output, 1), targets)
    loss.backward()
    raw = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    truth.add(step=batch, raw=float(raw), norm=grad_norm(model.parameters()), loss=loss.item())
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
print("done")
