"""Rules over a series of values (a gradient-norm or loss history): robust jumps (``spike``, ``loss_spike``),
steady growth (``increasing``), decay to ~0 (``decaying``), and whether a loss history shows progress.
Pure functions of host lists, shared by the monitor and ``python -m fastgrad.check``."""

from __future__ import annotations

import math
from statistics import median
from typing import Sequence

from ..finding import Finding, fmt as _fmt
from ..thresholds import Thresholds

__all__ = ["loss_progress", "robust_jumps", "beyond_ratio_noise", "above_tail", "LOG_Z", "detect_loss_jumps", "detect_trends", "loss_falling", "LOSS_JUMP"]

#: a loss jump (``detect_loss_jumps``; ``python -m fastgrad.check`` reads the same rule as harm): over ``z``
#: robust std above the median of the up to ``window`` losses before it, and at least ``min_ratio`` x it, after
#: ``warmup`` values with ``min_history`` of them known
#: ... and over ``log_z`` robust std of the logarithms above their median (``beyond_ratio_noise``)
LOSS_JUMP = {"window": 50, "warmup": 10, "min_history": 10, "z": 6.0, "min_ratio": 3.0, "log_z": 3.0}

#: a loss jump must also stand out of the loss's swings in ratio: over this many robust std of the logarithms
#: above their median. A loss whose values routinely swing 10-100x between steps (summed over a model whose
#: depth is drawn per step, or over episodes of random length) has a linear MAD small next to its peaks, so a
#: routine peak passes the linear test; on the log scale it is one more swing. Losses only: a loss is a level
#: that multiplies, while a norm's spike is judged against its own spread as it is.
LOG_Z = LOSS_JUMP["log_z"]

#: ... and out of their upper tail. A loss that is a mixture (most steps near 1, a tenth or more of them at
#: 50-500: an agent's rare terminal transitions, a kind of hard batch drawn often) has a median and a MAD, on
#: either scale, that see only the majority, so its routine highs pass both tests. Where more than this share of
#: the recent losses reached a jump's bar, their level is the tail's: the jump is judged against the median of
#: that top share (``above_tail``; its lowest would pass the tail's own highs, which spread 5-10x). The share
#: is read from a full window only: a tenth of a few losses (a rollout's first ones, a transient after a
#: target copy) is one or two of them, no tail.
TAIL_SHARE = 0.1

#: a norm spike: this many times the median of the norms before it (and ``spike_z`` robust std above it). A
#: loss jump after a step whose norm was below this is not that gradient's doing (``Harm.unusual``)
SPIKE_RATIO = 3.0


