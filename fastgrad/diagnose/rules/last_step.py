"""The last step's own statuses (the step report's rules: NaN names, dead parameters, depth, the norm's range)
as run findings. The run-wide rules replace the step report's loss and range judgements (``exploding``,
``decaying``, ``nonfinite_loss``, ``loss_spike``), and where the last step's zeros were made by a clip (a bound
of 0, or a float32 overflow) its zero and small-gradient statuses are not about the model."""

from __future__ import annotations

from ..finding import Finding
from .base import Rule, RunView
from .clip_zeroes import zeroed_by_clip

__all__ = ["LastStep"]

_REPLACED = ("decaying", "nonfinite_loss", "exploding", "loss_spike")
_ZERO_OR_SMALL = ("no_learning", "dead", "mostly_zero", "vanishing", "low", "clipped_to_zero", "depth_vanishing",
                  "small_but_learning")


class LastStep(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        if run.last is None:
            return []
        used = run.used
        last = used[-1] if used else None
        by_clip = last is not None and (zeroed_by_clip(last) or last.overflow)
        return [f for f in run.last.findings
                if f.code not in _REPLACED and not (by_clip and f.code in _ZERO_OR_SMALL)]


LAST_STEP = LastStep(
    "last_step", "critical", "the last step's statistics (per parameter and layer)",
    "the step report's statuses of the last step: nonfinite, no_learning, dead, mostly_zero, depth_vanishing, "
    "vanishing/low/elevated (a clip's zeros are not judged as the model's)")
