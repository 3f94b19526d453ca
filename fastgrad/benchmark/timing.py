"""Timing: CUDA events on GPUs, ``time.perf_counter`` on the CPU; paired ratios with confidence intervals.

The implementations of one (workload, op) are timed in rounds: each round times every implementation once,
starting at a different one each round, so a drift of the machine (another job starting, clocks changing)
hits all of them alike. What a reader is told is a *paired* figure: in every round the baseline's time over
the candidate's time (the speedup of that round), and the median of those ratios with a distribution-free
interval (order statistics of the binomial, no normality assumed). On a shared machine the absolute times
of a run wander by tens of percent, but two calls timed a few milliseconds apart see the same machine, so
their ratio is steady where the times are not.

Rounds go on until every headline ratio is settled (its interval lies clear of the verdict thresholds, or
is tight), or the case's time budget is spent, or ``max_rounds`` is reached.

Each repetition is bracketed on its own, so a ``reset`` (restoring gradients, flushing the GPU's L2 cache)
runs between repetitions without being timed, and the device is synchronised before the call, outside the
timed region. The host time of the call (how long Python is busy until the call returns, launches
included) is recorded alongside: on a GPU it is the overhead an asynchronous op adds to a training step; on
the CPU it equals the wall time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Confidence of the ratio intervals.
CONFIDENCE = 0.95
#: A speedup whose median lies within this band of 1 (1/1.05 .. 1.05) is "within noise" even when its
#: interval excludes 1: on a shared machine a 5% difference is not one a later run reliably repeats.
BAND = 0.05

#: Back-to-back calls per implementation per round when its calls are short (see Timer.rounds).
INNER = 3
INNER_BELOW_S = 0.025

#: Bytes zeroed before every GPU repetition: larger than any current L2 (H100 50 MB, H200 60 MB), so every
#: repetition reads its data from HBM and not from the cache the previous repetition warmed.
L2_FLUSH_BYTES = 256 * 2**20


def spread(samples: list[float]) -> float:
    """Interquartile range over median, (p75 - p25) / median, of ``samples`` (quartiles interpolated between
    order statistics); NaN for fewer than two samples, where no spread can be seen. The IQR is how far the
    middle half of the repetitions scatter, which is what makes a median trustworthy or not; a single
    preempted repetition on a shared machine does not move it, a machine that keeps drifting does."""
    if len(samples) < 2:
        return float("nan")
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    med = statistics.median(samples)
    return (q3 - q1) / med if med > 0 else float("nan")


@dataclass
class Measurement:
    median_ms: float
    min_ms: float
    host_ms: float
    reps: int
    #: (p75 - p25) / median of the timed repetitions, and of the host times
    spread: float = float("nan")
    host_spread: float = float("nan")

    @classmethod
    def of(cls, dev_ms: list[float], host_ms: list[float]) -> Measurement:
        return cls(statistics.median(dev_ms), min(dev_ms), statistics.median(host_ms), len(dev_ms),
                   spread(dev_ms), spread(host_ms))


# ------------------------------------------------------------------------------------- paired ratios
@dataclass(frozen=True)
class Ratio:
    """Median of the per-round ratios baseline / candidate (> 1: the candidate is faster) and its interval;
    ``lo``/``hi`` are NaN when there are too few rounds for an interval at the confidence asked for."""

    median: float
    lo: float
    hi: float
    n: int


def _binom_cdf_half(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    if k < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(min(k, n) + 1)) / 2.0 ** n


def ci_rank(n: int, confidence: float = CONFIDENCE) -> int:
    """The 1-based rank k such that [x_(k), x_(n+1-k)] of n sorted samples covers the median with at least
    ``confidence`` (the sign-test interval); 0 when n is too small for any such interval."""
    alpha = 1.0 - confidence
    k = 0
    # P(median < x_(k+1)) = P(Binomial(n, 1/2) <= k); both tails together must stay within alpha.
    while k + 1 <= n // 2 and 2 * _binom_cdf_half(k, n) <= alpha:
        k += 1
    return k


def paired_ratio(base: list[float | None], cand: list[float | None], confidence: float = CONFIDENCE) -> Ratio:
    """Ratio of paired times, round by round (rounds where either is missing are skipped)."""
    rs = sorted(b / c for b, c in zip(base, cand) if b is not None and c is not None and c > 0 and b > 0)
    n = len(rs)
    if n == 0:
        return Ratio(float("nan"), float("nan"), float("nan"), 0)
    k = ci_rank(n, confidence)
    lo, hi = (rs[k - 1], rs[n - k]) if k > 0 else (float("nan"), float("nan"))
    return Ratio(statistics.median(rs), lo, hi, n)


FASTER, SLOWER, NOISE = "faster", "slower", "within noise"
#: No verdict either way: too few rounds for an interval (the reference rows, timed in the first rounds only), or
#: no round at all. Never "within noise": a 0.3x with no interval is not a tie.
NO_INTERVAL, NOT_MEASURED = "no interval", "not measured"
#: A row whose figures contradict each other (its times' medians against its paired ratio, or an op faster than
#: its own floor pass): a fault of the measurement, not a result either way.
PROBLEM = "measurement problem"


def verdict(r: Ratio, band: float = BAND) -> tuple[str, str]:
    """(verdict, why) for a speedup ratio: ``faster`` when the whole interval is above 1 and the median at
    least ``1 + band``; ``slower`` when the interval is below 1 and the median at most ``1 / (1 + band)``;
    otherwise ``within noise``, saying whether the interval straddles 1 or the median is within the band. With
    too few rounds for an interval, ``no interval`` (why: how many rounds); with none, ``not measured``."""
    if r.n == 0 or math.isnan(r.median):
        return NOT_MEASURED, ""
    if math.isnan(r.lo):
        return NO_INTERVAL, f"{r.n} round{'s' if r.n != 1 else ''}"
    if r.lo <= 1.0 <= r.hi:
        return NOISE, "interval straddles 1"
    if 1.0 / (1.0 + band) < r.median < 1.0 + band:
        return NOISE, f"within +-{100 * band:.0f}%"
    return (FASTER, "") if r.lo > 1.0 else (SLOWER, "")


def median_ratio(base: list[float | None], cand: list[float | None]) -> float:
    """The ratio of the two medians, baseline over candidate, over the rounds where both ran: what a reader
    computes from the time columns (each the median of its rounds)."""
    pairs = [(b, c) for b, c in zip(base, cand) if b is not None and c is not None and b > 0 and c > 0]
    if not pairs:
        return float("nan")
    return statistics.median(b for b, _ in pairs) / statistics.median(c for _, c in pairs)


def judged(base: list[float | None], cand: list[float | None], confidence: float = CONFIDENCE,
           band: float = BAND) -> tuple[Ratio, str, str, float]:
    """(the paired ratio, its verdict, why, the ratio of the medians) of ``cand`` against ``base``: the verdict
    of :func:`verdict`, unless the ratio of the medians (the time columns) lies outside the paired interval
    widened by the noise band on each side. Then the two figures of one row say different things, which
    happens when the times jump between levels during the case (a median of such times lands on either
    level): a measurement problem, not a verdict."""
    r = paired_ratio(base, cand, confidence)
    v, why = verdict(r, band)
    mr = median_ratio(base, cand)
    if not math.isnan(r.lo) and not math.isnan(mr) and not r.lo / (1.0 + band) <= mr <= r.hi * (1.0 + band):
        v, why = PROBLEM, (f"the medians give {mr:.2f}x, outside the paired interval: the times jumped between "
                           "levels during the case")
    return r, v, why, mr


def settled(r: Ratio, band: float = BAND, tight: float = 0.10) -> bool:
    """Whether more rounds would be wasted on ratio ``r``: its interval lies wholly beyond one of the verdict
    thresholds (above 1 + band, below 1 / (1 + band), or inside the band), or it is tight (hi / lo within
    1 + ``tight``), so its verdict cannot move by more than a ratio near a threshold."""
    if math.isnan(r.lo):
        return False
    up, down = 1.0 + band, 1.0 / (1.0 + band)
    return r.lo >= up or r.hi <= down or (r.lo >= down and r.hi <= up) or r.hi <= r.lo * (1.0 + tight)


@dataclass
class Rounds:
    """What :meth:`Timer.rounds` measured: per implementation, its time in every round (None when it did
    not run that round) and host times alike, or the exception it raised."""

    dev_ms: list[list[float | None]]
    host_ms: list[list[float | None]]
    errors: list[BaseException | None]
    n_rounds: int
    #: why the rounds stopped: "settled", "budget", "max_rounds", "failed" (every pair lost a side)
    stopped: str
    #: calls per function per round (the round kept the fastest)
    inner: int = 1

    def measurement(self, i: int) -> Measurement | None:
        d = [x for x in self.dev_ms[i] if x is not None]
        h = [x for x in self.host_ms[i] if x is not None]
        return Measurement.of(d, h) if d else None


class Timer:
    def __init__(self, device: torch.device, *, warmup: int = 2, min_reps: int = 3, max_reps: int = 50,
                 budget_s: float = 1.0, flush_l2: bool = True):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.warmup, self.min_reps, self.max_reps, self.budget_s = warmup, min_reps, max_reps, budget_s
        self._flush = None
        if self.cuda and flush_l2:
            self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=self.device)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _prep(self, reset: Callable[[], None] | None) -> None:
        if reset is not None:
            reset()
        if self._flush is not None:
            self._flush.zero_()
        self.sync()

    def _once(self, fn: Callable[[], object]):
        """One timed call after ``_prep``: (device timing, host ms). The device timing is a pair of CUDA
        events (read at the end of the round) or, on the CPU, the wall time in ms."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            h0 = time.perf_counter()
            fn()
            h1 = time.perf_counter()
            end.record()
            return (start, end), (h1 - h0) * 1e3
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms

    def measure(self, fn: Callable[[], object], reset: Callable[[], None] | None = None) -> Measurement:
        """A single function's median over ``min_reps``..``max_reps`` repetitions within ``budget_s``."""
        r = self.rounds([fn], reset, pairs=[], min_rounds=self.min_reps, max_rounds=self.max_reps,
                        budget_s=self.budget_s)
        if r.errors[0] is not None:
            raise r.errors[0]
        m = r.measurement(0)
        assert m is not None
        return m

    def _warm(self, fns, resets, errors) -> list[float]:
        """Untimed warm-up calls; returns each function's last warm-up time in seconds."""
        est = [0.0] * len(fns)
        for i, fn in enumerate(fns):
            try:
                for _ in range(max(self.warmup, 1)):
                    self._prep(resets[i])
                    t0 = time.perf_counter()
                    fn()
                    self.sync()
                    est[i] = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - reported per implementation by the caller
                errors[i] = exc
        return est

    def rounds(self, fns: list[Callable[[], object]],
               reset: Callable[[], None] | list[Callable[[], None] | None] | None = None, *,
               pairs: list[tuple[int, int]], min_rounds: int, max_rounds: int, budget_s: float,
               ref: tuple[int, ...] = (), ref_rounds: int | None = None, host: bool = False,
               band: float = BAND, confidence: float = CONFIDENCE, inner: int | None = 1,
               min_inner: dict[int, int] | None = None, rounds_of: dict[int, int] | None = None) -> Rounds:
        """Time ``fns`` in rounds (each round every live function once, the starting one rotating) after
        ``warmup`` untimed calls each. Stops once every ``(baseline, candidate)`` pair in ``pairs`` is
        :func:`settled` (at least ``min_rounds`` rounds), or ``budget_s`` seconds of rounds are spent (at
        least ``min_rounds``), or at ``max_rounds``. Functions in ``ref`` (reference implementations, not
        part of the headline) run in the first ``ref_rounds`` rounds only. A function that raises leaves the
        rotation and its exception is returned; ``reset`` runs before every call, untimed (a list: one reset per
        function, e.g. the floor pass's own). ``host``: judge
        the pairs on host times (the host-overhead workloads).

        ``inner``: calls per function per round, back to back, of which the round keeps the fastest: the
        time of a call that the rest of a busy machine did not interrupt (preemption only ever adds time).
        None chooses: :data:`INNER` when the slowest function's warm-up call took under
        :data:`INNER_BELOW_S`, else 1 (long calls are interrupted every time, and cost too much to repeat).
        ``min_inner``: at least that many calls per round for the functions it names (e.g. the floor pass,
        short and cheap, whose fastest call should be an uninterrupted one). ``rounds_of``: the functions it
        names run in that many first rounds only (overrides ``ref_rounds`` for them)."""
        n = len(fns)
        errors: list[BaseException | None] = [None] * n
        dev: list[list] = [[] for _ in range(n)]
        hst: list[list] = [[] for _ in range(n)]
        resets = list(reset) if isinstance(reset, (list, tuple)) else [reset] * n
        est = self._warm(fns, resets, errors)
        if inner is None:
            inner = INNER if max(est, default=0.0) < INNER_BELOW_S else 1
        ref_rounds = min_rounds if ref_rounds is None else ref_rounds
        t0 = time.perf_counter()
        stopped = "max_rounds"
        r = 0
        while r < max_rounds:
            live = [i for i in range(n) if errors[i] is None
                    and r < (rounds_of or {}).get(i, ref_rounds if i in ref else max_rounds)]
            if not live:
                stopped = "failed"
                break
            order = live[r % len(live):] + live[:r % len(live)]
            got: dict[int, list[tuple]] = {}
            for i in order:
                try:
                    for _ in range(max(inner, (min_inner or {}).get(i, 0))):
                        self._prep(resets[i])
                        got.setdefault(i, []).append(self._once(fns[i]))
                except Exception as exc:  # noqa: BLE001
                    errors[i] = exc
                    got.pop(i, None)
            self.sync()
            for i in range(n):
                calls = got.get(i)
                if not calls:
                    dev[i].append(None)
                    hst[i].append(None)
                    continue
                ds = [d[0].elapsed_time(d[1]) for d, _ in calls] if self.cuda else [d for d, _ in calls]
                dev[i].append(min(ds))
                hst[i].append(min(h for _, h in calls))
            r += 1
            if r < min_rounds:
                continue
            series = hst if host else dev
            live_pairs = [(b, c) for b, c in pairs if errors[b] is None and errors[c] is None]
            if pairs and not live_pairs:
                stopped = "failed"  # nothing left to judge: no point spending the budget
                break
            if live_pairs and all(settled(paired_ratio(series[b], series[c], confidence), band)
                                  for b, c in live_pairs):
                stopped = "settled"
                break
            if time.perf_counter() - t0 >= budget_s:
                stopped = "budget"
                break
        return Rounds(dev, hst, errors, r, stopped, inner)


