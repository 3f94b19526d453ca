"""One pass over a checked run's findings before anything is rendered, so that no two findings state
opposite facts and a weaker finding that a stronger cause explains does not stand beside it:

- the loss: ``stall`` (not improved, against its noise) and the findings that say the loss is improving
  (``small_but_learning``) or not (``decaying``'s "without the loss improving") agree. With a stall,
  ``small_but_learning`` is the ``vanishing`` it was downgraded from; without one, while the loss improves,
  ``decaying`` is likely convergence (a notice that says so), never "training has stalled";
- a clip applied to still-scaled AMP gradients (``clip_scaled``) makes the update tiny: the small-gradient
  findings (``vanishing``, ``low``, ``small_but_learning``) are that clip's effect, not the model's, and go.

Per-rule facts (a NaN loss at steps a StepGuard skipped is reported as protected) are decided by the rules
themselves; this pass only reconciles findings with each other."""

from __future__ import annotations

import math

from .finding import Finding, fmt
from .rules.trends import loss_progress

__all__ = ["reconcile"]

#: what a clip of still-scaled gradients explains
_SCALED_CLIP_EXPLAINS = {"vanishing", "low", "small_but_learning"}


def reconcile(findings: list[Finding], losses: list[float], th) -> list[Finding]:
    """``findings`` made consistent (see the module docstring); ``losses``: the last series' finite losses."""
    codes = {f.code for f in findings}
    out = []
    improving = "stall" not in codes and bool(loss_progress(losses, th.loss_progress)) if losses else False
    for f in findings:
        if "clip_scaled" in codes and f.code in _SCALED_CLIP_EXPLAINS:
            continue
        if f.code == "small_but_learning" and "stall" in codes:
            f.code, f.severity, f.title = "vanishing", "warning", "vanishing, and the loss is not improving"
            f.detail = f.detail.split(";")[0] + "; the loss has not improved (see stall)."
        if f.code == "decaying":
            if improving:
                f.severity = "notice"
                f.evidence["variant"] = "converging"
                if "likely convergence" not in f.detail:
                    f.detail += " The loss is improving, so this is likely convergence."
            elif "stall" not in codes and losses:
                f.detail += (f" The loss went {fmt(losses[0])} -> {fmt(losses[-1])}."
                             if all(map(math.isfinite, (losses[0], losses[-1]))) else "")
        out.append(f)
    return out
