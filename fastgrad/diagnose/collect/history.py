"""The device ring buffers behind ``GradientMonitor``: one slot per step, chosen by a host-side counter, so a
step writes a few device values and never waits for the device; ``read`` copies the unread part to a host
history in ONE transfer.

Every write on the per-step path is a device op fed by device tensors or a ``fill_`` with a Python number:
never ``buf[i] = host_value`` (``Tensor.__setitem__`` turns the number into a CPU tensor and copies it over,
which on CUDA is a synchronizing host-to-device copy)."""

from __future__ import annotations

import math
from array import array

import torch
from torch import Tensor

__all__ = ["DeviceHistory"]


class DeviceHistory:
    """Per-step total norm, loss, NaN/Inf count, skip mark and (optionally) per-parameter norms, kept on the
    device for the last ``capacity`` steps; ``steps``/``norm``/``loss``/``nonfinite``/``skipped`` are the host
    copies of every step read so far. ``names``: the per-parameter columns."""

    def __init__(self, capacity: int, names: list[str], per_layer: bool):
        self.capacity = capacity
        self.names = names
        self.per_layer = per_layer
        self.step = 0  # the host-side counter: the only thing that picks slots
        self.bufs: dict[str, Tensor] | None = None
        self._index_cache: dict[tuple[str, ...], tuple[Tensor, Tensor] | None] = {}
        self._index_last: tuple[list[str], tuple] | None = None  # (names list object, its _layer_index answer)
        self.flushed = 0  # last step copied into the host history
        self.skips_used = False  # mark_skip() was called at least once
        self.skip_marked = 0  # the last step mark_skip() marked
        self.steps, self.norm, self.loss, self.nonfinite = array("q"), array("d"), array("d"), array("d")
        self.skipped = array("d")
        # Non-finite losses given as numbers: (first step, count, last step), merged with the device flag.
        self.host_bad_loss = [0, 0, 0]

    # ---------------------------------------------------------------- per step (no sync)
    def alloc(self, like: Tensor) -> None:
        dev, dt = like.device, like.dtype
        cap = self.capacity
        nan = float("nan")
        self.bufs = {
            "norm": torch.full((cap,), nan, device=dev, dtype=dt),
            "loss": torch.full((cap,), nan, device=dev, dtype=torch.float32 if dt != torch.float64 else dt),
            "nonfinite": torch.zeros(cap, device=dev, dtype=torch.int64),
            # 1 where mark_skip() marked the step skipped (a step guard's device flag)
            "skipped": torch.zeros(cap, device=dev, dtype=torch.int64),
            # [first step, count, last step] of non-finite tensor losses since the last report (0 = none)
            "bad_loss": torch.zeros(3, device=dev, dtype=torch.int64),
        }
        if self.per_layer:
            self.bufs["layers"] = torch.full((cap, len(self.names)), nan, device=dev, dtype=dt)

    def slot(self, step: int | None = None) -> int:
        return ((self.step if step is None else step) - 1) % self.capacity

    def write(self, stats, loss) -> None:
        """Advance the counter and write one step: ``stats`` (GradStats), ``loss`` (tensor, number or None)."""
        b = self.bufs
        self.step += 1
        k = self.slot()
        dev = b["norm"].device
        b["norm"][k:k + 1].copy_(stats.total_norm.reshape(1), non_blocking=True)
        if len(stats):
            b["nonfinite"][k:k + 1].copy_((stats.nan.sum() + stats.inf.sum()).reshape(1), non_blocking=True)
        else:
            b["nonfinite"][k:k + 1].fill_(0)
        b["skipped"][k:k + 1].fill_(0)  # mark_skip() may mark it
        if isinstance(loss, Tensor):
            lt = loss.detach().reshape(-1)
            b["loss"][k:k + 1].copy_(lt[:1], non_blocking=True)
            # Device-side flag of a non-finite loss: first/last step and count, all without a sync.
            bad = (~torch.isfinite(lt)).any().to(dev, non_blocking=True)
            fl = b["bad_loss"]
            fl[0:1].copy_(torch.where(bad & (fl[0] == 0), self.step, fl[0]).reshape(1))
            fl[1:2].add_(bad.reshape(1))
            fl[2:3].copy_(torch.where(bad, self.step, fl[2]).reshape(1))
        else:
            value = float("nan") if loss is None else float(loss)
            b["loss"][k:k + 1].fill_(value)  # a fill kernel with a host number: no copy, no sync
            if loss is not None and not math.isfinite(value):
                h = self.host_bad_loss
                h[0] = h[0] or self.step
                h[1] += 1
                h[2] = self.step
        if self.per_layer:
            row = b["layers"][k]
            src, dst = self._layer_index(stats.names, dev)
            if src is None:
                row.copy_(stats.norm, non_blocking=True)
            else:
                row.fill_(float("nan"))
                if len(dst):
                    row.index_copy_(0, dst, stats.norm.index_select(0, src).to(row.dtype))

    def mark_skip(self, skipped) -> None:
        """Mark the step just written skipped or not (a one-element tensor or a Python bool); no sync."""
        buf = self.bufs["skipped"]
        k = self.slot()
        if isinstance(skipped, Tensor):
            buf[k:k + 1].copy_((skipped.detach().reshape(1) != 0).to(torch.int64), non_blocking=True)
        else:
            buf[k:k + 1].fill_(int(bool(skipped)))
        self.skips_used = True
        self.skip_marked = self.step

    def _layer_index(self, names: list[str], dev) -> tuple[Tensor | None, Tensor | None]:
        """(positions in stats, destination columns) as cached device index tensors; (None, None) when the
        stats cover exactly the tracked parameters in order (the usual case: a plain copy)."""
        # Every step of a monitor's own statistics passes the same names list (its cached one): a hit on it
        # skips hashing a tuple of all names (~80 us at 4,000 parameters, ~0.5% of such a clip).
        last = self._index_last
        if last is not None and last[0] is names:
            return last[1]
        key = tuple(names)
        if key not in self._index_cache:
            if list(names) == self.names:
                self._index_cache[key] = None
            else:
                # built once per parameter set (then cached): a host-to-device copy of the index lists
                col = {n: j for j, n in enumerate(self.names)}
                pairs = [(i, col[n]) for i, n in enumerate(names) if n in col]
                src = torch.tensor([i for i, _ in pairs], dtype=torch.int64).to(dev, non_blocking=True)
                dst = torch.tensor([j for _, j in pairs], dtype=torch.int64).to(dev, non_blocking=True)
                self._index_cache[key] = (src, dst)
        v = self._index_cache[key]
        out = (None, None) if v is None else v
        self._index_last = (names, out)
        return out

    # ---------------------------------------------------------------- reading (the caller's one sync)
    def extras(self) -> list[Tensor]:
        """The buffers a report reads in its one transfer, in the order :meth:`absorb` takes them, then the
        non-finite-loss flag."""
        b = self.bufs
        return [b["norm"], b["loss"], b["nonfinite"], b["skipped"], b["bad_loss"]] if b is not None else []

    def _slots(self, first_step: int, last_step: int) -> list[int]:
        return [(s - 1) % self.capacity for s in range(first_step, last_step + 1)]

    def absorb(self, norm_buf: list[float], loss_buf: list[float], nf_buf: list[float],
               skip_buf: list[float]) -> None:
        """Append the steps not yet in the host history (those still in the ring) from host copies."""
        start = max(self.flushed + 1, self.step - self.capacity + 1, 1)
        for s, k in zip(range(start, self.step + 1), self._slots(start, self.step)):
            self.steps.append(s)
            self.norm.append(norm_buf[k])
            self.loss.append(loss_buf[k])
            self.nonfinite.append(nf_buf[k])
            self.skipped.append(skip_buf[k])
        self.flushed = self.step
        self._refresh_skips(skip_buf)

    def _refresh_skips(self, skip_buf: list[float]) -> None:
        """Re-read the skip marks of the steps still in the ring: mark_skip() may mark a step after a
        logging step copied it to the host."""
        if not self.skips_used:
            return
        h_steps, h_skip, n = self.steps, self.skipped, len(self.steps)
        for s in range(max(1, self.step - self.capacity + 1), self.step + 1):
            i = n - 1 - (self.step - s)
            if 0 <= i < n and h_steps[i] == s:
                h_skip[i] = skip_buf[(s - 1) % self.capacity]

    def flush(self) -> None:
        """Copy the unread part of the ring buffers into the host history (one sync)."""
        if self.bufs is None or (self.flushed == self.step and not self.skips_used):
            return
        b = self.bufs
        flat = torch.cat([b["norm"].double(), b["loss"].double(), b["nonfinite"].double(),
                          b["skipped"].double()]).tolist()
        c = self.capacity
        self.absorb(flat[:c], flat[c:2 * c], flat[2 * c:3 * c], flat[3 * c:])

    def take_bad_loss(self, dev_flag: list[float]) -> tuple[int, int, int] | None:
        """(first step, count, last step) of the non-finite losses since the last call, merging the device
        flag (read by the caller) and the host one (losses given as numbers); both are cleared."""
        h = self.host_bad_loss
        firsts = [int(v) for v in (dev_flag[0], h[0]) if v]
        count = int(dev_flag[1]) + h[1]
        last = max(int(dev_flag[2]), h[2])
        self.host_bad_loss = [0, 0, 0]
        if self.bufs is not None:
            self.bufs["bad_loss"].zero_()  # a kernel, no sync: the next window starts clean
        return (min(firsts), count, last) if count else None

    def layer_rows(self) -> dict[str, list[float]]:
        """Per-parameter norms of the steps still in the ring, oldest first (one sync)."""
        if not self.per_layer or self.bufs is None:
            return {}
        n = min(self.step, self.capacity)
        order = self._slots(self.step - n + 1, self.step)
        rows = self.bufs["layers"].double().tolist()
        return {name: [rows[k][j] for k in order] for j, name in enumerate(self.names)}
