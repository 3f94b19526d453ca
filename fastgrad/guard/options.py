"""The guard's options, checked before any work: each bad value raises with what is allowed and why. The
guard's own options are checked here; a mode's options, and what ``max_norm`` and ``norm_type`` may be for
it, come from its declaration (``fastgrad/guard/modes/``)."""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import _inputs as inputs
from ..backends import get as get_backend
from .modes import MODE_CLASSES, MODES
from .modes.base import Mode, count, real

__all__ = ["Options", "check_options", "make_mode", "mode_options_doc", "MODE_CLASSES", "MODES"]


class Options(NamedTuple):
    norm_type: float
    max_norm: float | None
    skip_factor: float | None
    max_consecutive_skips: int | None
    mode_options: dict
    exact: bool = False  # the norms come from fastgrad.exact (p = 1 or 2; inf is a max, exact already)


def check_options(*, mode, max_norm, norm_type, skip_factor, max_consecutive_skips, non_fused, zero_write,
                  backend=None, exact=False, **mode_kw) -> Options:
    """Every option checked before the guard is built (nothing registered, nothing read). ``mode_kw``: the
    mode's options as given (None: its default)."""
    if mode not in MODE_CLASSES:
        raise ValueError(f"StepGuard mode must be one of {', '.join(MODE_CLASSES)}; got {mode!r}")
    cls = MODE_CLASSES[mode]
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
    exact = inputs.check_exact(exact, norm_type)  # ValueError for a norm_type other than 1, 2, inf
    if cls.norm_types is not None and norm_type not in cls.norm_types:
        allowed = " or ".join(f"{p:g}" for p in cls.norm_types)
        raise ValueError(f"mode={mode!r} is defined on the {allowed}-norm (as its paper); norm_type must be "
                         f"{allowed}")
    max_norm = _max_norm(cls, max_norm)
    if skip_factor is not None:
        skip_factor = real(
            "skip_factor", skip_factor, low=1.0,
            why="a finite step is skipped when its norm exceeds skip_factor times the mode's reference (the "
                "run's typical norm); at 1 or below, ordinary steps exceed it, and since the reference learns "
                "from the steps taken, the guard would skip every step from then on. Typical: 5 to 10; None "
                "skips only non-finite steps")
    if max_consecutive_skips is not None:
        max_consecutive_skips = count("max_consecutive_skips", max_consecutive_skips,
                                      "how many skipped steps in a row raise GuardError (None: never)")

    given = {k: v for k, v in mode_kw.items() if v is not None}
    taken = {o.name: o for o in cls.taken(skip_factor)}
    extra = sorted(set(given) - set(taken))
    if extra:
        spike_only = [o.name for o in cls.OPTIONS if o.spike_only]
        hint = (f" (mode {mode!r} takes {' and '.join(spike_only)} only with skip_factor)"
                if skip_factor is None and spike_only else "")
        raise TypeError(f"mode={mode!r} does not take {', '.join(extra)} (it takes: "
                        f"{', '.join(sorted(taken)) or 'no mode options'}){hint}")
    values: dict[str, Any] = {name: (o.check(given[name]) if name in given else o.default)
                              for name, o in taken.items()}
    return Options(norm_type, max_norm, skip_factor, max_consecutive_skips, values, exact)


def _max_norm(cls: type[Mode], max_norm) -> float | None:
    """``max_norm`` as the mode declares it: required or not, its default, whether 0 is allowed."""
    if max_norm is None:
        if cls.max_norm_required:
            raise ValueError(f"mode={cls.name!r} needs max_norm ({cls.max_norm_is})")
        max_norm = cls.max_norm_default
    max_norm = None if max_norm is None else inputs.check_max_norm(max_norm)
    if max_norm == 0 and cls.max_norm_zero is not None:
        raise ValueError(f"max_norm for mode={cls.name!r} must be > 0, got {max_norm!r}: it is {cls.max_norm_is}; "
                         f"{cls.max_norm_zero}")
    return max_norm


def make_mode(mode: str, max_norm, skip_factor, options: dict) -> Mode:
    return MODE_CLASSES[mode](max_norm, skip_factor, options)


def mode_options_doc() -> str:
    """Each mode's options with their defaults and meaning, from the declarations (StepGuard's docstring)."""
    lines = []
    for name, cls in MODE_CLASSES.items():
        opts = ", ".join(f"{o.name}={o.default!r}" + (" (with skip_factor)" if o.spike_only else "")
                         for o in cls.OPTIONS) or "none"
        lines.append(f"            {name}: {opts}; max_norm: {cls.max_norm_is}"
                     + (f" (default {cls.max_norm_default:g})" if cls.max_norm_default is not None else ""))
    return "\n".join(lines)
