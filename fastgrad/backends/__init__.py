"""Backend registry and selection (docs/contract.md section 8).

Order of choice for one device's group of tensors:
1. the ``backend=`` argument of the public function;
2. else the process default set by :func:`set_backend`;
3. else the ``FASTGRAD_BACKEND`` environment variable (read at each call, so tests can set it);
4. else automatic: the first backend of :func:`auto_order` (the measured per-op table
   :data:`MEASURED_ORDER` for CUDA tensors, else :data:`AUTO_ORDER` for the device type) that is
   available and ``supports()`` the call; ``torch`` always can.

A backend named by 1-3 that cannot serve the call raises :class:`BackendError` naming why; an automatic
choice falls back quietly.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

import torch
from torch import Tensor

from .. import _scan
from . import ext_backend
from .base import OPS, Backend, BackendError, acc_dtype, amp_factor, clip_coef, is_fast_norm_type

__all__ = [
    "Backend", "BackendError", "OPS", "AUTO_ORDER", "acc_dtype", "amp_factor", "clip_coef", "is_fast_norm_type", "register", "get",
    "registered", "available_backends", "set_backend", "get_default_backend", "select", "select_automatic", "selects_builtin",
    "auto_order", "MEASURED_ORDER", "MEASURED_LONG_ORDER", "LONG_LIST_MIN", "MEASURED_RUN",
]

#: Automatic choice per device type. The Triton interpreter is never chosen automatically for CPU
#: tensors (it is a testing tool, far slower than the torch backend).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("cuda", "triton", "torch"),
    "cpu": ("cpu", "torch"),
}
_FALLBACK_ORDER = ("torch",)

_CUDA_FIRST = ("cuda", "triton", "torch")
_TRITON_FIRST = ("triton", "cuda", "torch")

#: The run the automatic CUDA orders below were measured on; the derivation and the timings it rests on are in
#: benchmarks/results/gpu/<run>/AUTO_ORDER.md.
MEASURED_RUN = "2026-11-25-h100"
#: Lists of at least this many tensors take the long-list order (the measured lists had <= 291 or 4,000 tensors).
LONG_LIST_MIN = 1000
#: op -> (order for shorter lists, order for lists of at least LONG_LIST_MIN tensors), CUDA tensors.
MEASURED_CUDA: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "norm": (_CUDA_FIRST, _TRITON_FIRST),
    "amp_norm": (_CUDA_FIRST, _TRITON_FIRST),
    "scale": (_CUDA_FIRST, _TRITON_FIRST),
    "clip_value": (_CUDA_FIRST, _TRITON_FIRST),
    "agc": (_CUDA_FIRST, _CUDA_FIRST),
    "centralize": (_CUDA_FIRST, _CUDA_FIRST),
    "grad_stats": (_CUDA_FIRST, _TRITON_FIRST),
}
#: Automatic order per device type and op (from MEASURED_CUDA), and for long lists.
MEASURED_ORDER: dict[str, dict[str, tuple[str, ...]]] = {"cuda": {op: o[0] for op, o in MEASURED_CUDA.items()}}
MEASURED_LONG_ORDER: dict[str, dict[str, tuple[str, ...]]] = {"cuda": {op: o[1] for op, o in MEASURED_CUDA.items()}}


def auto_order(op: str, device_type: str, n_tensors: int) -> tuple[str, ...]:
    """The automatic order of backends for primitive ``op`` on a list of ``n_tensors`` tensors of
    ``device_type``: the measured table where it has an entry, else :data:`AUTO_ORDER`."""
    order = None
    if n_tensors >= LONG_LIST_MIN:
        order = MEASURED_LONG_ORDER.get(device_type, {}).get(op)
    if order is None:
        order = MEASURED_ORDER.get(device_type, {}).get(op)
    return order if order is not None else AUTO_ORDER.get(device_type, _FALLBACK_ORDER)

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
    automatic choice. The name must be registered and usable in this process (BackendError with the reason
    otherwise); whether it can serve a given call is checked per call."""
    global _default
    if name is not None:
        why = get(name).unavailable_reason()
        if why is not None:  # refused now, not at the next clip far from this call
            raise BackendError(f"fastgrad backend {name!r} cannot run in this process: {why}")
    _default = name


def get_default_backend() -> str | None:
    """The backend name that applies when a call passes ``backend=None`` (None: automatic)."""
    return _default_backend(False)


