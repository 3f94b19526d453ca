"""``exploding``: the gradient norm before clipping above 1000 or 100 (the guide's limits), per optimizer, at
every step from the first. The guide's limits alone ask a question (a notice: a loss summed over the batch has
norms in the thousands); with harm the run shows at those steps (``rules.evidence``: NaN/Inf, a loss that jumps
or rises against its noise, an update that rewrites the weights, a norm 10x the run's own level) it is critical
above 1000 and a warning above 100; an update that rewrote the weights makes it critical at either tier, and a
far norm with no damage beside it (no NaN/Inf, no loss jump or rise, no rewrite) is a notice at either tier, as a
``spike`` with no damage is: one outlier batch that a clip or an adaptive optimizer absorbed. A step whose own
loss jumped with its norm is a batch the gradient came from: an outlier (a warning) where the norm stood 10x the
run's own level, a hard batch (a notice, as that spike would be) below it. An infinite norm of finite gradients is the largest explosion of all: the
sum of squares overflowed float32 (a true norm above ~1.8e19), and a clip then multiplies every gradient by 0."""

from __future__ import annotations

import math

from ..finding import Finding, fmt
from .base import Rule, RunView
from .evidence import SCALE_QUESTION, harm_of

__all__ = ["Exploding", "FLOAT32_NORM_MAX"]

#: harm that is no damage: a norm far above its own level, an outlier or hard batch's own loss (the update it
#: drove left the loss where it was)
_NO_DAMAGE = ("far", "outlier_batch", "hard_batch")
#: of those, what is a notice alone: a far norm nothing followed, a hard batch whose norm stayed within 10x of
#: the run's own level (what a `spike` with no damage is); an outlier batch far above that level is a warning
_NOTICE_ONLY = ("far", "hard_batch")

#: the largest L2 norm whose square sum float32 can hold (sqrt of float32's max, 3.4e38)
FLOAT32_NORM_MAX = 1.8e19


