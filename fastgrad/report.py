"""Gradient health report: the section 7 statuses of docs/contract.md, computed from one ``grad_stats`` pass (plus one pass
over the parameters for the grad/param norm ratio) and read to the host with a single sync.

Status rules (docs/contract.md section 7, with the gaps of that table filled in; docs/diagnostics.md explains why):

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
NaN or Inf loss (even with finite grads)  critical    ``nonfinite_loss`` (the current loss, or any
                                                      value of the loss history)
loss jumps >= 10x its recent median       warning     ``loss_spike`` (>= 3x: a notice)
> 50% of gradient values exactly zero     warning     ``dead``
early layers' norms > 1000x below late    warning     ``depth_vanishing``
========================================  ==========  =============================================
"""

from __future__ import annotations

import io
import math
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Iterable, Sequence

import torch
from torch import Tensor

from .stats import GradStats, _named, grad_stats

__all__ = ["Thresholds", "Finding", "ParamRow", "LayerRow", "GradientReport", "gradient_report", "loss_progress",
           "detect_loss_jumps"]

SEVERITIES = ("notice", "warning", "critical")
_RANK = {"healthy": 0, "notice": 1, "warning": 2, "critical": 3}


@dataclass(frozen=True)
class Thresholds:
    """The numbers of the table of docs/contract.md section 7; change them per model if its healthy range differs."""

    healthy_low: float = 0.1
    healthy_high: float = 10.0
    exploding: float = 100.0
    critical: float = 1000.0
    vanishing: float = 1e-3
    dead_fraction: float = 0.5
    depth_ratio: float = 1000.0
    # A loss history "shows progress" when its last quarter's mean is this fraction below its first quarter's.
    loss_progress: float = 0.01


@dataclass
class Finding:
    """One detected issue: ``code`` is stable (for programs), ``title``/``detail`` are for people."""

    code: str
    severity: str
    title: str
    detail: str = ""
    layers: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)


