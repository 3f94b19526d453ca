"""``loss_diverging``: a finite loss that trends up and stays up, judged over the whole run of one optimizer.

The start is the smaller of the first loss and the median of the first three (one odd first batch does not
set it). The loss diverges (critical) when it reaches 10x that start, holds there for the next step (or to
the end of the run), AND the median of the last quarter of the run is still 10x the start, or the loss stays
10x up at every step from there to the end of the run, and 10x the median of the losses before it (a blow-up
in the last quarter: the run ended on it): a
rise that comes back down is not a divergence. 3x under the same conditions is "rising" (a warning). A jump to 10x after which
the loss never gets back down (the medians of the last half and the last quarter of the run still 1.5x the
start) is a warning too: the run ends worse than it began.

A loss that climbs gradually (the ratio passed only after the run's first quarter; its peak in the second
half of the run, unless it came back down from it and only stays above its start) while the gradient norms
stay modest (every norm below 100) and stable (the last quarter's median norm within 2x of the first
quarter's; for a loss that came back down, no norm far above its own level), and no update rewrote the
weights, is at most a notice: that is how a bootstrapped value or TD loss behaves when its targets grow with the returns
(actor-critic critics, DQN), not a learning rate too high. A loss that jumps early and stays up (a language
model at a learning rate far too high: its peak within the first steps) is judged as a divergence even with
modest norms.

In a run that moves its own targets (a model it forwards, trains through no optimizer and rewrites in place:
a DQN or actor-critic target network, an EMA teacher; ``collect.targets``), or that steps an RL environment (its
agent's returns are its targets; ``collect.targets.environment_module``), a rise with no harm beyond it (no
norm far above its own level by more than the loss's own rise explains, ``Harm.far_for_its_loss``, with damage
after it; no rewrite, no NaN) is that notice however early it began and however far its
norms grew with it: such a loss starts near 0, while the targets are the model's own untrained outputs, and its
gradients scale with the targets.

A series whose loss ever goes negative (a policy gradient's signed objective) is not judged: a ratio means
nothing there."""

from __future__ import annotations

import math

from ..finding import Finding, fmt
from .base import Rule, RunView, median
from .evidence import harm_of

__all__ = ["LossDiverging", "loss_divergence"]


