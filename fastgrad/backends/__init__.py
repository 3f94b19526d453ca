"""Backend registry and selection (SPEC section 8).

Order of choice for one device's group of tensors:
1. the ``backend=`` argument of the public function;
2. else the process default set by :func:`set_backend`;
3. else the ``FASTGRAD_BACKEND`` environment variable (read at each call, so tests can set it);
4. else automatic: the first backend of :data:`AUTO_ORDER` for the device type that is available and
   ``supports()`` the call; ``torch`` always can.

A backend named by 1-3 that cannot serve the call raises :class:`BackendError` naming why; an automatic
choice falls back quietly.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from .base import OPS, Backend, BackendError, acc_dtype, is_fast_norm_type

__all__ = [
    "Backend", "BackendError", "OPS", "AUTO_ORDER", "acc_dtype", "is_fast_norm_type", "register", "get",
    "registered", "available_backends", "set_backend", "get_default_backend", "select",
]

#: Automatic choice per device type. The Triton interpreter is never chosen automatically for CPU
#: tensors (it is a testing tool, far slower than the torch backend).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("cuda", "triton", "torch"),
    "cpu": ("cpu", "torch"),
}
_FALLBACK_ORDER = ("torch",)

_REGISTRY: dict[str, Backend] = {}
_default: str | None = None


def register(backend: Backend) -> None:
    """Add (or replace) a backend under ``backend.name``."""
    if not backend.name:
        raise ValueError("a backend needs a non-empty name")
    _REGISTRY[backend.name] = backend


def registered() -> dict[str, Backend]:
    """All registered backends by name, usable or not."""
    return dict(_REGISTRY)


def get(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown fastgrad backend {name!r}; registered backends: {', '.join(_REGISTRY)}"
        ) from None


def available_backends() -> list[str]:
    """Names of the backends usable in this process (their reasons: ``python -m fastgrad.info``)."""
    return [name for name, b in _REGISTRY.items() if b.unavailable_reason() is None]


def set_backend(name: str | None) -> None:
    """Make ``name`` the process-wide default backend (it overrides ``FASTGRAD_BACKEND``); None restores
    automatic choice. The name must be registered; whether it can serve a call is checked per call."""
    global _default
    if name is not None:
        get(name)
    _default = name


def get_default_backend() -> str | None:
    """The backend name that applies when a call passes ``backend=None`` (None: automatic)."""
    if _default is not None:
        return _default
    env = os.environ.get("FASTGRAD_BACKEND", "").strip()
    return env or None


def _unavailable(name: str) -> str | None:
    """A backend's availability: fixed for the process, so under torch.compile it is evaluated once while
    tracing and kept as a constant (the first check may import an extension under a lock, which dynamo
    cannot trace)."""
    return _REGISTRY[name].unavailable_reason()


_assume_constant = getattr(getattr(torch, "compiler", None), "assume_constant_result", None)
if _assume_constant is None:  # pragma: no cover - older torch spelling
    _assume_constant = getattr(getattr(torch, "_dynamo", None), "assume_constant_result", None)
if _assume_constant is not None:
    _unavailable = _assume_constant(_unavailable)


def select(op: str, tensors: Sequence[Tensor], backend: str | None = None, **params) -> Backend:
    """The backend that runs primitive ``op`` on ``tensors`` (one device's group)."""
    name = backend if backend is not None else get_default_backend()
    if name is not None:
        b = get(name)
        why = _unavailable(name) or b.supports(op, tensors, **params)
        if why is not None:
            raise BackendError(
                f"fastgrad backend {name!r} cannot run {op}: {why}. "
                "Pass backend=None (and unset FASTGRAD_BACKEND) for automatic choice with fallback."
            )
        return b
    dev = tensors[0].device.type if tensors else "cpu"
    for candidate in AUTO_ORDER.get(dev, _FALLBACK_ORDER):
        b = _REGISTRY.get(candidate)
        if b is None or _unavailable(candidate) is not None:
            continue
        if b.supports(op, tensors, **params) is None:
            return b
    return _REGISTRY["torch"]


def _register_builtin() -> None:
    from .torch_backend import TorchBackend

    register(TorchBackend())
    # The optional backends import their heavy dependencies lazily, so these imports cannot fail for a
    # missing Triton or a missing compiled extension; they report that through unavailable_reason().
    from .triton_backend import TritonBackend

    register(TritonBackend())
    from .ext_backend import CpuBackend, CudaBackend

    register(CudaBackend())
    register(CpuBackend())


_register_builtin()
