"""One pass over a checked run's findings before anything is rendered, so that no two findings state
opposite facts and a weaker finding that a stronger cause explains does not stand beside it:

- the loss: ``stall`` (not improved, against its noise) and the findings that say the loss is improving
  (``small_but_learning``) or not (``decaying``'s "without the loss improving") agree. With a stall,
  ``small_but_learning`` is the ``vanishing`` it was downgraded from; without one, while the loss improves,
  ``decaying`` is likely convergence (a notice that says so), never "training has stalled";
- a bootstrapped loss's rise (``loss_diverging``'s notice: targets that grow with the returns) is not harm:
  a warning of the same optimizer whose only harm is that rise is a notice;
- a norm below the guide's 1e-3 (``vanishing``) is a warning beside a ``stall`` (the loss has not improved against
  its noise: the harm), else a notice: the guide's number alone asks a question;
- a clip applied to still-scaled AMP gradients (``clip_scaled``) makes the update tiny: the small-gradient
  findings (``vanishing``, ``low``, ``small_but_learning``) are that clip's effect, not the model's, and go;
- cause before effect (``link_causes``): where one finding explains another, the effect says that it follows
  from the cause (``evidence["follows"]``) and the report puts the cause first (``finding.place_causes``):
  gradients never zeroed -> the norm's growth; a loss the optimizer climbs -> the explosion; an update that
  replaced the weights before the loss crossed its divergence ratio -> that divergence (a rewrite from the
  crossing on is the divergence's evidence, and follows it); such an update -> an explosion or a NaN at a later
  step, or an explosion at its own step that a gradient within the guide's range would not have averted (the
  learning rate alone made the update: ``rules.rewrite.lr_alone``); a learning rate that blows the run up -> the
  explosion and the units it kills; activations saturated by the initialisation ->
  the stall and the vanishing across depth; tensors that never learn -> the zeros and the vanishing of the
  layers before them.

Per-rule facts (a NaN loss at steps a StepGuard skipped is reported as protected) are decided by the rules
themselves; this pass only reconciles findings with each other."""

from __future__ import annotations

import math

from .finding import Finding, fmt
from .rules.evidence import GUESSES
from .rules.trends import loss_progress
from .thresholds import RunLimits

__all__ = ["reconcile", "link_causes"]

#: the harm kinds that are the loss's own rise (``rules.evidence.Harm.at``)
_LOSS_HARM = {"loss_rose", "loss_jump"}
#: what a clip of still-scaled gradients explains
_SCALED_CLIP_EXPLAINS = {"vanishing", "low", "small_but_learning"}


def reconcile(findings: list[Finding], losses: list[float], th) -> list[Finding]:
    """``findings`` made consistent (see the module docstring); ``losses``: the last series' finite losses."""
    codes = {f.code for f in findings}
    # a bootstrapped loss's rise (``loss_diverging``'s notice) is not harm: a warning of the same optimizer (or
    # of the whole run) whose only harm is that rise (the loss rose or jumped) is a notice
    boot = {f.evidence.get("series") for f in findings
            if f.code == "loss_diverging" and f.evidence.get("variant") == "bootstrapped"}
    out = []
    improving = "stall" not in codes and bool(loss_progress(losses, th.loss_progress)) if losses else False
    for f in findings:
        if "clip_scaled" in codes and f.code in _SCALED_CLIP_EXPLAINS:
            continue
        harm = f.evidence.get("harm")
        series = f.evidence.get("series")
        if (f.severity == "warning" and (series in boot or (series is None and boot)) and harm
                and set(harm) <= _LOSS_HARM):   # (no series: a run-wide finding, judged on the run's loss)
            f.severity, f.evidence["harm"] = "notice", []
            f.title = f.title.replace("with harm", "with no harm beyond a bootstrapped loss's rise")
            f.detail += (" That rise is a bootstrapped loss's (see `loss_diverging`): the loss's own rise is not "
                         "harm here.")
        if f.code == "small_but_learning" and "stall" in codes:
            f.code, f.severity, f.title = "vanishing", "warning", "vanishing, and the loss is not improving"
            f.detail = f.detail.split(";")[0] + "; the loss has not improved (see stall)."
        elif f.code == "vanishing" and f.severity == "warning" and "stall" not in codes:
            f.severity, f.evidence["harm"] = "notice", []
            f.title = "vanishing: below the guide's 1e-3, with no stall of the loss seen"
            f.detail += (" No stall of the loss against its own noise was seen over the run: the guide's number "
                         "alone asks a question.")
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


