"""``weight_decay_drag``: an optimizer's weight decay drags its weights to zero. Two facts of the run, both
needed: the pull the decay alone adds each step, lr x weight_decay (the largest over the steps and the param
groups, as the optimizer held them), is at least ``RunLimits.decay_pull`` (1e-2: 100x what AdamW at lr 1e-3 and
weight_decay 0.1 pulls); and the weights' norm, measured at the sampled update steps, fell to
``RunLimits.decay_fall`` of its first measured value or below. Decoupled (AdamW) or added to the gradient
(SGD, Adam), the weights shrink by about that share each step whatever the gradient says, so the model is
pulled towards zero faster than the loss can hold it up. A warning: the run trains a model the decay keeps
erasing. The stall, the vanishing gradients across depth and the oversized update ratios of weights near zero
are its effects: the stall (whose advice would move the learning rate) is not reported beside it."""

from __future__ import annotations

import math

from ..finding import Finding, fmt
from .base import Rule, RunView

__all__ = ["WeightDecayDrag", "WEIGHT_DECAY_DRAG", "decay_drag"]


def decay_drag(pull: float, norms: list[tuple[int, float]], *, least_pull: float, fall: float) -> dict | None:
    """``{"first", "last", "share"}`` (the first and the last measured weights' norms, with their steps, and
    last / first) when ``pull`` (lr x weight_decay) is at least ``least_pull`` and the norms (``(step, norm)``,
    finite, oldest first) fell to ``fall`` of the first or below; else None."""
    norms = [(s, v) for s, v in norms if math.isfinite(v)]
    if pull < least_pull or len(norms) < 2 or norms[0][1] <= 0:
        return None
    share = norms[-1][1] / norms[0][1]
    return {"first": norms[0], "last": norms[-1], "share": share} if share <= fall else None


class WeightDecayDrag(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        out, lim = [], run.limits
        for k, (pull, wd, kind) in sorted((run.ctx.get("decay") or {}).items()):
            norms = [(u["step"], u["weight_norm"]) for u in run.ctx.get("updates") or ()
                     if u["series"] == k and "weight_norm" in u]
            d = decay_drag(pull, norms, least_pull=lim.decay_pull, fall=lim.decay_fall)
            if d is None:
                continue
            (s0, v0), (s1, v1) = d["first"], d["last"]
            out.append(Finding(
                self.code, "warning", f"{run.label(k)}weight decay drags the weights to zero",
                f"{run.label(k)}{kind}'s weight_decay={wd:g} at its learning rate pulls the weights by "
                f"{fmt(pull)} of their size each step (lr x weight_decay; about 1e-4 or less is usual), whatever "
                f"the gradient says: the weights' norm fell from {fmt(v0)} at step {s0} to {fmt(v1)} at step {s1} "
                f"({fmt(d['share'])}x). A stalled loss, gradients vanishing across the layers and update ratios "
                "near 1 of weights near zero follow from it.",
                steps=[s0, s1], evidence={"series": k, "pull": pull, "weight_decay": wd, "optimizer": kind,
                                          "first": [s0, v0], "last": [s1, v1], "share": d["share"]}))
        return out


WEIGHT_DECAY_DRAG = WeightDecayDrag(
    "weight_decay_drag", "warning", "each optimizer's lr x weight_decay and the measured weights' norm",
    "an optimizer's lr x weight_decay is at least 0.01 a step and its measured weights' norm fell to half its "
    "first value or below", suppresses=("stall",))
