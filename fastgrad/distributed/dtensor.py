"""DTensor adapters: whether a list holds DTensors (without importing torch.distributed for a plain call),
their gradients read without torch-function handling, and the results handed back as DTensors."""

from __future__ import annotations

import operator
from typing import Sequence

import torch
from torch import Tensor

from .. import _scan

_DT: type | None = None
_DT_CHECKED = False


def dtensor_class() -> type | None:
    """The DTensor class, or None where torch.distributed (or DTensor) is not built in. Imported on first
    need only, so a plain call never pays for torch.distributed.tensor's import."""
    global _DT, _DT_CHECKED
    if not _DT_CHECKED:
        _DT_CHECKED = True
        try:
            import torch.distributed as dist

            if dist.is_available():
                try:
                    from torch.distributed.tensor import DTensor  # torch >= 2.5
                except ImportError:  # pragma: no cover - torch 2.4
                    from torch.distributed._tensor import DTensor
                _DT = DTensor
        except ImportError:  # pragma: no cover - builds without distributed
            _DT = None
    return _DT


def replicate_placement():
    try:
        from torch.distributed.tensor import Replicate
    except ImportError:  # pragma: no cover - torch 2.4
        from torch.distributed._tensor import Replicate
    return Replicate


def is_dtensor(t) -> bool:
    if type(t) is Tensor:
        return False
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def has_dtensor(tensors: Sequence[Tensor]) -> bool:
    """Whether the list holds a DTensor anywhere. A :class:`fastgrad._scan.Checked` list (every plain
    single-process call with the compiled helpers) is all plain tensors by construction: one ``is``. Any
    other list is looked at whole, so a plain tensor first no longer hides DTensors behind it. ``len``, not
    ``bool``: the Dynamo of torch 2.11 cannot trace ``bool`` of a list."""
    if type(tensors) is _scan.Checked or len(tensors) == 0:
        return False
    for t in tensors:
        if type(t) is not Tensor and is_dtensor(t):
            return True
    return False


_GRAD = operator.attrgetter("grad")


def dtensor_grads(params: Sequence[Tensor]) -> list[Tensor] | None:
    """``[p.grad for p in params if p.grad is not None]`` when every parameter is a DTensor whose
    ``__torch_function__`` is DTensor's own (disabled) one, read with torch-function handling switched off:
    the same objects, at half the cost (the handling alone is about a microsecond per parameter). None
    otherwise (the caller reads them the usual way)."""
    cls = dtensor_class()
    if cls is None or not params or torch.compiler.is_compiling():
        return None
    own = cls.__torch_function__
    for t in set(map(type, params)):
        if not issubclass(t, cls) or t.__torch_function__ is not own:
            return None
    with torch._C.DisableTorchFunctionSubclass():
        return [g for g in map(_GRAD, params) if g is not None]


def wrap_like(value: Tensor, sh):
    """A result for the caller: a Replicate() DTensor on the grads' mesh when all of them are DTensors on
    one mesh (what torch's clip_grad_norm_ returns), else the plain tensor (the same on every rank)."""
    if sh.mesh is None:
        return value
    Replicate = replicate_placement()
    return dtensor_class().from_local(value, sh.mesh, [Replicate()] * sh.mesh.ndim, run_check=False)


def to_local_norm(total_norm):
    """A total norm given to clip_grads_with_norm_ as a DTensor (ours: Replicate; torch's inf norm:
    Partial(max)) becomes the plain replicated value (a collective only for a Partial one)."""
    if is_dtensor(total_norm):
        if all(p.is_replicate() for p in total_norm.placements):
            return total_norm._local_tensor
        return total_norm.full_tensor()
    return total_norm
