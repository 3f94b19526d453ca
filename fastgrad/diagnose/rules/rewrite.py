"""``update_rewrote``: a measured update moved an optimizer's weights by ``RunLimits.blowup_update`` (1x) of
their own size or more (``||after - before|| / ||before||`` over the whole model, at the steps the checker
measures: every one of the first 8, then every 16th). Such a step replaces the weights instead of adjusting
them (about 1e-3 is typical), whether or not the loss recovers after it. The rewrite begins earlier where the
updates just before that step each rewrote one layer (``layer_rewrite_before``: a small head rewritten while
a large body dilutes the whole ratio); its first step, the one other findings are ordered by, is then there.
A warning when it recurs (two measured steps or more: the learning rate keeps overwriting the weights) or when the run shows harm from it on (a NaN, a
loss jump, a norm far above its own level, a loss that rose or did not improve over the run, or that fell from
the blow-up yet never came back to its value before the rewrite: ``rules.evidence``);
a notice for one such step the run then learnt past (Adam's first step on small weights moves each of them by
about the learning rate). The same list of steps is the ``rewrite`` harm other findings quote
(``rules.evidence.harm_of``).

Whether the learning rate alone made the first rewrite (``evidence["lr_alone"]``, ``lr_alone``): the update
of that step, with the gradient it used brought within the guide's bound (``Thresholds.exploding``, 100; a
clipped update already is), would still have moved the weights by 1x or more. A gradient update scales with
its gradient, so this asks whether a gradient of ordinary size would have done the same at that learning rate;
then a gradient explosion at that step is not the rewrite's cause (``consistency.link_causes``). For Adam-like
updates, whose size does not follow the gradient's, the scaling understates the update: the test errs towards
blaming the gradient.

``update_tiny``, the other end of the same measurement: in a run of several optimizers (adversarial,
actor-critic: ``stall`` judges one optimizer's loss only, and names tiny updates there), an optimizer whose
median measured update moved its weights by less than ``RunLimits.stall_tiny_update`` (1e-6) of their size,
over ``RunLimits.tiny_update_steps`` measured steps at least: its learning rate cannot move them. A warning
when its own loss did not improve against its noise over the run (``rules.evidence.loss_change``), else a
notice."""

from __future__ import annotations

import math

from ..finding import Finding, fmt
from .base import Rule, RunView
from .evidence import harm_of, tiny_update, update_size
from .never_learns import never_learning

__all__ = ["UpdateRewrote", "UPDATE_REWROTE", "UpdateTiny", "UPDATE_TINY", "layer_rewrite_before", "rewritten_layer"]


