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

from .report import Finding, GradientReport, Thresholds, _gather
from .stats import GradStats, _named, grad_stats

__all__ = ["GradientMonitor", "detect_trends"]

_CSV_FIELDS = ["step", "status", "total_norm", "max_abs", "nan", "inf", "zero_fraction", "param_norm",
               "grad_param_ratio", "loss", "findings"]


def detect_trends(steps: Sequence[int], norms: Sequence[float], *, new_after: int = 0, k_sigma: float = 3.0,
                  window: int = 200, min_history: int = 10, thresholds: Thresholds | None = None) -> list[Finding]:
    """Trends of a total-norm history (oldest first), as report findings:

    - ``spike``: a step after ``new_after`` whose norm exceeds mean + k_sigma * std of the (up to ``window``)
      finite norms before it; needs ``min_history`` of them. The std is floored at 5% of the mean so that a
      nearly constant history does not turn small wobbles into spikes. A warning if some spike is also over
      twice the mean, else a notice.
    - ``increasing``: over the last ``window`` finite norms split in four quarters, each quarter's median is
      above the previous one and the last is at least twice the first (medians ignore single spikes).
    - ``decaying``: each quarter's median below the previous one and the last one under the vanishing
      threshold (1e-3) or 1000x below the first: the norm decays to ~0.
    """
    th = thresholds or Thresholds()
    found: list[Finding] = []
    spikes, big = [], False
    for i, (s, v) in enumerate(zip(steps, norms)):
        if s <= new_after or not math.isfinite(v):
            continue
        base = [x for x in norms[max(0, i - window):i] if math.isfinite(x)]
        if len(base) < min_history:
            continue
        mean = sum(base) / len(base)
        std = math.sqrt(sum((x - mean) ** 2 for x in base) / len(base))
        std = max(std, 0.05 * abs(mean))
        if v > mean + k_sigma * std:
            spikes.append(s)
            big = big or v > 2 * mean
    if spikes:
        # Over a long noisy history some k-sigma excursions are chance: only a spike that also doubles the
        # mean norm is a warning.
        found.append(Finding("spike", "warning" if big else "notice", f"gradient norm spikes (> {k_sigma:g} sigma)",
                             f"{len(spikes)} step(s) above mean + {k_sigma:g} std of the preceding history.",
                             steps=spikes))
    recent = [v for v in norms[-window:] if math.isfinite(v)]
    if len(recent) >= max(min_history, 4):
        q = len(recent) // 4
        med = [median(recent[i * q:(i + 1) * q]) for i in range(3)] + [median(recent[3 * q:])]
        first_step = steps[-len(norms[-window:])]
        if all(b > a for a, b in zip(med, med[1:])) and med[3] >= 2 * med[0]:
            found.append(Finding("increasing", "warning", "gradient norm steadily increasing",
                                 f"Median norm grew {med[3] / med[0] if med[0] else math.inf:.3g}x since step "
                                 f"{first_step} ({' -> '.join(f'{m:.3g}' for m in med)})."))
        elif all(b < a for a, b in zip(med, med[1:])) and (med[3] < th.vanishing or med[3] * 1000 <= med[0]):
            found.append(Finding("decaying", "warning", "gradient norm decaying to ~0",
                                 f"Median norm fell from {med[0]:.3g} to {med[3]:.3g} since step {first_step}."))
    return found


