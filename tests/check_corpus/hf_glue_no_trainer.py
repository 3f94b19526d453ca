"""Modelled on huggingface/transformers@0310c247aafa21ef0567787645656d0ef1d42cf9
examples/pytorch/text-classification/run_glue_no_trainer.py, with the accelerator's calls written as the plain
torch they stand for: a BertForSequenceClassification, AdamW over two parameter groups (weight decay except
"bias" and "LayerNorm.weight"), get_scheduler("linear"), the loss divided by gradient_accumulation_steps and an
update when `step % gradient_accumulation_steps == 0` or at the last batch (that version's condition, so the
first update follows one micro-batch), no clip. The model is built from a small BertConfig with random
weights (no download); the data are synthetic sentences whose label says whether a marker token occurs.

--bug freeze-encoder: `for param in model.bert.parameters(): param.requires_grad = False` left in from a
feature-extraction experiment: only the classifier head trains, the optimizer still holds the frozen tensors."""
import argparse
import math
import warnings

import torch
from _corpus import Recorder
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
from transformers import BertConfig, BertForSequenceClassification, get_scheduler  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--weight_decay", type=float, default=0.01)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--per_device_train_batch_size", type=int, default=16)
parser.add_argument("--num_train_epochs", type=int, default=5)
parser.add_argument("--bug", choices=["none", "freeze-encoder"], default="none")
args = parser.parse_args()
torch.manual_seed(42)

g = torch.Generator().manual_seed(0)
ids = torch.randint(4, 64, (320, 12), generator=g)
has = torch.rand(320, generator=g) < 0.5
for k in range(3):  # the marker token, three times in a positive sentence
    ids[has, torch.randint(1, 12, (int(has.sum()),), generator=g)] = 3
ids[:, 0] = 2  # [CLS]
train_dataloader = DataLoader(TensorDataset(ids, has.long()), shuffle=True, batch_size=args.per_device_train_batch_size,
                              generator=torch.Generator().manual_seed(1))

config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    max_position_embeddings=16, num_labels=2)
model = BertForSequenceClassification(config)
if args.bug == "freeze-encoder":
    for param in model.bert.parameters():
        param.requires_grad = False

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
max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
lr_scheduler = get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=0,
                             num_training_steps=max_train_steps)

completed_steps = 0
for epoch in range(args.num_train_epochs):
    model.train()
    for step, (input_ids, labels) in enumerate(train_dataloader):
        outputs = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)
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
