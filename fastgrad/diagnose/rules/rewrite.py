"""``update_rewrote``: a measured update moved an optimizer's weights by ``RunLimits.blowup_update`` (1x) of
their own size or more (``||after - before|| / ||before||`` over the whole model, at the steps the checker
measures: every one of the first 8, then every 16th). Such a step replaces the weights instead of adjusting
them (about 1e-3 is typical); it is the learning rate's gravest harm whether or not the loss recovers after it.
The same list of steps is the ``rewrite`` harm other findings quote (``rules.evidence.harm_of``)."""

from __future__ import annotations

from ..finding import Finding, fmt
from .base import Rule, RunView
from .evidence import harm_of

__all__ = ["UpdateRewrote", "UPDATE_REWROTE"]


class UpdateRewrote(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        out = []
        for k in run.per:
            rw = harm_of(run, k).rewrites
            if not rw:
                continue
            s, ratio = max(rw, key=lambda t: t[1])
            first = rw[0][0]
            lr = run.lr_at(k, first)
            measured = sum(1 for u in run.ctx.get("updates") or () if u["series"] == k)
            run.key_steps.add(first)
            at = "" if lr is None else f" with a learning rate of {lr:g}"
            out.append(Finding(
                self.code, "warning",
                f"{run.label(k)}an update rewrote the weights: {fmt(ratio)}x their own size at step {s}",
                f"{run.label(k)}{len(rw)} of the {measured} measured update(s) moved the weights by "
                f"{fmt(run.limits.blowup_update)}x their own size or more, first at step {first}{at} (steps "
                + ", ".join(f"{st}: {fmt(v)}x" for st, v in rw[:6]) + (", ..." if len(rw) > 6 else "")
                + "; about 1e-3 is typical). A step that size replaces what the weights had learnt instead of "
                "adjusting it: the learning rate is too high for this model at those steps, whether or not the "
                "loss recovers after them.",
                steps=[st for st, _ in rw], evidence={"series": k, "rewrite": [s, ratio], "first_step": first,
                                                      "lr": lr, "count": len(rw), "measured": measured}))
        return out


UPDATE_REWROTE = UpdateRewrote(
    "update_rewrote", "warning", "the measured update/weight ratios and each step's learning rate, per optimizer",
    "a measured update moved an optimizer's weights by 1x their own size or more")
