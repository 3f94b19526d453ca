"""Modelled on huggingface/transformers@00661e38a9e1393472adae9ac71f777b74ccdcde
examples/pytorch/language-modeling/run_clm_no_trainer.py, with the accelerator's calls written as the plain
torch they stand for: a GPT2LMHeadModel (labels = input_ids, the model shifts them), AdamW over two groups
(no decay for "bias" and "LayerNorm.weight"), get_scheduler("linear") with warm-up, the loss divided by
gradient_accumulation_steps and an update when `step % gradient_accumulation_steps == 0` or at the last batch,
no clip. The model is built from a small GPT2Config with random weights (no download); the data are synthetic
"lines" of tokens from a fixed Markov chain.

--bug pad-lines: instead of group_texts, each line is padded to block_size with its padding labelled -100, and
the file keeps its empty lines (as wikitext does between sections): a batch made only of empty lines has no
token to predict, its mean cross-entropy is 0/0 = NaN (with all-zero gradients)."""
import argparse
import math
import warnings

import torch
from _corpus import Recorder
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler  # noqa: E402

transformers.logging.set_verbosity_error()
parser = argparse.ArgumentParser()
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--weight_decay", type=float, default=0.0)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--per_device_train_batch_size", type=int, default=4)
parser.add_argument("--num_warmup_steps", type=int, default=3)
parser.add_argument("--bug", choices=["none", "pad-lines"], default="none")
args = parser.parse_args()
torch.manual_seed(42)
block_size, vocab = 16, 48

g = torch.Generator().manual_seed(0)
trans = torch.distributions.Dirichlet(torch.full((vocab - 1,), 0.05)).sample((vocab - 1,))


def line(n):
    out = [int(torch.randint(vocab - 1, (1,), generator=g))]
    for _ in range(n - 1):
        out.append(int(torch.multinomial(trans[out[-1]], 1, generator=g)))
    return out


lines = [line(int(torch.randint(8, block_size + 1, (1,), generator=g))) for _ in range(100)]
if args.bug == "pad-lines":
    lines[48:52] = [[], [], [], []]  # a section break
    pad = vocab - 1
    input_ids = torch.tensor([ln + [pad] * (block_size - len(ln)) for ln in lines])
    labels = torch.tensor([ln + [-100] * (block_size - len(ln)) for ln in lines])
else:  # group_texts: concatenate and cut into blocks of block_size
    flat = [t for ln in lines for t in ln]
    n = len(flat) // block_size * block_size
    input_ids = torch.tensor(flat[:n]).view(-1, block_size)
    labels = input_ids.clone()
train_dataloader = DataLoader(TensorDataset(input_ids, labels), shuffle=False,
                              batch_size=args.per_device_train_batch_size)

config = GPT2Config(vocab_size=vocab, n_positions=block_size, n_embd=32, n_layer=2, n_head=2,
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
no_decay = ["bias", "LayerNorm.weight"]
optimizer_grouped_parameters = [
    {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
     "weight_decay": args.weight_decay},
    {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
]
optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
rec = Recorder()
rec.watch(optimizer, model=model)
num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
max_train_steps = 3 * num_update_steps_per_epoch
lr_scheduler = get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                             num_training_steps=max_train_steps)

completed_steps = 0
for epoch in range(3):
    model.train()
    for step, (batch_ids, batch_labels) in enumerate(train_dataloader):
        outputs = model(input_ids=batch_ids, labels=batch_labels)
        loss = outputs.loss
        loss = loss / args.gradient_accumulation_steps
        loss.backward()
        rec.loss(loss)
        if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            completed_steps += 1
        if completed_steps >= max_train_steps:
            break
    print(f"epoch {epoch}: last loss {loss.item() * args.gradient_accumulation_steps:.4f}")
