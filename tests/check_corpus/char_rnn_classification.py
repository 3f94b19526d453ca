"""Modelled on pytorch/tutorials@016d0cc077f60c82b8497d4c7f92051ce40cafee
intermediate_source/char_rnn_classification_tutorial.py: a hand-made RNN cell (i2h and i2o Linear layers on the
concatenated one-hot letter and hidden state, LogSoftmax), one name per step read letter by letter,
nn.NLLLoss on the last output, rnn.zero_grad(), backward, then the tutorial's hand-written update
`p.data.add_(p.grad.data, alpha=-learning_rate)` with learning_rate = 0.005 (no torch.optim, no clip). Data:
synthetic "names" of four "languages", each a fixed random letter distribution.

--learning_rate 0.5: 100x the tutorial's value (its own comment: "If you set this too high, it might
explode")."""
import argparse
import random

import torch
import torch.nn as nn
from _corpus import Recorder

parser = argparse.ArgumentParser()
parser.add_argument("--learning_rate", type=float, default=0.005)
parser.add_argument("--n_iters", type=int, default=300)
args = parser.parse_args()
torch.manual_seed(0)
random.seed(0)

all_letters = "abcdefghijklmnopqrstuvwxyz"
n_letters = len(all_letters)
all_categories = ["A", "B", "C", "D"]
n_categories = len(all_categories)
g = torch.Generator().manual_seed(2)
letter_probs = torch.distributions.Dirichlet(torch.full((n_letters,), 0.3)).sample((n_categories,))


def randomTrainingExample():
    ci = random.randrange(n_categories)
    n = random.randint(3, 8)
    line = "".join(all_letters[int(i)] for i in torch.multinomial(letter_probs[ci], n, replacement=True,
                                                                   generator=g))
    line_tensor = torch.zeros(len(line), 1, n_letters)
    for li, letter in enumerate(line):
        line_tensor[li][0][all_letters.find(letter)] = 1
    return all_categories[ci], line, torch.tensor([ci], dtype=torch.long), line_tensor


class RNN(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.i2h = nn.Linear(input_size + hidden_size, hidden_size)
        self.i2o = nn.Linear(input_size + hidden_size, output_size)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, input, hidden):
        combined = torch.cat((input, hidden), 1)
        hidden = self.i2h(combined)
        output = self.softmax(self.i2o(combined))
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, self.hidden_size)


rnn = RNN(n_letters, 64, n_categories)
criterion = nn.NLLLoss()
learning_rate = args.learning_rate
rec = Recorder()


def train(category_tensor, line_tensor):
    hidden = rnn.initHidden()
    rnn.zero_grad()
    for i in range(line_tensor.size()[0]):
        output, hidden = rnn(line_tensor[i], hidden)
    loss = criterion(output, category_tensor)
    loss.backward()
    rec.loss(loss)
    rec.row(rnn.parameters(), model=rnn, lr=learning_rate)
    for p in rnn.parameters():
        p.data.add_(p.grad.data, alpha=-learning_rate)
    return output, loss.item()


current_loss = 0
for iter in range(1, args.n_iters + 1):
    category, line, category_tensor, line_tensor = randomTrainingExample()
    output, loss = train(category_tensor, line_tensor)
    current_loss += loss
    if iter % 50 == 0:
        print(f"{iter} {current_loss / 50:.4f}")
        current_loss = 0