@dataclass
class ParamRow:
    """Statistics of one parameter's gradient (``param_norm``/``ratio`` are None when params were not read)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    norm: float
    max_abs: float
    nan: int
    inf: int
    zero: int
    numel: int
    param_norm: float | None = None
    ratio: float | None = None


@dataclass
class LayerRow:
    """Parameters grouped by owning module (the name up to the last dot), in first-seen order."""

    name: str
    params: list[str]
    norm: float
    max_abs: float
    nan: int
    inf: int
    zero: int
    numel: int
    param_norm: float | None = None
    ratio: float | None = None


# ---------------------------------------------------------------------------------------------- recommendations
_RECOMMEND: dict[str, tuple[str, str]] = {
    "nonfinite": (
        "Find where the first non-finite value appears: check the loss before backward(), then the parameters. "
        "Under AMP, let the GradScaler skip the step (fastgrad.scaler_unscale_and_clip does the check fused).",
        "report = fastgrad.find_nonfinite(model, loss)   # after backward(); one sync\n"
        "print(report)  # loss finite?  which grads / params are NaN or Inf?\n"
        "# to locate the op that produced it:\n"
        "with torch.autograd.detect_anomaly():\n"
        "    loss = criterion(model(x), y); loss.backward()",
    ),
    "nonfinite_loss": (
        "The loss itself is NaN/Inf, so every update computed from it is garbage even where the gradients are "
        "finite. Check the loss before backward() and skip (or stop) the step; in a custom loss keep log, "
        "division and exp in range (add an eps, clamp); if the loss diverged first, lower the learning rate.",
        "loss = criterion(model(x), y)\n"
        "if not torch.isfinite(loss):   # one sync; fastgrad.GradientMonitor(model)(loss) flags it without one\n"
        "    raise FloatingPointError(f'non-finite loss {loss.item()} at step {step}')\n"
        "# unstable pieces of a custom loss:\n"
        "loss = -torch.log(p.clamp_min(1e-8))         # log(0) = -inf\n"
        "ratio = a / (b + 1e-8)                       # x / 0\n"
        "z = torch.exp(s.clamp(max=80.0))             # exp overflows float32 above ~88\n"
        "for group in optimizer.param_groups:         # and if the loss diverged first\n"
        "    group['lr'] *= 0.1",
    ),
    "loss_spike": (
        "The loss jumped far above its recent level: an outlier batch, a too-high learning rate, or the start "
        "of a divergence. Clip the gradient norm, lower the learning rate, and check the batch of that step.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 0.5",
    ),
    "no_learning": (
        "Nothing will change at the next step. Check that the parameters require grad, that the loss depends "
        "on them (no .detach()/.item() in the graph), and look for dead units (e.g. ReLU layers with large "
        "negative biases).",
        "frozen = [n for n, p in model.named_parameters() if not p.requires_grad]\n"
        "unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]\n"
        "print('frozen:', frozen, 'unused:', unused)",
    ),
    "exploding": (
        "Clip the gradient norm before every optimizer step; if the norm stays above 1000, also lower the "
        "learning rate (and consider warmup).",
        "loss.backward()\n"
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "optimizer.step()\n"
        "# if the norm is still > 1000:\n"
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 0.1",
    ),
    "elevated": (
        "Above the usual healthy range: watch the trend (fastgrad.GradientMonitor); clipping at max_norm=1.0 is "
        "cheap insurance.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)",
    ),
    "low": (
        "Below the usual healthy range. Fine while the loss keeps decreasing; if it stalls, check the "
        "initialisation and the learning rate.",
        "",
    ),
    "vanishing": (
        "Check the architecture and the initialisation: saturating activations (sigmoid/tanh), missing "
        "normalisation or residual connections, a saturated output or a loss scaled down to nothing.",
        "for m in model.modules():\n"
        "    if isinstance(m, torch.nn.Linear):\n"
        "        torch.nn.init.kaiming_normal_(m.weight, nonlinearity='relu')\n"
        "# and prefer ReLU/GELU + LayerNorm/BatchNorm + residual connections in deep stacks",
    ),
    "small_but_learning": ("Small gradients while the loss is decreasing are fine: no action needed.", ""),
    "dead": (
        "Most gradient values are exactly zero: dead ReLUs (use LeakyReLU/GELU, a lower learning rate, a "
        "smaller negative bias) or parameters the loss does not reach.",
        "model = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.LeakyReLU(0.01), torch.nn.Linear(h, k))",
    ),
    "depth_vanishing": (
        "The early layers barely learn: add residual connections and normalisation, use non-saturating "
        "activations, or give the early layers a higher learning rate.",
        "optimizer = torch.optim.AdamW([\n"
        "    {'params': early_layers.parameters(), 'lr': 10 * lr},\n"
        "    {'params': later_layers.parameters(), 'lr': lr},\n"
        "])",
    ),
    "spike": (
        "Isolated spikes usually come from outlier batches or a too-high learning rate: clip the norm.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)",
    ),
    "increasing": (
        "A steadily growing norm precedes divergence: lower the learning rate and clip the norm.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)",
    ),
    "nonfinite_seen": (
        "Some recent steps had NaN/Inf gradients. Under AMP with a GradScaler this is normal while the scale "
        "settles (those steps are skipped); otherwise locate the source.",
        "report = fastgrad.find_nonfinite(model, loss)   # right after the bad backward()\nprint(report)",
    ),
    "decaying": (
        "The gradient norm decays towards zero without the loss improving: training has stalled. Check the "
        "learning-rate schedule, saturation and dead units.",
        "",
    ),
}


def loss_progress(history: Sequence[float], rel: float = Thresholds.loss_progress) -> bool | None:
    """True when the loss history shows progress: the mean of its last quarter is at least ``rel`` (relative)
    below the mean of its first quarter. None when fewer than two finite values are known."""
    vals = [float(v) for v in history if math.isfinite(float(v))]
    if len(vals) < 2:
        return None
    k = max(1, len(vals) // 4)
    early = sum(vals[:k]) / k
    late = sum(vals[-k:]) / k
    return late < early - rel * abs(early)


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


# ---------------------------------------------------------------------------------------------- one sync
def _gather(stats: GradStats, param_norms: Tensor | None, extras: Sequence[Tensor] = ()) -> tuple[dict, list]:
    """Read everything a report needs to the host in ONE transfer: the stats, the parameter norms and any
    ``extras`` (e.g. a monitor's ring buffers) are concatenated on one device and copied together."""
    dev = stats.total_norm.device
    dt = torch.float32 if dev.type == "mps" else torch.float64  # MPS has no float64
    n = len(stats)
    pieces = [stats.total_norm.reshape(1), stats.norm, stats.max_abs, stats.nan, stats.inf, stats.zero]
    if param_norms is not None:
        pieces.append(param_norms.reshape(-1))
    pieces += [e.reshape(-1) for e in extras]
    flat = torch.cat([p.to(dev, dt, non_blocking=True) for p in pieces])
    vals = flat.tolist()  # the one host sync of a report
    out = {"total_norm": vals[0]}
    pos = 1
    for key in ("norm", "max_abs", "nan", "inf", "zero"):
        out[key] = vals[pos:pos + n]
        pos += n
    for key in ("nan", "inf", "zero"):
        out[key] = [int(v) for v in out[key]]
    if param_norms is not None:
        out["param_norm"] = vals[pos:pos + n]
        pos += n
    rest = []
    for e in extras:
        rest.append(vals[pos:pos + e.numel()])
        pos += e.numel()
    return out, rest


def _ratio(num: float, den: float | None) -> float | None:
    if den is None:
        return None
    if den == 0:
        return math.inf if num > 0 else (math.nan if math.isnan(num) else 0.0)
    return num / den


# ---------------------------------------------------------------------------------------------- the report
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

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_stats(cls, stats: GradStats, param_norms: Tensor | None = None, *,
                   loss_history: Sequence | Tensor | None = None, step: int | None = None,
                   thresholds: Thresholds | None = None, loss=None) -> "GradientReport":
        """Build a report from device statistics with one host sync. ``param_norms``: the per-tensor norms
        of the parameters in the order of ``stats`` (for the grad/param ratio). ``loss_history``: recent loss
        values (floats or tensors, oldest first) for the "small but learning is fine" caveat, the loss-jump
        rule and the non-finite-loss check. ``loss``: the current loss (tensor or number), read in the same
        sync; NaN/Inf there or in the history is a critical finding even when every gradient is finite."""
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
        host, rest = _gather(stats, param_norms, extras)
        if isinstance(loss, Tensor):
            value, bad = rest.pop()
            loss_value = value if not bad or not math.isfinite(value) else math.nan
        if rest:
            floats = rest[0]
        return cls._build(host, stats, loss_history=floats, step=step, thresholds=thresholds, loss=loss_value)

    @classmethod
    def _build(cls, host: dict, stats: GradStats, *, loss_history: Sequence[float] | None = None,
               step: int | None = None, thresholds: Thresholds | None = None,
               extra_findings: Iterable[Finding] = (), loss: float | None = None,
               history_steps: Sequence[int] | None = None) -> "GradientReport":
        """``history_steps``: the step of each ``loss_history`` value (default: positions 1..n)."""
        th = thresholds or Thresholds()
        pn = host.get("param_norm")
        params = [
            ParamRow(name, tuple(stats.shapes[i]), str(stats.dtypes[i]).replace("torch.", ""), host["norm"][i],
                     host["max_abs"][i], host["nan"][i], host["inf"][i], host["zero"][i],
                     math.prod(stats.shapes[i]),
                     None if pn is None else pn[i], None if pn is None else _ratio(host["norm"][i], pn[i]))
            for i, name in enumerate(stats.names)
        ]
        layers = _group_layers(params, pn is not None)
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
            ratio=_ratio(total, param_norm), params=params, layers=layers, no_grad=list(stats.no_grad),
            findings=[], step=step, loss_progress=progress, thresholds=th, loss=loss,
        )
        steps = list(history_steps) if history_steps is not None else (
            list(range(1, len(loss_history) + 1)) if loss_history is not None else [])
        # The loss comes first: a bad loss is the earliest cause of everything after it.
        report.findings = (_loss_findings(loss, loss_history, steps, step) + _classify(report)
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
            if _RANK[f.severity] > _RANK[worst]:
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

    # ---------------------------------------------------------------- machine-readable
    def to_dict(self) -> dict:
        """Plain Python values for loggers and JSON (NaN/Inf stay floats)."""
        d = {
            "step": self.step, "status": self.status, "total_norm": self.total_norm, "max_abs": self.max_abs,
            "nan": self.nan, "inf": self.inf, "zero": self.zero, "numel": self.numel,
            "zero_fraction": self.zero / self.numel if self.numel else 0.0,
            "param_norm": self.param_norm, "grad_param_ratio": self.ratio, "loss_progress": self.loss_progress,
            "loss": self.loss,
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
            f"{prefix}status_level": float(_RANK[self.status]),
        }
        if self.param_norm is not None:
            out[f"{prefix}param_norm"] = self.param_norm
            out[f"{prefix}grad_param_ratio"] = self.ratio
        if per_layer:
            for r in self.layers:
                out[f"{prefix}norm/{r.name}"] = r.norm
        return out

    # ---------------------------------------------------------------- human-readable
    def _summary_rows(self) -> list[tuple[str, str]]:
        rows = [("Status", self.status.upper()), ("Total gradient norm", _fmt(self.total_norm))]
        if self.param_norm is not None:
            rows += [("Parameter norm", _fmt(self.param_norm)), ("Grad / param norm ratio", _fmt(self.ratio))]
        frac = self.zero / self.numel if self.numel else 0.0
        rows += [
            ("Max abs gradient", _fmt(self.max_abs)),
            ("NaN / Inf values", f"{self.nan:,} / {self.inf:,}"),
            ("Zero gradient values", f"{frac:.1%} of {self.numel:,}"),
            ("Tensors with a gradient", f"{len(self.params)} (without: {len(self.no_grad)})"),
        ]
        if self.loss is not None:
            rows.append(("Loss", _fmt(self.loss) + ("" if math.isfinite(self.loss) else " (NON-FINITE)")))
        if self.loss_progress is not None:
            rows.append(("Loss history", "improving" if self.loss_progress else "not improving"))
        if self.step is not None:
            rows.insert(0, ("Step", str(self.step)))
        return rows

    def _layer_rows(self, max_layers: int) -> tuple[list[list[str]], int]:
        rows = []
        for r in self.layers[:max_layers]:
            zero = f"{r.zero / r.numel:.1%}" if r.numel else "-"
            rows.append([r.name, _fmt(r.norm), _fmt(r.max_abs), _fmt(r.param_norm), _fmt(r.ratio), zero,
                         str(r.nan), str(r.inf)])
        return rows, max(0, len(self.layers) - max_layers)

    _LAYER_HEAD = ["Layer", "Grad norm", "Max abs", "Param norm", "Grad/param", "Zero", "NaN", "Inf"]

    def to_markdown(self, max_layers: int = 50) -> str:
        """Markdown: Summary table, Issues Detected (severity, affected layers), Recommendations (with code),
        then per-layer gradients (at most ``max_layers`` rows)."""
        out = ["# Gradient report" + (f" (step {self.step})" if self.step is not None else ""), "",
               "## Summary", "", "| Metric | Value |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in self._summary_rows()]
        out += ["", "## Issues Detected", ""]
        if not self.findings:
            out.append("No issues detected: the gradients look healthy.")
        else:
            out += ["| Severity | Issue | Affected layers | Detail |", "|---|---|---|---|"]
            for f in self.findings:
                out.append(f"| {f.severity} | {_md(f.title)} | {_md(_layers_text(f))} | {_md(f.detail)} |")
        out += ["", "## Recommendations", ""]
        recs = self._recommendations()
        if not recs:
            out.append("None: keep training.")
        for code, text, snippet in recs:
            out += [f"### {code}", "", text, ""]
            if snippet:
                out += ["```python", snippet, "```", ""]
        rows, more = self._layer_rows(max_layers)
        if rows:
            out += ["", "## Per-layer gradients", "", "| " + " | ".join(self._LAYER_HEAD) + " |",
                    "|" + "---|" * len(self._LAYER_HEAD)]
            out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
            if more:
                out.append(f"\n({more} more layers not shown)")
        return "\n".join(out).rstrip() + "\n"

    def to_text(self, max_layers: int = 30) -> str:
        """Plain-text rendering (what :meth:`show` prints when rich is not installed)."""
        buf = io.StringIO()
        title = "Gradient report" + (f" (step {self.step})" if self.step is not None else "")
        print(title, "=" * len(title), sep="\n", file=buf)
        w = max(len(k) for k, _ in self._summary_rows())
        for k, v in self._summary_rows():
            print(f"{k:<{w}}  {v}", file=buf)
        print("\nIssues detected:" if self.findings else "\nNo issues detected.", file=buf)
        for f in self.findings:
            print(f"  [{f.severity.upper()}] {f.title}", file=buf)
            if f.layers or f.steps:
                print(f"      affected: {_layers_text(f)}", file=buf)
            if f.detail:
                print(f"      {f.detail}", file=buf)
        for code, text, snippet in self._recommendations():
            print(f"\nRecommendation ({code}): {text}", file=buf)
            for line in snippet.splitlines():
                print(f"    {line}", file=buf)
        rows, more = self._layer_rows(max_layers)
        if rows:
            table = [self._LAYER_HEAD] + rows
            widths = [max(len(r[i]) for r in table) for i in range(len(self._LAYER_HEAD))]
            print("", file=buf)
            for row in table:
                print("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                                for i, c in enumerate(row)), file=buf)
            if more:
                print(f"({more} more layers not shown)", file=buf)
        return buf.getvalue()

    def __str__(self) -> str:
        return self.to_text()

    def show(self, console=None, *, max_layers: int = 30, use_rich: bool | None = None) -> None:
        """Print the report: rich tables when rich is installed (or ``use_rich=True``), else plain text."""
        if use_rich is not False:
            try:
                from rich.console import Console
                from rich.table import Table
            except ImportError:
                if use_rich:
                    raise
            else:
                self._show_rich(console or Console(), Table, max_layers)
                return
        print(self.to_text(max_layers), end="", file=console if hasattr(console, "write") else None)

    def _show_rich(self, console, Table, max_layers: int) -> None:
        style = {"healthy": "green", "notice": "cyan", "warning": "yellow", "critical": "bold red"}
        summary = Table(title="Gradient report" + (f" (step {self.step})" if self.step is not None else ""),
                        show_header=False)
        summary.add_column("Metric")
        summary.add_column("Value")
        for k, v in self._summary_rows():
            summary.add_row(k, f"[{style[self.status]}]{v}[/]" if k == "Status" else v)
        console.print(summary)
        if self.findings:
            issues = Table(title="Issues detected")
            for h in ("Severity", "Issue", "Affected", "Detail"):
                issues.add_column(h)
            for f in self.findings:
                issues.add_row(f"[{style[f.severity]}]{f.severity}[/]", f.title, _layers_text(f), f.detail)
            console.print(issues)
        for code, text, snippet in self._recommendations():
            console.print(f"[bold]{code}[/]: {text}")
            if snippet:
                console.print(snippet, markup=False, highlight=False)
        rows, more = self._layer_rows(max_layers)
        if rows:
            layers = Table(title="Per-layer gradients")
            for h in self._LAYER_HEAD:
                layers.add_column(h, justify="left" if h == "Layer" else "right")
            for row in rows:
                layers.add_row(*row)
            console.print(layers)
            if more:
                console.print(f"({more} more layers not shown)")

    def _recommendations(self) -> list[tuple[str, str, str]]:
        seen, out = set(), []
        for f in sorted(self.findings, key=lambda f: -_RANK[f.severity]):
            if f.code in seen or f.code not in _RECOMMEND:
                continue
            seen.add(f.code)
            text, snippet = _RECOMMEND[f.code]
            out.append((f.code, text, snippet))
        return out


# ---------------------------------------------------------------------------------------------- loss rules
def _loss_findings(loss: float | None, history: Sequence[float] | None, steps: Sequence[int],
                   step: int | None) -> list[Finding]:
    """A non-finite current loss or history value (critical), else a jump of the last history values far
    above their recent median (``detect_loss_jumps``)."""
    hist = list(history) if history is not None else []
    bad = [s for s, v in zip(steps, hist) if not math.isfinite(v)]
    now_bad = loss is not None and not math.isfinite(loss)
    if now_bad or bad:
        where = []
        if now_bad:
            where.append(f"the current loss is {loss}" + (f" (step {step})" if step is not None else ""))
        if bad:
            where.append(f"{len(bad)} value(s) of the loss history are NaN/Inf, first at step {bad[0]}")
        return [Finding("nonfinite_loss", "critical", "non-finite loss (NaN/Inf); check the loss before backward()",
                        _cap("; ".join(where)) + ". The gradients computed from it are meaningless even "
                        "if finite.", steps=sorted(set(bad + ([step] if now_bad and step is not None else []))))]
    return detect_loss_jumps(steps, hist)


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _robust_baseline(values: Sequence[float]) -> tuple[float, float]:
    """(median, scaled MAD) of ``values``: 1.4826 * MAD estimates the std of normal noise, and neither
    moves much when a few outliers (earlier spikes) are in the window."""
    med = median(values)
    mad = median(abs(v - med) for v in values)
    return med, 1.4826 * mad


def robust_jumps(steps: Sequence[int], values: Sequence[float], *, new_after: int, warmup: int, window: int,
                 min_history: int, z: float, min_ratio: float) -> list[tuple[int, float, float, float]]:
    """``(step, value, value / median, median)`` of each step after ``new_after`` and ``warmup`` whose value
    is over ``z`` robust std (floored at 5% of the median) above the median of the up to ``window`` finite
    values before it and at least ``min_ratio`` times that median (positive medians only)."""
    vals = list(values)
    out = []
    for i, (s, v) in enumerate(zip(steps, vals)):
        if s <= new_after or s <= warmup or not math.isfinite(v):
            continue
        base = [x for x in vals[max(0, i - window):i] if math.isfinite(x)]
        if len(base) < min_history:
            continue
        med, sd = _robust_baseline(base)
        if med > 0 and v > med + z * max(sd, 0.05 * med) and v >= min_ratio * med:
            out.append((s, v, v / med, med))
    return out


def detect_loss_jumps(steps: Sequence[int], losses: Sequence[float], *, new_after: int = 0, window: int = 50,
                      warmup: int = 10, min_history: int = 10, z: float = 6.0, notice_ratio: float = 3.0,
                      warn_ratio: float = 10.0) -> list[Finding]:
    """``loss_spike`` findings: a step after ``new_after`` (and after ``warmup`` values) whose loss is more
    than ``z`` robust standard deviations above the median of the up to ``window`` finite losses before it
    AND at least ``notice_ratio`` times that median (a warning from ``warn_ratio``). Only positive medians
    are compared by ratio; a loss that can be negative gets no jump findings."""
    jumps = robust_jumps(steps, losses, new_after=new_after, warmup=warmup, window=window,
                         min_history=min_history, z=z, min_ratio=notice_ratio)
    if not jumps:
        return []
    top = max(jumps, key=lambda j: j[2])
    sev = "warning" if top[2] >= warn_ratio else "notice"
    title = (f"loss jump at step {top[0]}: {top[2]:.3g}x its recent median" if len(jumps) == 1 else
             f"loss jumps at {len(jumps)} steps (largest {top[2]:.3g}x its recent median, step {top[0]})")
    detail = "; ".join(f"step {s}: {_fmt(v)} ({r:.3g}x median {_fmt(m)})" for s, v, r, m in jumps[:5])
    return [Finding("loss_spike", sev, title, detail + ".", steps=[j[0] for j in jumps])]


# ---------------------------------------------------------------------------------------------- classification
def _group_layers(params: list[ParamRow], with_params: bool) -> list[LayerRow]:
    layers: dict[str, LayerRow] = {}
    sq: dict[str, float] = {}
    psq: dict[str, float] = {}
    for r in params:
        key = _module_of(r.name)
        row = layers.get(key)
        if row is None:
            row = layers[key] = LayerRow(key, [], 0.0, 0.0, 0, 0, 0, 0)
            sq[key] = psq[key] = 0.0
        row.params.append(r.name)
        sq[key] += r.norm * r.norm
        row.max_abs = math.nan if math.isnan(r.max_abs) or math.isnan(row.max_abs) else max(row.max_abs, r.max_abs)
        row.nan += r.nan
        row.inf += r.inf
        row.zero += r.zero
        row.numel += r.numel
        if with_params:
            psq[key] += r.param_norm * r.param_norm
    for key, row in layers.items():
        row.norm = math.sqrt(sq[key])
        if with_params:
            row.param_norm = math.sqrt(psq[key])
            row.ratio = _ratio(row.norm, row.param_norm)
    return list(layers.values())


def _classify(rep: GradientReport) -> list[Finding]:
    th = rep.thresholds
    found: list[Finding] = []
    total = rep.total_norm
    bad = rep.nonfinite_params()
    if bad:
        found.append(Finding(
            "nonfinite", "critical",
            f"NaN/Inf gradients in {len(bad)} parameter(s); check the loss before backward()",
            f"{rep.nan:,} NaN and {rep.inf:,} Inf gradient values.", bad))
    elif not rep.params:
        found.append(Finding("no_learning", "critical",
                             "no learning; frozen parameters or dead units",
                             "No parameter has a gradient (all frozen, unused, or backward() not called).",
                             list(rep.no_grad)))
    elif total == 0:
        found.append(Finding("no_learning", "critical", "no learning; frozen parameters or dead units",
                             "Every gradient is exactly zero.", [r.name for r in rep.layers]))
    elif total > th.critical:
        found.append(Finding("exploding", "critical", "exploding: clip now, lower the learning rate",
                             f"Total norm {_fmt(total)} > {_fmt(th.critical)}.", _largest(rep)))
    elif total > th.exploding:
        found.append(Finding("exploding", "warning", "exploding, clip (max_norm=1.0)",
                             f"Total norm {_fmt(total)} > {_fmt(th.exploding)}.", _largest(rep)))
    elif total > th.healthy_high:
        found.append(Finding("elevated", "notice", "elevated: above the healthy range",
                             f"Total norm {_fmt(total)} is between {_fmt(th.healthy_high)} and "
                             f"{_fmt(th.exploding)}.", _largest(rep)))
    elif total < th.vanishing:
        if rep.loss_progress:
            found.append(Finding("small_but_learning", "notice", "small gradients, but the loss is improving",
                                 f"Total norm {_fmt(total)} < {_fmt(th.vanishing)}; small but learning is fine."))
        else:
            why = ("the loss is not improving" if rep.loss_progress is False
                   else "no loss history to show progress")
            found.append(Finding("vanishing", "warning", "vanishing; check architecture and initialisation",
                                 f"Total norm {_fmt(total)} < {_fmt(th.vanishing)} and {why}."))
    elif total < th.healthy_low:
        found.append(Finding("low", "notice", "low: below the healthy range",
                             f"Total norm {_fmt(total)} is between {_fmt(th.vanishing)} and "
                             f"{_fmt(th.healthy_low)}; fine while the loss decreases."))

    # Dead parameters: share of gradient VALUES (scalar parameters) that are exactly zero. An all-zero model
    # is already "no_learning".
    if rep.numel and total != 0 and rep.zero / rep.numel > th.dead_fraction:
        dead = [r.name for r in rep.params if r.numel and r.zero / r.numel > th.dead_fraction]
        found.append(Finding("dead", "warning", "dead parameters",
                             f"{rep.zero / rep.numel:.1%} of gradient values are exactly zero "
                             f"(> {th.dead_fraction:.0%}).", dead))

    depth = _depth_check(rep.layers, th.depth_ratio)
    if depth is not None:
        found.append(depth)
    return found


def _largest(rep: GradientReport, k: int = 3) -> list[str]:
    finite = [r for r in rep.layers if math.isfinite(r.norm)]
    return [r.name for r in sorted(finite, key=lambda r: -r.norm)[:k]]


def _depth_check(layers: list[LayerRow], ratio: float) -> Finding | None:
    """Compare the mean gradient norm of the first quarter of the layers (registration order, which is depth
    order for Sequential-style models) with that of the last quarter."""
    # Layers with exactly zero gradient are dead (a separate finding), not "vanishing".
    rows = [r for r in layers if math.isfinite(r.norm) and r.norm > 0]
    if len(rows) < 2:
        return None
    k = max(1, len(rows) // 4)
    early = sum(r.norm for r in rows[:k]) / k
    late = sum(r.norm for r in rows[-k:]) / k
    if late == 0 or early * ratio >= late:
        return None
    affected = [r.name for r in rows[:-k] if r.norm * ratio < late]
    detail = (f"Mean norm of the first {k} layer(s) {_fmt(early)} vs the last {k} {_fmt(late)} "
              f"(ratio {_fmt(late / early) if early else 'inf'}).")
    return Finding("depth_vanishing", "warning", "vanishing across depth", detail, affected)


# ---------------------------------------------------------------------------------------------- helpers
def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.3e}" if abs(x) < 1e-3 or abs(x) >= 1e4 else f"{x:.4g}"


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _layers_text(f: Finding, limit: int = 8) -> str:
    items = f.layers or [f"step {s}" for s in f.steps]
    if not items:
        return "-"
    more = len(items) - limit
    return ", ".join(items[:limit]) + (f", ... (+{more})" if more > 0 else "")


# ---------------------------------------------------------------------------------------------- entry point
def gradient_report(model_or_parameters, *, loss=None, loss_history: Sequence | Tensor | None = None,
                    include_params: bool = True, step: int | None = None, thresholds: Thresholds | None = None,
                    backend: str | None = None) -> GradientReport:
    """Gradient health report of a model (or parameters, or ``(name, param)`` pairs) after ``backward()``.

    Reads every gradient once (``grad_stats``) and, with ``include_params``, every parameter once (for the
    grad/param norm ratio), then syncs the host once. ``loss`` (tensor or number) is the current loss and
    ``loss_history`` (oldest first) the recent ones: a NaN/Inf in either is a critical ``nonfinite_loss``
    finding even when every gradient is finite; the history also enables the "small but learning is fine"
    caveat for vanishing gradients and the ``loss_spike`` rule."""
    named = _named(model_or_parameters)
    stats = grad_stats(named, backend=backend)
    pnorms = None
    if include_params and len(stats):
        from .clip import multi_tensor_norm

        params = [p.detach() for _, p in named if p.grad is not None]
        _, pnorms = multi_tensor_norm(params, per_tensor=True, backend=backend)
    return GradientReport.from_stats(stats, pnorms, loss_history=loss_history, step=step, thresholds=thresholds,
                                     loss=loss)
