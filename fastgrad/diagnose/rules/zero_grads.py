"""``zero_grads``: one optimizer's gradients were exactly zero in every tensor (or absent) at its last steps,
judged per optimizer series: the step's update is zero, nothing that optimizer owns learns. Steps a clip
zeroed are ``clip_zeroes``/``exploding`` (overflow), not this."""

from __future__ import annotations

from ..finding import Finding, fmt
from .base import Rule, RunView
from .clip_zeroes import zeroed_by_clip

__all__ = ["ZeroGrads"]


def _zero(r) -> bool:
    return r.total_norm == 0 and r.nonfinite == 0 and not zeroed_by_clip(r) and not r.overflow


class ZeroGrads(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        out = []
        for k, recs in run.per.items():
            if not recs or not _zero(recs[-1]):
                continue
            # the run of zero steps that reaches the end of the series
            i = len(recs)
            while i > 0 and _zero(recs[i - 1]):
                i -= 1
            tail = recs[i:]
            if len(tail) < 2 and len(recs) > 1:
                continue  # one zero step at the end: the step report's no_learning covers it
            nonzero_before = recs[i - 1] if i > 0 else None
            run.key_steps.add(tail[0].step)
            none = all(r.numel == 0 for r in tail)
            what = "had no gradient at all" if none else "had every gradient exactly 0"
            out.append(Finding(
                self.code, "critical",
                f"{run.label(k)}" + ("no gradient reaches its parameters" if none else "every gradient is exactly zero")
                + f" from step {tail[0].step}: that optimizer learns nothing",
                f"{run.label(k)}{len(tail)} of its {len(recs)} step(s), from step {tail[0].step} to the end, {what}"
                + (f" (the step before, {nonzero_before.step}, had norm {fmt(nonzero_before.grad_norm)})"
                   if nonzero_before is not None else "")
                + ": its loss no longer reaches its parameters (a detached branch, an op whose derivative is 0 "
                  "such as round, sign or argmax, a frozen or disconnected network, a loss that does not depend "
                  "on them) or every unit it owns is dead.",
                [], [r.step for r in tail],
                {"series": k, "first_step": tail[0].step, "count": len(tail), "of": len(recs)}))
        return out


ZERO_GRADS = ZeroGrads(
    "zero_grads", "critical", "each step's norm and NaN/Inf count, per optimizer",
    "an optimizer's gradients are all exactly zero (or absent) over its last 2+ steps (not a clip's zeros)",
    ("no_learning",), needs=("grad_norm",))
