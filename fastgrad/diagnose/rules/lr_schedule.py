"""``lr_schedule``: the learning rate each step ran with (first param group, read before the step, as the
run's schedule set it) was not one that trains, judged per optimizer:

- negative at some step (critical): ``step()`` then moves the weights uphill, gradient ascent. The usual cause
  is a schedule run past its end (a linear decay ``1 - t / T`` stepped more than ``T`` times);
- collapsed (warning): after its peak it fell below ``RunLimits.lr_collapse`` of that peak and stayed there to the
  end, over at least ``RunLimits.lr_collapse_share`` of the steps: the updates stopped long before the run did.
  The usual cause is a schedule counted in epochs but stepped per batch. A schedule that reaches its floor only
  at its last steps (cosine annealing to 0) is not this.

A loss that stops improving or rises, and the norms that follow, are this finding's effects
(``consistency.link_causes``): the fix is the schedule, never a learning rate multiplied up or down by hand."""

from __future__ import annotations

from ..finding import Finding, fmt
from .base import Rule, RunView

__all__ = ["LrSchedule", "LR_SCHEDULE", "lr_trouble"]


def lr_trouble(lrs: list[tuple[int, float]], collapse: float, share: float) -> dict | None:
    """``lrs``: (step, lr) of one optimizer, in order. The first problem: ``{"variant": "negative", ...}`` at
    the first negative lr, else ``{"variant": "collapse", ...}`` when the lr stays below ``collapse`` x its peak
    from some step after the peak to the end, over at least ``share`` of the steps (and 2); else None."""
    if len(lrs) < 2:
        return None
    peak_step, peak = max(lrs, key=lambda t: t[1])
    neg = [(s, v) for s, v in lrs if v < 0]
    if neg:
        return {"variant": "negative", "step": neg[0][0], "lr": neg[0][1], "count": len(neg), "peak": peak,
                "peak_step": peak_step, "lowest": min(v for _, v in lrs)}
    if peak <= 0:
        return None  # 0 at every step: lr_zero
    i = len(lrs)
    while i > 0 and lrs[i - 1][1] < collapse * peak and lrs[i - 1][0] > peak_step:
        i -= 1
    n = len(lrs) - i
    if n < max(2, share * len(lrs)):
        return None
    return {"variant": "collapse", "step": lrs[i][0], "lr": lrs[i][1], "count": n, "peak": peak,
            "peak_step": peak_step, "last": lrs[-1][1]}


class LrSchedule(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        lim, out = run.limits, []
        for k, recs in run.per.items():
            t = lr_trouble([(r.step, r.lr) for r in recs if r.lr is not None], lim.lr_collapse,
                           lim.lr_collapse_share)
            if t is None:
                continue
            label, n = run.label(k), len(recs)
            run.key_steps.add(t["step"])
            ev = {"series": k} | t
            if t["variant"] == "negative":
                out.append(Finding(
                    self.code, "critical", f"{label}the learning rate went negative at step {t['step']}: each "
                    "step from there moves the weights uphill",
                    f"{label}The learning rate the optimizer stepped with was {fmt(t['lr'])} at step {t['step']} "
                    f"(its peak {fmt(t['peak'])} at step {t['peak_step']}; {t['count']} of its {n} steps below 0, "
                    f"down to {fmt(t['lowest'])}): a negative learning rate turns descent into ascent, so the loss "
                    "is driven up, not down. A schedule run past its end (a linear decay 1 - t/T stepped more than "
                    "T times, a lambda that crosses 0) is the usual cause.", steps=[t["step"]], evidence=ev))
            else:
                out.append(Finding(
                    self.code, "warning", f"{label}the learning rate collapsed from step {t['step']}: "
                    f"{fmt(t['peak'])} -> {fmt(t['last'])}",
                    f"{label}The schedule took the learning rate from {fmt(t['peak'])} (step {t['peak_step']}) to "
                    f"{fmt(t['lr'])} at step {t['step']}, below {lim.lr_collapse:g} of its peak, and it stayed there "
                    f"for the last {t['count']} of its {n} steps (ending at {fmt(t['last'])}): the updates stopped "
                    "long before the run did. A schedule counted in epochs but stepped once per batch, or a decay "
                    "factor applied at every step, is the usual cause.", steps=[t["step"]], evidence=ev))
        return out


LR_SCHEDULE = LrSchedule(
    "lr_schedule", "critical", "each step's learning rate (first param group), per optimizer",
    "an optimizer's learning rate went negative at some step (critical), or fell below 1e-3 of its peak and "
    "stayed there to the end over at least a quarter of its steps (a warning)")
