"""``accum_not_divided``: an optimizer whose steps each follow k >= 2 backward calls (a window of micro-batches)
where every tensor passed to ``backward()`` is a loss function's output as it returned it (its ``grad_fn`` is
the loss's own node: no division or multiplication after it), and the same loss each time. The window's
gradient is then the sum of k micro-batch gradients, k times their mean: the optimizer steps as if its learning
rate were k times larger, and changing k changes the training. Judged on ``RunLimits.accum_share`` of the
optimizer's steps; one optimizer only (a GAN backpropagates its critic's real and fake halves apart, two losses
rather than a window). A notice; a warning where the run shows harm from the first step on
(``rules.evidence.harm_of``: a NaN/Inf, a loss that rose or jumped, an update that rewrote the weights, a norm
far above its own level). A loss the script means to sum (its learning rate tuned for the sum) is the one
case this misreads, and the finding says so."""

from __future__ import annotations

from collections import Counter

from ..finding import Finding
from .base import Rule, RunView
from .evidence import harm_of

__all__ = ["AccumNotDivided", "ACCUM_NOT_DIVIDED", "summed_windows"]


def summed_windows(windows, steps: set[int]) -> tuple[int, str, int] | None:
    """``(k, loss node, steps)`` when the windows of ``steps`` (``(step, backward calls, of them straight from a
    loss function, that node)``) are mostly k >= 2 calls all straight from one loss, else None."""
    mine = [w for w in windows if w[0] in steps]
    hits = [w for w in mine if w[1] >= 2 and w[2] == w[1] and w[3] not in (None, "mixed")]
    if not hits:
        return None
    (k, node), n = Counter((w[1], w[3]) for w in hits).most_common(1)[0]
    return k, node, n


class AccumNotDivided(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        if run.multi or run.manual:
            return []
        k = run.last_series
        recs = run.per.get(k, [])
        if not recs:
            return []
        got = summed_windows(run.ctx.get("windows") or (), {r.step for r in recs})
        if got is None or got[2] < run.limits.accum_share * len(recs):
            return []
        window, node, n = got
        first = recs[0].step
        harm = harm_of(run, k).at([first])
        fn = node.removesuffix("0").removesuffix("Backward")
        ev = {"series": k, "window": window, "node": node, "steps": n, "of": len(recs),
              "harm": [kind for kind, _ in harm]}
        return [Finding(
            self.code, "warning" if harm else "notice",
            f"a loss summed over {window} accumulation steps, not averaged",
            f"At {n} of the {len(recs)} optimizer steps, {window} backward calls ran before the step, each on a "
            f"loss function's output as it returned it ({fn}, not divided by {window}): the step's gradient is "
            f"the sum of the {window} micro-batch gradients, {window}x their mean, as if the learning rate were "
            f"{window}x larger (and changing the window changes the training)."
            + (" Harm followed: " + "; ".join(t for _, t in harm) + "." if harm else "")
            + " If the learning rate was tuned for the sum, this is intended.",
            steps=[first], evidence=ev)]


ACCUM_NOT_DIVIDED = AccumNotDivided(
    "accum_not_divided", "warning", "the backward calls between an optimizer's steps and the node each "
    "backpropagated",
    "at 90% of one optimizer's steps, k >= 2 backward calls each on a loss function's output as returned (not "
    "divided by k): a notice, a warning with harm from the first step")
