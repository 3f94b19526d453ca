"""What the framework adapters share: the optional import, and the guard's counters as loggable numbers."""

from __future__ import annotations

import importlib


def require(module: str, package: str, what: str):
    """Import ``module`` or raise ImportError naming the pip package that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs the '{package}' package, which is not installed: pip install {package}"
                          ) from e


def counters(guard, prefix: str) -> dict[str, float]:
    """The guard's counters and last norms as plain numbers (ONE device-to-host transfer), named for a
    logger; empty before the first clip."""
    st = guard.state()
    keys = ("steps", "skipped_steps", "nonfinite_steps", "spike_steps", "clipped_steps", "consecutive_skipped",
            "total_norm", "clipped_norm")
    return {f"{prefix}{k}": float(st[k]) for k in keys if k in st}