#: the effects each cause explains, and why (in words)
_ACCUMULATION = ({"exploding", "increasing", "spike", "no_clipping", "elevated", "loss_diverging", "update_rewrote",
                  "stall"},
                 "the optimizer stepped on the sum of every step's gradients so far, so their norm (and the update) "
                 "grows with the number of steps")
_BLOW_UP = ({"exploding", "spike", "increasing", "no_clipping", "dead", "mostly_zero"},
            "the learning rate that drove the loss up also drove the gradients (and the units it pushed out of "
            "their range)")
_NEVER = ({"dead", "mostly_zero"}, "the tensors that never learn are these zeros")
#: ... and a loss that cannot improve while they do not
_NEVER_STALL = "the loss cannot improve through tensors that never learn, whatever the learning rate"
#: what a learning-rate schedule gone wrong explains (``lr_schedule``'s variants), and why
_SCHEDULE = {
    "negative": ({"loss_diverging", "exploding", "spike", "increasing", "no_clipping", "nonfinite_loss", "nonfinite",
                  "nonfinite_history", "dead", "mostly_zero", "stall", "elevated", "update_rewrote"},
                 "a negative learning rate steps uphill, so the loss (and the gradients with it) is driven up"),
    "collapse": ({"stall", "decaying", "vanishing", "low", "small_but_learning", "update_tiny"},
                 "a learning rate that near 0 stops every update, so the loss stops moving"),
}
#: what activations saturated by the initialisation explain (``saturated_at_init``), and why
_SATURATED = ({"stall", "depth_vanishing"},
              "units on their flat tails pass back almost none of their gradient, so the layers before them (and "
              "the loss) barely move, whatever the learning rate")
#: why an effect follows an update that replaced the weights (``update_rewrote``): a divergence whose loss crossed
#: its ratio after the first rewrite; an explosion, or a NaN the learning rate made, after it; an explosion at its
#: step that a gradient within the guide's bound would have made too
_REWRITE = {
    "divergence": ("an update as large as the weights replaced what they had learnt before the loss rose, so the "
                   "loss starts over from wherever that step threw the weights"),
    "explosion": "the gradients computed on the weights that update threw out of range blew up",
    "nan": "what the model and its loss computed on the weights that update threw out of range overflowed",
    "same_step": ("at that learning rate even a gradient within the guide's range (a norm of 100) would have moved "
                  "the weights by their own size: the learning rate, not the gradient's size, made the update "
                  "whose harm this explosion quotes"),
}
#: why an update that rewrote the weights follows a clip that bounded no gradient an update used
_MISPLACED_CLIP = ("the script's clip runs where it bounds no gradient an update uses (after optimizer.step(), or "
                   "before backward()); between backward() and step() it would have cut this update's gradient to "
                   "its max_norm, and the update to under the weights' size")
_MISPLACED_CLIP_NORM = ("the script's clip runs where it bounds no gradient an update uses (after optimizer.step(), "
                        "or before backward()); between backward() and step() it would have cut these gradients to "
                        "its max_norm before any update used them")
_NONFINITE = ("nonfinite_loss", "nonfinite", "nonfinite_history")
#: what a loss the optimizer climbs explains (``gradient_ascent`` with harm), and why
_ASCENT = ({"exploding", "loss_diverging", "update_rewrote", "no_clipping", "clip_zeroes", "nonfinite_loss",
            "nonfinite", "nonfinite_history", "dead", "mostly_zero", "stall"},
           "an optimizer that climbs the loss drives the loss function, and the gradients with it, up")
#: an effect names its cause, so its title drops the guess that blames (or would change) the learning rate
_LR_GUESSES = (": the learning rate is the first suspect", "; lower the learning rate (or the loss scale)",
               ", lower the learning rate")
#: ... and its detail the sentence that blames the learning rate by the update size alone (``stall``'s,
#: ``update_rewrote``'s)
_LR_CLAIMS = ((": the learning rate is too small to move them.", "."),
              (": steps that large without progress bounce across the minimum, the learning rate is too large.", "."),
              (": the learning rate is too high for this model at those steps.", "."))