class UpdateRewrote(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        out = []
        # tensors of the model's computation that never learn (zero, or cut off from the loss): a loss that did
        # not improve is theirs, not an update's, whatever the update (``never_learns`` says so)
        zero, cut, _ = never_learning(run)
        live = run.ctx.get("live") or {}
        for k in run.per:
            h = harm_of(run, k)
            rw = h.rewrites
            if not rw:
                continue
            s, ratio = max(rw, key=lambda t: t[1])
            began = layer_rewrite_before(run, k, rw[0][0])
            first = began[0] if began else rw[0][0]
            lr = run.lr_at(k, first)
            measured = sum(1 for u in run.ctx.get("updates") or () if u["series"] == k)
            run.key_steps.add(first)
            whole_lr = run.lr_at(k, rw[0][0])
            at = "" if whole_lr is None else f" with a learning rate of {whole_lr:g}"
            c = h.change
            stuck = [n for n in zero + cut if live[n][0] == k]
            flat = c is not None and not c["improved"] and not c["rose"]
            harm = h.rewrite_harm([st for st, _ in rw], first, stuck=bool(stuck))
            grave = h.rewrite_grave(harm)
            if harm:
                after = " Harm the run shows from it on: " + "; ".join(t for _, t in harm) + "."
            elif grave:
                after = " It recurred: the learning rate keeps overwriting the weights."
            else:
                fell = h.loss_fell()
                after = (f" The run learnt past it (the loss went {fell}): one such step, at notice." if fell else
                         " One such step, and no harm the run shows after it: at notice.")
                if flat and stuck:
                    after += (f" The loss did not improve, but {len(stuck)} tensor(s) of the model never learn "
                              "(`never_learns`): that is theirs, not this update's.")
            alone = lr_alone(run, k, first, began[2] if began else rw[0][1])
            out.append(Finding(
                self.code, "warning" if grave else "notice",
                f"{run.label(k)}an update rewrote the weights: {fmt(ratio)}x their own size at step {s}",
                f"{run.label(k)}{len(rw)} of the {measured} measured update(s) moved the weights by "
                f"{fmt(run.limits.blowup_update)}x their own size or more, first at step {rw[0][0]}{at} (steps "
                + ", ".join(f"{st}: {fmt(v)}x" for st, v in rw[:6]) + (", ..." if len(rw) > 6 else "")
                + "; about 1e-3 is typical)."
                + ("" if not began else f" It began at step {first}, in one layer: that step's update moved "
                   f"`{began[1]}` by {fmt(began[2])}x its own size"
                   + ("" if lr is None else f" (learning rate {lr:g})")
                   + f", and every update from there to step {rw[0][0]} rewrote at least one layer.")
                + " A step that size replaces what the weights had learnt instead of "
                "adjusting it: the learning rate is too high for this model at those steps." + after,
                steps=[st for st, _ in rw], evidence={"series": k, "rewrite": [s, ratio], "first_step": first,
                                                      "lr": lr, "count": len(rw), "measured": measured,
                                                      "first_ratio": began[2] if began else rw[0][1],
                                                      "first_norm": _used_norm(run, k, first),
                                                      "harm": [kind for kind, _ in harm], "lr_alone": alone}))
        return out


def layer_rewrite_before(run: RunView, k, step: int) -> tuple[int, str, float] | None:
    """Where the rewrite that reached the whole model at ``step`` began: (step, layer, ratio) of the earliest
    measured update of series ``k`` in the unbroken run of updates just before ``step`` (steps s-1, s-2, ...,
    each measured) each of which moved at least one layer by ``RunLimits.blowup_update`` of its own size (its
    largest such layer); None when the update of step s-1 was not measured or rewrote no layer. A layer that moved
    its own size is rewritten even while the rest of the model dilutes the whole ratio (a small head beside a large body), and the update of step s raises only
    later losses: so the rewrite, and what it explains, starts there. The run must be unbroken: one early step on
    small weights (Adam's first) that the following updates do not repeat began nothing. A layer of all-zero
    weights (ratio inf) had nothing to rewrite."""
    ups = sorted((u for u in run.ctx.get("updates") or () if u["series"] == k and u["step"] < step),
                 key=lambda u: u["step"])
    out, nxt = None, step
    for u in reversed(ups):
        hit = rewritten_layer(u, run.limits)
        if u["step"] != nxt - 1 or hit is None:
            break
        v, n = hit
        out, nxt = (u["step"], n, v), u["step"]
    return out


def rewritten_layer(update: dict, limits) -> tuple[float, str] | None:
    """(ratio, layer) of the layer one measured update moved most, when that is ``limits.blowup_update`` of its
    own size or more; None otherwise. A layer of all-zero weights (ratio inf) had nothing to rewrite."""
    hit = [(v, n) for n, v in (update.get("layers") or {}).items()
           if v is not None and math.isfinite(v) and v >= limits.blowup_update]
    return max(hit) if hit else None


def _used_norm(run: RunView, k, step: int) -> float:
    """The norm of the gradients the update of ``step`` used (after the script's clip), NaN if unread."""
    return next((r.total_norm for r in run.per[k] if r.step == step), math.nan)


def lr_alone(run: RunView, k, step: int, ratio: float) -> bool:
    """The update of ``step`` (``ratio`` times its weights) would have been 1x its weights or more with the
    gradient it used within the guide's bound: ``ratio * min(1, bound / used norm)``; an infinite or unread
    norm: the gradient's doing, not the learning rate's alone."""
    used = _used_norm(run, k, step)
    if not (math.isfinite(used) and used > 0):
        return False
    return ratio * min(1.0, run.th.exploding / used) >= run.limits.blowup_update


UPDATE_REWROTE = UpdateRewrote(
    "update_rewrote", "warning", "the measured update/weight ratios and each step's learning rate, per optimizer",
    "a measured update moved an optimizer's weights by 1x their own size or more")


class UpdateTiny(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        if not run.multi:
            return []   # one optimizer: stall's tiny_update variant says it, with the loss
        lim, out = run.limits, []
        for k in run.per:
            med, n = update_size(run, k)
            if n < lim.tiny_update_steps or not tiny_update(med, lim):
                continue
            ch = harm_of(run, k).change
            stuck = ch is not None and not ch["improved"]
            first = run.per[k][0].step
            lr = run.lr_at(k, first)
            at = "" if lr is None else f" (learning rate {lr:g})"
            out.append(Finding(
                self.code, "warning" if stuck else "notice",
                f"{run.label(k)}updates too small to move the weights: {fmt(med)} of their size",
                f"{run.label(k)}the median of {n} measured updates moved the weights by {fmt(med)} of their "
                f"own size, below {fmt(lim.stall_tiny_update)} (about 1e-3 is typical){at}: at that rate the run "
                "ends with the weights where they began, whatever the gradients say. "
                + ("Its loss did not improve against its own noise over the run." if stuck else
                   "Its loss moved anyway (the other optimizers' doing, or noise)."),
                steps=[first], evidence={"series": k, "update_ratio": med, "measured": n, "lr": lr,
                                         "stuck": stuck}))
        return out


UPDATE_TINY = UpdateTiny(
    "update_tiny", "warning", "the measured update/weight ratios of each optimizer, in a run of several, and its "
    "loss", "an optimizer's median measured update below 1e-6 of its weights (several optimizers; stall says it "
    "for one): a warning when its loss did not improve, else a notice", needs=("loss",))
