"""The guard's options, checked before any work: each bad value raises with what is allowed and why."""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import _inputs as I
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


def check_options(*, mode, max_norm, norm_type, skip_factor, max_consecutive_skips, non_fused, zero_write,
                  **mode_kw) -> Options:
    if mode not in MODES:
        raise ValueError(f"StepGuard mode must be one of {', '.join(MODES)}; got {mode!r}")
    if non_fused not in ("sync", "restore"):
        raise ValueError(f"non_fused must be 'sync' or 'restore', got {non_fused!r}")
    if not isinstance(zero_write, bool):
        raise TypeError(f"zero_write must be True or False, got {zero_write!r}")
    norm_type = I.check_norm_type(norm_type)
    if mode != "norm" and norm_type != 2.0:
        raise ValueError(f"mode={mode!r} is defined on the 2-norm (as its paper); norm_type must be 2")
    if mode == "norm":
        if max_norm is None:
            raise ValueError("mode='norm' needs max_norm (the clip threshold)")
    elif mode == "adagc" and max_norm is None:
        max_norm = 1.0  # the paper's lambda_abs
    max_norm = None if max_norm is None else I.check_max_norm(max_norm)
    if skip_factor is not None:
        skip_factor = I._as_float("skip_factor", skip_factor)
        if not skip_factor > 0:
            raise ValueError(f"skip_factor must be > 0, got {skip_factor}")
    if max_consecutive_skips is not None and (isinstance(max_consecutive_skips, bool) or
                                              not isinstance(max_consecutive_skips, int) or
                                              max_consecutive_skips < 1):
        raise ValueError(f"max_consecutive_skips must be a positive int or None, got {max_consecutive_skips!r}")

    given = {k: v for k, v in mode_kw.items() if v is not None}
    cls = MODE_CLASSES[mode]
    defaults = dict(cls.options) if mode != "norm" or skip_factor is not None else {}
    allowed = set(defaults)
    extra = sorted(set(given) - allowed)
    if extra:
        raise TypeError(f"mode={mode!r} does not take {', '.join(extra)} (it takes: "
                        f"{', '.join(sorted(allowed)) or 'no mode options'})")
    o: dict[str, Any] = {**defaults, **given}
    if "warmup_steps" in o and (not isinstance(o["warmup_steps"], int) or o["warmup_steps"] < 1):
        raise ValueError(f"warmup_steps must be a positive int, got {o['warmup_steps']!r}")
    if "history_size" in o and (not isinstance(o["history_size"], int) or o["history_size"] < 1):
        raise ValueError(f"history_size must be a positive int, got {o['history_size']!r}")
    if "percentile" in o and not 0 <= o["percentile"] <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {o['percentile']!r}")
    for k in ("alpha", "beta"):
        if k in o and not 0 <= o[k] < 1:
            raise ValueError(f"{k} must be in [0, 1), got {o[k]!r}")
    for k in ("z_thresh", "lambda_rel", "clip_factor"):
        if k in o and not o[k] > 0:
            raise ValueError(f"{k} must be > 0, got {o[k]!r}")
    return Options(norm_type, max_norm, skip_factor, max_consecutive_skips, o)


def make_mode(mode: str, max_norm, skip_factor, options: dict):
    return MODE_CLASSES[mode](max_norm, skip_factor, options)
