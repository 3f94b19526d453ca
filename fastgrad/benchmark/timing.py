"""Timing: CUDA events on GPUs, ``time.perf_counter`` on the CPU; medians and spreads over repetitions.

The implementations of one (workload, op) are timed interleaved: each round times every implementation once,
starting at a different one each round, so a drift of the machine (another job starting, clocks changing)
hits all of them alike instead of whichever happened to run last.

Each repetition is bracketed on its own, so a ``reset`` (restoring gradients, flushing the GPU's L2 cache)
runs between repetitions without being timed, and the device is synchronised before the call, outside the
timed region. The host time of the call (how long Python is busy until the call returns, launches
included) is recorded alongside: on a GPU it is the overhead an asynchronous op adds to a training step; on
the CPU it equals the wall time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Rows whose spread is over this are marked unstable (and kept out of the best-speedup table).
UNSTABLE_SPREAD = 0.10

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
        events (read after the round's final sync) or, on the CPU, the wall time in ms."""
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
        out = self.measure_interleaved([fn], reset)[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def measure_interleaved(self, fns: list[Callable[[], object]], reset: Callable[[], None] | None = None,
                            max_reps: int | None = None) -> list[Measurement | Exception]:
        """Time ``fns`` round-robin; returns one Measurement per function, or the exception it raised (a
        failing function leaves the rotation, the others go on). ``reset`` runs before every call."""
        results: list[Measurement | Exception | None] = [None] * len(fns)
        est = [0.0] * len(fns)
        for i, fn in enumerate(fns):
            try:
                for _ in range(max(self.warmup, 1)):
                    self._prep(reset)
                    t0 = time.perf_counter()
                    fn()
                    self.sync()
                    est[i] = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - reported per implementation by the caller
                results[i] = exc
        alive = [i for i in range(len(fns)) if results[i] is None]
        if not alive:
            return results  # type: ignore[return-value]
        # The budget is per implementation: each gets budget_s of timing on average.
        per_round = max(sum(est[i] for i in alive), 1e-6)
        cap = self.max_reps if max_reps is None else max_reps
        reps = int(min(cap, max(self.min_reps, self.budget_s * len(alive) / per_round)))
        dev: dict[int, list] = {i: [] for i in alive}
        host: dict[int, list[float]] = {i: [] for i in alive}
        for r in range(reps):
            order = alive[r % len(alive):] + alive[:r % len(alive)]
            for i in order:
                if results[i] is not None:
                    continue
                self._prep(reset)
                try:
                    d, h = self._once(fns[i])
                except Exception as exc:  # noqa: BLE001
                    results[i] = exc
                    continue
                dev[i].append(d)
                host[i].append(h)
        self.sync()
        for i in alive:
            if results[i] is not None:
                continue
            ms = [s.elapsed_time(e) for s, e in dev[i]] if self.cuda else dev[i]
            results[i] = Measurement.of(ms, host[i])
        return results  # type: ignore[return-value]


def copy_bandwidth(timer: Timer, nbytes: int) -> float:
    """Measured bandwidth of a large device-to-device copy in GB/s (10^9 bytes/s, read + write counted)."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=timer.device)
    dst = torch.empty_like(src)
    m = timer.measure(lambda: dst.copy_(src))
    del src, dst
    return 2 * n * 4 / (m.median_ms * 1e-3) / 1e9
