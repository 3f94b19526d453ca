"""``spike``, ``increasing``, ``decaying``: the trends of each optimizer's norm before clipping
(``fastgrad.diagnose.rules.trends.detect_trends``), each series indexed by its own steps (its warm-up, its
baseline; hand-overs between optimizers are not spikes) and reported with the run's step numbers."""

from __future__ import annotations

import math

from ..finding import Finding
from .base import Rule, RunView
from .trends import detect_trends, loss_falling

__all__ = ["NormTrends"]


class NormTrends(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        out = []
        for k, recs in run.per.items():
            # the losses too: a norm that rises while the loss falls is how many healthy runs converge
            losses = [r.loss if r.loss is not None else math.nan for r in recs]
            tf = detect_trends(list(range(1, len(recs) + 1)), [r.grad_norm for r in recs], thresholds=run.th,
                               losses=losses)
            for f in tf:
                if f.code == "increasing" and f.severity == "warning" and recs and all(r.clipped for r in recs):
                    falling = loss_falling(list(range(1, len(recs) + 1)), losses, 1, len(recs))
                    if falling is not None:
                        # every update was bounded by the script's clip and the loss fell: not a divergence
                        f.severity, f.title = "notice", "gradient norm rising under the script's clip while the loss falls"
                        f.detail += (f" The loss fell {falling} and the script clipped every step, so no update grew "
                                     "with it: not a divergence by itself.")
            glob = {i: r.step for i, r in enumerate(recs, 1)}
            for f in tf:
                f.steps = [glob.get(s, s) for s in f.steps]
                if run.multi:
                    f.title = f"{run.names[k]}: {f.title}"
                    f.detail = f"{run.names[k]} (its own step count): {f.detail}"
                f.evidence["series"] = k
                run.key_steps |= set(f.steps[:3])
            out += tf
        return out


NORM_TRENDS = NormTrends(
    "spike/increasing/decaying", "warning", "each step's norm before clipping, per optimizer",
    "spike: > 6 robust std and 3x above the recent median (warning from 5x); increasing: four rising quarter "
    "medians, 2x overall (a notice while the loss falls inside the healthy range, or under a clip of every step); decaying: four falling quarter medians ending below 1e-3 (or 1000x down and below 0.1)")
