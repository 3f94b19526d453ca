"""GradientMonitor: per-step gradient statistics kept on the device, read to the host only on logging steps.

Every call runs the fused ``grad_stats`` pass and writes its results into preallocated device ring buffers at
a slot chosen by a host-side step counter, so a non-logging step launches a few kernels and never waits for
the device. Every ``every`` steps the monitor reads the buffers and the current statistics in ONE sync,
builds a :class:`~fastgrad.report.GradientReport` with the trends of the history (steady growth, k-sigma
spikes, decay to ~0) and hands it to the logger(s)."""

from __future__ import annotations

import csv
import logging
import math
import os
from array import array
from statistics import median
from typing import Sequence

import torch
from torch import Tensor

from .report import (Finding, GradientReport, Thresholds, _fmt, _gather, detect_loss_jumps, loss_progress,
                     robust_jumps)
from . import _inputs as I
from . import _scan
from .backends import clip_coef
from . import distributed as D
from .stats import GradStats, _named, _stats_of, _stats_of_all, row_sparse_names

__all__ = ["GradientMonitor", "detect_trends"]

_CSV_FIELDS = ["step", "status", "total_norm", "max_abs", "nan", "inf", "zero_fraction", "param_norm",
               "grad_param_ratio", "loss", "findings", "skipped_steps"]


