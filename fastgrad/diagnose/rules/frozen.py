"""``frozen_in_optimizer``: tensors handed to an optimizer that has never been able to train them, because they
are frozen (``requires_grad`` False) at every step the run sampled.

Freezing is the script's choice and not a finding by itself (the summary names frozen tensors). But a
deliberate freeze builds the optimizer from what trains; an optimizer given the frozen tensors was built as if
they were to learn, which is how a stray ``requires_grad_(False)`` (a line left from a fine-tuning run, a loop
that froze the wrong part) shows. Said at notice: a working setup that passes ``model.parameters()`` around a
frozen backbone reads the same, and the notice only asks."""

from __future__ import annotations

from ..finding import Finding
from .base import Rule, RunView

__all__ = ["FrozenInOptimizer", "FROZEN_IN_OPTIMIZER"]


class FrozenInOptimizer(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        held = run.ctx.get("frozen_held") or {}
        if not held:
            return []
        names = list(held)
        series = held[names[0]]
        who = run.names[series] if series < len(run.names) else "the optimizer"
        trains = sum(1 for v in (run.ctx.get("live") or {}).values() if v[0] == series)
        return [Finding(
            self.code, "notice", f"{len(names)} frozen tensor(s) handed to {who}, which never trains them",
            f"{len(names)} tensor(s) in the parameter groups of {who} had requires_grad=False at every step the run "
            f"sampled, so they never got a gradient and kept their values, while {trains} other tensor(s) of it "
            "trained. An optimizer is given what it should train: if the freeze is deliberate (a pretrained part "
            "kept as it is), build the optimizer from the trainable parameters; if not, remove the "
            "requires_grad_(False) (a line left from a fine-tuning run, a loop that froze the wrong part).",
            names, [], {"frozen": names, "series": series, "trainable": trains})]


FROZEN_IN_OPTIMIZER = FrozenInOptimizer(
    "frozen_in_optimizer", "notice", "each optimizer's parameters' requires_grad at the sampled steps",
    "tensors in an optimizer's parameter groups that are frozen (requires_grad False) at every sampled step of "
    "that optimizer")
