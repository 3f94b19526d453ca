"""One step's gradient health: ``GradientReport`` (plain host values, built with ONE host sync) and
``gradient_report``. The statuses come from the step rules (``fastgrad.diagnose.rules.step``: the table of
``fastgrad.diagnose.thresholds``), the advice from ``fastgrad.diagnose.advice``, the renderings from
``fastgrad.diagnose.render.step_text``; this module wires them together.

========================================  ==========  =============================================
finding                                   severity    code
========================================  ==========  =============================================
any NaN or Inf gradient                   critical    ``nonfinite`` (names the parameters)
total norm == 0 (or no gradient at all)   critical    ``no_learning``
total norm > 1000                         critical    ``exploding``
100 < total norm <= 1000                  warning     ``exploding``
10 < total norm <= 100                    notice      ``elevated``
0.1 <= total norm <= 10                   (healthy)
1e-3 <= total norm < 0.1                  notice      ``low``
0 < total norm < 1e-3                     warning     ``vanishing``; a notice ``small_but_learning``
                                                      instead when a loss history shows progress
total norm == 0 after a clip to max_norm 0 critical  ``clipped_to_zero`` (instead of ``no_learning``,
                                                      when the report is told about the clip)
NaN or Inf loss (even with finite grads)  critical    ``nonfinite_loss`` (the current loss, or any
                                                      value of the loss history)
loss jumps >= 10x its recent median       warning     ``loss_spike`` (>= 3x: a notice)
> 50% of parameter tensors all-zero grad  warning     ``dead``
> 75% of dense gradient values zero       notice      ``mostly_zero`` (when ``dead`` does not apply)
early layers' norms > 1000x below late    warning     ``depth_vanishing`` (row-sparse layers, i.e.
                                                      embeddings, and free parameters such as a learned
                                                      initial state or a scalar gain left out)
========================================  ==========  =============================================
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import torch
from torch import Tensor

from ..stats import GradStats, grad_stats, named_params, row_sparse_names
from .collect.snapshot import LayerRow, ParamRow, RowSparseRow, gather, group_layers, ratio, row_sparse_rows
from .finding import Finding
from .render import step_text
from .rules.step import classify, loss_findings
from .rules.trends import loss_progress
from .thresholds import RANK, Thresholds

__all__ = ["GradientReport", "gradient_report"]


@dataclass
class GradientReport:
    """Gradient health at one step. Build it with :func:`gradient_report` (or a ``GradientMonitor``); all
    fields are plain Python values, so using the report never touches the device again."""

    total_norm: float
    max_abs: float
    nan: int
    inf: int
    zero: int
    numel: int
    param_norm: float | None
    ratio: float | None
    params: list[ParamRow]
    layers: list[LayerRow]
    no_grad: list[str]
    findings: list[Finding]
    step: int | None = None
    loss_progress: bool | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)
    loss: float | None = None  # the current loss, when one was given (NaN/Inf kept)
    #: embedding-like parameters (see :class:`RowSparseRow`) and how the depth rule treated them
    row_sparse: list[RowSparseRow] = field(default_factory=list)
    #: the total norm before a clip, and the clip's max_norm, when the caller told the report about one
    pre_clip_norm: float | None = None
    clip_max_norm: float | None = None
    #: steps skipped by a step guard since the previous report (``GradientMonitor.record_skip``); None: unknown
    skipped_steps: int | None = None

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_stats(cls, stats: GradStats, param_norms: Tensor | None = None, *,
                   loss_history: Sequence | Tensor | None = None, step: int | None = None,
                   thresholds: Thresholds | None = None, loss=None, row_sparse: Iterable[str] | None = None,
                   pre_clip_norm=None, clip_max_norm: float | None = None) -> "GradientReport":
        """Build a report from device statistics with one host sync. ``param_norms``: the per-tensor norms
        of the parameters in the order of ``stats`` (for the grad/param ratio). ``loss_history``: recent loss
        values (floats or tensors, oldest first) for the "small but learning is fine" caveat, the loss-jump
        rule and the non-finite-loss check. ``loss``: the current loss (tensor or number), read in the same
        sync; NaN/Inf there or in the history is a critical finding even when every gradient is finite.

        ``row_sparse``: names of embedding-like parameters (``fastgrad.stats.row_sparse_names(model)``), added
        to those ``stats`` already knows (sparse gradients, embeddings of a module given to ``grad_stats``);
        the depth rule leaves out those of them whose gradient touched only some rows, and the report shows
        the evidence. ``pre_clip_norm`` (number or 0-dim tensor, read in the same sync) and ``clip_max_norm``:
        tell the report that the gradients it reads were clipped: a zero total norm after a clip to
        ``max_norm=0`` (or any clip of a nonzero ``pre_clip_norm`` to a zero total) is ``clipped_to_zero``,
        not "frozen parameters or dead units"."""
        extras, floats = [], None
        dev = stats.total_norm.device
        if isinstance(loss_history, Tensor):
            extras = [loss_history.detach()]
        elif loss_history is not None:
            loss_history = list(loss_history)
            if any(isinstance(v, Tensor) for v in loss_history):
                extras = [torch.stack([torch.as_tensor(v).detach().reshape(()).to(dev, torch.float64)
                                       for v in loss_history])]
            else:
                floats = [float(v) for v in loss_history]
        loss_value = None
        if isinstance(loss, Tensor):
            # every element counts for finiteness; the first one is the value shown
            lt = loss.detach().reshape(-1)
            extras.append(torch.stack([lt[0].to(dev, torch.float64) if lt.numel() else
                                       torch.zeros((), dtype=torch.float64, device=dev),
                                       (~torch.isfinite(lt)).any().to(dev, torch.float64)]))
        elif loss is not None:
            loss_value = float(loss)
        pre = None
        if isinstance(pre_clip_norm, Tensor):
            extras.append(pre_clip_norm.detach().reshape(1))
        elif pre_clip_norm is not None:
            pre = float(pre_clip_norm)
        host, rest = gather(stats, param_norms, extras)
        if isinstance(pre_clip_norm, Tensor):
            pre = rest.pop()[0]
        if isinstance(loss, Tensor):
            value, bad = rest.pop()
            loss_value = value if not bad or not math.isfinite(value) else math.nan
        if rest:
            floats = rest[0]
        return cls._build(host, stats, loss_history=floats, step=step, thresholds=thresholds, loss=loss_value,
                          row_sparse=row_sparse, pre_clip_norm=pre, clip_max_norm=clip_max_norm)

    @classmethod
    def _build(cls, host: dict, stats: GradStats, *, loss_history: Sequence[float] | None = None,
               step: int | None = None, thresholds: Thresholds | None = None,
               extra_findings: Iterable[Finding] = (), loss: float | None = None,
               history_steps: Sequence[int] | None = None, row_sparse: Iterable[str] | None = None,
               pre_clip_norm: float | None = None, clip_max_norm: float | None = None,
               skipped_steps: int | None = None, loss_jumps: bool = True) -> "GradientReport":
        """``history_steps``: the step of each ``loss_history`` value (default: positions 1..n).
        ``loss_jumps=False``: the caller judges loss jumps itself (a monitor, once per jump: judged here over
        the whole history, one spike would be reported at every logging step while it stays in the window)."""
        th = thresholds or Thresholds()
        pn = host.get("param_norm")
        params = [
            ParamRow(name, tuple(stats.shapes[i]), str(stats.dtypes[i]).replace("torch.", ""), host["norm"][i],
                     host["max_abs"][i], host["nan"][i], host["inf"][i], host["zero"][i],
                     math.prod(stats.shapes[i]),
                     None if pn is None else pn[i], None if pn is None else ratio(host["norm"][i], pn[i]))
            for i, name in enumerate(stats.names)
        ]
        layers = group_layers(params, pn is not None)
        finite_max = [r.max_abs for r in params]
        max_abs = max(finite_max, key=lambda v: (not math.isnan(v), v)) if finite_max else 0.0
        if any(math.isnan(v) for v in finite_max):
            max_abs = math.nan
        param_norm = None if pn is None else math.sqrt(sum(v * v for v in pn))
        total = host["total_norm"]
        progress = None if loss_history is None else loss_progress(loss_history, th.loss_progress)
        report = cls(
            total_norm=total, max_abs=max_abs, nan=sum(r.nan for r in params), inf=sum(r.inf for r in params),
            zero=sum(r.zero for r in params), numel=sum(r.numel for r in params), param_norm=param_norm,
            ratio=ratio(total, param_norm), params=params, layers=layers, no_grad=list(stats.no_grad),
            findings=[], step=step, loss_progress=progress, thresholds=th, loss=loss,
            row_sparse=row_sparse_rows(params, set(stats.row_sparse) | set(row_sparse or ())),
            pre_clip_norm=pre_clip_norm, clip_max_norm=None if clip_max_norm is None else float(clip_max_norm),
            skipped_steps=skipped_steps,
        )
        steps = list(history_steps) if history_steps is not None else (
            list(range(1, len(loss_history) + 1)) if loss_history is not None else [])
        # The loss comes first: a bad loss is the earliest cause of everything after it.
        report.findings = (loss_findings(loss, loss_history, steps, step, jumps=loss_jumps) + classify(report)
                           + list(extra_findings))
        report._downgrade_with_progress()
        return report

    def _downgrade_with_progress(self) -> None:
        # The "small but learning is fine" caveat also covers a monitor's decay-to-zero trend.
        if self.loss_progress:
            for f in self.findings:
                if f.code == "decaying" and f.severity == "warning":
                    f.severity = "notice"
                    f.detail += " The loss is decreasing, so this is likely convergence."

    # ---------------------------------------------------------------- summary
    @property
    def status(self) -> str:
        """"healthy", "notice", "warning" or "critical": the worst finding's severity."""
        worst = "healthy"
        for f in self.findings:
            if RANK[f.severity] > RANK[worst]:
                worst = f.severity
        return worst

    @property
    def healthy(self) -> bool:
        return self.status == "healthy"

    def codes(self, severity: str | None = None) -> list[str]:
        """Codes of the findings (optionally of one severity), in report order."""
        return [f.code for f in self.findings if severity is None or f.severity == severity]

    def finding(self, code: str) -> Finding | None:
        return next((f for f in self.findings if f.code == code), None)

    def nonfinite_params(self) -> list[str]:
        return [r.name for r in self.params if r.nan or r.inf]

    def zero_params(self) -> list[str]:
        """Parameters (tensors) whose gradient is entirely zero: what the ``dead`` rule counts."""
        return [r.name for r in self.params if r.numel and r.zero == r.numel]

    # ---------------------------------------------------------------- machine-readable
    def to_dict(self) -> dict:
        """Plain Python values for loggers and JSON (NaN/Inf stay floats)."""
        d = {
            "step": self.step, "status": self.status, "total_norm": self.total_norm, "max_abs": self.max_abs,
            "nan": self.nan, "inf": self.inf, "zero": self.zero, "numel": self.numel,
            "zero_fraction": self.zero / self.numel if self.numel else 0.0,
            "param_norm": self.param_norm, "grad_param_ratio": self.ratio, "loss_progress": self.loss_progress,
            "loss": self.loss,
            "zero_params": self.zero_params(), "row_sparse": [asdict(r) for r in self.row_sparse],
            "pre_clip_norm": self.pre_clip_norm, "clip_max_norm": self.clip_max_norm,
            "skipped_steps": self.skipped_steps,
            "no_grad": list(self.no_grad),
            "findings": [asdict(f) for f in self.findings],
            "layers": [asdict(r) for r in self.layers],
            "params": [asdict(r) | {"shape": list(r.shape)} for r in self.params],
        }
        return d

    def scalars(self, per_layer: bool = True, prefix: str = "grad/") -> dict[str, float]:
        """Flat ``{tag: number}`` for scalar loggers (TensorBoard, W&B, CSV)."""
        out = {
            f"{prefix}total_norm": self.total_norm, f"{prefix}max_abs": self.max_abs,
            f"{prefix}nan": float(self.nan), f"{prefix}inf": float(self.inf),
            f"{prefix}zero_fraction": self.zero / self.numel if self.numel else 0.0,
            f"{prefix}status_level": float(RANK[self.status]),
            f"{prefix}zero_params": float(len(self.zero_params())),
        }
        if self.skipped_steps is not None:
            out[f"{prefix}skipped_steps"] = float(self.skipped_steps)
        if self.param_norm is not None:
            out[f"{prefix}param_norm"] = self.param_norm
            out[f"{prefix}grad_param_ratio"] = self.ratio
        if per_layer:
            for r in self.layers:
                out[f"{prefix}norm/{r.name}"] = r.norm
        return out

    # ---------------------------------------------------------------- human-readable
    # ---------------------------------------------------------------- human-readable (fastgrad.diagnose.render)
    def summary_rows(self) -> list[tuple[str, str]]:
        """(metric, value) rows of the report's summary table."""
        return step_text.summary_rows(self)

    def to_markdown(self, max_layers: int = 50) -> str:
        """Markdown: Summary table, Issues Detected (severity, affected layers), Recommendations (with code),
        then per-layer gradients (at most ``max_layers`` rows)."""
        return step_text.to_markdown(self, max_layers)

    def to_text(self, max_layers: int = 30, width: int | None = None) -> str:
        """Plain-text rendering (what :meth:`show` prints when rich is not installed). ``width``: fit the
        lines into that many columns (prose wrapped; the per-layer table loses its all-zero NaN/Inf columns,
        then Max abs and Param norm, and abbreviates layer names from the middle); None: no limit."""
        return step_text.to_text(self, max_layers, width)

    def __str__(self) -> str:
        return self.to_text()

    def show(self, console=None, *, max_layers: int = 30, use_rich: bool | None = None,
             width: int | None = None) -> None:
        """Print the report: rich tables when rich is installed (or ``use_rich=True``), else plain text,
        fitted to the terminal's width (``width`` overrides it)."""
        step_text.show(self, console, max_layers=max_layers, use_rich=use_rich, width=width)


