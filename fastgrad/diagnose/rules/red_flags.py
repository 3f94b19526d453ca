"""The red flags of a training loop, seen at run time by the interceptors: ``clip_scaled`` (a clip of
still-scaled AMP gradients), ``clip_after_step``, ``clip_not_params`` (a clip handed a loss), ``clip_partial`` (a clip inside an accumulation window),
``no_zero_grad`` (gradients never zeroed) and ``no_clipping`` (nothing clips a norm above 100)."""

from __future__ import annotations

import math

from ..finding import Finding, fmt, steps_text
from .base import Rule, RunView
from .exploding import largest_layers

__all__ = ["ClipScaled", "ClipAfterStep", "ClipNotParams", "ClipPartial", "NoZeroGrad", "NoClipping"]


class ClipScaled(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        s = run.flags.get("clip_scaled") or []
        if not s:
            return []
        return [Finding(self.code, "critical", "clipping gradients that are still scaled (AMP)",
                        "A clip ran between scaler.scale(loss).backward() and scaler.unscale_ at step(s) "
                        f"{steps_text(s)}: it measured scale * grad, so its return is not the gradient norm "
                        "(the report shows the norm the update used instead).", steps=s,
                        evidence={"first_step": s[0], "count": len(s)})]


class ClipAfterStep(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        s = run.flags.get("clip_after_step") or []
        if not s:
            return []
        if run.manual and run.ctx.get("clips_found_grads"):
            # a hand-written loop whose clip found gradients at other calls (updates that take turns, each
            # clipping every part): the calls that found none are idle, not a clip in the wrong place
            return []
        bound = run.ctx.get("misplaced_clip_max")
        at = "" if bound is None else f" (max_norm={bound:g})"
        if run.manual:  # a hand-written loop: the clip found no gradient, the update had dropped them
            title = "clipping before backward(): the clip finds no gradient"
            detail = (f"A clip{at} ran after step(s) {steps_text(s)} and before the next backward(), when "
                      "zero_grad() or the update had dropped every gradient: it finds none and bounds nothing an "
                      "update uses.")
        elif run.ctx.get("misplaced_clip_bare"):  # every gradient None: zero_grad() ran before it
            title = "clipping before backward(): the clip finds no gradient"
            detail = (f"A clip{at} ran after zero_grad() and before backward(), after the step of step(s) "
                      f"{steps_text(s)}: every gradient was None, so it bounds nothing an update uses.")
        else:
            title = "clipping after optimizer.step()"
            detail = (f"A clip{at} ran after the step of step(s) {steps_text(s)} and before the next backward: it "
                      "bounds no gradient an update uses.")
        return [Finding(self.code, "warning", title, detail, steps=s,
                        evidence={"first_step": s[0], "count": len(s), "max_norm": bound})]


class ClipNotParams(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        s = run.flags.get("clip_not_params") or []
        if not s:
            return []
        c = run.ctx.get("clip_not_params") or {}
        call = f"`{c['code']}` ({c['file']}:{c['line']})" if c.get("code") else f"a {c.get('fn', 'clip')} call"
        what = c.get("what", "tensors that are not parameters")
        return [Finding(self.code, "warning", "the clip was handed no parameter: it bounds no gradient",
                        f"{call} was handed {what}, not the parameters, at {len(s)} call(s) from step {s[0]}. Only a "
                        "parameter (a leaf that requires grad) keeps a .grad an update uses: the clip bounds nothing "
                        "and every step was taken unclipped.", steps=s,
                        evidence={"first_step": s[0], "count": len(s), "max_norm": c.get("max_norm"),
                                  "call": c.get("code"), "fn": c.get("fn")})]


class ClipPartial(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        s = run.flags.get("clip_partial") or []
        if not s:
            return []
        return [Finding(self.code, "warning", "clipping partial gradients in an accumulation window",
                        "A clip was followed by more backward() calls before the step at step(s) "
                        f"{steps_text(s)}.", steps=s, evidence={"first_step": s[0], "count": len(s)})]


class NoZeroGrad(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        used = run.used
        checked = [r for r in used if r.leftover is not None or r.leftover_checked]
        stale = [r.step for r in used if r.leftover is not None and r.leftover > 0 and not r.zeroed]
        run.flags["no_zero_grad"] = stale
        if len(stale) < 2 or len(stale) * 2 < len(checked):
            return []
        if run.manual and len(stale) < len(checked):
            # a hand-written loop is read at each backward() when it never calls zero_grad(); one that zeroes
            # or drops its gradients by hand at some of them (an accumulation window) is not this
            return []
        return [Finding(self.code, "critical", "gradients are never zeroed between steps",
                        f"At {len(stale)} of {len(checked)} steps the next backward() added to the previous "
                        "gradients (no zero_grad() / set_to_none seen).", steps=stale,
                        evidence={"count": len(stale), "of": len(checked)})]


class NoClipping(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        # an overflowed norm (inf from finite gradients) is the largest of all
        hit = [r for r in run.used if r.overflow or (math.isfinite(r.grad_norm) and r.grad_norm > run.th.exploding)]
        if run.clip_calls or not hit:
            return []
        over = [r for r in hit if r.overflow]
        peak = math.inf if over else max(r.grad_norm for r in hit)
        s = [r.step for r in hit]
        run.flags["no_clipping"] = s
        # a warning where the explosion, or a spike, shows harm (a spike's damage is a reason to clip, and
        # the advice must not say "no clip is needed" beside it); beside a norm that is the loss's own
        # scale, or a far one nothing followed, a notice
        exp = [f for f in run.findings if f.code in ("exploding", "spike") and f.severity != "notice"]
        harmed = bool(exp)
        return [Finding(self.code, "warning" if harmed else "notice", "no gradient clipping while the norm exceeds 100",
                        f"The norm reached {'inf (overflowed float32)' if over else fmt(peak)} and no clip function "
                        "was called." + ("" if harmed else " The run shows no damage from it (see exploding)."),
                        largest_layers(run.last) or list(run.bad_params), s,
                        {"peak": peak, "harm": sorted({h for f in exp for h in f.evidence.get("harm", ["overflow"])})})]


CLIP_SCALED = ClipScaled("clip_scaled", "critical", "where each clip ran (the GradScaler interceptors)",
                         "a clip between scaler.scale(loss).backward() and scaler.unscale_", needs=("script",))
CLIP_AFTER_STEP = ClipAfterStep("clip_after_step", "warning", "where each clip ran",
                                "a clip after optimizer.step() and before the next backward", needs=("script",))
CLIP_NOT_PARAMS = ClipNotParams("clip_not_params", "warning", "the tensors each clip was handed",
                                "a clip handed no parameter (a loss, a computed tensor): it bounds nothing",
                                needs=("script",))
CLIP_PARTIAL = ClipPartial("clip_partial", "warning", "where each clip ran",
                           "a clip followed by more backward() calls before the step", needs=("script",))
NO_ZERO_GRAD = NoZeroGrad("no_zero_grad", "critical", "the gradients left before each backward",
                          "gradients never zeroed between steps (they accumulate forever)", needs=("script",))
NO_CLIPPING = NoClipping("no_clipping", "warning", "the clip calls and each step's norm",
                         "no clip call at all while the norm exceeded 100 (a notice when exploding is one)",
                         needs=("script",))
