"""``lr_zero``: an optimizer whose learning rate was exactly 0 at every one of its steps (two or more): its
parameters never change, whatever the gradients say. A schedule that starts at 0 (warm-up) is not this: one
nonzero step is enough to stay quiet."""

from __future__ import annotations

from ..finding import Finding
from .base import Rule, RunView

__all__ = ["LrZero"]


class LrZero(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        out = []
        for k, recs in run.per.items():
            if len(recs) < 2 or any(r.lr is None or r.lr != 0 for r in recs):
                continue
            run.key_steps.add(recs[0].step)
            out.append(Finding(
                self.code, "warning",
                f"{run.label(k)}the learning rate is 0 at every step: nothing this optimizer owns changes",
                f"{run.label(k)}All {len(recs)} of its steps ran with lr=0 (first param group), so its parameters "
                "kept their initial values whatever the gradients were: the loss can only move through other "
                "optimizers or the data. A learning-rate argument or schedule that came out as 0 (an integer "
                "division, a warm-up that never ends, a scheduler stepped to its floor) is the usual cause.",
                steps=[r.step for r in recs][:1], evidence={"series": k, "count": len(recs)}))
        return out


LR_ZERO = LrZero("lr_zero", "warning", "each step's learning rate (first param group), per optimizer",
                 "an optimizer's learning rate was exactly 0 at every one of its steps (2 or more)",
                 needs=("lr",), min_steps=2)