def _rewrite_and_rise(f: Finding, findings: list[Finding]) -> tuple[Finding, Finding] | None:
    """(``update_rewrote``, ``loss_diverging``) of ``f``'s optimizer when ``f`` is one of them and the divergence
    blames the learning rate and quotes a rewrite as its evidence; else None."""
    other = "loss_diverging" if f.code == "update_rewrote" else "update_rewrote"
    g = next((g for g in findings if g.code == other and
              g.evidence.get("series") == f.evidence.get("series")), None)
    if g is None:
        return None
    rewrite, rise = (f, g) if f.code == "update_rewrote" else (g, f)
    return (rewrite, rise) if rise.evidence.get("rewrite") and _learning_rate(rise, "") else None


def _rewrote_first(rewrite: Finding, rise: Finding) -> bool:
    """The first update that rewrote the weights came before the loss crossed its divergence ratio: the update of
    step s is applied after step s's loss, so it can raise only the losses of later steps."""
    r, s = rewrite.evidence.get("first_step"), rise.evidence.get("first_step")
    return r is not None and s is not None and r < s


def _rewrite_before(f: Finding, findings: list[Finding]) -> tuple[Finding, str] | None:
    """The ``update_rewrote`` (warning: a rewrite the run learnt past explains nothing later) of ``f``'s optimizer
    that explains ``f``, an ``exploding`` or a NaN the learning rate made (``nonfinite*``, variant
    ``learning_rate``), and why: its first rewrite came before ``f``'s first step, or, for an explosion, at that
    step and the learning rate alone made it (``rules.rewrite.lr_alone``); else (or for any other ``f``) None."""
    if not (f.code == "exploding" or f.code in _NONFINITE and f.evidence.get("variant") == "learning_rate"):
        return None
    s = f.evidence.get("first_step", f.evidence.get("born_at_step"))
    for g in findings:
        if g.code != "update_rewrote" or g.severity == "notice" or \
                f.evidence.get("series", g.evidence.get("series")) != g.evidence.get("series"):
            continue
        r = g.evidence.get("first_step")
        if r is None or s is None:
            continue
        if r < s:
            return g, _REWRITE["explosion" if f.code == "exploding" else "nan"]
        if r == s and f.code == "exploding" and g.evidence.get("lr_alone"):
            return g, _REWRITE["same_step"]
    return None


def _misplaced_clip(f: Finding, findings: list[Finding]) -> Finding | None:
    """The ``clip_after_step`` that explains ``f``, an ``update_rewrote`` or an ``exploding``: the clip was
    misplaced at ``f``'s first step s (it ran after the update of step s-1, or, at step 1, it runs that way every
    step). For an explosion, the norms over the limit were above the clip's max_norm: in place, it would have
    bounded the updates they drove. For a rewrite, the gradient that update used was above the clip's max_norm,
    and scaled to it the update would have stayed under the rewrite bound (else the learning rate alone rewrote
    the weights). Else None."""
    if f.code not in ("update_rewrote", "exploding"):
        return None
    c = next((g for g in findings if g.code == "clip_after_step"), None)
    if c is None or c.evidence.get("max_norm") is None:
        return None
    b, s = c.evidence["max_norm"], f.evidence.get("first_step")
    if f.code == "exploding":
        at = s is not None and (s - 1 in c.steps or (s == 1 and 1 in c.steps))
        return c if at and f.evidence.get("variant") != "overflow" and b < f.evidence.get("peak", 0) else None
    norm, ratio = f.evidence.get("first_norm"), f.evidence.get("first_ratio")
    if s is None or norm is None or ratio is None or not (s - 1 in c.steps or (s == 1 and 1 in c.steps)):
        return None
    # the update scaled as the clip would have scaled its gradient (a norm at or under the bound gives a ratio
    # of 1x or more: the rewrite is not the clip's)
    if not (math.isfinite(norm) and norm > 0):
        return None
    return c if ratio * b / norm < RunLimits.blowup_update else None


def _learning_rate(f: Finding, effect: str) -> bool:
    """A finding that blames the learning rate for a blow-up (for the units it killed, ``effect`` dead or
    mostly_zero: an explosion whose harm is a loss jump or an update that rewrote the weights, too)."""
    if f.code == "loss_diverging":
        return f.severity != "notice" and f.evidence.get("variant") != "bootstrapped"
    if f.code == "exploding" and effect in ("dead", "mostly_zero"):
        return f.severity != "notice" and bool({"rewrite", "loss_jump"} & set(f.evidence.get("harm", ())))
    return f.code in _NONFINITE and f.evidence.get("variant") == "learning_rate"


