"""Timing: CUDA events on GPUs, ``time.perf_counter`` on the CPU; medians over adaptive repetitions.

Each repetition is bracketed on its own, so a ``reset`` (restoring gradients, flushing the GPU's L2 cache)
can run between repetitions without being timed. The host time of the call (how long Python is busy
before the call returns, launches included) is recorded alongside: on a GPU it is the overhead that an
asynchronous op adds to a training step; on the CPU it equals the wall time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Measurement:
    median_ms: float
    min_ms: float
    host_ms: float
    reps: int


class Timer:
    def __init__(self, device: torch.device, *, warmup: int = 2, min_reps: int = 3, max_reps: int = 50,
                 budget_s: float = 1.0, flush_l2: bool = True):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.warmup, self.min_reps, self.max_reps, self.budget_s = warmup, min_reps, max_reps, budget_s
        self._flush = None
        if self.cuda and flush_l2:
            # Larger than any current L2 (H100 50 MB, H200 60 MB), so every repetition reads from HBM.
            self._flush = torch.empty(256 * 2**20, dtype=torch.int8, device=self.device)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _prep(self, reset: Callable[[], None] | None) -> None:
        if reset is not None:
            reset()
        if self._flush is not None:
            self._flush.zero_()
        self.sync()

    def measure(self, fn: Callable[[], object], reset: Callable[[], None] | None = None) -> Measurement:
        est = 0.0
        for _ in range(max(self.warmup, 1)):
            self._prep(reset)
            t0 = time.perf_counter()
            fn()
            self.sync()
            est = time.perf_counter() - t0
        reps = int(min(self.max_reps, max(self.min_reps, self.budget_s / max(est, 1e-6))))
        dev_ms, host_ms = [], []
        if self.cuda:
            events = []
            for _ in range(reps):
                self._prep(reset)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                h0 = time.perf_counter()
                fn()
                h1 = time.perf_counter()
                end.record()
                events.append((start, end))
                host_ms.append((h1 - h0) * 1e3)
            self.sync()
            dev_ms = [s.elapsed_time(e) for s, e in events]
        else:
            for _ in range(reps):
                self._prep(reset)
                t0 = time.perf_counter()
                fn()
                dev_ms.append((time.perf_counter() - t0) * 1e3)
            host_ms = dev_ms
        return Measurement(statistics.median(dev_ms), min(dev_ms), statistics.median(host_ms), reps)


def copy_bandwidth(timer: Timer, nbytes: int) -> float:
    """Measured bandwidth of a large device-to-device copy in GB/s (10^9 bytes/s, read + write counted)."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=timer.device)
    dst = torch.empty_like(src)
    m = timer.measure(lambda: dst.copy_(src))
    del src, dst
    return 2 * n * 4 / (m.median_ms * 1e-3) / 1e9
