"""What every guard mode is: the protocol a read pass talks to, and the declaration of its options.

A mode is one file in this folder defining one :class:`Mode` subclass (found by ``modes/__init__.py``). It
declares its ``name``, its options (:class:`Option`: the keyword, the default, the allowed range and why),
what ``max_norm`` means for it, and implements ``init`` / ``fits`` (its device state) and ``update``: the
read pass hands it the step's :class:`Norms` and gets back ``(coefficient, spike)``. Every coefficient comes
from a rule of ``fastgrad.decide``. Nothing here reads device data on the host."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor

from ... import _inputs as inputs
from ... import decide


# ---------------------------------------------------------------- option checks
def real(name: str, value, *, low: float, high: float = math.inf, low_open: bool = True, high_open: bool = True,
         why: str) -> float:
    """A real number in the interval, or ValueError naming the option, the interval and why."""
    # (numbers.Real: also numpy's scalars, as sweeps over np.linspace hand them over)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok or math.isnan(v):
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}{low:g}, {high:g}{hi}, got {value!r}: {why}")
    return v


def count(name: str, value, why: str) -> int:
    """A positive int (numpy's integer scalars too, returned as a Python int), or ValueError with why."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}: {why}")
    return int(value)


class Option:
    """One option of a mode, declared once: ``StepGuard``'s keyword ``name``, its ``default``, the allowed
    values (a positive int with ``integer``, else a real number in the interval ``low``..``high``, each end
    open or closed) and ``why`` (what it is, said when a value is refused). ``spike_only``: taken only with
    ``skip_factor`` (it shapes the spike reference)."""

    __slots__ = ("name", "default", "why", "integer", "low", "high", "low_open", "high_open", "spike_only")

    def __init__(self, name: str, default, why: str, *, integer: bool = False, low: float = 0.0,
                 high: float = math.inf, low_open: bool = True, high_open: bool = True, spike_only: bool = False):
        self.name, self.default, self.why = name, default, why
        self.integer, self.low, self.high = integer, low, high
        self.low_open, self.high_open, self.spike_only = low_open, high_open, spike_only

    def check(self, value):
        if self.integer:
            return count(self.name, value, self.why)
        return real(self.name, value, low=self.low, high=self.high, low_open=self.low_open,
                    high_open=self.high_open, why=self.why)


# the options several modes share: each mode picks its own default
def ema_weight(name: str, default: float, **kw) -> Option:
    return Option(name, default, "the EMA's weight on its past (0: no memory; 1 would never move)", low=0.0,
                  high=1.0, low_open=False, **kw)


def warmup_steps(default: int, **kw) -> Option:
    return Option("warmup_steps", default, "steps of statistics gathered before the adaptive rule applies",
                  integer=True, **kw)


def epsilon(default: float) -> Option:
    return Option("eps", default, "a small positive guard against division by zero")


# ---------------------------------------------------------------- what a read pass hands a mode
class Norms:
    """One step's reading of the gradients: ``total`` (the 0-dim total norm), ``per`` (per-tensor norms, in
    the total's dtype and device, for a mode with ``per_tensor``; else None) and ``index`` (the positions
    among the optimizer's parameters of the tensors ``per`` holds; None: all of them). ``nonfinite`` /
    ``finite``: the verdict on the total (``decide.nonfinite``), computed once, when first asked.
    ``clipped``: the read pass's own kernel has already applied ``clip_grad_norm_``'s coefficient at
    ``max_norm`` (only for a mode with ``kernel_clip``), so the mode computes no coefficient."""

    __slots__ = ("total", "per", "index", "clipped", "_nonfinite", "_finite")

    def __init__(self, total: Tensor, per: Tensor | None = None, index: Tensor | None = None, *,
                 nonfinite: Tensor | None = None, clipped: bool = False):
        self.total = total
        self.per = None if per is None else per.to(total.device, total.dtype)
        self.index = index
        self.clipped = clipped
        self._nonfinite = nonfinite
        self._finite = None

    @property
    def nonfinite(self) -> Tensor:
        if self._nonfinite is None:
            self._nonfinite = decide.nonfinite(self.total)
        return self._nonfinite

    @property
    def finite(self) -> Tensor:
        if self._finite is None:
            self._finite = ~self.nonfinite
        return self._finite


def zeros(like: Tensor, *shape: int) -> Tensor:
    """State on the norm's device, in its dtype."""
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


class Mode:
    """A guard mode. Class attributes (the declaration):

    * ``name``: ``StepGuard(..., mode=name)``; ``OPTIONS``: its :class:`Option` declarations;
    * ``per_tensor``: its rule needs every tensor's norm and gives one coefficient per tensor (the read pass
      then writes each tensor by its own; no zero-write hand-over to a fused optimizer);
    * ``kernel_clip``: its coefficient is ``decide.clip_coef(total, max_norm)`` (``clip_grad_norm_``'s), which
      the one-call read passes compute inside their kernel (and then pass ``Norms(clipped=True)``);
    * ``norm_types``: the norm types its rule is defined on (None: any);
    * ``max_norm_is``: what ``max_norm`` is to it; ``max_norm_required``; ``max_norm_default`` (when None is
      given); ``max_norm_zero``: why 0 is refused (None: 0 is allowed).

    An instance holds the checked ``max_norm``, ``skip_factor`` and ``options`` (name -> value) and its
    ``state`` (device tensors, filled by ``init``; what ``StepGuard.state_dict`` saves)."""

    name: str = ""
    OPTIONS: tuple[Option, ...] = ()
    per_tensor = False
    kernel_clip = False
    norm_types: tuple[float, ...] | None = (2.0,)
    max_norm_is = "a hard cap on the adaptive threshold"
    max_norm_required = False
    max_norm_default: float | None = None
    max_norm_zero: str | None = "at 0 every gradient is zeroed. Pass None for no cap"

    def __init__(self, max_norm: float | None, skip_factor: float | None, options: dict[str, Any]):
        self.max_norm = max_norm
        self.skip_factor = skip_factor
        self.options = options
        self.state: dict[str, Tensor] = {}

    @classmethod
    def taken(cls, skip_factor) -> tuple[Option, ...]:
        """The options this mode takes with (or without) a ``skip_factor``."""
        return tuple(o for o in cls.OPTIONS if skip_factor is not None or not o.spike_only)

    def init(self, total: Tensor, n_params: int) -> None:
        """Create the state on ``total``'s device, in its dtype (``n_params``: the optimizer's parameters)."""
        self.state = {}

    def fits(self, n_params: int) -> bool:
        """Whether the (loaded or moved) state serves an optimizer with ``n_params`` parameters."""
        return True

    def update(self, norms: Norms) -> tuple[Tensor | None, Tensor | None]:
        """One step: ``(coefficient, spike)``, the statistics updated, device ops only.

        The coefficient: 0-dim, or for a ``per_tensor`` mode one per tensor of ``norms.per``; None only when
        ``norms.clipped`` (a ``kernel_clip`` mode whose coefficient the read pass's kernel applied). The spike:
        a 0-dim bool (``decide.spike``), or None without ``skip_factor``. A non-finite total leaves the
        statistics as they were."""
        raise NotImplementedError