# ---------------------------------------------------------------------------------------------- entry point
def gradient_report(model_or_parameters, *, loss=None, loss_history: Sequence | Tensor | None = None,
                    include_params: bool = True, step: int | None = None, thresholds: Thresholds | None = None,
                    row_sparse: Iterable[str] | None = None, pre_clip_norm=None, clip_max_norm: float | None = None,
                    backend: str | None = None) -> GradientReport:
    """Gradient health report of a model (or parameters, or ``(name, param)`` pairs) after ``backward()``.

    Reads every gradient once (``grad_stats``) and, with ``include_params``, every parameter once (for the
    grad/param norm ratio), then syncs the host once. ``loss`` (tensor or number) is the current loss and
    ``loss_history`` (oldest first) the recent ones: a NaN/Inf in either is a critical ``nonfinite_loss``
    finding even when every gradient is finite; the history also enables the "small but learning is fine"
    caveat for vanishing gradients and the ``loss_spike`` rule. ``row_sparse``, ``pre_clip_norm`` and
    ``clip_max_norm``: see :meth:`GradientReport.from_stats` (the embeddings of a module are found by
    themselves)."""
    named = named_params(model_or_parameters)
    stats = grad_stats(named, backend=backend)
    stats.row_sparse = stats.row_sparse + row_sparse_names(model_or_parameters)
    pnorms = None
    if include_params and len(stats):
        from ..clip import multi_tensor_norm

        by_name = dict(named)
        params = [by_name[n].detach() for n in stats.names]
        _, pnorms = multi_tensor_norm(params, per_tensor=True, backend=backend)
    return GradientReport.from_stats(stats, pnorms, loss_history=loss_history, step=step, thresholds=thresholds,
                                     loss=loss, row_sparse=row_sparse, pre_clip_norm=pre_clip_norm,
                                     clip_max_norm=clip_max_norm)
