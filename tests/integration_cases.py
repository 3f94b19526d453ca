"""Shared pieces of tests/test_integrations_*.py: a tiny regression data set with NaN batches at known
steps, and bitwise snapshots of a model's parameters and its optimizer's state."""

from __future__ import annotations

import torch

from .helpers import bits


def batches(n: int, bad: set[int], batch: int = 4, seed: int = 0):
    """``n`` (x, y) batches of a linear problem; the inputs of the batches in ``bad`` hold a NaN."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 2, generator=gen)
    out = []
    for i in range(n):
        x = torch.randn(batch, 3, generator=gen)
        y = x @ w + 0.01 * torch.randn(batch, 2, generator=gen)
        if i in bad:
            x[0, 1] = float("nan")
        out.append((x, y))
    return out


def snapshot(params, optimizer) -> list:
    """Bits of every parameter and of every optimizer state value (keys sorted), in order."""
    out = [bits(p.detach()).clone() for p in params]
    for p in params:
        st = optimizer.state.get(p, {})
        for k in sorted(st):
            v = st[k]
            out.append((k, bits(v).clone() if isinstance(v, torch.Tensor) else v))
    return out


def same(a, b) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, tuple):
            if x[0] != y[0] or not (torch.equal(x[1], y[1]) if isinstance(x[1], torch.Tensor) else x[1] == y[1]):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def finite(params) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in params)


class BatchNormNet(torch.nn.Module):
    """A regression net with BatchNorm: a NaN input batch writes NaN into its running statistics in the
    forward, before any decision (what the guard's ``model=`` keeps out)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def model_bits(model, optimizer) -> list:
    """Bits of the parameters, the buffers (running statistics, num_batches_tracked) and the optimizer state."""
    return snapshot(list(model.parameters()), optimizer) + [bits(b).clone() for b in model.buffers()]