def loss_progress(history: Sequence[float], rel: float = Thresholds.loss_progress) -> bool | None:
    """True when the loss history shows progress: the mean of its last quarter is at least ``rel`` (relative)
    below the mean of its first quarter. None when fewer than two finite values are known."""
    vals = [float(v) for v in history if math.isfinite(float(v))]
    if len(vals) < 2:
        return None
    k = max(1, len(vals) // 4)
    early = sum(vals[:k]) / k
    late = sum(vals[-k:]) / k
    return late < early - rel * abs(early)


def _robust_baseline(values: Sequence[float]) -> tuple[float, float]:
    """(median, scaled MAD) of ``values``: 1.4826 * MAD estimates the std of normal noise, and neither
    moves much when a few outliers (earlier spikes) are in the window."""
    med = median(values)
    mad = median(abs(v - med) for v in values)
    return med, 1.4826 * mad


def robust_jumps(steps: Sequence[int], values: Sequence[float], *, new_after: int, warmup: int, window: int,
                 min_history: int, z: float, min_ratio: float, log_z: float | None = None
                 ) -> list[tuple[int, float, float, float]]:
    """``(step, value, value / median, median)`` of each step after ``new_after`` and ``warmup`` whose value
    is over ``z`` robust std (floored at 5% of the median) above the median of the up to ``window`` finite
    values before it, at least ``min_ratio`` times that median (positive medians only), and over ``log_z``
    robust std of the logarithms of the positive ones above their median (``beyond_ratio_noise``) and
    ``min_ratio`` times their tail where more than a tenth of them reached the first two bars (``above_tail``)."""
    vals = list(values)
    out = []
    for i, (s, v) in enumerate(zip(steps, vals)):
        if s <= new_after or s <= warmup or not math.isfinite(v):
            continue
        base = [x for x in vals[max(0, i - window):i] if math.isfinite(x)]
        if len(base) < min_history:
            continue
        med, sd = _robust_baseline(base)
        above = med + z * max(sd, 0.05 * med)
        if (med > 0 and v > above and v >= min_ratio * med
                and (log_z is None or (beyond_ratio_noise(base, v, log_z, min_history)
                                       and above_tail(base, v, max(above, min_ratio * med), min_ratio)))):
            out.append((s, v, v / med, med))
    return out


def above_tail(base: Sequence[float], v: float, bar: float, ratio: float) -> bool:
    """``v`` stands ``ratio`` times above the upper tail of ``base`` where that tail reached ``bar``: the tail is
    the top ``TAIL_SHARE`` of ``base`` and one more (more than a tenth), its level their median. Losses only, as
    ``beyond_ratio_noise``; a ``base`` shorter than a full window (``LOSS_JUMP["window"]``) has none."""
    if len(base) < LOSS_JUMP["window"]:
        return True
    top = sorted(base)[-(int(len(base) * TAIL_SHARE) + 1):]
    return top[0] < bar or v >= ratio * median(top)


def beyond_ratio_noise(base: Sequence[float], v: float, log_z: float = LOG_Z, min_history: int = 1) -> bool:
    """``v`` is over ``log_z`` robust std of ``log(base)`` above its median (the std floored at log 1.05, as the
    linear one is at 5% of the median). Zeros have no logarithm: with fewer than ``min_history`` positive
    values the linear test decides alone."""
    logs = [math.log(x) for x in base if x > 0]
    if len(logs) < min_history:
        return True
    lmed, lsd = _robust_baseline(logs)
    return math.log(v) > lmed + log_z * max(lsd, math.log(1.05))


def detect_loss_jumps(steps: Sequence[int], losses: Sequence[float], *, new_after: int = 0,
                      window: int = LOSS_JUMP["window"], warmup: int = LOSS_JUMP["warmup"],
                      min_history: int = LOSS_JUMP["min_history"], z: float = LOSS_JUMP["z"],
                      notice_ratio: float = LOSS_JUMP["min_ratio"], warn_ratio: float = 10.0,
                      log_z: float = LOSS_JUMP["log_z"]) -> list[Finding]:
    """``loss_spike`` findings: a step after ``new_after`` (and after ``warmup`` values) whose loss is more
    than ``z`` robust standard deviations above the median of the up to ``window`` finite losses before it,
    AND at least ``notice_ratio`` times that median, AND over ``log_z`` robust std of their logarithms above
    theirs (a warning from ``warn_ratio``). Only positive medians are compared by ratio; a loss that can be
    negative gets no jump findings."""
    jumps = robust_jumps(steps, losses, new_after=new_after, warmup=warmup, window=window,
                         min_history=min_history, z=z, min_ratio=notice_ratio, log_z=log_z)
    if not jumps:
        return []
    top = max(jumps, key=lambda j: j[2])
    sev = "warning" if top[2] >= warn_ratio else "notice"
    title = (f"loss jump at step {top[0]}: {top[2]:.3g}x its recent median" if len(jumps) == 1 else
             f"loss jumps at {len(jumps)} steps (largest {top[2]:.3g}x its recent median, step {top[0]})")
    detail = "; ".join(f"step {s}: {_fmt(v)} ({r:.3g}x median {_fmt(m)})" for s, v, r, m in jumps[:5])
    return [Finding("loss_spike", sev, title, detail + ".", steps=[j[0] for j in jumps])]



def detect_trends(steps: Sequence[int], norms: Sequence[float], *, new_after: int = 0, spike_z: float = 6.0,
                  spike_ratio: float = SPIKE_RATIO, warn_ratio: float = 5.0, baseline: int = 50, warmup: int = 20,
                  window: int = 200, min_history: int = 10, trend_ratio: float = 2.0,
                  thresholds: Thresholds | None = None, losses: Sequence[float] | None = None) -> list[Finding]:
    """Trends of a total-norm history (oldest first), as report findings. Baselines are robust (median and
    scaled MAD), so earlier spikes and heavy-tailed noise do not move them, and steps up to ``warmup`` are
    never judged (early training is allowed to move fast):

    - ``spike``: a step after ``new_after`` whose norm is more than ``spike_z`` robust standard deviations
      above the median of the (up to ``baseline``) finite norms before it AND at least ``spike_ratio`` times
      that median; needs ``min_history`` of them. The robust std is floored at 5% of the median so a nearly
      constant history does not turn wobbles into spikes. A warning when some spike is ``warn_ratio`` times
      the median or more, else a notice. The title names the step and the size of the largest spike.
    - ``increasing``: the finite norms after ``warmup`` in the last ``window`` steps, split in four quarters:
      each quarter's median above the previous one and the last at least ``trend_ratio`` times the first.
      A warning, except when ``losses`` (one per step of ``steps``, NaN where unknown) show the loss falling
      over the same steps while every quarter's median stays inside the healthy band (0.1 to 10 by default):
      a converging run often has a rising norm, so that is a notice that shows the evidence.
    - ``decaying``: each quarter's median below the previous one and the last one under the vanishing
      threshold (1e-3), or 1000x below the first and under the healthy range (0.1): the norm decays to ~0.
    """
    th = thresholds or Thresholds()
    found: list[Finding] = []
    spikes = robust_jumps(steps, norms, new_after=new_after, warmup=warmup, window=baseline,
                          min_history=min_history, z=spike_z, min_ratio=spike_ratio)
    if spikes:
        s0, v0, r0, m0 = max(spikes, key=lambda t: t[2])
        sev = "warning" if r0 >= warn_ratio else "notice"
        title = (f"gradient norm spike at step {s0}: {r0:.3g}x the recent median" if len(spikes) == 1 else
                 f"gradient norm spikes at {len(spikes)} steps (largest at step {s0}: {r0:.3g}x the recent median)")
        detail = "; ".join(f"step {s}: norm {_fmt(v)} = {r:.3g}x median {_fmt(m)}" for s, v, r, m in spikes[:5])
        found.append(Finding("spike", sev, title, detail + ("; ..." if len(spikes) > 5 else "") + ".",
                             steps=[t[0] for t in spikes]))
    tail = list(zip(steps[-window:], norms[-window:]))
    recent = [v for s, v in tail if s > warmup and math.isfinite(v)]
    if len(recent) >= max(min_history, 4):
        q = len(recent) // 4
        med = [median(recent[i * q:(i + 1) * q]) for i in range(3)] + [median(recent[3 * q:])]
        first_step = next(s for s, v in tail if s > warmup and math.isfinite(v))
        if all(b > a for a, b in zip(med, med[1:])) and med[3] >= trend_ratio * med[0]:
            detail = (f"Median norm grew {med[3] / med[0] if med[0] else math.inf:.3g}x since step "
                      f"{first_step} ({' -> '.join(f'{m:.3g}' for m in med)}).")
            falling = loss_falling(steps, losses, first_step, window)
            if falling is not None and all(th.healthy_low <= m <= th.healthy_high for m in med):
                found.append(Finding("increasing", "notice", "gradient norm rising inside the healthy range while "
                                     "the loss falls", detail + f" It stays within {_fmt(th.healthy_low)} to "
                                     f"{_fmt(th.healthy_high)} and the loss fell {falling}: usual for a "
                                     "converging run, no action needed."))
            else:
                found.append(Finding("increasing", "warning", "gradient norm steadily increasing", detail))
        elif all(b < a for a, b in zip(med, med[1:])) and (
                med[3] < th.vanishing or (med[3] * 1000 <= med[0] and med[3] < th.healthy_low)):
            # "to ~0": a norm that falls 1000x but is still in or above the healthy range is not decaying
            found.append(Finding("decaying", "warning", "gradient norm decaying to ~0",
                                 f"Median norm fell from {med[0]:.3g} to {med[3]:.3g} since step {first_step}."))
    return found


def loss_falling(steps: Sequence[int], losses: Sequence[float] | None, first_step: int, window: int
                  ) -> str | None:
    """``"a -> b"`` (the mean of the first and of the last quarter of the finite losses from ``first_step`` on,
    within the last ``window`` steps) when the loss fell over them (``loss_progress``), else None."""
    if losses is None:
        return None
    pairs = list(zip(steps, losses))[-window:]
    vals = [float(v) for s, v in pairs if s >= first_step and math.isfinite(float(v))]
    if len(vals) < 4 or not loss_progress(vals):
        return None
    k = max(1, len(vals) // 4)
    return f"{_fmt(sum(vals[:k]) / k)} -> {_fmt(sum(vals[-k:]) / k)}"