def copy_bandwidth(timer: Timer, nbytes: int) -> float:
    """Measured bandwidth of a large device-to-device copy in GB/s (10^9 bytes/s, read + write counted):
    the floor's rate for passes that read and write gradients."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=timer.device)
    dst = torch.empty_like(src)
    m = timer.measure(lambda: dst.copy_(src))
    del src, dst
    return 2 * n * 4 / (m.median_ms * 1e-3) / 1e9


def read_bandwidth(timer: Timer, nbytes: int) -> float:
    """Measured bandwidth of a large read-only stream in GB/s: the sum of an fp32 tensor (one 4-byte read
    per element, nothing written but the scalar), the floor's rate for passes that only read gradients."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=timer.device)
    m = timer.measure(lambda: src.sum())
    del src
    return n * 4 / (m.median_ms * 1e-3) / 1e9


def inplace_bandwidth(timer: Timer, nbytes: int) -> float:
    """Measured bandwidth of a large in-place read+write pass in GB/s (read + write counted): ``x.mul_(1)``,
    the access pattern of in-place gradient passes (scale, clip by value). On CPUs it beats a copy into
    another buffer, whose destination lines are read before they are written (write-allocate)."""
    n = nbytes // 4
    x = torch.ones(n, dtype=torch.float32, device=timer.device)
    m = timer.measure(lambda: x.mul_(1.0))
    del x
    return 2 * n * 4 / (m.median_ms * 1e-3) / 1e9
