"""Whether what a checkpoint would hold is finite: the parameters, the optimizer state, the model's buffers
(when the guard knows the model) and the guard's own statistics. One batched device reduction per dtype and
device, combined into one flag, read once (:func:`all_finite`); the names of what is not finite only on the
failure path (:func:`nonfinite`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import distributed


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if distributed.is_dtensor(t) else t


def _floating(items):
    for name, t in items:
        if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel():
            yield name, _local(t).detach()


def all_finite(items) -> bool:
    """``items``: (name, tensor) pairs. True when every floating element is finite; one host read."""
    groups: dict = {}
    for _, t in _floating(items):
        groups.setdefault((t.device, t.dtype), []).append(t)
    if not groups:
        return True
    flags = []
    for ts in groups.values():
        # the largest magnitude of each tensor: NaN or inf exactly when some element is not finite
        flags.append(torch.stack(torch._foreach_norm(ts, math.inf)).isfinite().all())
    dev = flags[0].device
    return bool(torch.stack([f.to(dev) for f in flags]).all())


def nonfinite(items, limit: int = 5) -> list[str]:
    """The names of the first ``limit`` tensors holding a NaN or an inf (reads each; the failure path)."""
    out = []
    for name, t in _floating(items):
        if not bool(t.isfinite().all()):
            out.append(name)
            if len(out) >= limit:
                break
    return out
