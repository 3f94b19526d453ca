"""A Lightning run on a tiny regression model that logs to a CSVLogger in OUT/run/version_0/metrics.csv: the
training loss every step, the total gradient norm (Lightning's ``grad_norm`` utility) and the learning rate
(``LearningRateMonitor``). ``--lr 2`` makes the loss diverge."""

import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import grad_norm

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--steps", type=int, default=40)
a = p.parse_args()


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def on_before_optimizer_step(self, optimizer):
        self.log("grad_2.0_norm_total", grad_norm(self, norm_type=2)["grad_2.0_norm_total"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=a.lr)


pl.seed_everything(0, verbose=False)
w = torch.randn(8, 1)
xs = torch.randn(a.steps * 8, 8)
ds = torch.utils.data.TensorDataset(xs, xs @ w + 0.1 * torch.randn(len(xs), 1))
trainer = pl.Trainer(max_steps=a.steps, log_every_n_steps=1, logger=CSVLogger(a.out, name="run", version=0),
                     callbacks=[LearningRateMonitor(logging_interval="step")], enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                     val_check_interval=20, limit_val_batches=2)
trainer.fit(Tiny(), torch.utils.data.DataLoader(ds, batch_size=8), torch.utils.data.DataLoader(ds, batch_size=8))
