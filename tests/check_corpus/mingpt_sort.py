"""Modelled on karpathy/minGPT@37baab71b9abea1b76ab957409a1cc2fbfba8a26 mingpt/model.py, mingpt/trainer.py and
the sorting problem of demo.ipynb: a GPT (wte, wpe, blocks of LayerNorm, masked CausalSelfAttention, an MLP of
c_fc/NewGELU/c_proj, ln_f, lm_head), configure_optimizers' AdamW groups by module type (Linear weights decayed;
biases, LayerNorm and Embedding weights not), lr 5e-4, betas (0.9, 0.95); the Trainer's loop of forward,
model.zero_grad(set_to_none=True), backward, clip_grad_norm_(1.0), step. Data: the sort task itself (sequences
of 6 digits from 0..2; the prompt's targets are ignored with -1). Tiny sizes.

--bug blocks-unused: forward calls each block but drops its output (`block(x)` for `x = block(x)`): the
transformer blocks never take part in the loss, and their gradients stay None."""
import argparse
import math

import torch
import torch.nn as nn
from _corpus import Recorder
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--max_iters", type=int, default=60)
parser.add_argument("--bug", choices=["none", "blocks-unused"], default="none")
cfg = parser.parse_args()
torch.manual_seed(3407)

length, num_digits = 6, 3
block_size = length * 2 - 1
n_layer, n_head, n_embd, pdrop = 2, 2, 32, 0.1


class SortDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 10000

    def __getitem__(self, idx):
        inp = torch.randint(num_digits, size=(length,), dtype=torch.long)
        sol = torch.sort(inp)[0]
        cat = torch.cat((inp, sol), dim=0)
        x = cat[:-1].clone()
        y = cat[1:].clone()
        y[:length - 1] = -1
        return x, y


class NewGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(pdrop)
        self.resid_dropout = nn.Dropout(pdrop)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd), c_proj=nn.Linear(4 * n_embd, n_embd),
                                      act=NewGELU(), dropout=nn.Dropout(pdrop)))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(num_digits, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(pdrop),
            h=nn.ModuleList([Block() for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, num_digits, bias=False)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            torch.nn.init.zeros_(module.bias)
            torch.nn.init.ones_(module.weight)

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        decay, no_decay = set(), set()
        for mn, m in self.named_modules():
            for pn, p in m.named_parameters():
                fpn = "%s.%s" % (mn, pn) if mn else pn
                if pn.endswith("bias"):
                    no_decay.add(fpn)
                elif pn.endswith("weight") and isinstance(m, nn.Linear):
                    decay.add(fpn)
                elif pn.endswith("weight") and isinstance(m, (nn.LayerNorm, nn.Embedding)):
                    no_decay.add(fpn)
        param_dict = {pn: p for pn, p in self.named_parameters()}
        optim_groups = [
            {"params": [param_dict[pn] for pn in sorted(decay)], "weight_decay": weight_decay},
            {"params": [param_dict[pn] for pn in sorted(no_decay)], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long).unsqueeze(0)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            if cfg.bug == "blocks-unused":
                block(x)
            else:
                x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


model = GPT()
optimizer = model.configure_optimizers(0.1, 5e-4, (0.9, 0.95))
rec = Recorder()
rec.watch(optimizer, model=model)
train_loader = torch.utils.data.DataLoader(
    SortDataset(), sampler=torch.utils.data.RandomSampler(SortDataset(), replacement=True, num_samples=int(1e10)),
    shuffle=False, batch_size=64)
model.train()
iter_num = 0
data_iter = iter(train_loader)
while True:
    x, y = next(data_iter)
    logits, loss = model(x, y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    rec.loss(loss)
    rec.before_clip(model.parameters())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    iter_num += 1
    if iter_num % 20 == 0:
        print(f"iter {iter_num}: train loss {loss.item():.5f}")
    if iter_num >= cfg.max_iters:
        break
