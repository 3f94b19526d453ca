"""NaN/Inf: ``nonfinite_loss`` (the loss was NaN/Inf at some step) and ``nonfinite_history`` (the optimizer
stepped on NaN/Inf gradients), both with where the first NaN/Inf was born (``trace_origin``)."""

from __future__ import annotations

import math

from ..finding import Finding, fmt, steps_text
from .base import NanOrigin, Rule, RunView
from .buffers import buffers_bad

__all__ = ["trace_origin", "stuck_from", "NonfiniteLoss", "NonfiniteHistory"]


def trace_origin(run: RunView) -> NanOrigin | None:
    """Where the run's first NaN/Inf was born, from three clocks: the first step whose loss was non-finite,
    the first step the optimizer stepped on non-finite gradients, and the watcher's first non-finite module
    output (or a root module's input). The earliest wins; at the same step, a module output explains the loss
    and the loss explains the gradients. A module output that went non-finite only AFTER the loss or the
    gradients did is a consequence (the weights the optimizer updated with garbage), not the birthplace; a
    NaN that follows a gradient explosion (a norm above 1000, or overflowed) is said to follow it, and one born
    in the loss or a module right after an update that rewrote the weights (``_update_blowup``) is the learning
    rate's (``cause="learning_rate"``)."""
    bad_loss = next((r.step for r in run.steps if r.loss is not None and not math.isfinite(r.loss)), None)
    bad_grad = next((r.step for r in run.used if r.bad), None)
    o = run.forward_origin
    fwd = None if o is None else (o.step + 1 if not run.manual else None)
    is_input = o is not None and getattr(o, "where", "output") == "input"
    mod = None if o is None else f"{o.module} ({o.module_type})"
    if o is not None and run.manual:  # no optimizer steps to count: the module, without a step
        first = min(s for s in (bad_loss, bad_grad) if s is not None) if (bad_loss or bad_grad) else 1
        if is_input:
            return NanOrigin("input", first, None, _input_text(o, mod, None))
        return NanOrigin("forward", first, o.module, f"the first non-finite module output was {mod}")
    firsts = [s for s in (bad_loss, bad_grad, fwd) if s is not None]
    if not firsts:
        return None
    first = min(firsts)
    after = _after_explosion(run, first)
    later = ""
    if fwd is not None and fwd > first:
        later = (f"; the first non-finite module {'input' if is_input else 'output'} ({mod} at step {fwd}) came "
                 "after: a consequence of the update with non-finite values, not the source")
    if fwd == first and is_input:
        return NanOrigin("input", first, None, _input_text(o, mod, fwd) + after)
    blow = _update_blowup(run, first)
    if fwd == first and blow is not None and not after:
        return NanOrigin("forward", first, o.module,
                         f"born in the forward pass: the first non-finite module output was {mod} at step {fwd}, "
                         f"right after the update of step {blow['step']} moved the weights by "
                         f"{fmt(blow['ratio'])}x their own size{_lr_of(blow)}: the weights were thrown out of range "
                         f"and {o.module} overflowed on them. The learning rate is the cause, not the module",
                         cause="learning_rate")
    if fwd == first:
        return NanOrigin("forward", first, o.module,
                         f"born in the forward pass: the first non-finite module output was {mod} at step {fwd}"
                         + after)
    if bad_loss == first and blow is not None:
        u = blow
        return NanOrigin("loss", first, None,
                         f"born in the loss at step {first}, right after the update of step {u['step']} moved the "
                         f"weights by {fmt(u['ratio'])}x their own size{_lr_of(u)}: every module output was still finite, "
                         "but the weights were thrown out of range and the loss overflowed on them. The learning "
                         "rate is the cause, not the loss's formula" + later, cause="learning_rate")
    if bad_loss == first:
        return NanOrigin("loss", first, None,
                         f"born in the loss at step {first}: every module output of that step was finite, so the "
                         "loss computation outside the modules made it (a hand-written loss: log(0), x/0, exp "
                         "overflow)" + later + after)
    return NanOrigin("backward", first, None,
                     f"born in backward at step {first}: the loss and every module output of that step were "
                     "finite, the gradients were not (an op with an unstable derivative, e.g. sqrt or log at 0, "
                     "or fp16 overflow; torch.autograd.detect_anomaly() names the op)" + later + after)


