"""optimizer.step(closure): SGD (one evaluation per step) or LBFGS (several). The truth is read on each
step's FIRST closure evaluation (the checker's documented choice). --nan-last: the last step's closure turns
NaN (LBFGS: from its second evaluation on, so only a later evaluation is non-finite)."""
import argparse

import torch
from _truth import Truth, grad_norm

p = argparse.ArgumentParser()
p.add_argument("--opt", choices=["sgd", "lbfgs"], default="sgd")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--nan-last", action="store_true")
a = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = (torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4) if a.opt == "lbfgs"
       else torch.optim.SGD(model.parameters(), lr=0.05))
x, y = torch.randn(64, 8), torch.randn(64, 1)
truth = Truth()
for step in range(1, a.steps + 1):
    evals = []

    def closure():
        opt.zero_grad()
        inp = x
        if a.nan_last and step == a.steps and (a.opt == "sgd" or evals):
            inp = x * float("nan")
        loss = torch.nn.functional.mse_loss(model(inp), y)
        loss.backward()
        if not evals:
            truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
        evals.append(loss.item())
        return loss

    opt.step(closure)
    truth.steps[-1]["evals"] = len(evals)
    truth.write()
print("done")
