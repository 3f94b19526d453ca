"""The harm a checked run shows, per optimizer series: what the severity of a finding about the gradient norm
rests on. A number from the guide alone (a norm above 100 or 1000) is a question for the user, a notice; a
warning or a critical finding needs harm the run itself shows:

- ``nonfinite``: a NaN/Inf loss or gradient in the series, from the steps in question on (a NaN/Inf loss at a
  step a GradScaler or StepGuard skipped too: no loss scale makes the loss itself non-finite);
- ``loss_rose``: the loss rose against its own noise (the last quarter's mean above the first quarter's by
  more than ``RunLimits.stall_z`` standard errors of that difference and ``Thresholds.loss_progress`` of its
  level: ``loss_change``, the same statistics the stall rule reads), except in a run that moves its own targets
  (a target network) or steps an RL environment: its losses grow with the returns;
- ``loss_jump``: the loss jumped far above its recent median at the step after one of the steps (the
  ``loss_spike`` rule's robust jump, or ``RunLimits.far_ratio`` times the median of the losses before it), and
  out of the swings its own history shows in ratio (``trends.LOG_Z``), to above the loss of that step itself and
  of the excursion it was in (``Harm.rose_after``); not while the loss comes back from a jump a target network's
  hard copy made (``Harm.sync_transients``). A loss is compared only with losses on the same data: in an
  on-policy agent's run, those since its last new rollout (``data_refreshes``), whose first batches are new to
  the model;
- ``rewrite``: a measured update moved the weights by ``RunLimits.blowup_update`` (1x) of their size or more;
- ``far``: a step's norm is ``RunLimits.far_ratio`` times (or more) the run's own level: the median of the
  finite norms before it (up to 50 of them, at least ``RunLimits.far_history``), by more than the loss's own
  rise at that step explains (``Harm.far_for_its_loss``).

A loss summed over the batch has norms in the thousands and falls; a policy gradient's norm grows with its
episodes as it learns: neither shows any of these, so neither is warned about."""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

from ..finding import fmt
from ..thresholds import RunLimits, Thresholds
from .base import RunView, median
from .trends import LOSS_JUMP, SPIKE_RATIO, above_tail, beyond_ratio_noise, robust_jumps

__all__ = ["loss_change", "own_level", "update_size", "tiny_update", "data_refreshes", "Harm", "harm_of", "BASELINE",
           "SCALE_QUESTION", "RISE_REASON", "GUESSES"]

#: what a norm above the guide's limits with no harm most often is, and a rising one: guesses that a finding which
#: follows from a known cause drops (``consistency.link_causes``)
SCALE_QUESTION = (" Is it the loss's own scale? A loss summed over the batch (or over an episode) has norms this "
                  "size while it learns.")
RISE_REASON = (" A norm that grows while the run learns (longer episodes of a policy gradient, a sharper model) is "
               "not a divergence by itself; no action needed while that holds.")
GUESSES = (SCALE_QUESTION, RISE_REASON)

#: the norms a step is compared with: up to this many finite norms before it (the spike rule's baseline)
BASELINE = 50


