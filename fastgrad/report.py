"""``fastgrad.report``: where ``GradientReport`` and ``gradient_report`` have always been imported from. The code
lives in ``fastgrad.diagnose`` (``report``: the report; ``rules``: its statuses; ``render``: its renderings);
this module re-exports its public names."""

from .diagnose.collect.snapshot import LayerRow, ParamRow, RowSparseRow
from .diagnose.finding import Finding
from .diagnose.report import GradientReport, gradient_report
from .diagnose.rules.trends import detect_loss_jumps, loss_progress, robust_jumps
from .diagnose.thresholds import SEVERITIES, Thresholds

__all__ = ["Thresholds", "Finding", "ParamRow", "LayerRow", "RowSparseRow", "GradientReport", "gradient_report",
           "loss_progress", "detect_loss_jumps", "robust_jumps", "SEVERITIES"]