def loss_divergence(recs, ratio: float, hold: int = 2, end_ratio: float | None = None):
    """(base step, base loss, first step at >= ratio x base, its loss, peak step, peak loss, end level, step of
    the highest loss from the first step on, whether it rose only in the run's last quarter) when the
    series' finite loss rises to ``ratio`` times its start, holds for ``hold`` steps (or to the end), and the
    median of the run's last quarter is still at least ``end_ratio`` (default: ``ratio``) times the start, as is
    the median of its last half when ``end_ratio`` is given; else None."""
    pts = [(r.step, r.loss) for r in recs if r.loss is not None and math.isfinite(r.loss)]
    if len(pts) < 3 or min(v for _, v in pts) < 0:
        return None
    vals = [v for _, v in pts]
    base = min(vals[0], median(vals[:3]))
    if base <= 0:
        return None
    q = max(1, len(vals) // 4)
    end = median(vals[-q:])
    first = 1
    if end < (ratio if end_ratio is None else end_ratio) * base:
        # it came back down: not over the run; unless it is up at every step from its crossing to the end (a
        # blow-up in the run's last quarter, at least ``hold`` steps long: the run ended there)
        j = len(vals)
        while j > 1 and vals[j - 1] >= ratio * base:
            j -= 1
        if end_ratio is not None or len(vals) - j < hold:
            return None
        # ... and up against the level the run held before it, not only its first value: a noisy loss whose
        # first value was low by chance ends with a few values above 3x that value as often as not
        if min(vals[j:]) < ratio * median(vals[:j]):
            return None
        first = j
    if end_ratio is not None and median(vals[len(vals) // 2:]) < end_ratio * base:
        return None
    for i in range(first, len(pts)):
        if min(vals[i:i + hold]) >= ratio * base:
            # the run's real peak is quoted (a spike before the first step that held the ratio is still the
            # peak); the highest point from that step on says whether the loss is still climbing
            j = max(range(len(pts)), key=lambda t: vals[t])
            c = max(range(i, len(pts)), key=lambda t: vals[t])
            b = next(k for k in range(len(pts)) if vals[k] == base)
            return pts[b][0], base, pts[i][0], vals[i], pts[j][0], vals[j], end, pts[c][0], first > 1
    return None


class LossDiverging(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        lim, out = run.limits, []
        targets = list(run.ctx.get("moving_targets") or ())  # target networks the script moves itself
        env = run.ctx.get("environment")  # an RL environment the script steps: its agent's returns are its targets
        for k, recs in run.per.items():
            sev, ratio = "critical", lim.diverge_ratio
            d = loss_divergence(recs, ratio)
            if d is None:
                sev, ratio = "warning", lim.rise_ratio
                d = loss_divergence(recs, ratio, hold=3)
            unrecovered = False
            if d is None and len(recs) >= lim.min_steps:
                # a jump of 10x after which the loss never got back down to its start: not diverging at the end,
                # but the run is worse than where it began (a learning rate too high that the optimizer survived)
                sev, ratio, unrecovered = "warning", lim.diverge_ratio, True
                d = loss_divergence(recs, ratio, hold=1, end_ratio=lim.unrecovered_ratio)
            if d is None:
                continue
            s0, v0, s1, v1, sp, vp, end, sc, late = d
            if late:  # up from step s1 to the end: the level it ended on, not the last quarter's
                end = [r.loss for r in recs if r.loss is not None and math.isfinite(r.loss)][-1]
            norms = [r.grad_norm for r in recs if math.isfinite(r.grad_norm)]
            q = max(1, len(norms) // 4)
            modest = bool(norms) and max(norms) < lim.modest_norm and len(norms) == len(recs)
            m0 = median(norms[:q]) if norms else 0.0
            stable = m0 > 0 and median(norms[-q:]) <= 2 * m0
            label = run.label(k)
            nrm = {r.step: r.grad_norm for r in recs}
            ev = {"series": k, "start_step": s0, "start": v0, "first_step": s1, "peak_step": sp, "peak": vp,
                  "end_level": end, "ratio": vp / v0}
            # the learning rate's evidence: an update that rewrote the weights
            h = harm_of(run, k)
            rw = max(h.rewrites, key=lambda t: t[1], default=None)
            upd = "" if rw is None else (f" An update moved the weights by {fmt(rw[1])}x their own size (step "
                                         f"{rw[0]}): one step rewrote them.")
            if rw is not None:
                ev["rewrite"] = list(rw)
            order = [r.step for r in recs]
            pos = order.index(sc) if sc in order else 0
            late_peak = pos >= len(recs) // 2  # still climbing: a value loss tracking growing returns
            # ... and it took a while to get there: a loss that passes the ratio within the first quarter of the
            # run jumped (an LSTM at lr=2000: 20x at its second step), it did not follow growing targets
            gradual = (order.index(s1) if s1 in order else 0) >= len(recs) // 4
            # a loss that came back down from its peak (unrecovered) is not "still climbing": its late peak is
            # not asked for, and its norms may follow the loss's own scale (a TD error grows with the returns) as
            # long as no step's norm is far above its own level; a run that moves its own targets (a target
            # network) bootstraps, whenever its rise began and however large its norms grew with it. Harm beyond
            # the rise (an update that rewrote the weights, a NaN, a norm far above its own level; without moving
            # targets, a norm above the modest bound) never gets the exemption.
            far = any(h.far(s) for s in h.steps)
            clean = rw is None and not h.nonfinite and not late
            # against moving targets, a norm that grew with its loss (a critic whose first TD error was near 0)
            # is the loss's own scale: only a norm far beyond what the loss's rise explains, with damage after it
            # (a loss jump, a NaN), is harm; one that nothing followed is no damage, as `exploding` reads it (a
            # critic's gradient grows with its activations too while it learns: DDPG's, 15x its early level)
            boot = (modest and gradual and ((stable and late_peak) or (unrecovered and not far))) or \
                ((targets or env) and not any(h.far_for_its_loss(s) and h.at([s], far=False, rewrite=False)
                                              for s in h.steps))
            if clean and boot:
                run.key_steps.add(sp)
                out.append(Finding(
                    self.code, "notice", f"{label}the loss rose ({end / v0:.3g}x its start at the end) with "
                    "no other harm" + (" against targets the run moves itself" if targets else
                                       " in a run that learns from an environment" if env else ""),
                    f"{label}{'loss' if label else 'Loss'} {fmt(v0)} at step {s0} -> peak {fmt(vp)} at step {sp}, "
                    f"{fmt(end)} over the last quarter of the run, while "
                    + (f"every gradient norm stayed below {fmt(lim.modest_norm)} (max {fmt(max(norms))})"
                       if modest else f"the gradient norm (max {fmt(max(norms))}) grew with it")
                    + (" and the norm's level held within 2x" if stable else ", none far above its own level")
                    + ", and no update rewrote the weights. That "
                    "is how a bootstrapped value or TD loss behaves when its targets grow with the returns; not "
                    "a divergence by itself." + (f" The run moves its own targets: {', '.join(targets)} "
                                                 + ("is" if len(targets) == 1 else "are") + " forwarded, "
                                                 "trained by no optimizer and rewritten in place (a target "
                                                 + ("network)." if len(targets) == 1 else "network each).")
                                                 if targets else
                                                 f" The script steps an RL environment ({env}): its value targets "
                                                 "are its own returns, which grow as it learns." if env else "")
                    + " Watch the returns, not this loss.", steps=[sp],
                    evidence=ev | {"variant": "bootstrapped", "targets": targets, "environment": env}))
                continue
            run.key_steps |= {s1, sp}
            if unrecovered:
                out.append(Finding(
                    self.code, sev, f"{label}the loss jumped {vp / v0:.3g}x its start and never came back down to "
                    "it: the learning rate is the first suspect",
                    f"{label}{'loss' if label else 'Loss'} {fmt(v0)} at step {s0} -> peak {fmt(vp)} at step {sp}, "
                    f"and still {fmt(end)} over the last quarter of the run ({end / v0:.3g}x its start; over the "
                    f"last half too): the run ends worse than it began. The gradient norm went {fmt(nrm.get(s0))} "
                    f"-> {fmt(nrm.get(sp))} over the same steps." + run.lr_text(k, s1) + upd, steps=[s1, sp],
                    evidence=ev | {"variant": "unrecovered"}))
                continue
            out.append(Finding(
                self.code, sev,
                f"{label}the loss is {'diverging' if sev == 'critical' else 'rising'} ({vp / v0:.3g}x its start): "
                "the learning rate is the first suspect",
                f"{label}{'loss' if label else 'Loss'} {fmt(v0)} at step {s0} -> {fmt(v1)} at step {s1} "
                f"(>= {ratio:g}x) -> peak {fmt(vp)} at step {sp}, and "
                + (f"still {fmt(end)} at the last step (it stayed up from step {s1} to the end of the run)" if late
                   else f"still {fmt(end)} over the last quarter of the run (it stayed up)")
                + f"; the gradient norm went {fmt(nrm.get(s0))} -> {fmt(nrm.get(sp))} over "
                "the same steps." + run.lr_text(k, s1) + upd, steps=[s1, sp], evidence=ev))
        return out


LOSS_DIVERGING = LossDiverging(
    "loss_diverging", "critical", "each step's finite loss and norm, per optimizer",
    "the loss reaches 10x its start (critical; 3x: warning) and stays up to the end of the run (the last "
    "quarter's median, or every step from there to the end); climbing gradually with modest, stable norms (a "
    "bootstrapped value/TD loss): a notice", needs=("loss",), min_steps=3)
