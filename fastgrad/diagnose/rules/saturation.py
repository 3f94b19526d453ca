"""``saturated_at_init``: at the first forward, before any update, a tanh or sigmoid layer had at least
``RunLimits.saturated_share`` (half) of its outputs on the activation's flat tails, where its slope is below
``RunLimits.saturated_slope`` (2%) of its largest (``collect.saturation``). On the weights the script built,
that is the initialisation's scale (or unnormalised inputs): an exploding initialisation of a deep tanh stack
puts most units there, each passes back under 2% of its gradient, and the gradients of the layers before it
grow with the depth of the stack while its signal is scrambled. Nothing the run did caused it, and no norm need be
out of the guide's range to show it.

A warning when the loss did not improve over the run, as ``stall`` judges it (evaluated before this rule: its
finding is the harm, and follows from this one in the report); else a notice (the run learnt anyway, more slowly
than it could)."""

from __future__ import annotations

from ..finding import Finding, fmt
from .base import Rule, RunView

__all__ = ["SaturatedAtInit", "SATURATED_AT_INIT", "saturated"]


def saturated(layers: list[dict], share: float) -> list[dict]:
    """The layers (``{"module", "type", "share", ...}``) with at least ``share`` of their outputs saturated."""
    return [x for x in layers if x["share"] >= share]


class SaturatedAtInit(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        seen = run.ctx.get("saturation") or []
        hit = saturated(seen, run.limits.saturated_share)
        if not hit:
            return []
        stuck = "stall" in run.codes()
        kinds = sorted({x["type"] for x in hit})
        shown = ", ".join(f"{x['module']} ({x['type']}) {x['share']:.0%}" for x in hit[:6]) + \
            (", ..." if len(hit) > 6 else "")
        return [Finding(
            self.code, "warning" if stuck else "notice",
            f"{'/'.join(kinds)} saturated at initialisation: {len(hit)} of {len(seen)} layer(s)",
            f"At the first forward, on the weights the script built (before any update), {len(hit)} of the "
            f"{len(seen)} {'/'.join(sorted({x['type'] for x in seen}))} layer(s) had "
            f"{fmt(run.limits.saturated_share * 100)}% or more of their outputs where the activation is flat (its "
            f"slope under {fmt(run.limits.saturated_slope * 100)}% of its largest): {shown}. Those units pass "
            "back almost none of their gradient and carry little of the input forward: the initialisation's "
            "scale (or the inputs') is too large for the activation. "
            + ("The loss did not improve over the run (see stall)." if stuck else
               "The run learnt anyway, more slowly than a network whose units are in range."),
            layers=[x["module"] for x in hit], steps=[1],
            evidence={"layers": {x["module"]: x["share"] for x in hit}, "seen": len(seen), "stuck": stuck})]


SATURATED_AT_INIT = SaturatedAtInit(
    "saturated_at_init", "warning", "the outputs of every tanh/sigmoid module at the first forward, before any update",
    "half or more of a tanh or sigmoid layer's outputs sat on its flat tails (slope under 2% of its largest) at the "
    "first forward: the initialisation's scale, or unnormalised inputs", needs=("tensors",))