def loss_change(losses: list[float], *, window: int, z: float, rel: float) -> dict:
    """How the finite ``losses`` (oldest first) moved over their last ``window`` values, against their own
    noise: ``first``/``last`` (the first and the last quarter's means, a quarter of at least 2), ``noise`` (the
    step-to-step noise: the scaled MAD of the successive differences about their mean, over sqrt(2), which a
    steady trend does not inflate), ``se`` (the standard error of the difference of the two means), ``drop``
    (first - last) and ``need`` (the change that counts: ``z`` standard errors and ``rel`` of the level).
    ``improved``: drop > need; ``rose``: -drop > need."""
    vals = losses[-window:]
    q = max(2, len(vals) // 4)
    first, last = sum(vals[:q]) / q, sum(vals[-q:]) / q
    diffs = [b - a for a, b in zip(vals, vals[1:])]
    md = sum(diffs) / len(diffs)  # the trend per step (an alternating wiggle has a median difference of +-e)
    noise = 1.4826 * median([abs(d - md) for d in diffs]) / math.sqrt(2)
    se = noise * math.sqrt(2 / q)
    need = max(z * se, rel * abs(first))
    drop = first - last
    return {"first": first, "last": last, "noise": noise, "se": se, "drop": drop, "need": need, "n": len(vals),
            "quarter": q, "improved": drop > need, "rose": -drop > need}


def own_level(norms: list[float], i: int, min_history: int) -> float | None:
    """The run's own level before position ``i`` of ``norms``: the median of the up to ``BASELINE`` finite
    norms before it; None when fewer than ``min_history`` (``RunLimits.far_history``) are known or it is 0."""
    base = [v for v in norms[max(0, i - BASELINE):i] if math.isfinite(v)]
    if len(base) < min_history:
        return None
    lev = median(base)
    return lev if lev > 0 else None


def update_size(run: RunView, k: int) -> tuple[float | None, int]:
    """``(median, count)`` of series ``k``'s finite measured update/weight ratios (median None: none measured):
    the size of its updates that ``stall`` and ``update_tiny`` judge."""
    ups = sorted(u["ratio"] for u in run.ctx.get("updates") or () if u["series"] == k and math.isfinite(u["ratio"]))
    return (ups[len(ups) // 2] if ups else None), len(ups)


def tiny_update(ratio: float | None, limits: RunLimits) -> bool:
    """Updates below ``RunLimits.stall_tiny_update`` of the weights: the learning rate cannot move them."""
    return ratio is not None and ratio < limits.stall_tiny_update


def data_refreshes(run: RunView, k: int) -> list[int]:
    """The steps of series ``k`` that are its first on freshly collected data. In a run that steps an RL
    environment, a series most of whose steps follow the same number of model calls (its update's own forwards:
    an on-policy agent's update epochs on one rollout) and some at least ``RunLimits.refresh_calls`` more (a
    rollout, collected with gradients on or off): those. A DQN acts as often before each of its steps, and a
    policy gradient updating once per episode follows as many calls as its episode had steps, so neither has
    any; nor has a run with no environment (an evaluation between epochs collects no data)."""
    if not run.ctx.get("environment"):
        return []
    recs = run.per.get(k, [])
    calls = sorted((r.step, r.calls) for r in run.steps)
    at = [s for s, _ in calls]
    total = list(itertools.accumulate(n for _, n in calls))

    def upto(step: int) -> int:  # the calls counted by the run's steps up to ``step``
        i = bisect.bisect_right(at, step)
        return total[i - 1] if i else 0

    counts = [upto(r.step) - (upto(p.step) if p is not None else 0) for p, r in zip([None, *recs], recs)]
    usual = median(counts) if counts else 0
    if sum(n == usual for n in counts) * 2 <= len(counts):
        return []
    return [r.step for r, n in zip(recs, counts) if n - usual >= run.limits.refresh_calls]


@dataclass
class Harm:
    """The harm one series shows (see the module docstring). ``items`` of :meth:`at`: ``(kind, text)``."""

    series: int
    steps: list[int]
    norms: list[float]
    nonfinite: list[int] = field(default_factory=list)   # steps with a NaN/Inf loss or gradient
    jumps: dict = field(default_factory=dict)            # step -> (loss, ratio to its recent median)
    change: dict | None = None                           # loss_change of the series' finite losses
    rewrites: list[tuple[int, float]] = field(default_factory=list)  # (step, update/weight ratio >= 1)
    losses: list[float] = field(default_factory=list)     # the loss at each of ``steps`` (NaN: none)
    # the run moves its own targets (a target network) or steps an RL environment: its losses grow with the
    # returns, so a rise over the run is no harm by itself (``loss_diverging``'s bootstrapped notice); jumps,
    # NaN/Inf and rewrites still are
    bootstraps: bool = False
    acts: bool = False   # the run steps an RL environment: its agent collects its own data
    used: list[float] = field(default_factory=list)       # the norm each update used (after any clip)
    far_ratio: float = RunLimits.far_ratio
    far_history: int = RunLimits.far_history
    # a loss that ends above its value before a rewrite by more than this many standard errors and this share
    # of that value never came back (``unrecovered``): ``RunLimits.stall_z``, ``Thresholds.loss_progress``
    back_z: float = RunLimits.stall_z
    back_rel: float = Thresholds.loss_progress

    def rewrite_words(self) -> str:
        """What the measured updates did, for a finding that found no harm: none rewrote the weights, or the one
        that did the run learnt past (``rewrite_harm``)."""
        if not self.rewrites:
            return "no update rewrote the weights"
        s, r = self.rewrites[0]
        return f"the one update that rewrote the weights ({fmt(r)}x, step {s}) the run learnt past"

    def rewrite_grave(self, harm: list) -> bool:
        """The run's rewrites are harm: they recur, or ``harm`` (their ``rewrite_harm``) shows some."""
        return len(self.rewrites) > 1 or bool(harm)

    def rewrite_harm(self, steps: list[int], first: int, *, stuck: bool = False) -> list[tuple[str, str]]:
        """The harm the run shows from a rewrite at ``steps`` (begun at ``first``) on, besides the rewrite itself:
        what ``at`` finds there, and what shows the run did not learn past it (``unrecovered``). Empty, for one
        rewrite: the run learnt past it (Adam's first step on small weights, a linear model's first step from a
        near-zero initialisation), and no finding takes it for damage; ``update_rewrote`` says so at notice."""
        return self.at(steps, rewrite=False) + self.unrecovered(first, stuck=stuck)

    def unrecovered(self, first: int, *, stuck: bool = False) -> list[tuple[str, str]]:
        """What shows that the run did not learn past a rewrite that began at ``first``, each as (kind, evidence
        in words): its loss did not improve over the run (``no_progress``; not where ``stuck``: tensors that never
        learn explain a flat loss), or it fell yet never came back to its value at ``first`` (``not_recovered``).
        Part of ``rewrite_harm``."""
        c, out = self.change, []
        if c is not None and not c["improved"] and not c["rose"] and not stuck:
            out.append(("no_progress", "the loss did not improve over the run"))
        before = self.losses[self.steps.index(first)] if first in self.steps else math.nan
        if c is not None and c["improved"] and math.isfinite(before) and \
                c["last"] - before > max(self.back_z * c["se"], self.back_rel * abs(before)):
            out.append(("not_recovered", f"the loss never came back to {fmt(before)}, its value at step "
                                         f"{first}: {fmt(c['last'])} over the last quarter of the run"))
        return out

    def far(self, step: int) -> tuple[float, float] | None:
        """(norm / own level, own level) at ``step`` when that is at least ``far_ratio``, else None."""
        if step not in self.steps:
            return None
        i = self.steps.index(step)
        lev = own_level(self.norms, i, self.far_history)
        v = self.norms[i]
        if lev is None or not math.isfinite(v) or v < self.far_ratio * lev:
            return None
        return v / lev, lev

    def unusual(self, step: int) -> bool:
        """The norm at ``step`` stands out of the run's own level: ``SPIKE_RATIO`` times the median of the norms
        before it or more, or no level is known yet (the first step). A loss jump after a step whose norm was
        the run's usual one (a loss summed over the batch has norms above 100 at every step) is not the doing of
        that step's gradient: its update was of the run's usual size. Where a clip bounded the step, the norm its
        update used is what is compared (with the norms the run's updates used)."""
        if step not in self.steps:
            return False
        i = self.steps.index(step)
        norms, v = self.norms, self.norms[i]
        u = self.used[i] if i < len(self.used) else math.nan
        if math.isfinite(v) and math.isfinite(u) and u < v:
            # a clip bounded this update: its size is the norm it used, judged against the norms the updates used
            norms, v = self.used, u
        lev = own_level(norms, i, self.far_history)
        return lev is None or not math.isfinite(v) or v >= SPIKE_RATIO * lev

    def far_for_its_loss(self, step: int) -> bool:
        """``far`` at ``step`` by more than the loss's own rise there explains. A squared error's gradient grows
        with the square root of the loss (a TD error that grows with the returns: its norm follows): a norm ``r``
        times its own level beside a loss ``l`` times its own is far when ``r / sqrt(l)`` is at least
        ``far_ratio``. Where the loss did not rise, or has no positive level, that is ``far`` itself."""
        f = self.far(step)
        if f is None:
            return False
        i = self.steps.index(step)
        v = self.losses[i] if i < len(self.losses) else math.nan
        lev = own_level(self.losses, i, self.far_history)
        if lev is None or not math.isfinite(v) or v <= lev:
            return True
        return f[0] / math.sqrt(v / lev) >= self.far_ratio

    def following(self, steps) -> set[int]:
        """The series' step after each of ``steps`` (the step whose loss that step's update drove)."""
        pos = {s: i for i, s in enumerate(self.steps)}
        return {self.steps[pos[s] + 1] for s in steps if s in pos and pos[s] + 1 < len(self.steps)}

    def rose_after(self, steps) -> set[int]:
        """Of the steps ``following`` each of ``steps``, those whose loss stood above the peak of the excursion
        that step was in: its own loss, and every loss before it back to the last one at or below its level (the
        median of the losses before that step, ``own_level``). The loss the update drove must be higher than the
        loss was before it. A loss already as high at the step itself (a hard batch, a PPO batch its epochs reuse)
        or earlier in the same excursion (a DQN's loss coming back from a hard copy of its target network) was
        high before the update; its next value is no damage of it. A step whose own loss is unknown or
        non-finite is not compared."""
        pos = {s: i for i, s in enumerate(self.steps)}
        out = set()
        for s in steps:
            i = pos.get(s)
            if i is None or i + 1 >= len(self.steps):
                continue
            before = self.losses[i] if i < len(self.losses) else math.nan
            after = self.losses[i + 1] if i + 1 < len(self.losses) else math.nan
            if not (math.isfinite(before) and math.isfinite(after)):
                out.add(self.steps[i + 1])
                continue
            peak, lev, j = before, own_level(self.losses, i, self.far_history), i - 1
            while lev is not None and j >= 0 and math.isfinite(self.losses[j]) and self.losses[j] > lev:
                peak = max(peak, self.losses[j])
                j -= 1
            if after > peak:
                out.add(self.steps[i + 1])
        return out

    def at(self, steps: list[int], *, far: bool = True, own_step=(), usual_ok: bool = True, rewrite: bool = True
           ) -> list[tuple[str, str]]:
        """The harm shown at (or from) ``steps``, each as (kind, evidence in words); empty: none. ``own_step``:
        steps whose own loss jump counts too, as ``outlier_batch`` where that step's norm was also ``far`` (no
        damage: the batch or state the norm came from, before its update; ``exploding`` reads it as a warning where
        no clip bounded that update), else, or in a run that steps an RL environment (an episode's end is an
        outlier transition of the agent's own data), as ``hard_batch`` (no damage, a notice).
        ``usual_ok`` False: a loss jump counts only after a step whose norm was ``unusual`` (the harm of a large
        gradient; a rewrite's harm is its update's, whatever the norm). ``rewrite`` False: leave the rewrite
        itself out."""
        if not steps:
            return []
        out = []
        bad = [s for s in self.nonfinite if s >= steps[0]]
        if bad:
            out.append(("nonfinite", f"the loss or the gradients went NaN/Inf at step {bad[0]}"))
        # the step after each (the update it drove): a loss that jumps at the step itself was computed before
        # that step's update, and its gradient grew with it (a hard batch, a deeper draw of a dynamic model)
        nxt = self.rose_after(steps if usual_ok else [s for s in steps if self.unusual(s)])
        jumped = sorted(s for s in self.jumps if s in nxt)
        if jumped:
            s = max(jumped, key=lambda t: self.jumps[t][1])
            out.append(("loss_jump", f"the loss jumped to {fmt(self.jumps[s][0])} at step {s}, "
                                     f"{self.jumps[s][1]:.3g}x its recent median"))
        elif own_step:
            own = set(own_step)
            mine = [s for s in self.jumps if s in own]
            if mine:
                s = max(mine, key=lambda t: self.jumps[t][1])
                # a batch whose gradient stood far above the run's own level too is an outlier (a corrupt or
                # extreme batch: a warning in `exploding`); nearer that level it is a hard batch, what a `spike`
                # is, with no damage after it
                # (a hard batch's finding goes on to say that nothing followed it)
                # An agent that collects its own data meets outlier transitions by design (an episode's end,
                # where a TD target stops bootstrapping): without damage after it, that is no corrupt batch
                kind, what = ("outlier_batch", "an outlier batch") if self.far(s) is not None and not self.acts \
                    else ("hard_batch", "a hard batch")
                out.append((kind, f"the loss of step {s} itself jumped to {fmt(self.jumps[s][0])}, "
                                  f"{self.jumps[s][1]:.3g}x its recent median ({what} or state, and its gradient "
                                  "with it" + ("; the next step's loss did not jump)" if kind == "outlier_batch"
                                               else ")")))
        c = self.change
        if c is not None and c["rose"] and not self.bootstraps:
            out.append(("loss_rose", f"the loss rose from {fmt(c['first'])} to {fmt(c['last'])} (first to last "
                                     f"quarter's mean), beyond its own noise ({fmt(c['need'])})"))
        # a rewrite is harm where it recurs or the run shows harm from it on (``rewrite_harm``); one the run
        # learnt past is not
        rw = [s for s, _ in self.rewrites]
        if rewrite and rw and self.rewrite_grave(self.rewrite_harm(rw, rw[0])):
            s, r = max(self.rewrites, key=lambda t: t[1])
            out.append(("rewrite", f"an update moved the weights by {fmt(r)}x their own size (step {s})"))
        if far:
            # far by more than its own loss explains: a deeper draw of a dynamic model, a hard batch, has a loss
            # far above its level and a gradient that grew with it (``far_for_its_loss``)
            hits = [(s, self.far(s)) for s in steps if self.far_for_its_loss(s)]
            hits = [(s, h) for s, h in hits if h is not None]
            if hits:
                s, (ratio, lev) = max(hits, key=lambda t: t[1][0])
                out.append(("far", f"the norm at step {s} was {ratio:.3g}x the run's own level before it "
                                   f"(median {fmt(lev)})"))
        return out

    def sync_transients(self, syncs) -> list[tuple[int, int]]:
        """``(first, last)`` steps of the series during which its loss came back from a jump a target network's
        hard copy made: from the first step at or after a sync (``target_syncs``) whose loss, or the next one's,
        jumped, to the step before the loss is first back at or below its level before the sync (the median of
        the losses before it). The targets changed under the loss there: its jumps are theirs, no update's. A sync
        with no jump (a Polyak average, every step) marks nothing."""
        out = []
        for k in sorted(set(syncs)):
            i = bisect.bisect_left(self.steps, k)
            if i >= len(self.steps) or not any(self.steps[j] in self.jumps for j in (i, i + 1)
                                               if j < len(self.steps)):
                continue
            lev = own_level(self.losses, i, self.far_history)
            if lev is None:
                continue
            j = i + 2
            while j < len(self.steps) and not (math.isfinite(self.losses[j]) and self.losses[j] <= lev):
                j += 1
            out.append((self.steps[i], self.steps[j - 1]))
        return out

    def loss_words(self) -> str:
        """What the loss did, for a finding that found no harm: it fell, it rose as a bootstrapped loss does (no
        harm here), or it did not rise beyond its noise."""
        fell, c = self.loss_fell(), self.change
        if fell:
            return f"the loss fell ({fell})"
        if c is not None and c["rose"] and self.bootstraps:
            return (f"the loss rose ({fmt(c['first'])} -> {fmt(c['last'])}) as a loss against the run's own returns "
                    "or targets does while it learns, no harm by itself")
        return "the loss did not rise beyond its own noise"

    def loss_fell(self) -> str | None:
        """"a -> b" (the first and the last quarter's mean loss) when the loss improved beyond its noise."""
        c = self.change
        return f"{fmt(c['first'])} -> {fmt(c['last'])}" if c is not None and c["improved"] else None


def _loss_jumps(pts: list[tuple[int, float]], history: int, lim: RunLimits, *, fresh: bool = False) -> dict:
    """step -> (loss, ratio to its recent median) of the jumps among ``pts`` (step, finite loss): the loss_spike
    rule's (its warm-up counted in these steps: early training moves fast) and, after ``history`` losses, one
    ``RunLimits.far_ratio`` times its own level (a positive one: a signed objective has none), out of its own
    swings in ratio (a loss that routinely swings 10x between steps has no jump at 16x) and of their upper tail
    (``above_tail``: a loss a tenth of whose steps stand 50x its median is judged against those). ``fresh``:
    ``pts`` are the losses of one rollout's update epochs, whose minibatches draw on the same data: a jump must also top
    every loss before it there (a minibatch of the rollout's rare states, no higher than the first pass met
    them, is the data's)."""
    vals = [v for _, v in pts]
    out = {pts[i - 1][0]: (v, ratio)
           for i, v, ratio, _ in robust_jumps(list(range(1, len(pts) + 1)), vals, new_after=0, **LOSS_JUMP)}
    for i, (s, v) in enumerate(pts):
        lev = own_level(vals, i, history)
        base = vals[max(0, i - BASELINE):i]
        if (lev is not None and v >= lim.far_ratio * lev and s not in out
                and beyond_ratio_noise(base, v, min_history=history)
                and above_tail(base, v, lim.far_ratio * lev, lim.far_ratio)):
            out[s] = (v, v / lev)
    if fresh:
        pos = {s: i for i, (s, _) in enumerate(pts)}
        peak = [-math.inf, *itertools.accumulate(vals, max)]  # peak[i]: the highest of the losses before i
        out = {s: j for s, j in out.items() if j[0] > peak[pos[s]]}
    return out


def harm_of(run: RunView, k: int) -> Harm:
    """The harm series ``k`` of ``run`` shows (computed once per run and series)."""
    cache = run.ctx.setdefault("_harm", {})
    if k in cache:
        return cache[k]
    lim, th = run.limits, run.th
    recs = run.per.get(k, [])
    steps = [r.step for r in recs]
    h = Harm(k, steps, [r.grad_norm for r in recs], far_ratio=lim.far_ratio, far_history=lim.far_history,
             back_z=lim.stall_z, back_rel=th.loss_progress)
    # ... and a NaN/Inf loss at a step a GradScaler or a StepGuard then skipped: the loss is computed before any
    # loss scale, so no scale made it (the weights or the data did); skipped gradients alone are the scale's
    h.nonfinite = sorted({r.step for r in recs if r.bad or (r.loss is not None and not math.isfinite(r.loss))}
                         | {r.step for r in run.steps if r.series == k and (r.skipped or r.guard_skipped)
                            and r.loss is not None and not math.isfinite(r.loss)})
    h.losses = [r.loss if r.loss is not None else math.nan for r in recs]
    h.used = [r.total_norm for r in recs]
    h.acts = bool(run.ctx.get("environment"))
    h.bootstraps = bool(run.ctx.get("moving_targets") or h.acts)
    pts = [(r.step, r.loss) for r in recs if r.loss is not None and math.isfinite(r.loss)]
    if len(pts) >= 4:
        h.change = loss_change([v for _, v in pts], window=lim.stall_window, z=lim.stall_z, rel=th.loss_progress)
    # each loss against the losses before it on the same data: an on-policy agent's are those since its last
    # new rollout (the run's level before it was the model's fit to the rollout before), and there against at
    # least as many of them as the loss_spike rule needs (a rollout's first batches have no level yet) and above
    # them all
    at = [s for s, _ in pts]
    fresh = {bisect.bisect_left(at, r) for r in data_refreshes(run, k)}
    cuts = sorted(fresh | {0, len(pts)})
    for a, b in zip(cuts, cuts[1:]):
        h.jumps.update(_loss_jumps(pts[a:b], LOSS_JUMP["min_history"] if a in fresh else lim.far_history, lim,
                                   fresh=a in fresh))
    # ... but not those of a loss coming back from a target network's hard copy: the targets moved under it
    spans = h.sync_transients(run.ctx.get("target_syncs") or ())
    if spans:
        h.jumps = {s: j for s, j in h.jumps.items() if not any(a <= s <= b for a, b in spans)}
    h.rewrites = [(u["step"], u["ratio"]) for u in run.ctx.get("updates") or ()
                  if u["series"] == k and math.isfinite(u["ratio"]) and u["ratio"] >= lim.blowup_update]
    cache[k] = h
    return h
