"""``stall``: the loss has not improved over the run (the last ``RunLimits.stall_window`` losses of one
optimizer), judged against its own noise and, for a cross-entropy, against chance level.

The first and the last quarter of the window are compared by their means. Their difference counts as an
improvement only when it exceeds ``stall_z`` standard errors (the step-to-step noise: the scaled MAD of the
successive differences about their mean over sqrt(2), which a steady trend does not inflate) and the share of the level that
``Thresholds.loss_progress`` asks of a "loss improving" everywhere else. A loss that rose by more than that has
not improved either: a stall, unless ``loss_diverging`` judges the rise. A cross-entropy's chance level is ln(classes): a loss that ends
within ``stall_chance`` of it learned nothing a uniform guess does not know; one whose last quarter is not below its
first loss by the change that counts has not improved, even when a blow-up in between made its first quarter's
mean higher; nor has one that fell from above chance only to it, not below it by that change (it learnt the
uniform guess, not the input). A notice, or a warning when the
loss is flat to ``stall_flat`` of its level (it does not even wiggle: the updates do not reach it) or when the
measured updates are below ``stall_tiny_update`` of the weights (the learning rate cannot move them); never
critical, the run may still be right (a loss that cannot fall: labels without signal)."""

from __future__ import annotations

import math

from ..finding import Finding, fmt
from .base import Rule, RunView
from .evidence import loss_change, tiny_update, update_size

__all__ = ["Stall", "loss_stall"]


def loss_stall(losses: list[float], *, window: int, z: float, rel: float, chance: float | None = None,
               chance_share: float = 0.0) -> dict | None:
    """``loss_change`` of ``losses`` (finite, oldest first) when they did not improve over their last ``window``
    values (see the module docstring), else None. With ``chance`` (ln(classes) of a cross-entropy), the dict also
    says ``at_chance`` (the last quarter within ``chance_share`` of it) and ``back`` (improved on the first quarter,
    but at chance and not below the first loss by the change that counts: a stall too)."""
    c = loss_change(losses, window=window, z=z, rel=rel)
    c["at_chance"] = chance is not None and abs(c["last"] - chance) <= chance_share * chance
    # a blow-up and its recovery make the first quarter's mean high: a "fall" back to chance learned nothing
    c["back"] = c["at_chance"] and c["improved"] and losses[-c["n"]] - c["last"] <= c["need"]
    # a fall from above chance that ends at it, no lower by the change that counts: the model learnt the uniform
    # guess (a freshly initialised head scores above ln(classes)) and nothing about the input
    c["to_chance"] = c["at_chance"] and c["improved"] and chance - c["last"] <= c["need"]
    return None if c["improved"] and not (c["back"] or c["to_chance"]) else c


class Stall(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        lim, out = run.limits, []
        if run.codes() & {"nonfinite_loss", "nonfinite_history", "loss_diverging", "zero_grads", "clip_zeroes",
                          "lr_zero"}:
            return []  # a stronger cause explains a loss that does not fall
        for k, recs in run.per.items():
            pts = [(r.step, r.loss) for r in recs if r.loss is not None and math.isfinite(r.loss)]
            if len(pts) < lim.stall_min_steps or run.multi:
                continue  # adversarial and actor-critic losses are not meant to fall: one series only
            vals = [v for _, v in pts]
            classes = run.ctx.get("classes")
            chance = math.log(classes) if classes and classes > 1 else None
            s = loss_stall(vals, window=lim.stall_window, z=lim.stall_z, rel=run.th.loss_progress, chance=chance,
                           chance_share=lim.stall_chance)
            if s is None:
                continue
            at_chance, back, v0 = s["at_chance"], s["back"], vals[-s["n"]]
            steps = [st for st, _ in pts[-s["n"]:]]
            level = abs(s["last"]) or 1.0
            flat = s["noise"] <= lim.stall_flat * level and abs(s["drop"]) <= lim.stall_flat * level
            lr = run.lr_at(k, steps[0])  # the lr in force when the window began, as the schedule set it
            upd, _ = update_size(run, k)
            tiny = tiny_update(upd, lim)
            large = upd is not None and upd > lim.stall_large_update
            ev = {"series": k, "first_step": steps[0], "last_step": steps[-1], "window": s["n"],
                  "first_mean": s["first"], "last_mean": s["last"], "noise": s["noise"], "se": s["se"],
                  "lr": lr, "classes": classes, "chance": chance, "at_chance": at_chance, "back": back, "to_chance": s["to_chance"], "flat": flat,
                  "update_ratio": upd, "tiny_update": tiny}
            if tiny or large:  # the advice follows the update size: raise the learning rate, or lower it
                ev["variant"] = "tiny_update" if tiny else "large_update"
            label = run.label(k)
            moved = f"fell {fmt(s['drop'])}" if s["drop"] > 0 else f"rose {fmt(-s['drop'])}"
            why = (f"it {moved}, but only back to where it began: its first loss was {fmt(v0)}" if back else
                   f"it {moved}, but only down to chance and no lower: a uniform guess scores as well" if
                   s["to_chance"] else
                   f"flat: it {moved} and its step-to-step noise is {fmt(s['noise'])}" if flat else
                   f"it {moved}, beyond its step-to-step noise ({fmt(s['noise'])}) but short of the 3x rise that "
                   "would be a divergence" if s["rose"] else
                   f"it {moved}, less than {fmt(lim.stall_z)} standard errors of that difference ({fmt(lim.stall_z)} x "
                   f"{fmt(s['se'])}, from a step-to-step noise of {fmt(s['noise'])}) or less than "
                   f"{run.th.loss_progress:.0%} of its level")
            at = (f" It sits at chance: a cross-entropy over {classes} classes scores ln({classes}) = "
                  f"{fmt(chance)} with a uniform guess." if at_chance else "")
            out.append(Finding(
                self.code, "warning" if flat or tiny else "notice",
                f"{label}the loss has not improved over {s['n']} steps" + (" (at chance level)" if at_chance else ""),
                f"{label}{'mean' if label else 'Mean'} loss {fmt(s['first'])} over steps {steps[0]}-"
                f"{steps[s['quarter'] - 1]} -> {fmt(s['last'])} over steps {steps[-s['quarter']]}-{steps[-1]}: "
                f"{why}.{at}" + run.lr_text(k, steps[0]) + (
                    "" if upd is None else f" Each update moved the weights by {fmt(upd)} of their size (the median "
                    f"over the measured steps; about 1e-3 is typical)" + (": the learning rate is too small to move "
                                                                         "them." if tiny else
                                                                         ": steps that large without progress "
                                                                         "bounce across the minimum, the learning "
                                                                         "rate is too large." if large else ".")),
                steps=[steps[0], steps[-1]], evidence=ev))
        return out


STALL = Stall(
    "stall", "warning", "each step's finite loss, the learning rate and the cross-entropy's class count",
    "the loss did not improve over the run (last quarter vs first, beyond 3 standard errors of its noise and "
    "1% of its level; a rise short of a divergence included; at ln(classes) for a cross-entropy: at chance): a notice, a warning when flat or when the "
    "updates are below 1e-6 of the weights", needs=("loss",), min_steps="stall_min_steps")