class GradientMonitor:
    """Track gradient health during training without host syncs except on logging steps.

    ::

        monitor = fastgrad.GradientMonitor(model, every=100, logger=SummaryWriter())
        for x, y in data:
            loss = criterion(model(x), y)
            loss.backward()
            report = monitor(loss)      # None except every 100th step, when it is a GradientReport
            optimizer.step(); optimizer.zero_grad()

    ``logger``: a TensorBoard ``SummaryWriter`` (anything with ``add_scalar``), a Weights & Biases run
    (anything with ``log(dict)``), a ``logging.Logger``, a CSV path or text file, a callable
    ``f(metrics: dict, step: int)``, or a list of these; None keeps the reports in ``last_report`` only.
    ``history``: ring-buffer length in steps (at least ``every``). ``loss`` may be a tensor (stored on the
    device, no sync) or a number.
    """

    def __init__(self, model, every: int | None = 100, logger=None, *, history: int = 1000,
                 per_layer: bool = True, include_params: bool = True, k_sigma: float = 3.0,
                 trend_window: int = 200, min_history: int = 10, thresholds: Thresholds | None = None,
                 backend: str | None = None):
        if every is not None and every < 1:
            raise ValueError(f"every must be a positive number of steps or None, got {every!r}")
        self.named = _named(model)
        self.names = [n for n, p in self.named if p.requires_grad]
        self.every = every
        self.loggers = list(logger) if isinstance(logger, (list, tuple)) else ([] if logger is None else [logger])
        self.capacity = max(history, every or 1)
        self.per_layer = per_layer
        self.include_params = include_params
        self.k_sigma = k_sigma
        self.trend_window = trend_window
        self.min_history = min_history
        self.thresholds = thresholds or Thresholds()
        self.backend = backend
        self.step = 0  # host-side counter: the only thing that picks ring-buffer slots
        self.last_report: GradientReport | None = None
        self.last_stats: GradStats | None = None
        self._bufs: dict[str, Tensor] | None = None
        self._index_cache: dict[tuple[str, ...], Tensor | None] = {}
        self._flushed = 0  # last step copied into the host history
        self._logged = 0  # last step whose trends were reported
        self._h_steps, self._h_norm, self._h_loss, self._h_nonfinite = array("q"), array("d"), array("d"), array("d")
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
        }
        if self.per_layer:
            self._bufs["layers"] = torch.full((cap, len(self.names)), nan, device=dev, dtype=dt)

    def _layer_index(self, names: list[str], dev) -> tuple[Tensor | None, Tensor | None]:
        """(positions in stats, destination columns) as cached device index tensors; (None, None) when the
        stats cover exactly the tracked parameters in order (the usual case: a plain copy)."""
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
        return (None, None) if v is None else v

    @torch.no_grad()
    def __call__(self, loss=None) -> GradientReport | None:
        """Record this step's gradients (call after ``backward()``); on a logging step return the report."""
        stats = grad_stats(self.named, backend=self.backend)
        self.last_stats = stats
        if self._bufs is None:
            like = stats.total_norm
            if not len(stats) and self.named:  # no grads yet: live where the parameters live
                p0 = self.named[0][1]
                like = torch.zeros((), device=p0.device, dtype=torch.float32)
            self._alloc(like)
        b = self._bufs
        self.step += 1
        slot = (self.step - 1) % self.capacity
        dev = b["norm"].device
        b["norm"][slot:slot + 1].copy_(stats.total_norm.reshape(1), non_blocking=True)
        if len(stats):
            b["nonfinite"][slot:slot + 1].copy_((stats.nan.sum() + stats.inf.sum()).reshape(1), non_blocking=True)
        else:
            b["nonfinite"][slot] = 0
        if isinstance(loss, Tensor):
            b["loss"][slot:slot + 1].copy_(loss.detach().reshape(-1)[:1], non_blocking=True)
        else:
            b["loss"][slot] = float("nan") if loss is None else float(loss)  # a fill kernel, no sync
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

    step_ = __call__

    # ---------------------------------------------------------------- reading (syncs)
    def _slots(self, first_step: int, last_step: int) -> list[int]:
        return [(s - 1) % self.capacity for s in range(first_step, last_step + 1)]

    def _absorb(self, norm_buf: list[float], loss_buf: list[float], nf_buf: list[float]) -> None:
        """Append the steps not yet in the host history (those still in the ring) from host copies."""
        start = max(self._flushed + 1, self.step - self.capacity + 1, 1)
        for s, k in zip(range(start, self.step + 1), self._slots(start, self.step)):
            self._h_steps.append(s)
            self._h_norm.append(norm_buf[k])
            self._h_loss.append(loss_buf[k])
            self._h_nonfinite.append(nf_buf[k])
        self._flushed = self.step

    def flush(self) -> None:
        """Copy the unread part of the ring buffers into the host history (one sync)."""
        if self._bufs is None or self._flushed == self.step:
            return
        b = self._bufs
        flat = torch.cat([b["norm"].double(), b["loss"].double(), b["nonfinite"].double()]).tolist()
        c = self.capacity
        self._absorb(flat[:c], flat[c:2 * c], flat[2 * c:])

    def history(self) -> dict[str, list]:
        """Every recorded step so far (those before the last ``history`` steps only if a logging step or
        :meth:`flush` read them in time): ``steps``, ``total_norm``, ``loss`` (NaN where none was given) and
        ``nonfinite`` (NaN+Inf gradient values per step)."""
        self.flush()
        return {"steps": list(self._h_steps), "total_norm": list(self._h_norm), "loss": list(self._h_loss),
                "nonfinite": [int(v) for v in self._h_nonfinite]}

    def layer_history(self) -> dict[str, list[float]]:
        """Per-parameter gradient norms of the steps still in the ring buffer, oldest first (one sync)."""
        if not self.per_layer or self._bufs is None:
            return {}
        n = min(self.step, self.capacity)
        order = self._slots(self.step - n + 1, self.step)
        rows = self._bufs["layers"].double().tolist()
        return {name: [rows[k][j] for k in order] for j, name in enumerate(self.names)}

    @torch.no_grad()
    def log(self) -> GradientReport:
        """Build the report of the current step (one sync) and send it to the loggers. Called automatically
        on every ``every``-th step; call it yourself at any time."""
        stats = self.last_stats if self.last_stats is not None else grad_stats(self.named, backend=self.backend)
        pnorms = None
        if self.include_params and len(stats):
            from .clip import multi_tensor_norm

            params = [p.detach() for n, p in self.named if p.grad is not None]
            _, pnorms = multi_tensor_norm(params, per_tensor=True, backend=self.backend)
        b = self._bufs
        extras = [b["norm"], b["loss"], b["nonfinite"]] if b is not None else []
        host, rest = _gather(stats, pnorms, extras)  # the one sync of a logging step
        if rest:
            self._absorb(*rest)
        steps = list(self._h_steps)[-self.capacity:]
        norms = list(self._h_norm)[-self.capacity:]
        losses = [v for v in list(self._h_loss)[-self.trend_window:] if math.isfinite(v)]
        trends = detect_trends(steps, norms, new_after=self._logged, k_sigma=self.k_sigma, window=self.trend_window,
                               min_history=self.min_history, thresholds=self.thresholds)
        bad_steps = [s for s, v in zip(self._h_steps, self._h_nonfinite) if s > self._logged and v > 0]
        current_bad = sum(host["nan"]) + sum(host["inf"]) > 0
        if bad_steps and not (current_bad and bad_steps == [self.step]):
            trends.append(Finding("nonfinite_seen", "warning", "non-finite gradients at earlier steps",
                                  f"{len(bad_steps)} step(s) since the last report had NaN/Inf gradients.",
                                  steps=bad_steps))
        report = GradientReport._build(host, stats, loss_history=losses or None, step=self.step,
                                       thresholds=self.thresholds, extra_findings=trends)
        new_steps = [(s, v) for s, v in zip(self._h_steps, self._h_norm) if s > self._logged]
        self._logged = self.step
        self.last_report = report
        loss_now = self._h_loss[-1] if len(self._h_loss) and self._h_steps[-1] == self.step else math.nan
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
            spikes = detect_trends(h["steps"], h["total_norm"], k_sigma=self.k_sigma, window=self.trend_window,
                                   min_history=self.min_history, thresholds=th)
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
