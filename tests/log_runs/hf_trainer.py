"""A Hugging Face Trainer run on a tiny regression model that leaves its trainer_state.json in OUT (every
step logged). ``--lr 3`` makes the loss diverge."""

import argparse

import torch
import transformers

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--steps", type=int, default=40)
a = p.parse_args()


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


torch.manual_seed(0)
w = torch.randn(8, 1)
xs = torch.randn(a.steps * 8, 8)
data = [{"x": x, "labels": x @ w + 0.1 * torch.randn(1)} for x in xs]
args = transformers.TrainingArguments(
    output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=8, learning_rate=a.lr, logging_steps=1,
    report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, optim="sgd", lr_scheduler_type="constant",
    max_grad_norm=1e9, seed=0)
trainer = transformers.Trainer(model=Tiny(), args=args, train_dataset=data,
                               data_collator=lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]})
trainer.train()
trainer.state.save_to_json(f"{a.out}/trainer_state.json")