def detect_trends(steps: Sequence[int], norms: Sequence[float], *, new_after: int = 0, spike_z: float = 6.0,
                  spike_ratio: float = 3.0, warn_ratio: float = 5.0, baseline: int = 50, warmup: int = 20,
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
      threshold (1e-3) or 1000x below the first: the norm decays to ~0.
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
            falling = _loss_falling(steps, losses, first_step, window)
            if falling is not None and all(th.healthy_low <= m <= th.healthy_high for m in med):
                found.append(Finding("increasing", "notice", "gradient norm rising inside the healthy range while "
                                     "the loss falls", detail + f" It stays within {_fmt(th.healthy_low)} to "
                                     f"{_fmt(th.healthy_high)} and the loss fell {falling}: usual for a "
                                     "converging run, no action needed."))
            else:
                found.append(Finding("increasing", "warning", "gradient norm steadily increasing", detail))
        elif all(b < a for a, b in zip(med, med[1:])) and (med[3] < th.vanishing or med[3] * 1000 <= med[0]):
            found.append(Finding("decaying", "warning", "gradient norm decaying to ~0",
                                 f"Median norm fell from {med[0]:.3g} to {med[3]:.3g} since step {first_step}."))
    return found


def _loss_falling(steps: Sequence[int], losses: Sequence[float] | None, first_step: int, window: int
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


def _check_logger(lg) -> None:
    """Refuse, when the monitor is built, a logger that would fail at the first logging step (maybe hours
    later). Accepts what ``GradientMonitor._emit`` can drive."""
    if isinstance(lg, type):
        raise TypeError(f"unsupported logger {lg.__name__}: a class, not an instance; pass e.g. {lg.__name__}(...)")
    if hasattr(lg, "add_scalar") or isinstance(lg, logging.Logger):
        return
    if hasattr(lg, "log") and callable(lg.log):
        return
    if hasattr(lg, "write"):
        if not callable(lg.write):
            raise TypeError(f"logger {lg!r}: its 'write' attribute is not callable; pass an open text file")
        return
    if isinstance(lg, (str, os.PathLike)):
        path = os.fspath(lg)
        if not path:
            raise ValueError("logger: an empty CSV path; pass a file name such as 'grad_health.csv'")
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ValueError(f"logger: CSV path {path!r} is a directory; name a file inside it, e.g. "
                             f"{os.path.join(path, 'grad_health.csv')!r}")
        if not os.path.isdir(folder):
            raise ValueError(f"logger: the folder of the CSV path {path!r} does not exist ({folder}); create it "
                             f"first (os.makedirs({folder!r}, exist_ok=True)) or pick another path")
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise ValueError(f"logger: the CSV path {path!r} is not writable")
        return
    if callable(lg) and not isinstance(lg, type):
        return
    raise TypeError(
        f"unsupported logger {lg!r} of type {type(lg).__name__}: pass a TensorBoard SummaryWriter (has "
        "add_scalar), a wandb run (has log(dict)), a logging.Logger, a CSV path or open text file, a callable "
        "f(metrics: dict, step: int), a list of these, or None")


def _fusable(grads: list[Tensor]) -> bool:
    """Dense real floating plain tensors: what the fused statistics pass reads (DTensor, sparse and complex
    gradients take the two-pass path)."""
    if type(grads) is I.Checked:
        return True
    for g in grads:
        if type(g) is not Tensor and not isinstance(g, torch.nn.Parameter):
            return False
        if g.layout != torch.strided or g.dtype not in (torch.float16, torch.bfloat16, torch.float32,
                                                         torch.float64):
            return False
    return True


def _readable(grads: list[Tensor]) -> bool:
    """What grad_stats reads: plain real floating tensors, dense or sparse (not DTensor, not complex)."""
    if type(grads) is I.Checked:
        return True
    for g in grads:
        if type(g) is not Tensor and not isinstance(g, torch.nn.Parameter):
            return False
        if not g.dtype.is_floating_point:
            return False
    return True


def _empty_like_stats(named, total: Tensor) -> GradStats:
    """Statistics the fused pass cannot compute (e.g. sparse grads): only the total norm, nothing per tensor."""
    total = total.full_tensor() if hasattr(total, "full_tensor") else total  # a DTensor norm: its value
    e_f = torch.zeros(0, device=total.device)
    e_i = torch.zeros(0, dtype=torch.int64, device=total.device)
    return GradStats([], [], [], e_f, e_f, e_i, e_i, e_i, e_i, total.detach().reshape(()).float(),
                     [n for n, _ in named])


class GradientMonitor:
    """Track gradient health during training without host syncs except on logging steps.

    ::

        monitor = fastgrad.GradientMonitor(model, every=100, logger=SummaryWriter())
        for x, y in data:
            loss = criterion(model(x), y)
            loss.backward()
            report = monitor(loss)      # None except every 100th step, when it is a GradientReport
            optimizer.step(); optimizer.zero_grad()

    or, clipping and monitoring in one read of the gradients::

            loss.backward()
            monitor.clip_grad_norm_(1.0, loss=loss)   # = fastgrad.clip_grad_norm_ + monitor(loss)
            optimizer.step(); optimizer.zero_grad()

    ``logger``: a TensorBoard ``SummaryWriter`` (anything with ``add_scalar``), a Weights & Biases run
    (anything with ``log(dict)``), a ``logging.Logger``, a CSV path or text file, a callable
    ``f(metrics: dict, step: int)``, or a list of these; None keeps the reports in ``last_report`` only.
    ``row_sparse``: names of embedding-like parameters to leave out of the depth rule, for a monitor given
    parameters rather than the module (the embeddings of a module are found by themselves).
    ``guard``: a :class:`fastgrad.StepGuard` whose skipped steps the reports count (``skipped_steps``), marked
    from its device flag without a sync, whichever order the loop calls ``monitor(...)`` and ``guard.clip_()``
    in (the order is learnt from the first step; monitoring first describes the gradients before clipping).
    Each is checked here (TypeError/ValueError naming the problem), not at the first logging step.
    ``history``: ring-buffer length in steps (at least ``every``). ``loss`` may be a tensor (stored on the
    device, no sync) or a number; a NaN/Inf loss on any step is reported, as critical, at the next logging
    step with the first step it happened (a device-side flag: no sync in between).

    Alert rules (:func:`detect_trends`, :func:`~fastgrad.report.detect_loss_jumps`): robust baselines
    (median and MAD of the last ``baseline`` steps), nothing judged during the first ``warmup`` steps; a
    spike must be ``spike_z`` robust std above the median and ``spike_ratio`` times it (a warning from
    ``warn_ratio``); a loss jump of 10x its recent median is a warning, of 3x a notice.
    """

    def __init__(self, model, every: int | None = 100, logger=None, *, history: int = 1000,
                 per_layer: bool = True, include_params: bool = True, spike_z: float = 6.0,
                 spike_ratio: float = 3.0, warn_ratio: float = 5.0, baseline: int = 50, warmup: int = 20,
                 trend_window: int = 200, min_history: int = 10, thresholds: Thresholds | None = None,
                 row_sparse: Sequence[str] | None = None, guard=None, backend: str | None = None):
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be a positive number of steps or None, got {every!r}")
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be a positive number of steps, got {history!r}")
        self.loggers = list(logger) if isinstance(logger, (list, tuple)) else ([] if logger is None else [logger])
        for lg in self.loggers:
            _check_logger(lg)
        self.named = _named(model)
        self._by_name = dict(self.named)
        # embeddings: left out of the depth rule (found in a module; named by the caller otherwise)
        self._row_sparse = row_sparse_names(model) + [n for n in (row_sparse or ()) if isinstance(n, str)]
        self._clip_step: tuple[int, float] | None = None  # (step, max_norm) of the last monitor.clip_grad_norm_
        self._skips_used = False  # record_skip() was called at least once
        self._skip_marked = 0  # the last step record_skip() marked
        self._skip_from = 0  # skip marks of steps up to here are in an earlier report
        if guard is not None and not (hasattr(guard, "clip_") and hasattr(guard, "calls")):
            raise TypeError(f"guard must be a fastgrad.StepGuard, got {type(guard).__name__}")
        self._guard = guard
        self._guard_calls = 0 if guard is None else guard.calls  # guard.clip_ calls already accounted for
        self._guard_first: bool | None = None  # True: the loop calls guard.clip_() before monitor(...)
        self.names = [n for n, p in self.named if p.requires_grad]
        self._all_names = [n for n, _ in self.named]
        self._params = [p for _, p in self.named]
        self._meta: dict = {}  # names/shapes/dtypes/numel of the all-grads case, computed once
        self.every = every
        self.capacity = max(history, every or 1)
        self.per_layer = per_layer
        self.include_params = include_params
        self.rules = dict(spike_z=spike_z, spike_ratio=spike_ratio, warn_ratio=warn_ratio, baseline=baseline,
                          warmup=warmup, window=trend_window, min_history=min_history)
        self.trend_window = trend_window
        self.thresholds = thresholds or Thresholds()
        self.backend = backend
        self.step = 0  # host-side counter: the only thing that picks ring-buffer slots
        self.last_report: GradientReport | None = None
        self.last_stats: GradStats | None = None
        self._bufs: dict[str, Tensor] | None = None
        self._index_cache: dict[tuple[str, ...], Tensor | None] = {}
        self._index_last: tuple[list[str], tuple] | None = None  # (names list object, its _layer_index answer)
        self._flushed = 0  # last step copied into the host history
        self._logged = 0  # last step whose trends were reported
        self._h_steps, self._h_norm, self._h_loss, self._h_nonfinite = array("q"), array("d"), array("d"), array("d")
        self._h_skipped = array("d")
        # Non-finite losses given as numbers, since the last report: (first step, count, last step).
        self._host_bad_loss = [0, 0, 0]
        self._csv_files: dict[int, tuple] = {}

    # ---------------------------------------------------------------- per step
    def _alloc(self, like: Tensor) -> None:
        dev, dt = like.device, like.dtype
        cap = self.capacity
        nan = float("nan")
        self._bufs = {
            "norm": torch.full((cap,), nan, device=dev, dtype=dt),
            "loss": torch.full((cap,), nan, device=dev, dtype=torch.float32 if dt != torch.float64 else dt),
            "nonfinite": torch.zeros(cap, device=dev, dtype=torch.int64),
            # 1 where record_skip() marked the step skipped (a step guard's device flag)
            "skipped": torch.zeros(cap, device=dev, dtype=torch.int64),
            # [first step, count, last step] of non-finite tensor losses since the last report (0 = none)
            "bad_loss": torch.zeros(3, device=dev, dtype=torch.int64),
        }
        if self.per_layer:
            self._bufs["layers"] = torch.full((cap, len(self.names)), nan, device=dev, dtype=dt)

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
                col = {n: j for j, n in enumerate(self.names)}
                pairs = [(i, col[n]) for i, n in enumerate(names) if n in col]
                src = torch.tensor([i for i, _ in pairs], dtype=torch.int64).to(dev, non_blocking=True)
                dst = torch.tensor([j for _, j in pairs], dtype=torch.int64).to(dev, non_blocking=True)
                self._index_cache[key] = (src, dst)
        v = self._index_cache[key]
        out = (None, None) if v is None else v
        self._index_last = (names, out)
        return out

    @torch.no_grad()
    def __call__(self, loss=None) -> GradientReport | None:
        """Record this step's gradients (call after ``backward()``); on a logging step return the report."""
        return self.record(self._stats(), loss)

    step_ = __call__

    def _stats(self, grads: list[Tensor] | None = None) -> GradStats:
        return _stats_of(self._all_names, self._params, self.backend, self._meta, grads)

    @torch.no_grad()
    def record(self, stats: GradStats, loss=None) -> GradientReport | None:
        """Record one step from statistics computed elsewhere (e.g. by a clip pass or ``fastgrad.check``)
        without reading the gradients again: ``stats`` must come from ``grad_stats`` over this monitor's
        parameters (or a subset: per-layer columns are matched by name). No host sync except on a logging
        step, where the report is returned (else None)."""
        self.last_stats = stats
        if self._bufs is None:
            like = stats.total_norm
            if not len(stats) and self.named:  # no grads yet: live where the parameters live
                p0 = self.named[0][1]
                like = torch.zeros((), device=p0.device, dtype=torch.float32)
            self._alloc(like)
        b = self._bufs
        g = self._guard
        # guard.clip_ ran since the last record (and decided something: with no gradients it has no flag)
        fresh = g is not None and g.calls != self._guard_calls and g.skipped is not None
        if g is not None:
            self._guard_calls = g.calls
        if fresh:
            if self._guard_first is None:
                self._guard_first = self.step == 0
            if not self._guard_first and self.step:  # monitor first: that clip_ decided the step recorded last
                self.record_skip(g.skipped)
        self.step += 1
        slot = (self.step - 1) % self.capacity
        dev = b["norm"].device
        b["norm"][slot:slot + 1].copy_(stats.total_norm.reshape(1), non_blocking=True)
        if len(stats):
            b["nonfinite"][slot:slot + 1].copy_((stats.nan.sum() + stats.inf.sum()).reshape(1), non_blocking=True)
        else:
            b["nonfinite"][slot] = 0
        b["skipped"][slot] = 0  # a fill kernel; record_skip() may mark it
        if fresh and self._guard_first:  # clip_ first: its flag is this step's
            self.record_skip(g.skipped)
        if isinstance(loss, Tensor):
            lt = loss.detach().reshape(-1)
            b["loss"][slot:slot + 1].copy_(lt[:1], non_blocking=True)
            # Device-side flag of a non-finite loss: first/last step and count, all without a sync.
            bad = (~torch.isfinite(lt)).any().to(dev, non_blocking=True)
            fl = b["bad_loss"]
            fl[0:1].copy_(torch.where(bad & (fl[0] == 0), self.step, fl[0]).reshape(1))
            fl[1:2].add_(bad.reshape(1))
            fl[2:3].copy_(torch.where(bad, self.step, fl[2]).reshape(1))
        else:
            value = float("nan") if loss is None else float(loss)
            b["loss"][slot] = value  # a fill kernel, no sync
            if loss is not None and not math.isfinite(value):
                h = self._host_bad_loss
                h[0] = h[0] or self.step
                h[1] += 1
                h[2] = self.step
        if self.per_layer:
            row = b["layers"][slot]
            src, dst = self._layer_index(stats.names, dev)
            if src is None:
                row.copy_(stats.norm, non_blocking=True)
            else:
                row.fill_(float("nan"))
                if len(dst):
                    row.index_copy_(0, dst, stats.norm.index_select(0, src).to(row.dtype))
        if self.every is not None and self.step % self.every == 0:
            return self.log()
        return None

    @torch.no_grad()
    def record_skip(self, skipped) -> None:
        """Mark the step just recorded (by ``monitor(...)``, ``record`` or ``clip_grad_norm_``) as skipped or
        not: ``skipped`` is a 0-dim tensor (bool, int or float; nonzero = skipped), e.g. the device flag of a
        step guard or ``found_inf`` of a GradScaler, or a Python bool. The flag is copied into the ring buffer
        on the device (no host sync); logging steps count the skipped steps since the previous report
        (``GradientReport.skipped_steps``, a ``skipped_steps`` finding) and :meth:`history` lists them.
        Calling it again for the same step replaces the mark. A logging step's report covers its own step
        only when the mark came before it (``record_skip`` after ``monitor(...)``, the usual order, has its
        mark counted in the next report)."""
        if self.step == 0 or self._bufs is None:
            raise RuntimeError("record_skip() marks the step just recorded: call it after monitor(...), "
                               "monitor.record(...) or monitor.clip_grad_norm_(...) of that step")
        slot = (self.step - 1) % self.capacity
        buf = self._bufs["skipped"]
        if isinstance(skipped, Tensor):
            if skipped.numel() != 1:
                raise ValueError(f"record_skip() takes a one-element flag, got a tensor of shape "
                                 f"{tuple(skipped.shape)}")
            buf[slot:slot + 1].copy_((skipped.detach().reshape(1) != 0).to(torch.int64), non_blocking=True)
        elif isinstance(skipped, (bool, int)):
            buf[slot] = int(bool(skipped))
        else:
            raise TypeError(f"record_skip() takes a 0-dim tensor or a bool, got {type(skipped).__name__}")
        self._skips_used = True
        self._skip_marked = self.step

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None, *, loss=None) -> Tensor:
        """``fastgrad.clip_grad_norm_`` over the monitored parameters AND this step's monitor record, from
        ONE read of the gradients: the fused statistics pass gives the per-tensor L2 norms (and max |g|,
        NaN/Inf/zero counts), the total norm and the clip coefficient are derived on the device, and the
        gradients are scaled only where the coefficient is below 1 (the fused backends skip the write
        otherwise). Returns the total norm before clipping, as ``clip_grad_norm_`` does; no host sync except
        on a logging step (then the report is in ``last_report`` and went to the loggers) or with
        ``error_if_nonfinite=True``. The recorded statistics are those before clipping.

        CPU gradients on the cpu backend (every parameter with a gradient): statistics, coefficient and scale
        run in one compiled call, and the total and the clipped gradients equal ``fastgrad.clip_grad_norm_``'s
        bit for bit (the statistics kernel sums squares exactly as the norm kernel does). Elsewhere the total
        is the norm of the per-tensor norms, as the torch backend's clip computes it (same bits there); where
        a backend's clip sums all squares before one rounding, equal to its total within float32 rounding
        and the clipped gradients to about one ulp. ``norm_type`` other than 2, sparse/complex/DTensor gradients:
        ``fastgrad.clip_grad_norm_`` then a separate statistics pass (two reads)."""
        from . import clip as C

        max_norm = I.check_max_norm(max_norm)
        p = I.check_norm_type(norm_type)
        if p == 2.0:  # CPU grads on the cpu backend: statistics, coefficient and scale in one C++ call
            fast = _scan.monitor_clip_cpu(self._params, max_norm, error_if_nonfinite, self.backend)
            if fast is not None:
                total, nonfinite, mask, *cols = fast
                if nonfinite:
                    raise RuntimeError(C._NONFINITE_MSG.format(p))  # nothing was written
                cols = dict(zip(("norm", "max_abs", "nan", "inf", "zero"), cols), total_norm=total)
                self._clip_step = (self.step + 1, max_norm)
                self.record(_stats_of_all(self._all_names, self._params, cols, self._meta), loss)
                return total.to(_scan.dtype_of_mask(mask, total.dtype))
        grads = I.grads_of(self._params)
        if p != 2.0 or not grads or not _fusable(grads):
            # The statistics are read first, so that they describe the gradients before clipping.
            stats = self._stats(grads) if grads and (_readable(grads) or D.has_dtensor(grads)) else None
            total = C.clip_grad_norm_(self._params, max_norm, p, error_if_nonfinite, foreach,
                                      backend=self.backend)
            self._clip_step = (self.step + 1, max_norm)
            self.record(stats if stats is not None else _empty_like_stats(self.named, total), loss)
            return total
        stats = self._stats(grads)
        total = stats.total_norm
        if error_if_nonfinite:
            C._check_finite(total, p)  # the one sync asked for, before anything is written
        C._scale(grads, clip_coef(total, max_norm), self.backend, foreach)
        self._clip_step = (self.step + 1, max_norm)
        self.record(stats, loss)
        return total.to(I.promoted_dtype(grads))

    # ---------------------------------------------------------------- reading (syncs)
    def _slots(self, first_step: int, last_step: int) -> list[int]:
        return [(s - 1) % self.capacity for s in range(first_step, last_step + 1)]

    def _absorb(self, norm_buf: list[float], loss_buf: list[float], nf_buf: list[float],
                skip_buf: list[float]) -> None:
        """Append the steps not yet in the host history (those still in the ring) from host copies."""
        start = max(self._flushed + 1, self.step - self.capacity + 1, 1)
        for s, k in zip(range(start, self.step + 1), self._slots(start, self.step)):
            self._h_steps.append(s)
            self._h_norm.append(norm_buf[k])
            self._h_loss.append(loss_buf[k])
            self._h_nonfinite.append(nf_buf[k])
            self._h_skipped.append(skip_buf[k])
        self._flushed = self.step
        self._refresh_skips(skip_buf)

    def _refresh_skips(self, skip_buf: list[float]) -> None:
        """Re-read the skip marks of the steps still in the ring: record_skip() may mark a step after a
        logging step copied it to the host."""
        if not self._skips_used:
            return
        h_steps, h_skip, n = self._h_steps, self._h_skipped, len(self._h_steps)
        for s in range(max(1, self.step - self.capacity + 1), self.step + 1):
            i = n - 1 - (self.step - s)
            if 0 <= i < n and h_steps[i] == s:
                h_skip[i] = skip_buf[(s - 1) % self.capacity]

    def flush(self) -> None:
        """Copy the unread part of the ring buffers into the host history (one sync)."""
        if self._bufs is None or (self._flushed == self.step and not self._skips_used):
            return
        b = self._bufs
        flat = torch.cat([b["norm"].double(), b["loss"].double(), b["nonfinite"].double(),
                          b["skipped"].double()]).tolist()
        c = self.capacity
        self._absorb(flat[:c], flat[c:2 * c], flat[2 * c:3 * c], flat[3 * c:])

    def history(self) -> dict[str, list]:
        """Every recorded step so far (those before the last ``history`` steps only if a logging step or
        :meth:`flush` read them in time): ``steps``, ``total_norm``, ``loss`` (NaN where none was given),
        ``nonfinite`` (NaN+Inf gradient values per step) and ``skipped`` (1 where :meth:`record_skip` marked
        the step skipped)."""
        self.flush()
        return {"steps": list(self._h_steps), "total_norm": list(self._h_norm), "loss": list(self._h_loss),
                "nonfinite": [int(v) for v in self._h_nonfinite], "skipped": [int(v) for v in self._h_skipped]}

    def layer_history(self) -> dict[str, list[float]]:
        """Per-parameter gradient norms of the steps still in the ring buffer, oldest first (one sync)."""
        if not self.per_layer or self._bufs is None:
            return {}
        n = min(self.step, self.capacity)
        order = self._slots(self.step - n + 1, self.step)
        rows = self._bufs["layers"].double().tolist()
        return {name: [rows[k][j] for k in order] for j, name in enumerate(self.names)}

    def _bad_loss_finding(self, dev_flag: list[float]) -> Finding | None:
        """Merge the device flag and the host one (losses given as numbers), then clear both."""
        h = self._host_bad_loss
        firsts = [int(v) for v in (dev_flag[0], h[0]) if v]
        count = int(dev_flag[1]) + h[1]
        last = max(int(dev_flag[2]), h[2])
        self._host_bad_loss = [0, 0, 0]
        if self._bufs is not None:
            self._bufs["bad_loss"].zero_()  # a kernel, no sync: the next window starts clean
        if not count:
            return None
        first = min(firsts)
        since = f"since step {self._logged}" if self._logged else "so far"
        detail = (f"The loss was NaN/Inf at {count} step(s) {since}, first at step {first}"
                  + (f", last at step {last}" if last != first else "")
                  + ". The optimizer stepped on gradients of a meaningless loss (finite or not).")
        return Finding("nonfinite_loss", "critical",
                       f"non-finite loss (NaN/Inf) first at step {first}; check the loss before backward()",
                       detail, steps=sorted({first, last}))

    def _trend_args(self) -> dict:
        return dict(self.rules)

    @torch.no_grad()
    def log(self) -> GradientReport:
        """Build the report of the current step (one sync) and send it to the loggers. Called automatically
        on every ``every``-th step; call it yourself at any time."""
        stats = self.last_stats if self.last_stats is not None else self._stats()
        pnorms = None
        if self.include_params and len(stats):
            from .clip import multi_tensor_norm

            # The parameters of the recorded statistics, by name: their gradients may be gone by now (log()
            # after optimizer.zero_grad()), so "the params that have a grad now" would not line up.
            by_name = self._by_name
            params = [by_name[n].detach() for n in stats.names if n in by_name]
            if len(params) == len(stats):
                _, pnorms = multi_tensor_norm(params, per_tensor=True, backend=self.backend)
        b = self._bufs
        extras = [b["norm"], b["loss"], b["nonfinite"], b["skipped"], b["bad_loss"]] if b is not None else []
        host, rest = _gather(stats, pnorms, extras)  # the one sync of a logging step
        flag = rest.pop() if rest else [0, 0, 0]
        if rest:
            self._absorb(*rest)
        r = self.rules
        steps = list(self._h_steps)[-self.capacity:]
        norms = list(self._h_norm)[-self.capacity:]
        losses = list(self._h_loss)[-self.capacity:]
        trends = detect_trends(steps, norms, new_after=self._logged, thresholds=self.thresholds,
                               losses=losses, **self._trend_args())
        trends += detect_loss_jumps(steps, losses, new_after=self._logged, window=r["baseline"],
                                    warmup=r["warmup"], min_history=r["min_history"])
        bad_loss = self._bad_loss_finding(flag)
        bad_steps = [s for s, v in zip(self._h_steps, self._h_nonfinite) if s > self._logged and v > 0]
        current_bad = sum(host["nan"]) + sum(host["inf"]) > 0
        if bad_steps and not (current_bad and bad_steps == [self.step]):
            trends.append(Finding("nonfinite_seen", "warning", "non-finite gradients at earlier steps",
                                  f"{len(bad_steps)} step(s) since the last report had NaN/Inf gradients.",
                                  steps=bad_steps))
        skipped = None
        if self._skips_used:
            upto = self.step if self._skip_marked == self.step else self.step - 1
            since = [(s, v) for s, v in zip(self._h_steps, self._h_skipped) if self._skip_from < s <= upto]
            self._skip_from = max(self._skip_from, upto)
            marked = [s for s, v in since if v > 0]
            skipped = len(marked)
            if marked:
                sev = "warning" if 2 * len(marked) > len(since) else "notice"
                trends.append(Finding(
                    "skipped_steps", sev, f"{len(marked)} of {len(since)} step(s) skipped, steps {since[0][0]} to "
                    f"{since[-1][0]}",
                    f"The step guard skipped step(s) {', '.join(map(str, marked[:8]))}"
                    + (", ..." if len(marked) > 8 else "") + ": those updates were not applied"
                    + (" (more than half of the steps: training is barely moving)." if sev == "warning" else "."),
                    steps=marked))
        clip = self._clip_step[1] if self._clip_step is not None and self._clip_step[0] == self.step else None
        finite_losses = [v for v in losses[-self.trend_window:] if math.isfinite(v)]
        loss_now = self._h_loss[-1] if len(self._h_loss) and self._h_steps[-1] == self.step else math.nan
        report = GradientReport._build(host, stats, loss_history=finite_losses or None, step=self.step,
                                       thresholds=self.thresholds,
                                       extra_findings=([bad_loss] if bad_loss else []) + trends,
                                       loss=None if math.isnan(loss_now) and bad_loss is None else loss_now,
                                       row_sparse=self._row_sparse, clip_max_norm=clip, skipped_steps=skipped)
        if bad_loss is not None:  # first in the list: the earliest cause
            report.findings.remove(bad_loss)
            report.findings.insert(0, bad_loss)
        new_steps = [(s, v) for s, v in zip(self._h_steps, self._h_norm) if s > self._logged]
        self._logged = self.step
        self.last_report = report
        for lg in self.loggers:
            self._emit(lg, report, new_steps, loss_now)
        return report

    # ---------------------------------------------------------------- loggers (duck-typed)
    def _emit(self, lg, report: GradientReport, new_steps, loss_now: float) -> None:
        step = report.step
        scalars = report.scalars(per_layer=self.per_layer)
        if hasattr(lg, "add_scalar"):  # TensorBoard SummaryWriter (or tensorboardX)
            # Full-resolution norm curve from the ring buffer: no extra sync, steps written after the fact.
            for s, v in new_steps:
                lg.add_scalar("grad/total_norm", v, s)
            for tag, v in scalars.items():
                if tag != "grad/total_norm":
                    lg.add_scalar(tag, v, step)
            if not report.healthy and hasattr(lg, "add_text"):
                lg.add_text("grad/report", report.to_markdown(), step)
        elif isinstance(lg, logging.Logger):
            level = {"healthy": logging.DEBUG, "notice": logging.INFO, "warning": logging.WARNING,
                     "critical": logging.ERROR}[report.status]
            lg.log(level, "step %d: gradient status %s, total norm %.4g%s", step, report.status,
                   report.total_norm, "".join(f"; {f.severity}: {f.title}" for f in report.findings))
        elif hasattr(lg, "log") and callable(lg.log):  # a wandb run: its step counter is its own
            lg.log(scalars | {"grad/step": step, "grad/status": report.status})
        elif isinstance(lg, (str, os.PathLike)) or hasattr(lg, "write"):
            self._write_csv(lg, report, loss_now)
        elif callable(lg):
            lg(scalars | {"grad/status": report.status}, step)
        else:
            raise TypeError(f"unsupported logger of type {type(lg).__name__}")

    def _write_csv(self, target, report: GradientReport, loss_now: float) -> None:
        key = id(target)
        if key not in self._csv_files:
            if hasattr(target, "write"):
                fh, own = target, False
                empty = not getattr(target, "tell", lambda: 0)()
            else:
                empty = not os.path.exists(target) or os.path.getsize(target) == 0
                fh, own = open(target, "a", newline=""), True
            w = csv.DictWriter(fh, fieldnames=_CSV_FIELDS)
            if empty:
                w.writeheader()
            self._csv_files[key] = (fh, w, own)
        fh, w, _ = self._csv_files[key]
        d = report.to_dict()
        w.writerow({
            "step": report.step, "status": report.status, "total_norm": report.total_norm,
            "max_abs": report.max_abs, "nan": report.nan, "inf": report.inf, "zero_fraction": d["zero_fraction"],
            "param_norm": "" if report.param_norm is None else report.param_norm,
            "grad_param_ratio": "" if report.ratio is None else report.ratio,
            "loss": "" if math.isnan(loss_now) else loss_now, "findings": ";".join(report.codes()),
            "skipped_steps": "" if report.skipped_steps is None else report.skipped_steps,
        })
        fh.flush()

    def close(self) -> None:
        """Close the CSV files the monitor opened itself."""
        for fh, _, own in self._csv_files.values():
            if own:
                fh.close()
        self._csv_files.clear()

    # ---------------------------------------------------------------- plotting
    def plot(self, path, *, title: str = "Gradient norm") -> str:
        """Write the total-norm-over-time curve to ``path`` (PNG): log scale, the healthy band shaded, spikes
        and non-finite steps marked. Needs matplotlib; syncs once to read the unread steps."""
        try:
            # The object API, not pyplot: no global backend switch, no window, safe inside any app.
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as e:  # optional dependency
            raise ImportError("GradientMonitor.plot needs matplotlib: pip install matplotlib") from e
        h = self.history()
        th = self.thresholds
        fig = Figure(figsize=(8, 4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        pts = [(s, v) for s, v in zip(h["steps"], h["total_norm"]) if math.isfinite(v) and v > 0]
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], lw=1.2, label="total grad norm")
            spikes = detect_trends(h["steps"], h["total_norm"], thresholds=th, **self._trend_args())
            marks = {s for f in spikes if f.code == "spike" for s in f.steps}
            sp = [(s, v) for s, v in pts if s in marks]
            if sp:
                ax.scatter([s for s, _ in sp], [v for _, v in sp], color="tab:red", zorder=3, label="spike")
            ax.set_yscale("log")
        bad = [s for s, v in zip(h["steps"], h["nonfinite"]) if v > 0]
        for s in bad:
            ax.axvline(s, color="tab:red", alpha=0.3, lw=0.8)
        ax.axhspan(th.healthy_low, th.healthy_high, color="tab:green", alpha=0.1, label="healthy range")
        ax.set_xlabel("step")
        ax.set_ylabel("gradient norm")
        ax.set_title(title)
        ax.legend(loc="best")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
        return str(path)
