"""Training only in child processes (the A3C pattern: workers step a shared model); the parent steps nothing.
``--foreign``: the workers' function as a library's would be (another module, a file outside the script's
folder), which check does not run under a checker of its own. ``--evaluator-first``: the first process started
only evaluates the shared model (ikostrikov/pytorch-a3c starts its test process first). ``--workers-fail``:
every worker raises before its first step (a gym API its code predates), and the parent ends well anyway.
``--evaluators-only``: every process only evaluates the shared model; nothing trains anywhere. ``--subclass``: the
workers are a Process subclass of the script's whose ``run`` trains (the other A3C pattern); ``--spawn``: started
by the ``spawn`` method (a fresh interpreter that unpickles the process)."""
import sys
import types

import torch
import torch.multiprocessing as mp


def train(model, rank):
    if "--workers-fail" in sys.argv:
        raise TypeError("expected np.ndarray (got tuple)")
    torch.manual_seed(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def evaluate(model):
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 4))


class Worker(mp.Process):
    def __init__(self, model, rank):
        super().__init__()
        self.model, self.rank = model, rank

    def run(self):
        train(self.model, self.rank)


if __name__ == "__main__":
    target = train
    if "--spawn" in sys.argv:
        mp.set_start_method("spawn")
    if "--foreign" in sys.argv:
        target = types.FunctionType(train.__code__.replace(co_filename="/elsewhere/workers.py"), globals(), "train")
        target.__module__ = "elsewhere"
    model = torch.nn.Linear(4, 1)
    model.share_memory()
    procs = [mp.Process(target=target, args=(model, r)) for r in range(2)]
    if "--subclass" in sys.argv:
        procs = [Worker(model, r) for r in range(2)]
    if "--evaluators-only" in sys.argv:
        procs = [mp.Process(target=evaluate, args=(model,)) for _ in range(2)]
    if "--evaluator-first" in sys.argv:
        procs.insert(0, mp.Process(target=evaluate, args=(model,)))
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs) or "--workers-fail" in sys.argv
