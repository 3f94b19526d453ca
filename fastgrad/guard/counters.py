"""The guard's counters and the last step's readings, kept on the device.

Per step a list append (the step's 0-dim device tensors) and the run of skips in a row, kept on the device
(two small ops); the other counters are folded from the records with a few device ops every ``FOLD`` steps
or when read, and the norms and runs of skips go to the read window's ledger (``ledger.py``) at the same
fold. Nothing here reads device data on the host except :meth:`Counters.check_consecutive`."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ..decide import clip_coef, clip_engaged
from .ledger import QUANTILES, Ledger

#: Slots of ``StepGuard.counters()`` (one device tensor, float64 where the device has it).
COUNTERS = ("steps", "clipped", "skipped", "consecutive_skipped", "nonfinite", "spikes", "longest_skipped",
            "engaged")
_RUN, _LONGEST = COUNTERS.index("consecutive_skipped"), COUNTERS.index("longest_skipped")

FOLD = 256  # steps between two folds of the per-step records into the counters (a fold is ~15 small ops,
#             ~0.3 ms on a CPU: amortised over 256 steps it is ~1 us per step)


WARN_AFTER = 25  # skips in a row after which the guard warns, once, by default: far above one bad batch or a
#                 GradScaler's start-up back-off (each overflow halves the scale: 25 in a row is 3e7x), and
#                 reached early in a run that has stopped learning


class GuardError(RuntimeError):
    """Raised after ``max_consecutive_skips`` bad steps in a row: training is not making progress."""


class GuardWarning(UserWarning):
    """Warned once per guard after ``WARN_AFTER`` skips in a row (filter it to silence it)."""


_TRY = ("check the data, the learning rate, the loss scale and any state carried from step to step (a "
        "recurrent model's hidden state that went NaN makes every later batch NaN); fastgrad.find_nonfinite "
        "names the gradients that went non-finite")


class Counters:
    """``counts``: the COUNTERS vector; ``last``: the last folded step's (total, post-clip norm, coef,
    clipped, skipped); ``records``: per step since the last fold, (total, factor, inv_scale, bad, spike, run
    of skips after it). ``engage_at``: the fixed threshold a clip engages above (mode "norm": max_norm), or
    None for an adaptive mode, whose clip engages where its coefficient is below 1."""

    def __init__(self, max_norm: float | None, engage_at: float | None = None):
        self.max_norm = max_norm
        self.engage_at = engage_at
        self.ledger = Ledger()
        self.counts: Tensor | None = None
        self.records: list = []
        self.last = None
        self.host = None  # (host copy of consecutive_skipped, cuda event) for the lazy consecutive check
        self.streak: Tensor | None = None  # skips in a row so far, on the device: slot 3's one rule
        self.warned = False  # the WARN_AFTER warning was given (once per guard)
        self._mask: Tensor | None = None  # the slots of the counters, as a device index vector

    @staticmethod
    def zeros(device: torch.device) -> Tensor:
        """A COUNTERS vector of zeros (float64 where the device has it)."""
        cdt = torch.float32 if device.type == "mps" else torch.float64
        return torch.zeros(len(COUNTERS), dtype=cdt, device=device)

    def start(self, device: torch.device) -> None:
        self.counts = self.zeros(device)

    def clear(self, counts: Tensor | None, last: tuple | None = None, ledger: dict | None = None) -> None:
        """Start again from ``counts``, ``last`` and ``ledger`` (a loaded checkpoint's), no records. Counts
        saved before the longest run and the engaged count existed: the longest run starts at the current one,
        the engaged count at 0."""
        if counts is not None and counts.numel() < len(COUNTERS):
            counts = torch.cat([counts, counts[_RUN:_RUN + 1], counts.new_zeros(len(COUNTERS) - counts.numel() - 1)])
        self.records, self.last = [], last
        self.counts = counts
        self.streak = None if counts is None else counts[_RUN].clone()
        self.host = None
        self.ledger.load_state_dict(ledger)

    def record(self, total, factor, inv, bad, spike) -> None:
        self.records.append((total, factor, inv, bad, spike))
        run = self.streak
        if run is None:
            run = bad.new_zeros((), dtype=torch.float32 if bad.device.type == "mps" else torch.float64)
        elif run.device != bad.device:
            run = run.to(bad.device)
        # a skip extends the run, a step taken ends it: bad * (run + 1), one op (~10 us less per step on a
        # CPU than three); every read pass hands over ``bad`` as a 0/1 float flag
        self.streak = torch.addcmul(bad, run, bad)
        self.records[-1] += (self.streak,)  # (a fresh tensor each step: the run as of this step)
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
        # the clip engaged (skipped steps too: whether the clip engages does not depend on the skip)
        engaged = (clip_engaged(T, self.engage_at) if self.engage_at is not None
                   else torch.isfinite(T) & (coef < 1))
        runs = torch.stack([r[5] for r in recs]).to(dev, dt)
        self.ledger.add(T, runs, c[_RUN])
        top = runs.max()
        inc = torch.stack([c.new_full((), n), clipped.sum().to(dt), B.sum().to(dt), c.new_zeros(()),
                           (~torch.isfinite(T)).sum().to(dt), spikes.to(dt), c.new_zeros(()),
                           engaged.sum().to(dt)])
        # (the two runs replaced by device selects, not by indexed assignment: no host value enters a device
        # tensor): the current run is the last record's, the longest the larger of the old and this fold's
        slot = self._slots(dev)
        self.counts = torch.where(slot == _RUN, runs[-1],
                                  torch.where(slot == _LONGEST, torch.maximum(c, top), c + inc))
        self.last = (T[-1], T[-1] * coef[-1], coef[-1], clipped[-1], B[-1])

    def read(self) -> tuple[list | None, list]:
        """The batched read (ONE transfer): the last step's readings (None before a step), then the counters
        and the ledger's window (``Ledger.window``); the window then starts again."""
        self.fold()
        last = self.last
        if self.counts is None:
            vals, last = [0] * len(COUNTERS) + [float("nan")] * len(QUANTILES) + [0, 0, 0], None
        else:
            dt, dev = self.counts.dtype, self.counts.device
            parts = [self.counts, self.ledger.window(self.counts)]
            if last is not None:
                parts.insert(0, torch.stack([x.to(dev, dt) for x in last]))
            vals = torch.cat(parts).tolist()
            if last is not None:
                last, vals = vals[:len(last)], vals[len(last):]
        self.ledger.read()
        return last, vals

    def _slots(self, dev) -> Tensor:
        m = self._mask
        if m is None or m.device != dev:
            m = self._mask = torch.arange(len(COUNTERS), device=dev)
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
        """Start the host copy of the run of skips that the next call checks (no wait on CUDA)."""
        run = self.streak.reshape(1)
        if run.device.type == "cuda":
            host = torch.empty(1, dtype=run.dtype, pin_memory=True)
            host.copy_(run, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        else:  # already in host memory (a fresh tensor each step, so the value of this step)
            host, ev = run, None
        host._fastgrad_host_copy = True  # (the tests' stand-in for "no device sync" lets this read through)
        self.host = (host, ev)

    def check_consecutive(self, limit: int | None) -> None:
        """At the start of ``clip_``: the run of skips as of the previous call (once its copy has landed:
        never a wait) raises GuardError at ``limit``, and warns once at WARN_AFTER. Reads the counters
        (one transfer) only to word that warning."""
        if self.host is None or (limit is None and self.warned):
            return
        host, ev = self.host
        if ev is not None and not ev.query():
            return  # not landed yet: check at a later call rather than wait
        n = int(host.tolist()[0])  # host memory: no device sync
        if limit is not None and n >= limit:
            raise GuardError(
                f"StepGuard skipped {n} steps in a row (max_consecutive_skips={limit}): "
                "every recent step had a non-finite gradient norm or a spike. Training is not progressing; "
                f"{_TRY}. Nothing was modified by this call.")
        if n >= WARN_AFTER and not self.warned:
            self.warned = True
            self.host = None
            warnings.warn(self._stuck(n), GuardWarning, stacklevel=4)

    def _stuck(self, n: int) -> str:
        self.fold()
        got = dict(zip(COUNTERS, (int(v) for v in self.counts.tolist())))
        steps, skipped, nonfinite, spikes = (got[k] for k in ("steps", "skipped", "nonfinite", "spikes"))
        first = steps - n + 1
        causes = [f"{nonfinite} with a non-finite gradient norm (NaN/Inf)" if nonfinite else "",
                  f"{spikes} as spikes (skip_factor)" if spikes else ""]
        return (f"StepGuard skipped the last {n} steps in a row, from step {first} on (counting the guard's "
                f"clip_ calls from 1): no step has been taken since. In all {skipped} of {steps} steps "
                f"were skipped: {', '.join(c for c in causes if c)}. Training is not progressing; {_TRY}. "
                "max_consecutive_skips=N raises fastgrad.GuardError instead; this warning is given once per "
                "guard (category fastgrad.guard.GuardWarning).")


def window_error(st: dict, ended: int, limit: int) -> GuardError:
    """``state()``'s abort: since the read before ``st`` (a state() dict) a run of ``ended`` >= ``limit`` skips
    in a row was ended by a step taken."""
    err = GuardError(
        f"StepGuard skipped {ended} steps in a row since the previous state() read, then took a step "
        f"(max_consecutive_skips={limit}); {st['consecutive_skipped']} in a row now, {st['skipped_steps']} of "
        f"{st['steps']} steps in all ({st['nonfinite_steps']} with a non-finite norm, {st['spike_steps']} "
        f"spikes). Training is not progressing; {_TRY}. This error's .state holds the guard's readings.")
    err.state = st
    return err


def _one_like(t: Tensor) -> Tensor:
    return torch.ones((), dtype=torch.float32, device=t.device)