def stuck_from(run: RunView) -> int | None:
    """The first step of the NaN/Inf losses that last to the run's end (two steps at least), every one of them
    skipped by a GradScaler or a StepGuard: the skips kept the NaN out of the weights, yet nothing trained from
    that step on (the weights, or the data, make every forward non-finite). None when the run came back."""
    i = len(run.steps)
    while i > 0 and run.steps[i - 1].loss is not None and not math.isfinite(run.steps[i - 1].loss):
        i -= 1
    tail = run.steps[i:]
    if len(tail) < 2 or not all(r.skipped or r.guard_skipped for r in tail):
        return None
    return tail[0].step


def _lr_of(u: dict) -> str:
    return f" (learning rate {u['lr']:g})" if u.get("lr") is not None else ""


def _update_blowup(run: RunView, first: int) -> dict | None:
    """The last measured update before step ``first`` when it was at least ``RunLimits.blowup_update`` times
    the weights it was applied to (and finite): one step rewrote the model."""
    prev = [u for u in run.ctx.get("updates") or () if u["step"] < first]
    if not prev or prev[-1]["step"] != first - 1:
        return None
    u = prev[-1]
    return u if math.isfinite(u["ratio"]) and u["ratio"] >= run.limits.blowup_update else None


def _input_text(o, mod: str, step: int | None) -> str:
    at = f" at step {step}" if step is not None else ""
    if o.call == 0:
        return (f"already in the data: the input of {mod}{at} held NaN/Inf before any module of that step ran "
                "(check the batch: missing values, a normalisation dividing by a zero std, a corrupt sample)")
    return (f"made outside the modules: the input of {mod}{at} held NaN/Inf while every module output before "
            "it was finite (a tensor op between module calls: log, division, sqrt or exp out of range)")


def _after_explosion(run: RunView, first: int) -> str:
    """"; it follows the explosion ..." when the last used step before ``first`` had a norm above the critical
    limit (or an overflowed one): the huge update, not the module or op that first showed NaN, is the cause."""
    prev = [r for r in run.used if r.step < first]
    if not prev:
        return ""
    r = prev[-1]
    if not (r.overflow or (math.isfinite(r.grad_norm) and r.grad_norm > run.th.critical)):
        return ""
    size = "overflowed float32 (inf)" if r.overflow else fmt(r.grad_norm)
    return (f"; it follows the gradient explosion of step {r.step} (norm {size}"
            + ("" if r.clipped else ", applied unclipped") + "): an update that large drives the weights out of "
            "range, so the explosion is the cause")


def _origin_text(run: RunView) -> tuple[str, list[str], dict]:
    o = trace_origin(run)
    if o is None:
        return "", [], {}
    return (" The NaN/Inf was " + o.text + ".", [o.module] if o.module else [],
            {"born_in": o.where, "born_at_step": o.step, "born_module": o.module}
            | ({"variant": "learning_rate"} if o.cause == "learning_rate" else {}))


