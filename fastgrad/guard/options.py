"""The guard's options, checked before any work: each bad value raises with what is allowed and why."""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

from .. import _inputs as inputs
from .. import exact_reads as exact_norm
from ..backends import get as get_backend
from .adagc import AdaGCMode
from .autoclip import AutoClipMode
from .norm import NormMode
from .zclip import ZClipMode

MODE_CLASSES = {m.name: m for m in (NormMode, ZClipMode, AutoClipMode, AdaGCMode)}
MODES = tuple(MODE_CLASSES)


class Options(NamedTuple):
    norm_type: float
    max_norm: float | None
    skip_factor: float | None
    max_consecutive_skips: int | None
    mode_options: dict
    exact: bool = False  # the norms come from fastgrad.exact (p = 1 or 2; inf is a max, exact already)


def _number(name: str, value, *, low: float, high: float = math.inf, low_open: bool = True,
            high_open: bool = True, why: str) -> float:
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


def _count(name: str, value, why: str) -> int:
    # (numbers.Integral: also numpy's integer scalars; returned as a Python int)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}: {why}")
    return int(value)


_WHY = {
    "alpha": "the EMA's weight on its past (0: no memory; 1 would never move)",
    "beta": "the EMA's weight on its past (0: no memory; 1 would never move)",
    "z_thresh": "the z-score above which a norm is an outlier",
    "clip_factor": "the factor on ZClip's adaptive threshold (0 would clip every outlier to zero)",
    "lambda_rel": "how far above its EMA a tensor's norm may go (0 would zero every tensor)",
    "eps": "a small positive guard against division by zero",
    "percentile": "the percentile of the norm history used as the threshold",
    "warmup_steps": "steps of statistics gathered before the adaptive rule applies",
    "history_size": "how many past norms the percentile is taken over",
}


def check_options(*, mode, max_norm, norm_type, skip_factor, max_consecutive_skips, non_fused, zero_write,
                  backend=None, exact=False, **mode_kw) -> Options:
    """Every option checked before the guard is built (nothing registered, nothing read)."""
    if mode not in MODES:
        raise ValueError(f"StepGuard mode must be one of {', '.join(MODES)}; got {mode!r}")
    if non_fused not in ("sync", "restore"):
        raise ValueError(f"non_fused must be 'sync' (one flag read per step) or 'restore' (a device-side "
                         f"snapshot, no read), got {non_fused!r}")
    if not isinstance(zero_write, bool):
        raise TypeError(f"zero_write must be True or False, got {zero_write!r}")
    if backend is not None:
        get_backend(backend)  # ValueError naming the registered backends
    norm_type = inputs.check_norm_type(norm_type)
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be True or False, got {exact!r}")
    exact = exact_norm.applies(exact, norm_type)  # ValueError for a norm_type other than 1, 2, inf
    if mode != "norm" and norm_type != 2.0:
        raise ValueError(f"mode={mode!r} is defined on the 2-norm (as its paper); norm_type must be 2")
    if mode == "norm":
        if max_norm is None:
            raise ValueError("mode='norm' needs max_norm (the clip threshold)")
    elif mode == "adagc" and max_norm is None:
        max_norm = 1.0  # the paper's lambda_abs
    max_norm = None if max_norm is None else inputs.check_max_norm(max_norm)
    if mode != "norm" and max_norm == 0:
        # (mode "norm" keeps clip_grad_norm_'s meaning of 0: every gradient clipped to zero)
        raise ValueError(
            f"max_norm for mode={mode!r} must be > 0, got {max_norm!r}: it is "
            + ("AdaGC's global threshold of its warm-up (lambda_abs); at 0 every gradient is zeroed and every "
               "tensor's reference stays 0, so the run never learns again" if mode == "adagc" else
               "a hard cap on the adaptive threshold; at 0 every gradient is zeroed. Pass None for no cap"))
    if skip_factor is not None:
        skip_factor = _number(
            "skip_factor", skip_factor, low=1.0,
            why="a finite step is skipped when its norm exceeds skip_factor times the mode's reference (the "
                "run's typical norm); at 1 or below, ordinary steps exceed it, and since the reference learns "
                "from the steps taken, the guard would skip every step from then on. Typical: 5 to 10; None "
                "skips only non-finite steps")
    if max_consecutive_skips is not None:
        max_consecutive_skips = _count("max_consecutive_skips", max_consecutive_skips,
                                       "how many skipped steps in a row raise GuardError (None: never)")

    given = {k: v for k, v in mode_kw.items() if v is not None}
    cls = MODE_CLASSES[mode]
    defaults = dict(cls.options) if mode != "norm" or skip_factor is not None else {}
    allowed = set(defaults)
    extra = sorted(set(given) - allowed)
    if extra:
        hint = " (mode 'norm' takes alpha and warmup_steps only with skip_factor)" if mode == "norm" else ""
        raise TypeError(f"mode={mode!r} does not take {', '.join(extra)} (it takes: "
                        f"{', '.join(sorted(allowed)) or 'no mode options'}){hint}")
    o: dict[str, Any] = {**defaults, **given}
    for k in ("warmup_steps", "history_size"):
        if k in given:
            o[k] = _count(k, o[k], _WHY[k])
    for k in ("alpha", "beta"):
        if k in given:
            o[k] = _number(k, o[k], low=0.0, high=1.0, low_open=False, why=_WHY[k])
    for k in ("z_thresh", "clip_factor", "lambda_rel", "eps"):
        if k in given:
            o[k] = _number(k, o[k], low=0.0, why=_WHY[k])
    if "percentile" in given:
        o["percentile"] = _number("percentile", o["percentile"], low=0.0, high=100.0, low_open=False,
                                  high_open=False, why=_WHY["percentile"])
    return Options(norm_type, max_norm, skip_factor, max_consecutive_skips, o, exact)


def make_mode(mode: str, max_norm, skip_factor, options: dict):
    return MODE_CLASSES[mode](max_norm, skip_factor, options)
