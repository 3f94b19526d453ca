"""``spike``, ``increasing``, ``decaying``: the trends of each optimizer's norm before clipping
(``fastgrad.diagnose.rules.trends.detect_trends``), each series indexed by its own steps (its warm-up, its
baseline; hand-overs between optimizers are not spikes) and reported with the run's step numbers.

A spike is a warning from ``RunLimits.far_ratio`` (10x) its recent median with damage at a spike of that size
(NaN/Inf from it on, a loss that jumps at the step after to above its own, an update of 1x the weights there);
without damage, or below that ratio, a notice. A rising norm is a warning only with harm the run shows
(``rules.evidence``: NaN/Inf, a loss that jumps or rises beyond its noise, an update that rewrites the weights);
without it, a notice: a policy gradient's norm grows with its episodes while it learns, a converging model's as
it sharpens."""

from __future__ import annotations

import math

from ..finding import Finding
from .base import Rule, RunView
from .evidence import RISE_REASON, harm_of
from .trends import detect_trends

__all__ = ["NormTrends", "WARMUP"]

#: steps of a series never judged by the trends (early training is allowed to move fast)
WARMUP = 20


class NormTrends(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        out = []
        for k, recs in run.per.items():
            # the losses too: a norm that rises while the loss falls is how many healthy runs converge
            losses = [r.loss if r.loss is not None else math.nan for r in recs]
            # the run's step numbers (every finding and the report's table count steps across all optimizers),
            # with the warm-up counted in this series' own steps
            if not recs:   # an optimizer none of whose steps is read: no trend to judge
                continue
            steps = [r.step for r in recs]
            warm = steps[min(WARMUP, len(steps)) - 1]
            tf = detect_trends(steps, [r.grad_norm for r in recs], thresholds=run.th,
                               losses=losses, warmup=warm, warn_ratio=run.limits.far_ratio)
            for f in tf:
                if f.code == "increasing":
                    _judge_rise(f, run, k, [r.step for r in recs[WARMUP:]])
            for f in tf:
                if f.code == "spike" and f.severity == "warning":
                    _judge_spike(f, run, k)
                if run.multi:
                    f.title = f"{run.names[k]}: {f.title}"
                    f.detail = f"{run.names[k]}: {f.detail}"
                f.evidence["series"] = k
                run.key_steps |= set(f.steps[:3])
            out += tf
        return out


def _judge_spike(f: Finding, run: RunView, k: int) -> None:
    """A spike of ``RunLimits.far_ratio`` or more stays a warning only with damage at it (in place): NaN/Inf from
    it on, the loss jumping at the step after (the update it drove), or a measured update of 1x the weights there. A gradient
    spike that a clip bounded, or that Adam's normalisation absorbed, leaves the loss where it was: a notice."""
    h = harm_of(run, k)
    # the damage of the spikes that make it a warning: a loss jump after one of the many 3x spikes of a
    # replay-buffer run is not the doing of its 13x one
    big = [s for s in f.steps if h.far(s) is not None]
    near = set(big) | h.following(big)
    harm = [(kind, t) for kind, t in h.at(big, far=False) if kind in ("nonfinite", "loss_jump")]
    rw = [(s, r) for s, r in h.rewrites if s in near]
    if rw:
        s, r = max(rw, key=lambda t: t[1])
        harm.append(("rewrite", f"the update moved the weights by {r:.3g}x their own size (step {s})"))
    f.evidence["harm"] = [kind for kind, _ in harm]
    if harm:
        f.detail += " Damage the run shows: " + "; ".join(text for _, text in harm) + "."
        return
    f.severity = "notice"
    f.title += ", with no damage seen"
    f.detail += (" No damage seen: the loss did not jump after it, nothing went NaN/Inf and no measured "
                 "update there rewrote the weights (a clip, or an adaptive optimizer, bounds the step).")


def _judge_rise(f: Finding, run: RunView, k: int, steps: list[int]) -> None:
    """A rising norm's severity from the harm over the steps it was judged on (in place)."""
    h = harm_of(run, k)
    harm = h.at(steps, far=False)
    f.evidence["harm"] = [kind for kind, _ in harm]
    if harm:
        f.severity, f.title = "warning", "gradient norm steadily increasing, with harm"
        f.detail += " Harm the run shows: " + "; ".join(text for _, text in harm) + "."
        return
    f.severity = "notice"
    if "inside the healthy range" in f.title:  # the trend rule's own notice: its words stand
        return
    f.title = "gradient norm rising, with no harm seen"
    f.detail += (" No harm seen: " + h.loss_words() + ", nothing went NaN/Inf and " + h.rewrite_words() + "."
                 + RISE_REASON)


NORM_TRENDS = NormTrends(
    "spike/increasing/decaying", "warning", "each step's norm before clipping, per optimizer",
    "spike: > 6 robust std and 3x above the recent median (a notice; a warning from 10x with damage at it: "
    "NaN/Inf, a loss jump at the step after, an update of 1x the weights there); increasing: four "
    "rising quarter medians, 2x overall (a warning with harm the run shows: NaN/Inf, a loss that jumps or rises "
    "beyond its noise, an update of 1x the weights; else a notice); decaying: four falling quarter medians "
    "ending below 1e-3 (or 1000x down and below 0.1)", needs=("grad_norm",), min_steps=WARMUP + 1)
