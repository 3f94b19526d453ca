"""Input handling shared by every public function and backend: collecting gradients, validating arguments,
grouping by device. Everything here runs before any gradient is modified, so a bad call leaves the
gradients untouched."""

from __future__ import annotations

import math
import types
import warnings
from typing import Iterable

import torch
from torch import Tensor

from . import _scan, backends, exact
from .decide import nonfinite
from ._scan import Checked, checked  # noqa: F401  (re-exported for the public modules)
from .backends import Backend

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


#: Every wrong-device error of fastgrad, from the compiled kernels (csrc/cpu/kernels.h ``wrong_device``) and
#: from the Python checks (:func:`wrong_device_message`), reads "fastgrad::<op>: <what> [<index>] is on <device>,
#: expected <device>"; tests/test_ext.py holds every op to this pattern.
WRONG_DEVICE_PATTERN = r"fastgrad::\w+: \w+(?: \d+)? is on \S+, expected \S+"


def wrong_device_message(op: str, what: str, index: int | None, got, expected) -> str:
    """The wrong-device wording of the compiled kernels, for the checks made in Python."""
    item = what if index is None else f"{what} {index}"
    return f"fastgrad::{op}: {item} is on {got}, expected {expected}"


# ---------------------------------------------------------------- collecting
def as_list(parameters, *, warn_empty_generator: bool = False) -> list:
    """torch's handling of ``parameters``: one tensor, an iterable, or a generator (consumed once; an empty
    generator warns as torch.nn.utils.clip_grad_norm_ does)."""
    if isinstance(parameters, Tensor):
        return [parameters]
    if parameters is None:
        raise TypeError("parameters is None: pass the tensors whose gradients to use, e.g. model.parameters(); "
                        "the gradients were not modified")
    is_generator = isinstance(parameters, types.GeneratorType)
    try:
        items = list(parameters)
    except TypeError:
        if isinstance(parameters, torch.nn.Module):  # error path only: say what to pass instead
            raise TypeError(_MODULE_FIX.format(type(parameters).__name__)) from None
        raise
    if warn_empty_generator and is_generator and not items:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=4)
    return items


def optimizer_params(optimizer) -> list[Tensor]:
    """The parameters of every group of ``optimizer``, in order."""
    groups = optimizer.param_groups
    if len(groups) == 1:  # the common case: the group's own list, no per-parameter Python step
        return groups[0]["params"]
    return [p for group in groups for p in group["params"]]


def grads_of(params: Iterable[Tensor]) -> list[Tensor]:
    """The gradients of ``params`` that exist: a :class:`Checked` list from one C++ pass when the
    compiled helpers can answer (fastgrad/_scan.py), else Python's loop."""
    grads = _scan.grads_of(params)
    if grads is not None:
        return grads
    try:
        return [p.grad for p in params if p.grad is not None]  # (no walrus: dynamo cannot trace it)
    except AttributeError:
        reject_non_tensors(params)  # names the bad item and the fix
        raise


_MODULE_FIX = ("got a module ({}) where parameters are expected: pass model.parameters(), "
               "e.g. fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)")


def reject_non_tensors(items, what: str = "parameters") -> None:
    """Raise a TypeError that says the fix for the usual mistakes: ``model.named_parameters()`` (pairs) or a
    module where parameters are expected. Only called after the normal path failed (error path only)."""
    for item in items:
        if isinstance(item, Tensor):
            continue
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            raise TypeError(
                f"got (name, parameter) pairs where {what} are expected (model.named_parameters()?): pass "
                "model.parameters(), or [p for _, p in model.named_parameters()]; the gradients were not "
                "modified") from None
        if isinstance(item, torch.nn.Module):
            raise TypeError(_MODULE_FIX.format(type(item).__name__) + "; the gradients were not modified")
        raise TypeError(f"{what} must be tensors, got {type(item).__name__}; the gradients "
                        "were not modified")


