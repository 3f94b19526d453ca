"""A real lightning Trainer (automatic optimization always passes a closure to optimizer.step). The truth:
the loss in training_step and the gradient norm in on_before_optimizer_step (after backward, before step)."""
import os
import warnings

import torch
from _truth import Truth, grad_norm

warnings.filterwarnings("ignore")
import lightning as L  # noqa: E402

truth = Truth()


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        truth.add(step=self.global_step + 1, loss=loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        truth.steps[-1]["norm"] = grad_norm(self.parameters())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8)
trainer = L.Trainer(max_steps=int(os.environ.get("STEPS", "6")), accelerator="cpu", devices=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0)
trainer.fit(Net(), loader)
print("done")
