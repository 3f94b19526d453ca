"""``gradient_ascent``: the optimizer climbs the loss the script means to minimise. Two ways a script does that:

- ``negated``: the tensor passed to ``backward()`` is a loss function's output with its sign flipped
  (``-F.cross_entropy(...)``, ``loss * -1``, ``1 - loss``), read off the autograd graph on the host
  (``collect.loss_inputs.criterion_sign``) at ``RunLimits.ascent_share`` of the run's scalar backward calls,
  and no call backpropagates a loss function with its sign kept (a GAN whose critic minimises its loss while
  the generator maximises it, or a task loss minus an adversarial one, are meant that way);
- ``maximize``: an optimizer built with ``maximize=True`` steps on losses that are loss functions' outputs as
  returned (one optimizer: with several, the backward calls cannot be told apart).

A loss function (cross-entropy, MSE, BCE, ...) is at least 0 and is made to be minimised: climbing it is never
training. The harm the run itself shows sets the tier: the loss function's value rose against its own noise
(``rules.evidence.loss_change`` of the recorded losses: the recorded loss fell for a negated one) or went
non-finite: a warning; the sign alone, with no such rise yet: a notice. The norm's rise and spikes that follow
are effects, not reported beside it; an explosion it drives names it as its cause (``consistency``)."""

from __future__ import annotations

from ..finding import Finding, fmt
from .base import Rule, RunView
from .evidence import harm_of

__all__ = ["GradientAscent", "GRADIENT_ASCENT", "ascent_variant"]


def ascent_variant(signs: dict, maximize: list[bool], share: float) -> str | None:
    """``negated``, ``maximize`` or None, from the run's counts of scalar backward calls (``signs``: ``calls``,
    ``negated``, ``kept``: calls that reached a loss function with its sign flipped, kept) and each optimizer's
    ``maximize`` flag (see the module docstring)."""
    calls, neg, kept = signs.get("calls", 0), signs.get("negated", 0), signs.get("kept", 0)
    if not calls:
        return None
    if neg >= share * calls and kept == 0:
        return "negated"
    if len(maximize) == 1 and maximize[0] and kept >= share * calls and neg == 0:
        return "maximize"
    return None


class GradientAscent(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        signs = run.ctx.get("loss_signs") or {}
        maximize = list(run.ctx.get("maximize") or [])
        variant = ascent_variant(signs, maximize, run.limits.ascent_share)
        if variant is None:
            return []
        k = run.last_series
        recs = run.per.get(k, [])
        h = harm_of(run, k)
        ch = h.change or {}
        # the loss function's value rose: the recorded (negated) loss fell, or the maximised one rose
        rose = bool(ch.get("improved") if variant == "negated" else ch.get("rose"))
        node = (signs.get("node") or "a loss function").removesuffix("0").removesuffix("Backward")
        harm = []
        if rose:
            harm.append(f"the loss backpropagated went from {fmt(ch['first'])} (its first quarter's mean) to "
                        f"{fmt(ch['last'])} (its last quarter's): the loss function "
                        + ("under its minus sign rose" if variant == "negated" else "rose"))
        if h.nonfinite:
            harm.append(f"a NaN/Inf loss or gradient from step {h.nonfinite[0]}")
        ev = {"series": k, "variant": variant, "node": signs.get("node"), "calls": signs.get("calls", 0),
              "negated": signs.get("negated", 0), "kept": signs.get("kept", 0), "harm": harm}
        if variant == "negated":
            how = (f"{signs.get('negated', 0)} of the run's {signs.get('calls', 0)} backward calls were on {node}'s "
                   "output with its sign flipped (a minus sign, a negative factor, or 1 - loss), and none on a "
                   "loss function as it returned it: the optimizer minimises the negative of the loss, so it "
                   "climbs the loss")
        else:
            how = (f"the optimizer was built with maximize=True and every backward call was on a loss function's "
                   f"output as it returned it ({node}): it climbs the loss")
        first = recs[0].step if recs else None
        return [Finding(
            self.code, "warning" if harm else "notice", "gradient ascent: the optimizer climbs the loss",
            f"{how}. A loss function is made to be minimised." + (
                " Harm followed: " + "; ".join(harm) + "." if harm else
                " No rise of the loss function was seen yet: if climbing it is meant (an adversary's objective), "
                "this is intended.")
            + " The norm's growth that follows is its effect.",
            steps=[first] if first is not None else [], evidence=ev)]


GRADIENT_ASCENT = GradientAscent(
    "gradient_ascent", "warning", "the sign with which each backward call's loss functions enter the tensor it "
    "backpropagates, each optimizer's maximize flag, and the loss",
    "at 90% of the scalar backward calls, a loss function negated (and none as returned), or maximize=True on "
    "losses as returned: a notice, a warning when the loss function's value rose against its noise or went "
    "non-finite",
    needs=("loss",), suppresses=("spike", "increasing", "elevated", "decaying"))