def _default_backend(eager: bool) -> str | None:
    # eager: the caller is known not to be traced (a host fast path), so the tracing check is skipped
    if _default is not None:
        return _default
    env = _backend_env(eager)
    return (env.strip() or None) if env is not None else None


# os.environ.get costs ~2 us (it encodes the key and decodes the value on every call), a tenth of a whole
# clip over 148 CPU tensors; the mapping's own dict, keyed by the encoded name, answers the same in ~0.1 us
# and sees every change made through os.environ. Tracing (torch.compile) keeps the public spelling.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey("FASTGRAD_BACKEND") if hasattr(os.environ, "encodekey") else None


def _backend_env(eager: bool = False) -> str | None:
    if type(_ENV_DATA) is dict and _ENV_KEY is not None and (eager or not torch.compiler.is_compiling()):
        raw = _ENV_DATA.get(_ENV_KEY)
        return None if raw is None else os.environ.decodevalue(raw)
    return os.environ.get("FASTGRAD_BACKEND")


def _unavailable(name: str) -> str | None:
    """A backend's availability: fixed for the process, so under torch.compile it is evaluated once while
    tracing and kept as a constant (the first check may import an extension under a lock, which dynamo
    cannot trace)."""
    return _REGISTRY[name].unavailable_reason()


def _mark_constant(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing torch._dynamo at fastgrad import.

    The public decorator imports torch._dynamo (and through it sympy and triton): seconds of start-up
    that every script would pay for a mark only torch.compile reads. All it does is set
    ``fn._dynamo_marked_constant = True`` (so in every torch release since dynamo has had the decorator),
    which dynamo reads when it traces a call to ``fn``. tests/test_import.py checks that the installed torch's
    public decorator still sets exactly that attribute, and tests/test_compile.py that compiled calls keep
    working. Where dynamo is already imported the public spelling costs nothing, so it is used."""
    if "torch._dynamo" in sys.modules:
        public = getattr(getattr(torch, "compiler", None), "assume_constant_result", None)
        if public is None:  # pragma: no cover - older torch spelling
            public = getattr(sys.modules["torch._dynamo"], "assume_constant_result", None)
        if public is not None:
            return public(fn)
    fn._dynamo_marked_constant = True
    return fn


_unavailable = _mark_constant(_unavailable)


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
    return select_automatic(op, tensors, **params)


def select_automatic(op: str, tensors: Sequence[Tensor], **params) -> Backend:
    """Automatic choice alone (step 4): the first backend of :func:`auto_order` that is available and
    supports the call, else ``torch``. Also what a backend that gives up mid-call hands the call to."""
    dev = tensors[0].device.type if tensors else "cpu"
    for candidate in auto_order(op, dev, len(tensors)):
        b = _REGISTRY.get(candidate)
        if b is None or _unavailable(candidate) is not None:
            continue
        if b.supports(op, tensors, **params) is None:
            return b
    return _REGISTRY["torch"]


def selects_builtin(device_type: str, op: str, backend: str | None, norm_type: float) -> bool:
    """Whether :func:`select` would return the built-in backend named ``device_type`` ("cpu") for a
    Checked list (plain tensors on one ``device_type`` device) with this ``backend=`` argument and
    ``norm_type``, without building the list: lets a host fast path that calls that backend's kernels
    directly (fastgrad/_scan.py) skip the list scan. False whenever the answer could differ (another
    backend named or first in the order, a replaced registry entry, a norm order without a fused kernel);
    the caller then takes the general path, which selects (and raises) as usual. Its callers run eagerly (their
    ``_scan.helpers()`` is None while torch.compile traces), so the default is read without the tracing check."""
    name = backend if backend is not None else _default_backend(True)
    if name is None:
        order = auto_order(op, device_type, 0)
        if not order or order[0] != device_type:
            return False
        name = device_type
    elif name != device_type:
        return False
    b = _REGISTRY.get(name)
    return (b is not None and b is _BUILTIN.get(name) and _unavailable(name) is None
            and (op not in ("norm", "amp_norm", "agc") or is_fast_norm_type(norm_type)))


_BUILTIN: dict[str, Backend] = {}


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
    _BUILTIN.update(_REGISTRY)
    # The layers below the registry call back into it without importing it (that would be a cycle).
    _scan.set_selector(selects_builtin)
    ext_backend.set_registry(select_automatic, get_default_backend)


_register_builtin()