def link_causes(findings: list[Finding], order: list[str] = ()) -> list[Finding]:
    """Mark each finding that another explains (in place: ``evidence["follows"]``, a sentence in its detail).
    ``order``: the parameters' names in registration order (where a tensor sits in depth)."""
    # tensors in the model's computation that never learn (zero, or cut off from the loss after their module ran)
    # explain what depends on them; tensors the forward never uses explain nothing
    never = next((f for f in findings if f.code == "never_learns" and
                  (f.evidence.get("zero") or f.evidence.get("cut"))), None)
    zero = set(never.evidence["zero"]) | set(never.evidence.get("cut", ())) if never is not None else set()
    out = list(findings)
    accum = next((f for f in out if f.code == "no_zero_grad"), None)
    sched = [f for f in out if f.code == "lr_schedule"]
    ascent = next((f for f in out if f.code == "gradient_ascent" and f.severity != "notice"), None)
    saturated = next((f for f in out if f.code == "saturated_at_init"), None)
    for f in out:
        cause, why = None, ""
        lr = next((g for g in sched if f.code in _SCHEDULE[g.evidence["variant"]][0] and
                   f.evidence.get("series", g.evidence["series"]) == g.evidence["series"]), None)
        if lr is not None:
            cause, why = lr, _SCHEDULE[lr.evidence["variant"]][1]
        elif ascent is not None and f.code in _ASCENT[0]:
            cause, why = ascent, _ASCENT[1]
        elif accum is not None and f.code in _ACCUMULATION[0]:
            cause, why = accum, _ACCUMULATION[1]
        elif (clip := _misplaced_clip(f, out)) is not None:
            cause, why = clip, _MISPLACED_CLIP if f.code == "update_rewrote" else _MISPLACED_CLIP_NORM
        elif f.code in ("update_rewrote", "loss_diverging") and (pair := _rewrite_and_rise(f, out)):
            # one of the pair is the other's cause, by which came first (``_rewrote_first``)
            rewrite, rise = pair
            if f is rise and _rewrote_first(rewrite, rise):
                cause, why = rewrite, _REWRITE["divergence"]
            elif f is rewrite and not _rewrote_first(rewrite, rise):
                cause, why = rise, "the divergence quotes this update as its learning rate's evidence"
        elif (hit := _rewrite_before(f, out)) is not None:
            cause, why = hit
        elif f.code in _BLOW_UP[0] and f.evidence.get("variant") != "overflow":  # the largest blow-up: its own
            # the same optimizer's (a last step's finding has no series: the last optimizer's)
            c = next((g for g in out if g is not f and _learning_rate(g, f.code) and
                      f.evidence.get("series", g.evidence.get("series")) == g.evidence.get("series")), None)
            if c is not None:
                cause, why = c, _BLOW_UP[1]
        if cause is None and never is not None and f is not never:
            if f.code in _NEVER[0]:
                cause, why = never, _NEVER[1] + ("" if set(f.layers) <= zero else " (and more)")
            elif f.code == "stall":  # one optimizer only (the stall rule's)
                cause, why = never, _NEVER_STALL
            elif f.code == "depth_vanishing" and _starves(f, zero, order):
                cause, why = never, ("a layer that passes no gradient back starves the layers before it of "
                                     "theirs")
        if cause is None and saturated is not None and f.code in _SATURATED[0]:
            cause, why = saturated, _SATURATED[1]
        if cause is None or f.evidence.get("follows"):
            continue
        f.evidence["follows"] = cause.code
        for guess in _LR_GUESSES:
            f.title = f.title.replace(guess, "")
        for claim, plain in _LR_CLAIMS:
            f.detail = f.detail.replace(claim, plain)
        for guess in GUESSES:  # the known cause replaces the guess
            f.detail = f.detail.replace(guess, "")
        if cause.code == "clip_after_step":  # "clip" asks for a clip the script has: it needs moving
            f.title = f.title.replace(": clip (max_norm=1.0)", "").replace(": clip now", "")
        f.detail += f" It follows from `{cause.code}` (above): {why}."
    return out


def _starves(depth: Finding, zero: set[str], order: list[str]) -> bool:
    """A tensor that never learns sits after (deeper than) one of the layers whose gradient vanished."""
    pos = {n: i for i, n in enumerate(order)}
    units = depth.evidence.get("units", {})
    dead = [pos[n] for n in zero if n in pos]
    early = [pos[n] for u in depth.layers for n in units.get(u, ()) if n in pos]
    return bool(dead and early) and max(dead) > min(early)
