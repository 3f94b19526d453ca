"""The skip ledger's window: what ``StepGuard.state()`` reports about the steps since the previous read.

The counters (``counters.py``) are totals over the run. The ledger adds, per read window (the steps between
two ``state()`` reads):

* the total norms of the last :data:`RING` steps, kept in a fixed-size device ring; the window's median, p90
  and p99 are taken at the read over the finite norms the ring holds from that window (with their count);
* the longest run of skips in a row seen in the window (a run that started before the read counts with its
  full length), and the longest of those that a step taken ended, which ``max_consecutive_skips`` is checked
  against at the read (a run still going is the next ``clip_``'s to stop).

The ring is written when the per-step records are folded (every ``FOLD`` steps, or at a read): one slice copy
per fold, nothing per step, no host read. The window's statistics are reduced on the device and read in the
same single transfer as the counters."""

from __future__ import annotations

import torch
from torch import Tensor

#: How many of the last steps' total norms the ring holds: a window longer than this has its quantiles taken
#: over its last RING steps (``norm_count`` says how many). 8 KiB of float64 on the device.
RING = 1024

#: The quantiles ``state()`` reports: (name, q).
QUANTILES = (("norm_p50", 0.5), ("norm_p90", 0.9), ("norm_p99", 0.99))


def quantiles(values: Tensor, qs) -> tuple[Tensor, Tensor]:
    """The ``qs`` quantiles of the finite entries of ``values`` (NaN marks an empty slot or a non-finite
    norm), with their count, on the device and without a host read. Linear interpolation between the two
    nearest order statistics, ``numpy.quantile``'s default (Hyndman and Fan's type 7): with ``n`` values
    sorted, q sits at position ``q * (n - 1)``. The quantiles are NaN when there is no finite entry."""
    s, _ = torch.sort(torch.where(torch.isfinite(values), values, torch.full_like(values, float("nan"))))
    n = torch.isfinite(s).sum()  # the finite entries come first: sort puts NaN last
    last = (n - 1).clamp(min=0)
    pos = torch.stack([last.to(s.dtype) * q for q in qs])
    lo = pos.floor()
    lo_i = lo.long()
    hi_i = torch.minimum(lo_i + 1, last)
    a, b = s[lo_i], s[hi_i]
    out = a + (pos - lo) * (b - a)
    return torch.where(n > 0, out, torch.full_like(out, float("nan"))), n


class Ledger:
    """The ring of norms and the read window's bookkeeping. ``written``: norms written into the ring so far
    (host count, exact: one per recorded step); ``since``: ``written`` at the previous read; ``wmax``: the
    longest run of skips recorded since the previous read (device scalar, None when no step since); ``ended``:
    the longest of those that a step taken has ended."""

    def __init__(self):
        self.ring: Tensor | None = None
        self.written = 0
        self.since = 0
        self.wmax: Tensor | None = None
        self.ended: Tensor | None = None

    def add(self, totals: Tensor, streaks: Tensor, before: Tensor) -> None:
        """A fold's records: their total norms into the ring, their runs of skips into the window's longest.
        ``totals`` and ``streaks``: one entry per step, already on the counters' device and dtype; ``before``:
        the run of skips before the fold's first step."""
        n = totals.numel()
        ring = self.ring
        if ring is None or ring.device != totals.device or ring.dtype != totals.dtype:
            ring = self._fresh(totals) if ring is None else ring.to(totals.device, totals.dtype)
        keep = totals[-RING:] if n > RING else totals
        start = (self.written + n - keep.numel()) % RING
        head = min(keep.numel(), RING - start)  # (host ints: views of the ring, device copies into them)
        ring.narrow(0, start, head).copy_(keep[:head])
        if head < keep.numel():
            ring.narrow(0, 0, keep.numel() - head).copy_(keep[head:])
        self.ring = ring
        self.written += n
        self.wmax = _larger(self.wmax, streaks.max())
        # a step taken (run 0) ends the run before it: the run as of the step before
        prev = torch.cat([before.reshape(1), streaks[:-1]])
        self.ended = _larger(self.ended, torch.where(streaks == 0, prev, torch.zeros_like(prev)).max())

    @staticmethod
    def _fresh(like: Tensor) -> Tensor:
        return torch.full((RING,), float("nan"), dtype=like.dtype, device=like.device)

    def window(self, like: Tensor) -> Tensor:
        """The window's ``(p50, p90, p99, count, longest run, longest ended run)`` as one device vector on ``like``'s device and
        dtype (NaN quantiles for a window without a finite norm; 0 for a window without a step)."""
        k = min(self.written - self.since, RING)
        if self.ring is None or k == 0:
            vals = torch.full((len(QUANTILES),), float("nan"), dtype=like.dtype, device=like.device)
            n = like.new_zeros(())
        else:
            start = (self.written - k) % RING
            end = start + k
            ring = self.ring
            win = ring[start:end] if end <= RING else torch.cat([ring[start:], ring[:end - RING]])
            vals, n = quantiles(win, [q for _, q in QUANTILES])
        extra = [n] + [like.new_zeros(()) if r is None else r for r in (self.wmax, self.ended)]
        return torch.cat([vals.to(like.device, like.dtype), torch.stack([x.to(like.device, like.dtype) for x in extra])])

    def read(self) -> None:
        """A read took the window: the next one starts here."""
        self.since = self.written
        self.wmax = self.ended = None

    def state_dict(self) -> dict:
        return {"ring": None if self.ring is None else self.ring.clone(), "written": self.written,
                "since": self.since, "wmax": None if self.wmax is None else self.wmax.clone(),
                "ended": None if self.ended is None else self.ended.clone()}

    def load_state_dict(self, sd: dict | None) -> None:
        """``sd`` from :meth:`state_dict`; None (a checkpoint of an older fastgrad): an empty window."""
        sd = sd or {}
        ring, wmax, ended = sd.get("ring"), sd.get("wmax"), sd.get("ended")
        self.ring = None if ring is None else ring.clone()
        self.written = int(sd.get("written", 0))
        self.since = int(sd.get("since", 0))
        self.wmax = None if wmax is None else wmax.clone()
        self.ended = None if ended is None else ended.clone()


def _larger(old: Tensor | None, new: Tensor) -> Tensor:
    return new if old is None else torch.maximum(old, new.to(old.device))