class NonfiniteLoss(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        bad = [r.step for r in run.steps if r.loss is not None and not math.isfinite(r.loss)]
        if not bad:
            return []
        run.key_steps.add(bad[0])
        # steps a StepGuard or a GradScaler kept out of the weights: the loss was bad, the update never happened
        kept_out = {r.step for r in run.steps if r.guard_skipped or r.skipped}
        skipped_all = all(s in kept_out for s in bad)
        # a skip keeps the weights and the optimizer state, not the buffers the forward already wrote, and it
        # protects nothing when no step after it trains (``stuck_from``)
        bufs = buffers_bad(run)
        stuck = stuck_from(run) if skipped_all and not bufs else None
        protected = skipped_all and not bufs and stuck is None
        finite_grads = all(math.isfinite(r.total_norm) and r.nonfinite == 0 for r in run.used if r.step >= bad[0])
        text, layers, ev = _origin_text(run)
        ev = ev | {"first_step": bad[0], "count": len(bad), "protected": protected}
        head = f"The loss was non-finite at {len(bad)} step(s), first at step {bad[0]}"
        if skipped_all:
            who = "the step guard" if any(r.guard_skipped for r in run.steps if r.step in bad) else "the GradScaler"
            if stuck is not None:
                ev["stuck_from"] = stuck
                return [Finding(
                    self.code, "critical",
                    f"NaN/Inf loss at every step from step {stuck} on, each skipped by {who}: the weights stay "
                    "finite, but nothing trains",
                    f"{head}; {who} skipped every one of them, so neither the weights nor the optimizer state saw "
                    f"it, but the loss never came back: every step from step {stuck} to the end was NaN/Inf, so the "
                    f"run trained on nothing after step {stuck - 1} (the weights themselves, or the data, make each "
                    "forward non-finite)." + text, layers, bad, ev)]
            title = (f"NaN/Inf loss at step(s) {who} skipped: the run is protected" if protected else
                     f"NaN/Inf loss at step(s) {who} skipped: the weights never saw it, the buffers did")
            # not protected: the model keeps the NaN in its buffers, and the loss is its cause (so it leads)
            return [Finding(
                self.code, "warning" if protected else "critical", title,
                f"{head}; {who} skipped every one of them, so neither the weights nor the optimizer state saw it"
                + ("." if protected else ", but the forward had already written NaN/Inf into the model's buffers "
                   "(nonfinite_buffers).") + text, layers, bad, ev)]
        return [Finding(
            self.code, "critical", "NaN/Inf loss; check the loss before backward()",
            head + (", while every gradient stayed finite (the optimizer kept stepping on garbage)." if finite_grads
                    else ".") + text, layers, bad, ev)]


class NonfiniteHistory(Rule):
    """Extends the last step's own ``nonfinite`` finding when the last step is non-finite too."""

    def evaluate(self, run: RunView) -> list[Finding]:
        used = run.used
        bad = [r.step for r in used if r.bad]
        if not bad:
            return []
        run.key_steps.add(bad[0])
        later = [r.step for r in used if r.bad and r.evals > 1 and math.isfinite(r.total_norm)]
        text, _, ev = _origin_text(run)
        text = (f" NaN/Inf gradients at {len(bad)} step(s), first at step {bad[0]}."
                + (f" At step(s) {steps_text(later)} they appeared in a later evaluation of the step's closure "
                   "(the first evaluation was finite)." if later else "") + text)
        ev = ev | {"first_step": bad[0], "count": len(bad)}
        nf = next((f for f in run.findings if f.code == "nonfinite"), None)
        if nf is not None:  # the last step is itself non-finite: its finding tells the history too
            nf.detail += text
            nf.steps = bad
            nf.layers = nf.layers or list(run.bad_params)
            nf.evidence.update(ev)
            return []
        return [Finding(self.code, "critical", "the optimizer stepped on NaN/Inf gradients", text.strip(),
                        list(run.bad_params), bad, ev)]


NONFINITE_LOSS = NonfiniteLoss(
    "nonfinite_loss", "critical", "each step's loss", "the loss was NaN/Inf at some step (even with finite "
    "gradients); names where it was born: a module's forward, the loss computation, or backward; a warning "
    "when a StepGuard or GradScaler skipped every such step, no buffer turned NaN/Inf and the loss came back "
    "before the run ended (the run is protected)",
    needs=("loss",))
NONFINITE_HISTORY = NonfiniteHistory(
    "nonfinite_history", "critical", "each step's NaN/Inf gradient count",
    "the optimizer stepped on NaN/Inf gradients (not a step a GradScaler or StepGuard skipped)", needs=("grad_norm",))
