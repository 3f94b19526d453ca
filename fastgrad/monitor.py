"""``fastgrad.monitor``: where ``GradientMonitor`` and ``detect_trends`` have always been imported from. The code
lives in ``fastgrad.diagnose`` (``monitor``; its device buffers in ``collect.history``, its rules in
``rules.trends``); this module re-exports its public names."""

from .diagnose.monitor import GradientMonitor
from .diagnose.rules.trends import detect_trends

__all__ = ["GradientMonitor", "detect_trends"]
