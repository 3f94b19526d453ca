"""Modelled on karpathy/nanoGPT@3adf61e154c3fe3fca428ad6bc3818b27a3b8291 train.py and model.py (settings of
config/train_shakespeare_char.py): a GPT of token and position embeddings, pre-LayerNorm blocks (causal
self-attention, GELU MLP), a final LayerNorm and an lm_head tied to the token embedding, normal(0, 0.02) init
with the residual projections scaled by 1/sqrt(2 * n_layer); configure_optimizers' two AdamW groups (2-D
tensors decayed, the rest not), betas (0.9, 0.99); get_lr's linear warm-up and cosine decay written into
every param_group each iteration; gradient_accumulation_steps micro-batches, each loss divided by their
number; a GradScaler (disabled: float32 on CPU); scaler.unscale_, clip_grad_norm_(1.0), scaler.step,
scaler.update, zero_grad(set_to_none=True). Data: characters drawn from a fixed random Markov chain. Tiny.

--bug clip-in-micro-loop: the unscale and clip moved inside the micro-step loop, so each clip sees a partial
sum of the micro-batches and the last micro-batches are added after it."""
import argparse
import math

import torch
import torch.nn as nn
from _corpus import Recorder
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--max_iters", type=int, default=40)
parser.add_argument("--bug", choices=["none", "clip-in-micro-loop"], default="none")
cfg = parser.parse_args()

gradient_accumulation_steps = 4
batch_size, block_size = 8, 16
n_layer, n_head, n_embd, dropout, bias = 2, 2, 32, 0.1, False
learning_rate, min_lr = cfg.learning_rate, cfg.learning_rate / 10
warmup_iters, lr_decay_iters, max_iters = 5, cfg.max_iters, cfg.max_iters
weight_decay, beta1, beta2, grad_clip = 1e-1, 0.9, 0.99, 1.0
dtype = "float32"
torch.manual_seed(1337)

vocab_size = 32
g = torch.Generator().manual_seed(4)
trans = torch.distributions.Dirichlet(torch.full((vocab_size,), 0.05)).sample((vocab_size,))
text = [0]
for _ in range(6000):
    text.append(int(torch.multinomial(trans[text[-1]], 1, generator=g)))
train_data = torch.tensor(text)


def get_batch():
    ix = torch.randint(len(train_data) - block_size, (batch_size,))
    x = torch.stack([train_data[i:i + block_size] for i in ix])
    y = torch.stack([train_data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention()
        self.ln_2 = LayerNorm(n_embd, bias=bias)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block() for _ in range(n_layer)]),
            ln_f=LayerNorm(n_embd, bias=bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
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

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [{"params": decay_params, "weight_decay": weight_decay},
                        {"params": nodecay_params, "weight_decay": 0.0}]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


model = GPT()
scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
rec = Recorder()
rec.watch(optimizer, model=model)


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


X, Y = get_batch()
iter_num = 0
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    for micro_step in range(gradient_accumulation_steps):
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch()
        scaler.scale(loss).backward()
        rec.loss(loss)
        if cfg.bug == "clip-in-micro-loop" and grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if cfg.bug == "none" and grad_clip != 0.0:
        scaler.unscale_(optimizer)
        rec.before_clip(model.parameters())
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % 10 == 0:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}")
    iter_num += 1
    if iter_num > max_iters:
        break
