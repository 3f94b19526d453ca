"""GradientMonitor: per-step gradient statistics kept on the device, read to the host only on logging steps.

Every call runs the fused ``grad_stats`` pass and writes its results into preallocated device ring buffers
(``fastgrad.diagnose.collect.history``) at a slot chosen by a host-side step counter, so a non-logging step
launches a few kernels and never waits for the device. Every ``every`` steps the monitor reads the buffers and
the current statistics in ONE sync, builds a :class:`~fastgrad.diagnose.report.GradientReport` with the trends of the
history (``fastgrad.diagnose.rules.trends``: steady growth, k-sigma spikes, decay to ~0) and hands it to the
logger(s) (``fastgrad.diagnose.loggers``)."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .. import _inputs as inputs
from .. import _scan
from .. import distributed
from .. import passes
from ..backends import clip_coef
from ..stats import GradStats, named_params, row_sparse_names, stats_of, stats_of_all
from .collect.history import DeviceHistory
from .collect.snapshot import gather
from .finding import Finding
from .loggers import Loggers
from .render.plot import plot_monitor
from .report import GradientReport
from .rules.trends import SPIKE_RATIO, detect_loss_jumps, detect_trends
from .thresholds import Thresholds

__all__ = ["GradientMonitor", "detect_trends"]


def _fusable(grads: list[Tensor]) -> bool:
    """Dense real floating plain tensors: what the fused statistics pass reads (DTensor, sparse and complex
    gradients take the two-pass path)."""
    if type(grads) is inputs.Checked:
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
    if type(grads) is inputs.Checked:
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

    Alert rules (:func:`detect_trends`, :func:`~fastgrad.diagnose.rules.trends.detect_loss_jumps`): robust baselines
    (median and MAD of the last ``baseline`` steps), nothing judged during the first ``warmup`` steps; a
    spike must be ``spike_z`` robust std above the median and ``spike_ratio`` times it (a warning from
    ``warn_ratio``); a loss jump of 10x its recent median is a warning, of 3x a notice.
    """

    def __init__(self, model, every: int | None = 100, logger=None, *, history: int = 1000,
                 per_layer: bool = True, include_params: bool = True, spike_z: float = 6.0,
                 spike_ratio: float = SPIKE_RATIO, warn_ratio: float = 5.0, baseline: int = 50, warmup: int = 20,
                 trend_window: int = 200, min_history: int = 10, thresholds: Thresholds | None = None,
                 row_sparse: Sequence[str] | None = None, guard=None, backend: str | None = None):
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be a positive number of steps or None, got {every!r}")
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be a positive number of steps, got {history!r}")
        self._loggers = Loggers(list(logger) if isinstance(logger, (list, tuple)) else
                                ([] if logger is None else [logger]))
        self.loggers = self._loggers.items
        self.named = named_params(model)
        self._by_name = dict(self.named)
        # embeddings: left out of the depth rule (found in a module; named by the caller otherwise)
        self._row_sparse = row_sparse_names(model) + [n for n in (row_sparse or ()) if isinstance(n, str)]
        self._clip_step: tuple[int, float] | None = None  # (step, max_norm) of the last monitor.clip_grad_norm_
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
        self.last_report: GradientReport | None = None
        self.last_stats: GradStats | None = None
        self._hist = DeviceHistory(self.capacity, self.names, per_layer)
        self._logged = 0  # last step whose trends were reported

    @property
    def step(self) -> int:
        """Steps recorded so far (the host-side counter that picks the ring-buffer slots)."""
        return self._hist.step

    # ---------------------------------------------------------------- per step
    @torch.no_grad()
    def __call__(self, loss=None) -> GradientReport | None:
        """Record this step's gradients (call after ``backward()``); on a logging step return the report."""
        return self.record(self._stats(), loss)

    step_ = __call__

    def _stats(self, grads: list[Tensor] | None = None) -> GradStats:
        return stats_of(self._all_names, self._params, self.backend, self._meta, grads)

    @torch.no_grad()
    def record(self, stats: GradStats, loss=None) -> GradientReport | None:
        """Record one step from statistics computed elsewhere (e.g. by a clip pass or ``fastgrad.check``)
        without reading the gradients again: ``stats`` must come from ``grad_stats`` over this monitor's
        parameters (or a subset: per-layer columns are matched by name). No host sync except on a logging
        step, where the report is returned (else None)."""
        self.last_stats = stats
        h = self._hist
        if h.bufs is None:
            like = stats.total_norm
            if not len(stats) and self.named:  # no grads yet: live where the parameters live
                p0 = self.named[0][1]
                like = torch.zeros((), device=p0.device, dtype=torch.float32)
            h.alloc(like)
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
        h.write(stats, loss)
        if fresh and self._guard_first:  # clip_ first: its flag is this step's
            self.record_skip(g.skipped)
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
        if self.step == 0 or self._hist.bufs is None:
            raise RuntimeError("record_skip() marks the step just recorded: call it after monitor(...), "
                               "monitor.record(...) or monitor.clip_grad_norm_(...) of that step")
        if isinstance(skipped, Tensor):
            if skipped.numel() != 1:
                raise ValueError(f"record_skip() takes a one-element flag, got a tensor of shape "
                                 f"{tuple(skipped.shape)}")
        elif not isinstance(skipped, (bool, int)):
            raise TypeError(f"record_skip() takes a 0-dim tensor or a bool, got {type(skipped).__name__}")
        self._hist.mark_skip(skipped)

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
        from .. import clip as fastgrad_clip

        max_norm = inputs.check_max_norm(max_norm)
        p = inputs.check_norm_type(norm_type)
        if p == 2.0:  # CPU grads on the cpu backend: statistics, coefficient and scale in one C++ call
            fast = _scan.monitor_clip_cpu(self._params, max_norm, error_if_nonfinite, self.backend)
            if fast is not None:
                total, nonfinite, mask, *cols = fast
                if nonfinite:
                    raise RuntimeError(inputs.NONFINITE_MSG.format(p))  # nothing was written
                cols = dict(zip(("norm", "max_abs", "nan", "inf", "zero"), cols), total_norm=total)
                self._clip_step = (self.step + 1, max_norm)
                self.record(stats_of_all(self._all_names, self._params, cols, self._meta), loss)
                return total.to(_scan.dtype_of_mask(mask, total.dtype))
        grads = inputs.grads_of(self._params)
        if p != 2.0 or not grads or not _fusable(grads):
            # The statistics are read first, so that they describe the gradients before clipping.
            stats = self._stats(grads) if grads and (_readable(grads) or distributed.has_dtensor(grads)) else None
            total = fastgrad_clip.clip_grad_norm_(self._params, max_norm, p, error_if_nonfinite, foreach,
                                      backend=self.backend)
            self._clip_step = (self.step + 1, max_norm)
            self.record(stats if stats is not None else _empty_like_stats(self.named, total), loss)
            return total
        stats = self._stats(grads)
        total = stats.total_norm
        if error_if_nonfinite:
            inputs.check_finite(total, p)  # the one sync asked for, before anything is written
        passes.scale_(grads, clip_coef(total, max_norm), self.backend, foreach)
        self._clip_step = (self.step + 1, max_norm)
        self.record(stats, loss)
        return total.to(inputs.promoted_dtype(grads))

    # ---------------------------------------------------------------- reading (syncs)
    def flush(self) -> None:
        """Copy the unread part of the ring buffers into the host history (one sync)."""
        self._hist.flush()

    def history(self) -> dict[str, list]:
        """Every recorded step so far (those before the last ``history`` steps only if a logging step or
        :meth:`flush` read them in time): ``steps``, ``total_norm``, ``loss`` (NaN where none was given),
        ``nonfinite`` (NaN+Inf gradient values per step) and ``skipped`` (1 where :meth:`record_skip` marked
        the step skipped)."""
        h = self._hist
        h.flush()
        return {"steps": list(h.steps), "total_norm": list(h.norm), "loss": list(h.loss),
                "nonfinite": [int(v) for v in h.nonfinite], "skipped": [int(v) for v in h.skipped]}

    def layer_history(self) -> dict[str, list[float]]:
        """Per-parameter gradient norms of the steps still in the ring buffer, oldest first (one sync)."""
        return self._hist.layer_rows()

    def _bad_loss_finding(self, dev_flag: list[float]) -> Finding | None:
        """The non-finite losses since the last report (device flag and host numbers merged, then cleared)."""
        got = self._hist.take_bad_loss(dev_flag)
        if got is None:
            return None
        first, count, last = got
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
            from ..clip import multi_tensor_norm

            # The parameters of the recorded statistics, by name: their gradients may be gone by now (log()
            # after optimizer.zero_grad()), so "the params that have a grad now" would not line up.
            by_name = self._by_name
            params = [by_name[n].detach() for n in stats.names if n in by_name]
            if len(params) == len(stats):
                _, pnorms = multi_tensor_norm(params, per_tensor=True, backend=self.backend)
        hist = self._hist
        host, rest = gather(stats, pnorms, hist.extras())  # the one sync of a logging step
        flag = rest.pop() if rest else [0, 0, 0]
        if rest:
            hist.absorb(*rest)
        r = self.rules
        steps = list(hist.steps)[-self.capacity:]
        norms = list(hist.norm)[-self.capacity:]
        losses = list(hist.loss)[-self.capacity:]
        trends = detect_trends(steps, norms, new_after=self._logged, thresholds=self.thresholds,
                               losses=losses, **self._trend_args())
        trends += detect_loss_jumps(steps, losses, new_after=self._logged, window=r["baseline"],
                                    warmup=r["warmup"], min_history=r["min_history"])
        bad_loss = self._bad_loss_finding(flag)
        bad_steps = [s for s, v in zip(hist.steps, hist.nonfinite) if s > self._logged and v > 0]
        current_bad = sum(host["nan"]) + sum(host["inf"]) > 0
        if bad_steps and not (current_bad and bad_steps == [self.step]):
            trends.append(Finding("nonfinite_seen", "warning", "non-finite gradients at earlier steps",
                                  f"{len(bad_steps)} step(s) since the last report had NaN/Inf gradients.",
                                  steps=bad_steps))
        skipped = None
        if hist.skips_used:
            upto = self.step if hist.skip_marked == self.step else self.step - 1
            since = [(s, v) for s, v in zip(hist.steps, hist.skipped) if self._skip_from < s <= upto]
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
        loss_now = hist.loss[-1] if len(hist.loss) and hist.steps[-1] == self.step else math.nan
        report = GradientReport._build(host, stats, loss_history=finite_losses or None, step=self.step,
                                       thresholds=self.thresholds,
                                       extra_findings=([bad_loss] if bad_loss else []) + trends,
                                       loss=None if math.isnan(loss_now) and bad_loss is None else loss_now,
                                       row_sparse=self._row_sparse, clip_max_norm=clip, skipped_steps=skipped,
                                       loss_jumps=False)  # judged above, once per jump
        if bad_loss is not None:  # first in the list: the earliest cause
            report.findings.remove(bad_loss)
            report.findings.insert(0, bad_loss)
        new_steps = [(s, v) for s, v in zip(hist.steps, hist.norm) if s > self._logged]
        self._logged = self.step
        self.last_report = report
        self._loggers.emit(report, new_steps, loss_now, self.per_layer)
        return report

    def close(self) -> None:
        """Close the CSV files the monitor opened itself."""
        self._loggers.close()

    def plot(self, path, *, title: str = "Gradient norm") -> str:
        """Write the total-norm-over-time curve to ``path`` (PNG): log scale, the healthy band shaded, spikes
        and non-finite steps marked. Needs matplotlib; syncs once to read the unread steps."""
        try:
            return plot_monitor(self.history(), self.thresholds, self._trend_args(), path, title)
        except ImportError as e:
            raise ImportError("GradientMonitor.plot needs matplotlib: pip install matplotlib") from e
