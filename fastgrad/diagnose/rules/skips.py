"""Steps kept out of the weights: ``guard_skipped`` (a fastgrad.StepGuard skipped them) and ``amp_skipped``
(a GradScaler found Inf/NaN and skipped them)."""

from __future__ import annotations

import math

from ..finding import Finding, fmt
from .base import Rule, RunView
from .buffers import buffers_bad
from .nonfinite import stuck_from

__all__ = ["GuardSkipped", "AmpSkipped"]


class GuardSkipped(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        guarded = run.guarded
        if not guarded:
            return []
        gbad = [r for r in guarded if not math.isfinite(r.grad_norm) or r.nonfinite > 0]
        sev = "warning" if gbad or len(guarded) * 10 > len(run.steps) else "notice"
        ev = ", ".join(f"{r.step} ({fmt(r.grad_norm)})" for r in guarded[:8]) + (" ..." if len(guarded) > 8 else "")
        return [Finding(
            self.code, sev, "steps skipped by the step guard",
            f"fastgrad.StepGuard kept {len(guarded)} of {len(run.steps)} step(s) out of the weights and the "
            f"optimizer state ({len(gbad)} with NaN/Inf gradients, {len(guarded) - len(gbad)} spikes); step (norm "
            f"before clipping): {ev}. " + _protection(run)
            + "; if skips keep coming, find their source (the data at those steps, the loss, the learning rate).",
            steps=[r.step for r in guarded],
            evidence={"count": len(guarded), "nonfinite": len(gbad)})]


def _protection(run: RunView) -> str:
    """What the skips protected: the run, or the weights and the optimizer state only (the buffers already
    held NaN/Inf, or no step trained after the NaN losses began: ``nonfinite.stuck_from``)."""
    if buffers_bad(run):
        return "The weights and the optimizer state are safe, the buffers are not (nonfinite_buffers)"
    stuck = stuck_from(run)
    if stuck is not None:
        return (f"The weights and the optimizer state are safe, but the loss was NaN/Inf at every step from step "
                f"{stuck} on: nothing trained after step {stuck - 1}")
    return "The run is protected"


class AmpSkipped(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        if not run.amp_skipped:
            return []
        return [Finding(self.code, "notice", "steps skipped by the GradScaler",
                        f"{run.amp_skipped} step(s) had Inf/NaN gradients and were skipped.",
                        evidence={"count": run.amp_skipped})]


GUARD_SKIPPED = GuardSkipped("guard_skipped", "warning", "the StepGuard's device flag at each step",
                             "steps a fastgrad.StepGuard kept out of the weights (warning: NaN/Inf or > 10%)",
                             needs=("script",))
AMP_SKIPPED = AmpSkipped("amp_skipped", "notice", "the GradScaler's step calls",
                         "steps the GradScaler skipped (normal while its scale settles)", needs=("script",))