class Exploding(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        th, out = run.th, []
        last_k = run.last_series
        for k, recs in run.per.items():
            over = [r for r in recs if r.overflow]
            fin = [r for r in recs if math.isfinite(r.grad_norm)]
            crit = [r for r in recs if r.overflow or (math.isfinite(r.grad_norm) and r.grad_norm > th.critical)]
            warn = [r for r in fin if r.grad_norm > th.exploding]
            hit = crit or warn
            if not hit:
                continue
            pk = over[0] if over else max(fin, key=lambda r: r.grad_norm)
            run.key_steps |= {hit[0].step, pk.step}
            peak = "inf (overflowed float32)" if over else fmt(pk.grad_norm)
            label = run.label(k)
            start = recs[0]
            clipped = [r for r in hit if r.clipped]
            bound = next((r.clip_max for r in clipped if r.clip_max is not None), None)
            ev = {"series": k, "first_step": hit[0].step, "count": len(hit), "peak_step": pk.step,
                  "peak": math.inf if over else pk.grad_norm, "overflow_steps": [r.step for r in over]}
            if bound is not None:
                ev["max_norm"] = bound
            if clipped and bound is not None and any(r.grad_norm > bound for r in clipped):
                clip_text = (f" The script clips at max_norm={fmt(bound)}, so the update was bounded, but the raw "
                             "gradients are out of range.")
                ev["variant"] = "clipped"
            elif clipped and bound is not None:
                clip_text = (f" The script clips at max_norm={fmt(bound)}, above every norm seen: the clip never "
                             "acted.")
                ev["variant"] = "loose_clip"
            elif clipped:
                clip_text = " The script clips, but the raw gradients are out of range."
            else:
                clip_text = ""
            if over:
                zeroed = [r for r in over if r.clipped and r.total_norm == 0]
                detail = (f"{label}The gradient norm overflowed float32 at {len(over)} step(s), first at step "
                          f"{over[0].step}: every gradient value was finite, but their sum of squares passed "
                          f"float32's range (a norm above ~{fmt(FLOAT32_NORM_MAX)}), so the norm came out inf"
                          + (f" and the clip multiplied every gradient by 0 ({len(zeroed)} step(s) with a zero "
                             "update: nothing learnt there; the zeros are the clip's, not dead units)"
                             if zeroed else "") + ". "
                          f"In all, the norm exceeded {fmt(th.critical)} at {len(crit)} step(s), first at step "
                          f"{crit[0].step}; step {start.step} had {fmt(start.grad_norm)}." + run.lr_text(k, crit[0].step))
                out.append(Finding(self.code, "critical",
                                   f"{label}gradient norm overflowed float32 (inf from finite gradients): the "
                                   "largest explosion; lower the learning rate (or the loss scale)",
                                   detail, [], [r.step for r in crit], ev | {"variant": "overflow", "harm": ["overflow"]}))
                continue
            # critical: damage at the steps above 1000, or an update that rewrote the weights (the learning
            # rate's gravest harm, whatever tier the norm reached); a warning: a norm far above the run's own
            # level there, or a loss that jumped at that step itself (an outlier batch, before its update), with
            # no damage to show after it, or other harm at the steps above 100
            # an outlier batch whose update a clip bounded did no harm to show: its own loss jump counts only at
            # the steps no clip bounded (none ran, or its bound was above the norm)
            free = {r.step for r in hit if not (r.clipped and r.clip_max is not None and r.clip_max < r.grad_norm)}
            h = harm_of(run, k)
            # a loss jump is the harm of a step whose norm stood out of the run's own level: where every step is
            # above the guide's limit (the loss's own scale), a jump after an ordinary one is not the explosion's
            harm = h.at([r.step for r in crit], own_step=free, usual_ok=False) if crit else []
            if any(kind not in _NO_DAMAGE for kind, _ in harm):
                sev = "critical"
            else:
                # no damage above 1000: the steps above 100 (they hold those) decide
                harm = h.at([r.step for r in warn], own_step=free, usual_ok=False) or harm
                sev = ("critical" if any(kind == "rewrite" for kind, _ in harm) else
                       "warning" if any(kind not in _NOTICE_ONLY for kind, _ in harm) else "notice")
            ev["harm"] = [kind for kind, _ in harm]
            limit = th.critical if crit else th.exploding
            # each step named once: the first step over the limit, the peak, and the run's first step when
            # they differ
            first = f"first at step {hit[0].step} ({fmt(hit[0].grad_norm)})"
            if pk.step == hit[0].step:
                first = f"first and highest at step {pk.step} ({peak})"
            else:
                first += f"; peak {peak} at step {pk.step}"
            if start.step != hit[0].step:
                first += f"; step {start.step} had {fmt(start.grad_norm)}"
            detail = (f"{label}The gradient norm exceeded {fmt(limit)} at {len(hit)} step(s), {first}."
                      + clip_text + (run.lr_text(k, hit[0].step) if sev == "critical" else "") + _harm_text(harm, harm_of(run, k)))
            layers = largest_layers(run.last) if k == last_k else []
            # the script clips: "clip (max_norm=1.0)" would read as "add one"
            if not harm:
                title = (f"{label}gradient norm above {'1000' if crit else '100'} with no harm seen (the guide's "
                         "question: is this the loss's own scale?)")
            elif sev == "notice" and any(kind == "far" for kind, _ in harm):
                ev["variant"] = "no_damage"
                title = (f"{label}gradient norm above {'1000' if crit else '100'}, far above the run's own level, "
                         "with no damage seen")
            elif sev == "notice":
                ev["variant"] = "hard_batch"
                title = (f"{label}gradient norm above {'1000' if crit else '100'} at a hard batch (its own loss "
                         "jumped with it), with no damage seen")
            elif ev.get("variant") == "loose_clip":
                title = (f"{label}gradient norm above {'1000' if crit else '100'}, and the clip's bound "
                         f"(max_norm={fmt(bound)}) is above every norm: it never acts")
            elif ev.get("variant") == "clipped":
                title = (f"{label}gradient norm above {'1000' if crit else '100'} before the clip (max_norm="
                         f"{fmt(bound)} bounds the update): the gradients themselves are out of range")
            else:
                # critical at the lower tier too when an update rewrote the weights: the title names the tier the
                # norm reached, not the one the severity did
                title = (f"{label}gradient norm above {'1000' if crit else '100'}: clip now, lower the learning rate"
                         if sev == "critical" else
                         f"{label}gradient norm above {'1000' if crit else '100'}: clip (max_norm=1.0)")
            out.append(Finding(self.code, sev, title, detail, layers, [r.step for r in hit], ev))
        return out


def _harm_text(harm: list, h) -> str:
    """The evidence a severity rests on, in words."""
    if harm and all(kind in _NOTICE_ONLY for kind, _ in harm):
        # a spike that nothing followed: the same reading as ``spike``'s damage
        return (" " + "; ".join(text[0].upper() + text[1:] for _, text in harm) + ", but no damage followed: the "
                f"loss did not jump after it, nothing went NaN/Inf and {h.rewrite_words()} (a clip, or an adaptive "
                "optimizer, bounds the step).")
    if harm:
        return " Harm the run shows: " + "; ".join(text for _, text in harm) + "."
    return (" No harm seen: " + h.loss_words() + ", " + h.rewrite_words() + " and no step was 10x the run's "
            "own level: the guide's limit alone asks a question." + SCALE_QUESTION)


def largest_layers(last, k: int = 3) -> list[str]:
    if last is None:
        return []
    finite = [r for r in last.layers if math.isfinite(r.norm) and r.norm > 0]
    return [r.name for r in sorted(finite, key=lambda r: -r.norm)[:k]]


EXPLODING = Exploding(
    "exploding", "critical", "each step's norm before clipping, per optimizer",
    "the norm before clipping > 1000 (critical) or > 100 (warning) at some step, with harm the run shows at "
    "those steps (NaN/Inf, a loss that jumps or rises beyond its noise, an update of 1x the weights: critical at "
    "either; a norm 10x the run's own level with none of those, a step's own loss jump with a norm under 10x its "
    "level, or no harm at all: a notice; that jump with a norm 10x its level: a warning); an inf norm of finite gradients (float32 overflow) is the "
    "largest explosion", needs=("grad_norm",))
