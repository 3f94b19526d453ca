"""Shared cases of the step guard tests (tests/test_guard*.py): parameters with odd shapes, fresh
gradients per step (the same for every twin), bitwise snapshots of parameters and optimizer state, and a
stand-in for "no device sync" on the CPU."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .helpers import bits
from .helpers import optimizer_state as _opt_state

INF, NAN = float("inf"), float("nan")
SHAPES = [(17, 33), (7,), (1,), (129,), (3, 4, 5)]

OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam-fused-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
    "sgd-fused-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    "adagrad-fused": lambda ps: torch.optim.Adagrad(ps, lr=0.05, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam-forloop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "sgd-foreach-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
}
FUSED = {k for k in OPTIMIZERS if "fused" in k}


def _params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)) for s in SHAPES]


def _set_grads(params, step, scale=1.0, poison=None):
    """Fresh non-zero gradients for ``step`` (norm ~ 5 * scale), the same for every twin; ``poison`` puts a
    NaN or an inf into one element of the second tensor."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.18 * scale).to(p.device, p.dtype)
    if poison is not None:
        params[1].grad.view(-1)[3] = poison


def _snapshot(params, opt):
    return [bits(p.detach()).clone() for p in params] + [bits(t).clone() for t in _opt_state(opt)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@contextmanager
def no_host_reads():
    """Any read of tensor data on the host raises while active (CPU stand-in for 'no device sync'), except
    the guard's own host copy of its run of skips (on CUDA pinned memory read once its event has completed,
    so no sync either; on the CPU the tensor itself)."""
    names = ["item", "__bool__", "tolist", "__float__", "__int__", "__index__", "numpy"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def f(self, *a, **k):
            if getattr(self, "_fastgrad_host_copy", False):
                return saved[name](self, *a, **k)
            raise AssertionError(f"host read: Tensor.{name}")
        return f

    for n in names:
        setattr(torch.Tensor, n, refuse(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)



def _scaled(params, scaler, step, **kw):
    _set_grads(params, step, **kw)
    s = scaler.scale(torch.ones(()))  # the current scale (initialised on first use)
    for p in params:
        p.grad = p.grad * s.to(p.dtype)
