"""``probabilities_into_ce``: the script handed probabilities to a cross-entropy that applies its own
log-softmax (``F.cross_entropy(torch.softmax(z, 1), y)``, ``nn.CrossEntropyLoss()(probs, y)``, a model that ends
in ``nn.Softmax``). The evidence is the loss call itself: check counts the calls whose input was a softmax's
output (its ``grad_fn``) or whose rows lie in [0, 1] and sum to 1 within ``RunLimits.prob_row_tol``; at least
``RunLimits.prob_share`` of the run's cross-entropy calls must have been such.

A softmax of values in [0, 1] is nearly flat: for K classes the loss cannot go below -1 + ln(e + K - 1), the
loss of a one-hot probability row (1.46 for K = 10, against ln K = 2.30 at chance), and the gradients shrink as
the probabilities saturate. The finding quotes the run's loss against that floor. A warning: the model trains
against the wrong objective whatever its loss does. The low gradients, the stall and the norm's moves that
follow are effects of it, and are not reported beside it (``suppresses``)."""

from __future__ import annotations

import math

from ..finding import Finding, fmt
from .base import Rule, RunView, finite

__all__ = ["ProbabilitiesIntoCE", "PROBABILITIES_INTO_CE", "ce_floor"]


def ce_floor(classes: int) -> float:
    """The least cross-entropy over ``classes`` classes of an input row of probabilities: a one-hot row,
    log-softmaxed, scores -1 + ln(e + K - 1)."""
    return -1.0 + math.log(math.e + classes - 1)


class ProbabilitiesIntoCE(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        ce = run.ctx.get("ce_inputs") or {}
        calls = ce.get("calls", 0)
        got = max(ce.get("probabilities", 0), ce.get("softmax", 0))
        if not calls or got < run.limits.prob_share * calls:
            return []
        classes = run.ctx.get("classes")
        k = run.last_series
        recs = run.per.get(k, [])
        losses = finite([r.loss for r in recs])
        first = recs[0].step if recs else None
        ev = {"series": k, "calls": calls, "probabilities": ce.get("probabilities", 0),
              "softmax": ce.get("softmax", 0), "classes": classes}
        how = (f"{got} of the run's {calls} cross-entropy call(s) were handed "
               + ("a softmax's output" if ce.get("softmax", 0) >= ce.get("probabilities", 0) else
                  "rows of probabilities (each in [0, 1], summing to 1)"))
        stuck = ""
        if classes and classes > 1:
            floor, chance = ce_floor(classes), math.log(classes)
            ev.update(floor=floor, chance=chance)
            if len(losses) >= 4:
                q = max(1, len(losses) // 4)
                last = sum(losses[-q:]) / q
                ev["last_mean"] = last
                stuck = (f" The loss's last quarter averages {fmt(last)}, above the floor of {fmt(floor)} that such "
                         f"an input cannot go below for {classes} classes (-1 + ln(e + {classes} - 1); chance is "
                         f"ln({classes}) = {fmt(chance)}).")
            else:
                stuck = f" Such an input cannot score below {fmt(floor)} for {classes} classes."
        return [Finding(
            self.code, "warning", "probabilities fed to a cross-entropy that applies its own softmax",
            f"{how}. cross_entropy applies log_softmax to its input, so it softmaxes the probabilities again: the "
            f"second softmax of values in [0, 1] is nearly flat, the loss is stuck above a floor and the gradients "
            f"shrink as the probabilities saturate.{stuck} The low gradients and a stalled loss follow from "
            "it; they are not the learning rate's.",
            steps=[first] if first is not None else [], evidence=ev)]


PROBABILITIES_INTO_CE = ProbabilitiesIntoCE(
    "probabilities_into_ce", "warning", "the inputs of the script's cross-entropy calls and the loss",
    "at least half of the run's cross_entropy calls were handed probabilities (a softmax's output, or rows in "
    "[0, 1] summing to 1) instead of logits",
    suppresses=("low", "vanishing", "small_but_learning", "spike", "increasing", "stall"))