def pairs_of(params: list) -> tuple[list[Tensor], list[Tensor]] | None:
    """``(params with a grad, their grads)`` from one C++ pass, or None: see fastgrad/_scan.py."""
    pairs = _scan.pairs_of(params)
    if pairs is None:  # the compiled pass declined: before the caller's Python loop, name a bad item
        reject_non_tensors(params)
    return pairs


# ---------------------------------------------------------------- validating
class NotANumberError(ValueError, TypeError):
    """A numeric argument that is no number (None, a string, a list): torch's ``float(x)`` raises TypeError or
    ValueError for these, fastgrad raises this, which is both, with a message naming the argument, so code
    written against either torch's exception or fastgrad's documented ValueError catches it."""


class GradientDtypeError(TypeError, RuntimeError):
    """Integer or bool gradients: fastgrad's TypeError, and the RuntimeError torch's norm raises for them."""


def check_norm_type(norm_type) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise NotANumberError(
            f"norm_type must be a real number or 'inf', got {norm_type!r}"
        ) from None
    if math.isnan(p):
        raise ValueError("norm_type must not be NaN")
    return p


def check_exact(exact_asked: bool, p: float) -> bool:
    """Whether ``exact=True`` changes the computation: p = 1 or 2 (inf is a max, exact already). Rejects any
    other order with ValueError before any work."""
    if not exact_asked:
        return False
    return exact.check_norm_type(p) != math.inf


def check_max_norm(max_norm) -> float:
    value = _as_float("max_norm", max_norm)
    if math.isnan(value) or value < 0:
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm!r}")
    return value


def check_clip_value(clip_value) -> float:
    value = _as_float("clip_value", clip_value)
    if math.isnan(value) or value < 0:
        raise ValueError(f"clip_value must be a non-negative number, got {clip_value!r}")
    return value


def check_non_negative(name: str, value) -> float:
    v = _as_float(name, value)
    if math.isnan(v) or v < 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return v


def _as_float(name: str, value) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()  # an argument the caller passed as a tensor; torch reads it the same way
    try:
        return float(value)
    except (TypeError, ValueError):
        raise NotANumberError(f"{name} must be a number, got {value!r}") from None


NONFINITE_MSG = (
    "The total norm of order {} for gradients from `parameters` is non-finite, so it cannot be clipped. "
    "To disable this error and scale the gradients by the non-finite norm anyway, set "
    "`error_if_nonfinite=False`"
)


def check_finite(total: Tensor, norm_type: float) -> None:
    """``error_if_nonfinite``'s check of a total norm, before anything is written."""
    # The one host sync the contract allows (docs/contract.md section 3), and only when the caller asked for it.
    if nonfinite(total):
        raise RuntimeError(NONFINITE_MSG.format(norm_type))


def check_tensors(tensors: list[Tensor], what: str = "gradients", *, allow_fallback: bool = True) -> bool:
    """Reject integer/bool tensors with TypeError. Returns True when some tensor needs torch's own
    implementation (sparse or complex), which the clipping functions delegate to."""
    if type(tensors) is Checked:  # plain dense real floating tensors, checked in one pass already
        return False
    needs_torch = False
    for t in tensors:
        if not isinstance(t, Tensor):
            reject_non_tensors([t], what)
        dt = t.dtype
        if dt in _FLOATING and t.layout == torch.strided:
            continue
        if dt.is_complex or t.layout != torch.strided:
            if not allow_fallback:
                kind = "complex" if dt.is_complex else f"{t.layout}"
                raise TypeError(f"{kind} {what} are not supported by this function")
            needs_torch = True
            continue
        if not dt.is_floating_point:
            raise GradientDtypeError(f"{what} must be floating point; got a tensor of dtype {dt}")
        # other floating dtypes (float8...): torch's implementation decides
        needs_torch = True
    return needs_torch


def check_scaler(scaler, optimizer) -> None:
    """``scaler_unscale_and_clip``'s first check: ``scaler`` is a GradScaler (and not swapped with the
    optimizer), else a TypeError that says the fix."""
    if scaler is None or not hasattr(scaler, "unscale_"):
        explain_amp_args(scaler, optimizer, swapped_only=True)
        # None (a scaler the script only makes under AMP) would fail deep inside with an AttributeError
        raise TypeError(f"scaler_unscale_and_clip(scaler, optimizer, max_norm): scaler must be a "
                        f"torch.amp.GradScaler, got {type(scaler).__name__}; without AMP call "
                        "fastgrad.clip_grad_norm_(params, max_norm) instead (the gradients were not modified)")


