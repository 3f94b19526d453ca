"""The data carries NaN (a missing value in a feature column) from the first batch: the loss is NaN from
step 1 and so is every gradient. Nothing in the model made it. Expected: born in the forward pass at step 1,
at the model's INPUT (the first module's input was already non-finite), not "the first Linear layer"."""
import torch
from _truth import Truth

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x = torch.randn(64, 12)
x[5, 3] = float("nan")  # the missing value
y = torch.randn(64, 1)
truth = Truth()
for step in range(1, 11):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    truth.add(step=step, loss=loss.item(), input_finite=bool(torch.isfinite(x).all()))
    opt.step()
print("done")
