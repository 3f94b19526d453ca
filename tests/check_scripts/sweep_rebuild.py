"""A learning-rate sweep in one script: model and optimizer (Adam) built anew for each of 3 runs, 8 steps each,
the previous run's dropped. Recorded: the norms and losses, and at the end of each run whether the earlier runs'
parameters, optimizers and models are still alive (weak references; a collection first). Expected under check:
every step's norm and loss are the live model's, three optimizer series, and nothing of an earlier run alive,
as without check (check once kept every run's parameters, with their gradients, until the script ended)."""
import gc
import weakref

import torch
from _truth import Truth, grad_norm

truth = Truth()
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
step, refs, alive = 0, [], []
for run, lr in enumerate([0.1, 0.03, 0.01]):
    torch.manual_seed(run)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    refs.append([weakref.ref(model[0].weight), weakref.ref(opt), weakref.ref(model)])
    for _ in range(8):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        truth.add(step=step, run=run, norm=grad_norm(model.parameters()), loss=loss.item())
        opt.step()
        step += 1
    del model, opt, loss
    gc.collect()  # (an optimizer sits in a reference cycle: the collector frees it, not del)
    alive.append([[r() is not None for r in rs] for rs in refs])
truth.meta["alive"] = alive
truth.write()