def explain_amp_args(scaler, optimizer, swapped_only: bool = False) -> None:
    """Error path of ``scaler_unscale_and_clip``'s checks: ``optimizer`` has no param_groups (or ``scaler`` no
    unscale_). Say the fix."""
    if hasattr(scaler, "param_groups") and hasattr(optimizer, "unscale_"):
        raise TypeError("scaler_unscale_and_clip(scaler, optimizer, max_norm): the scaler and the optimizer are "
                        "swapped; call fastgrad.scaler_unscale_and_clip(scaler, optimizer, max_norm) (the "
                        "gradients were not modified)") from None
    if swapped_only:
        return
    raise TypeError(f"scaler_unscale_and_clip: optimizer must be a torch.optim.Optimizer (with param_groups), "
                    f"got {type(optimizer).__name__}; call fastgrad.scaler_unscale_and_clip(scaler, optimizer, "
                    "max_norm) (the gradients were not modified)") from None


# ---------------------------------------------------------------- grouping and dispatch
def group_by_device(tensors: list[Tensor]) -> dict[torch.device, list[int]]:
    """Indices of ``tensors`` per device, in first-seen order (so the first group is the first tensor's)."""
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        d = t.device
        idx = groups.get(d)
        if idx is None:
            groups[d] = idx = []
        idx.append(i)
    return groups


def split_by_device(tensors: list[Tensor]) -> list[list[Tensor]]:
    if not tensors:
        return []
    if type(tensors) is Checked:  # one device by construction
        return [tensors]
    first = tensors[0].device
    # Fast path: one device (almost every call); comparing devices is cheaper than hashing them.
    if all(t.device == first for t in tensors):
        return [tensors]
    return [[tensors[i] for i in idx] for idx in group_by_device(tensors).values()]


def restore_order(values: Tensor, groups: dict[torch.device, list[int]]) -> Tensor:
    """``values`` holds per-tensor results concatenated group by group (the order of ``groups``); return
    them in the original input order. Single-group input is returned as is."""
    if len(groups) <= 1:
        return values
    order = [i for idx in groups.values() for i in idx]
    inverse = torch.empty(len(order), dtype=torch.int64)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    # non_blocking: a blocking host-to-device copy counts as a sync under set_sync_debug_mode("error")
    return values.index_select(0, inverse.to(values.device, non_blocking=True))


def requested_backend(backend: str | None) -> str | None:
    return backend if backend is not None else backends.get_default_backend()


def pick(op: str, tensors: list[Tensor], backend: str | None, **params) -> Backend:
    return backends.select(op, tensors, backend, **params)


_BIT_OF = {torch.float16: _scan.F16, torch.bfloat16: _scan.BF16, torch.float32: _scan.F32, torch.float64: _scan.F64}


def has_dtype(tensors: list[Tensor], dtype: torch.dtype) -> bool:
    """Whether some tensor of ``tensors`` has ``dtype``."""
    if type(tensors) is Checked:
        return bool(tensors.dtype_mask & _BIT_OF.get(dtype, 0))
    return any(t.dtype == dtype for t in tensors)


def out_dtype(tensors: list[Tensor], local: list[Tensor] | None = None) -> torch.dtype | None:
    """The dtype a norm of ``tensors`` is returned in (torch's: their promoted dtype); None for an empty list (its
    norm keeps its own dtype). ``local``: a sharded list's local tensors, read instead when the compiled scan
    checked them (it knows their dtypes: no Python pass through the DTensors)."""
    if not tensors:
        return None
    return promoted_dtype(local if type(local) is Checked else tensors)


def promoted_dtype(tensors: list[Tensor]) -> torch.dtype:
    if type(tensors) is Checked:
        return _scan.promoted_dtype_of(tensors)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t.dtype != dtype:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype
