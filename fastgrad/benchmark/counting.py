"""What one call costs besides time: the torch operators it dispatches, and on a GPU the CUDA kernels it
launches and the host syncs it makes.

* operators: every ATen (or extension) operator the call reaches through torch's dispatcher, counted by a
  ``TorchDispatchMode`` (composite operators show as the operators they decompose into). Host work per call
  grows with it; on the CPU it is the count this machine can give. A Triton kernel launched from Python is no
  operator: the kernels count sees it.
* kernels: CUDA activities of the call in ``torch.profiler`` (kernels, and memcpy/memset, which are launches
  too), without Kineto's own "Activity Buffer Request" row.
* syncs: warnings ``torch.cuda.set_sync_debug_mode("warn")`` raises, one per host sync (an ``.item()``, a
  blocking copy to the host, a ``nonzero``...). A sync stalls the host until the GPU drains.

Counting runs apart from timing (a mode and a profiler slow every call they watch): the benchmark counts one
call per implementation after its timed rounds.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Profiler rows on the device that are not launches of the call.
NOT_LAUNCHES = frozenset({"Activity Buffer Request"})


@dataclass(frozen=True)
class Counts:
    """Per call; None: not counted (kernels and syncs on the CPU, operators of a compiled function)."""

    ops: int | None = None
    kernels: int | None = None
    syncs: int | None = None

    def as_row(self) -> dict:
        nan = float("nan")
        return {"ops_per_call": nan if self.ops is None else self.ops,
                "kernels_per_call": nan if self.kernels is None else self.kernels,
                "syncs_per_call": nan if self.syncs is None else self.syncs}


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched while it is active, by name (``aten.add.Tensor``, ...)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> collections.Counter[str]:
    """The operators ``fn()`` dispatches, by name."""
    with OpCounter() as counter:
        fn()
    return counter.counts


def launches(events: Iterable) -> int:
    """CUDA activities among profiler ``events`` (``prof.events()``), Kineto's bookkeeping rows left out."""
    return sum(1 for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in NOT_LAUNCHES)


def sync_warnings(caught: Iterable[warnings.WarningMessage]) -> int:
    """Host syncs among warnings caught under ``set_sync_debug_mode("warn")``."""
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def count_cuda(fn: Callable[[], object]) -> tuple[int, int]:
    """(kernels, host syncs) of one ``fn()`` on the current CUDA device."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(before)
            torch.cuda.synchronize()
    return launches(prof.events()), sync_warnings(caught)


def count_call(fn: Callable[[], object], device: torch.device, reset: Callable[[], None] | None = None,
               ops: bool = True) -> Counts:
    """Counts of one call of ``fn`` (``reset`` runs before each counted call, uncounted). ``ops=False``
    skips the operator count (a compiled function would be recompiled under a dispatch mode)."""
    n_ops = None
    if ops:
        if reset is not None:
            reset()
        n_ops = sum(count_ops(fn).values())
    if torch.device(device).type != "cuda":
        return Counts(ops=n_ops)
    if reset is not None:
        reset()
    kernels, syncs = count_cuda(fn)
    return Counts(ops=n_ops, kernels=kernels, syncs=syncs)
