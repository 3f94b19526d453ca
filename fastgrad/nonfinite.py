"""``fastgrad.nonfinite``: where ``find_nonfinite`` has always been imported from; the code lives in
``fastgrad.diagnose.collect.nonfinite``."""

from .diagnose.collect.nonfinite import NonFiniteEntry, NonFiniteReport, find_nonfinite

__all__ = ["NonFiniteEntry", "NonFiniteReport", "find_nonfinite"]
