"""A healthy little language model: nn.Embedding + GRU + Linear head, AdamW, learning "next token = token+1".
Its embedding's gradient is row-sparse (only the rows of the tokens in the batch): not vanishing."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
V, E = 64, 32


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, E)
        self.rnn = torch.nn.GRU(E, E, batch_first=True)
        self.head = torch.nn.Linear(E, V)

    def forward(self, t):
        return self.head(self.rnn(self.emb(t))[0])


model = LM()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
truth = Truth()
for step in range(1, 41):
    start = torch.randint(0, V, (16, 1))
    seq = (start + torch.arange(13)) % V
    opt.zero_grad(set_to_none=True)
    logits = model(seq[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), seq[:, 1:].reshape(-1))
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    opt.step()
print("done")
