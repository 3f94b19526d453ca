"""The guard's counters and the last step's readings, kept on the device.

Per step only a list append (the step's 0-dim device tensors); the counters are folded from these records
with a few device ops every ``FOLD`` steps, when read, or every step where ``max_consecutive_skips`` needs
the run of skips. Nothing here reads device data on the host except :meth:`Counters.check_consecutive`."""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends import clip_coef

#: Slots of ``StepGuard.counters()`` (one device tensor, float64 where the device has it).
COUNTERS = ("steps", "clipped", "skipped", "consecutive_skipped", "nonfinite", "spikes")

FOLD = 256  # steps between two folds of the per-step records into the counters (a fold is ~15 small ops,
#             ~0.3 ms on a CPU: amortised over 256 steps it is ~1 us per step)


class GuardError(RuntimeError):
    """Raised after ``max_consecutive_skips`` bad steps in a row: training is not making progress."""


class Counters:
    """``counts``: the COUNTERS vector; ``last``: the last folded step's (total, post-clip norm, coef,
    clipped, skipped); ``records``: per step since the last fold, (total, factor, inv_scale, bad, spike)."""

    def __init__(self, max_norm: float | None):
        self.max_norm = max_norm
        self.counts: Tensor | None = None
        self.records: list = []
        self.last = None
        self.host = None  # (host copy of consecutive_skipped, cuda event) for the lazy consecutive check
        self._mask: Tensor | None = None  # slot 3 of the counters, as a device bool mask

    def start(self, device: torch.device) -> None:
        cdt = torch.float32 if device.type == "mps" else torch.float64
        self.counts = torch.zeros(len(COUNTERS), dtype=cdt, device=device)

    def clear(self, counts: Tensor | None) -> None:
        self.records, self.last = [], None
        self.counts = counts

    def record(self, total, factor, inv, bad, spike) -> None:
        self.records.append((total, factor, inv, bad, spike))
        if len(self.records) >= FOLD:
            self.fold()

    def fold(self) -> None:
        recs, self.records = self.records, []
        if not recs:
            return
        c = self.counts
        dt, dev = c.dtype, c.device
        n = len(recs)
        # (torch.stack promotes mixed dtypes; one conversion per stacked vector, not per record)
        T = torch.stack([r[0] for r in recs]).to(dev, dt)
        factors = [r[1] for r in recs]
        if all(f is None for f in factors):  # the one-call CPU path keeps no coefficient: clip_grad_norm_'s
            coef = clip_coef(T.to(torch.float32), self.max_norm).to(dt)
        elif any(f is None for f in factors):
            derived = clip_coef(T.to(torch.float32), self.max_norm).to(dt).unbind(0)
            coef = torch.stack([f.to(dev, dt) if f is not None else d for f, d in zip(factors, derived)])
        else:
            coef = torch.stack(factors).to(dev, dt)
        if any(r[2] is not None for r in recs):  # factor = inv_scale * coef: divide the unscale back out
            coef = coef / torch.stack([r[2] if r[2] is not None else _one_like(r[1]) for r in recs]).to(dev, dt)
        B = torch.stack([r[3] for r in recs]).to(dev) > 0
        if any(r[4] is not None for r in recs):
            S = torch.stack([r[4].to(torch.float32) if r[4] is not None else B.new_zeros((), dtype=torch.float32)
                             for r in recs]).to(dev)
            spikes = ((S > 0) & torch.isfinite(T)).sum()  # a non-finite norm counts as non-finite only
        else:
            spikes = c.new_zeros(())
        clipped = (coef < 1) & ~B
        good = ~B
        last_good = torch.where(good, torch.arange(n, device=dev), -1).max()
        cons = torch.where(last_good < 0, c[3] + n, (n - 1 - last_good).to(dt))
        inc = torch.stack([c.new_full((), n), clipped.sum().to(dt), B.sum().to(dt), c.new_zeros(()),
                           (~torch.isfinite(T)).sum().to(dt), spikes.to(dt)])
        # (slot 3 replaced by a device select, not by indexed assignment: no host value enters a device tensor)
        self.counts = torch.where(self._slot3(dev), cons, c + inc)
        self.last = (T[-1], T[-1] * coef[-1], coef[-1], clipped[-1], B[-1])

    def _slot3(self, dev) -> Tensor:
        m = self._mask
        if m is None or m.device != dev:
            m = self._mask = torch.arange(len(COUNTERS), device=dev) == 3
        return m

    # ---------------------------------------------------------------- the last step (device tensors)
    def total_norm(self) -> Tensor | None:
        if self.records:
            return self.records[-1][0]
        return self.last[0] if self.last is not None else None

    def skipped(self) -> Tensor | None:
        if self.records:
            return self.records[-1][3] > 0
        return self.last[4] if self.last is not None else None

    def folded(self, i: int) -> Tensor | None:
        self.fold()
        return self.last[i] if self.last is not None else None

    # ---------------------------------------------------------------- max_consecutive_skips
    def copy_consecutive(self) -> None:
        """Start the host copy of ``consecutive_skipped`` that the next call checks (no wait on CUDA)."""
        self.fold()
        cons = self.counts[3:4]
        if cons.device.type == "cuda":
            host = torch.empty(1, dtype=cons.dtype, pin_memory=True)
            host.copy_(cons, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.host = (host, ev)
        else:
            self.host = (cons, None)

    def check_consecutive(self, limit: int | None) -> None:
        if limit is None or self.host is None:
            return
        host, ev = self.host
        if ev is not None and not ev.query():
            return  # not landed yet: check at a later call rather than wait
        n = int(host[0])
        if n >= limit:
            raise GuardError(
                f"StepGuard skipped {n} steps in a row (max_consecutive_skips={limit}): "
                "every recent step had a non-finite gradient norm or a spike. Training is not progressing; "
                "check the data, the learning rate, the loss scale and any state carried from step to step (a "
                "recurrent model's hidden state that went NaN makes every later batch NaN); "
                "fastgrad.find_nonfinite names the gradients that went non-finite. Nothing was modified by this "
                "call.")


def _one_like(t: Tensor) -> Tensor:
    return torch.ones((), dtype=torch.float32, device=t.device)
