"""``clip_zeroes``: a clip that set every gradient to zero (a bound of 0, or a finite nonzero norm clipped to
a zero update), so nothing learns; not frozen parameters or dead units. An inf norm zeroed by the clip is
the float32 overflow of ``exploding``, not this."""

from __future__ import annotations

import math

from ..finding import Finding, fmt
from .base import Rule, RunView

__all__ = ["ClipZeroes"]


def zeroed_by_clip(r) -> bool:
    return r.clipped and (r.clip_max == 0 or (r.clip_norm is not None and math.isfinite(r.clip_norm)
                                              and r.clip_norm > 0 and r.total_norm == 0))


class ClipZeroes(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        hit = [r for r in run.used if zeroed_by_clip(r)]
        if not hit:
            return []
        r0 = hit[0]
        run.key_steps.add(r0.step)
        bound = "max_norm=0" if r0.clip_max == 0 else (
            f"max_norm={fmt(r0.clip_max)}" if r0.clip_max is not None else "its bound")
        return [Finding(
            self.code, "critical", f"the gradient clip ({bound}) sets every gradient to zero: no learning",
            f"At {len(hit)} step(s) the clip call got a gradient norm of {fmt(r0.clip_norm)} (step {r0.step}) "
            f"and the step then saw a norm of {fmt(r0.total_norm)}: the parameters are not frozen and the units "
            "are not dead, the clip zeroes the update.", steps=[r.step for r in hit],
            evidence={"first_step": r0.step, "count": len(hit), "max_norm": r0.clip_max,
                      "norm_before": r0.clip_norm})]


CLIP_ZEROES = ClipZeroes(
    "clip_zeroes", "critical", "each step's clip bound, its return and the norm the update used",
    "a clip with max_norm 0 (or a finite nonzero norm clipped to a zero update) zeroed the gradients",
    ("no_learning", "dead", "mostly_zero", "vanishing", "low", "clipped_to_zero", "depth_vanishing"), needs=("script",))
