"""One-pass list scans: the per-tensor host work of a call, done once and in C++ when possible.

A public call looks at every tensor of its list several times: collect ``.grad``, check dtypes and
layouts, group by device, pick a backend, find the kernel table. Each Python pass costs ~0.1 us per
tensor, which on a 4,000-tensor model is milliseconds, more than the kernels themselves. Here the
compiled extension (``fastgrad._C.grads_of`` / ``scan`` / ``plan_key``, csrc/host.cpp) does those reads in
one C++ loop, and the result travels with the list as a :class:`Checked` list, which the layers below
recognise and trust instead of looping again.

The fast path answers only the common case: plain ``torch.Tensor``/``nn.Parameter`` objects, strided,
float16/bfloat16/float32/float64, all on one device. Anything else (subclasses such as DTensor, sparse,
complex, mixed devices, no extension, tracing under ``torch.compile``) gets ``None``/a plain list and the
Python code paths, which define the semantics and the error messages, run as before.
``FASTGRAD_HOST_SCAN=0`` turns the fast path off (for comparison and tests).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from . import _ext

# dtype bits of a mask (csrc/host.cpp: dtype_bit)
F16, BF16, F32, F64 = 1, 2, 4, 8
_DTYPE_OF_BIT = {F16: torch.float16, BF16: torch.bfloat16, F32: torch.float32, F64: torch.float64}
_ENV = "FASTGRAD_HOST_SCAN"

_state = {"enabled": os.environ.get(_ENV, "1").strip() not in ("0", "false", "off", "no")}


class Checked(list):
    """A list of plain dense real floating tensors on one ``device``, checked in one pass.

    ``dtype_mask`` has the bits F16/BF16/F32/F64 of the dtypes present; ``contiguous`` is True when every
    tensor is contiguous. Built only by :func:`checked` and never mutated afterwards (so the facts stay
    true); any list derived from it is a plain list again.
    """

    __slots__ = ("device", "dtype_mask", "contiguous")

    @property
    def dtypes(self) -> list[torch.dtype]:
        return [dt for bit, dt in _DTYPE_OF_BIT.items() if self.dtype_mask & bit]


def set_enabled(enabled: bool) -> bool:
    """Turn the compiled fast path on or off for this process; returns the previous setting."""
    prev = _state["enabled"]
    _state["enabled"] = bool(enabled)
    return prev


def helpers():
    """``fastgrad._C`` when its host helpers can be used for this call, else None."""
    if not _state["enabled"] or torch.compiler.is_compiling():
        return None
    mod = _ext.load()
    return mod if mod is not None and hasattr(mod, "scan") else None


def describe() -> str:
    """One line for ``python -m fastgrad.info``."""
    if not _state["enabled"]:
        return f"Python loops ({_ENV}=0)"
    mod = _ext.load()
    if mod is None:
        err = _ext.load_error() or ""
        why = ("declined: its smoke test failed, see the extension's load error" if "smoke test" in err
               else "not built" if "is not built" in err else "not loadable, see the extension's load error")
        return f"Python loops (fastgrad._C {why}; calls on long lists pay ~0.1 us per tensor per pass)"
    if not hasattr(mod, "scan"):
        return ("Python loops (this fastgrad._C has no host helpers; calls on long lists pay ~0.1 us per tensor per "
                "pass)")
    return "compiled (fastgrad._C: one C++ pass per call for plain tensors on one device)"


def checked(tensors: Sequence[Tensor]) -> Sequence[Tensor]:
    """``tensors`` as a :class:`Checked` list when they qualify, else unchanged."""
    if type(tensors) is Checked:
        return tensors
    c = helpers()
    if c is None:
        return tensors
    info = c.scan(tensors)
    if info is None:
        return tensors
    out = Checked(tensors)
    out.device, out.dtype_mask, out.contiguous = info
    return out


def grads_of(params: Sequence[Tensor]) -> list[Tensor] | None:
    """``[p.grad for p in params if p.grad is not None]`` as a :class:`Checked` list when possible; None
    when the compiled path cannot answer (the caller then uses Python)."""
    c = helpers()
    if c is None:
        return None
    grads = c.grads_of(params)
    if grads is None:
        return None
    return checked(grads) if grads else grads


def plain_grads_of(params: Sequence[Tensor]) -> list[Tensor] | None:
    """``[p.grad for p in params if p.grad is not None]`` from one C++ pass, without the scan that makes a
    :class:`Checked` list (for callers that have already validated the gradients); None as grads_of."""
    c = helpers()
    return None if c is None else c.grads_of(params)


def pairs_of(params: Sequence[Tensor]) -> tuple[Sequence[Tensor], Sequence[Tensor]] | None:
    """``(params that have a grad, their grads)``, each as a :class:`Checked` list when possible, for
    params whose grads match their shape and device; None when the compiled path cannot answer (the
    caller then uses Python, which also names any mismatch)."""
    c = helpers()
    if c is None or not hasattr(c, "pairs_of"):
        return None
    pairs = c.pairs_of(params)
    if pairs is None:
        return None
    ws, gs = pairs
    return (checked(ws), checked(gs)) if gs else (ws, gs)


def plan_key(tensors: Sequence[Tensor]):
    """Exact identity of a list for kernel-table caches (bytes of data_ptr, numel and dtype per tensor),
    or None when the compiled helper cannot give it."""
    c = helpers()
    return None if c is None else c.plan_key(tensors)


def clip_norm_cpu(params: Sequence[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool,
                  backend: str | None):
    """``clip_grad_norm_`` in one C++ call when the cpu backend would run it on plain dense CPU grads:
    ``(total, nonfinite)`` (``nonfinite`` True means error_if_nonfinite tripped and nothing was written),
    or None when the general path must run (nothing done). See csrc/host.cpp ``clip_norm_cpu``."""
    c = helpers()
    if c is None or not hasattr(c, "clip_norm_cpu"):
        return None
    if not builtin_selector()("cpu", "norm", backend, norm_type):
        return None
    return c.clip_norm_cpu(params, max_norm, norm_type, error_if_nonfinite)


def builtin_selector():
    """``fastgrad.backends.selects_builtin`` (see :func:`set_selector`)."""
    # The registry sits above this module (it imports it), so it hands the function down when it is
    # imported instead of this module importing it; until then (never in practice: every caller imports
    # the registry) the fast paths decline.
    return _state.get("selects_builtin") or _decline


def _decline(*_args) -> bool:
    return False


def set_selector(fn) -> None:
    """Called once by ``fastgrad.backends``: ``fn(device_type, op, backend, norm_type)`` says whether the
    built-in backend of that device type would serve the call (see ``backends.selects_builtin``)."""
    _state["selects_builtin"] = fn


def monitor_clip_cpu(params: Sequence[Tensor], max_norm: float, error_if_nonfinite: bool, backend: str | None):
    """``GradientMonitor.clip_grad_norm_`` (L2) in one C++ call and one read when the cpu backend would run both
    its statistics and its scale on plain dense CPU grads and every parameter has one: ``(total, nonfinite,
    dtype_mask, norm, max_abs, nan, inf, zero)`` (``total`` in the accumulation dtype; ``nonfinite`` True means
    error_if_nonfinite tripped and nothing was written), or None when the general path must run (nothing
    done). The total and the clipped gradients are :func:`clip_norm_cpu`'s bit for bit. See csrc/host.cpp
    ``monitor_clip_cpu``."""
    c = helpers()
    if c is None or not hasattr(c, "monitor_clip_cpu"):
        return None
    selects_builtin = builtin_selector()
    if not (selects_builtin("cpu", "grad_stats", backend, 2.0) and selects_builtin("cpu", "scale", backend, 2.0)):
        return None
    return c.monitor_clip_cpu(params, max_norm, error_if_nonfinite)


def dtype_of_mask(mask: int, acc: torch.dtype) -> torch.dtype:
    """The promoted dtype of a list with these dtype bits whose accumulation dtype is ``acc``: the one dtype
    when there is one, else ``acc`` (float16 with bfloat16 or float32 promotes to float32, anything with float64
    to float64)."""
    return _DTYPE_OF_BIT.get(mask, acc)


def acc_dtype_of(tensors: Checked) -> torch.dtype:
    return torch.float64 if tensors.dtype_mask & F64 else torch.float32


def promoted_dtype_of(tensors: Checked) -> torch.dtype:
    mask = tensors.dtype_mask
    if mask in _DTYPE_OF_BIT:
        return _DTYPE_OF_BIT[mask]
    out = None
    for dt in tensors.dtypes:
        out = dt if out is None else torch.promote_types(out, dt)
    return out
