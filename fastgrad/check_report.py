"""The report of ``python -m fastgrad.check``: findings of a whole run and their Markdown/JSON/plot renderings.

The per-step statuses (NaN names, dead parameters, depth) come from ``fastgrad.report`` on the last step's
statistics; this module judges the norm thresholds at every step and adds what only a whole run shows. Each
optimizer is its own series (norms, trends, loss):

==========================  ==========  ===============================================================
code                        severity    when
==========================  ==========  ===============================================================
``nonfinite_loss``          critical    the loss was NaN/Inf at some step (even with finite gradients)
``nonfinite_history``       critical    the optimizer stepped on NaN/Inf gradients (not a skipped AMP step)
``clip_scaled``             critical    a clip between ``scaler.scale(loss).backward()`` and ``unscale_``
``no_zero_grad``            critical    gradients never zeroed between steps (they accumulate forever)
``clip_after_step``         warning     a clip after ``optimizer.step()`` and before the next backward
``clip_partial``            warning     a clip followed by more backward calls before the step
``no_clipping``             warning     no clip call at all while the norm exceeded 100
``exploding``               crit./warn. a step's norm before clipping > 1000 / > 100 (every step, from the first)
``loss_diverging``          critical    a finite loss >= 10x its start for 2 consecutive steps (non-negative losses)
``clip_zeroes``             critical    a clip with bound 0 zeroed the gradients (not frozen parameters/dead units)
``amp_skipped``             notice      steps the GradScaler skipped (normal while its scale settles)
``guard_skipped``           warn./note  steps a fastgrad.StepGuard kept out of the weights (warning: NaN/Inf or > 10%)
``hand_written_loop``       notice      no torch.optim step: steps read at the scalar backward() calls
``not_checked``             warning     nothing could be read (exit code 4, status "not checked": never healthy)
``script_crashed``          critical    the script raised (exit code 3)
==========================  ==========  ===============================================================

Trends (``spike``, ``increasing``, ``decaying``) come from ``fastgrad.monitor.detect_trends``, per series.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .report import _RANK, _RECOMMEND, Finding, GradientReport, Thresholds, _fmt, _layers_text

__all__ = ["StepRecord", "CheckResult", "build_result"]

# The fixes of the run-time red flags (text, code): the guide's advice, as code to paste.
_FIXES: dict[str, tuple[str, str]] = {
    "nonfinite_history": (
        "The optimizer stepped on NaN/Inf gradients, so the parameters are now garbage. Stop on the first "
        "non-finite step and find its source; under AMP let the GradScaler skip such steps.",
        "total = fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "if not torch.isfinite(total):             # one sync per step: use while debugging\n"
        "    print(fastgrad.find_nonfinite(model, loss)); break",
    ),
    "clip_scaled": (
        "Gradients were clipped while still multiplied by the GradScaler's scale, so max_norm acted on "
        "scale * grad: the real update was clipped to max_norm / scale. Unscale first (or use the fused call).",
        "scaler.scale(loss).backward()\n"
        "scaler.unscale_(optimizer)                                  # before clipping\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "scaler.step(optimizer); scaler.update()\n"
        "# or, fused: fastgrad.scaler_unscale_and_clip(scaler, optimizer, 1.0)",
    ),
    "no_zero_grad": (
        "The gradients were never zeroed, so every step used the sum of all previous gradients. Zero them "
        "once per optimizer step (after the step, or before the backward of the next one).",
        "optimizer.step()\n"
        "optimizer.zero_grad(set_to_none=True)",
    ),
    "clip_after_step": (
        "Clipping after optimizer.step() changes nothing the optimizer used: the step was taken unclipped. "
        "Clip between backward() and step().",
        "loss.backward()\n"
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)   # before the step\n"
        "optimizer.step()\n"
        "optimizer.zero_grad(set_to_none=True)",
    ),
    "clip_partial": (
        "Clipping inside a gradient-accumulation window clips partial sums, and later micro-batches are added "
        "unclipped. Clip once, after the last micro-batch's backward, right before the step.",
        "for i, (x, y) in enumerate(loader):\n"
        "    (criterion(model(x), y) / accum_steps).backward()\n"
        "    if (i + 1) % accum_steps == 0:\n"
        "        fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)   # once per window\n"
        "        optimizer.step(); optimizer.zero_grad(set_to_none=True)",
    ),
    "no_clipping": (
        "The gradient norm exceeded 100 and nothing clips it. Clip before every optimizer step.",
        "loss.backward()\n"
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "optimizer.step()",
    ),
    "loss_diverging": (
        "The loss rose by an order of magnitude or more from where it started and stayed there: the usual cause "
        "is a learning rate too high for this model. Lower it (10x), clip the gradient norm, and warm it up.",
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 0.1                      # first suspect: the learning rate\n"
        "loss.backward()\n"
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "optimizer.step()\n"
        "# and a warm-up over the first steps:\n"
        "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))",
    ),
    # the per-step report's code; the run-wide text names the learning rate first
    "exploding": (
        "Clip the gradient norm before every optimizer step; above 1000 the learning rate is the first suspect: "
        "lower it (and consider warmup).",
        _RECOMMEND["exploding"][1],
    ),
    "clip_zeroes": (
        "A clip bound of 0 scales every gradient to zero, so nothing learns. Clip at a positive bound (1.0 is the "
        "usual start), or drop the clip.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)   # not max_norm=0",
    ),
    "not_checked": ("Nothing was checked: make the script take at least one optimizer step (or one scalar "
                    "backward()) under the checker, e.g. with fewer epochs or --steps.", ""),
    "amp_skipped": ("Skipped steps are how a GradScaler handles fp16 overflow; worry only if they keep coming.",
                    ""),
    "script_crashed": ("The script raised before finishing; the report covers the steps that ran.", ""),
}


@dataclass
class StepRecord:
    """One training step as the host saw it after a flush. ``total_norm`` is the norm of the gradients the
    update used (after any clip); ``clip_norm`` what the clip call returned (the norm before clipping)."""

    step: int
    skipped: bool = False
    numel: int = 0
    has_loss: bool = False
    clipped: bool = False
    zeroed: bool = False
    leftover_checked: bool = False
    series: int = 0             # which optimizer (0, 1, ... in the order they first stepped)
    evals: int = 1              # closure evaluations of the step (LBFGS: several; the first one is read)
    source: str = "optimizer"   # "optimizer", or "backward" for a hand-written loop (no torch.optim step)
    clip_max: float | None = None  # the bound the script passed to the clip, when a number
    lr: float | None = None     # the optimizer's learning rate at the step (first param group)
    unread: bool = False        # the checker failed to read this step's gradients (see checker_error)
    guard_skipped: bool = False  # a fastgrad.StepGuard kept this step out of the weights and the optimizer
    total_norm: float = math.nan
    nonfinite: float = 0.0
    zero: float = 0.0
    loss: float | None = None   # the sum of the losses backpropagated over the step
    leftover: float | None = None
    clip_norm: float | None = None

    @property
    def grad_norm(self) -> float:
        """The step's gradient norm before any clipping (what the backward passes produced)."""
        return self.clip_norm if self.clip_norm is not None else self.total_norm

    @property
    def bad(self) -> bool:
        return not self.skipped and not self.guard_skipped and not self.unread and \
            (not math.isfinite(self.total_norm) or self.nonfinite > 0)


@dataclass
class CheckResult:
    script: str
    args: list[str]
    steps: list[StepRecord]
    findings: list[Finding]
    summary: list[tuple[str, str, str]]
    trend: str
    origin: str | None
    last: GradientReport | None
    crashed: bool = False
    crash_text: str | None = None
    stopped: bool = False
    exit_code: int = 0
    flags: dict = field(default_factory=dict)
    series: list[str] = field(default_factory=list)
    key_steps: list[int] = field(default_factory=list)  # steps the trend table always shows
    context: dict = field(default_factory=dict)

    @property
    def status(self) -> str:
        if not self.steps or all(r.unread for r in self.steps):
            return "not checked"
        return max((f.severity for f in self.findings), key=_RANK.__getitem__, default="healthy")

    def codes(self, severity: str | None = None) -> list[str]:
        return [f.code for f in self.findings if severity is None or f.severity == severity]

    # ---------------------------------------------------------------- renderings
    def to_markdown(self) -> str:
        cmd = " ".join([self.script] + self.args)
        n = len(self.steps)
        how = " (stopped by --steps)" if self.stopped else (" (the script crashed)" if self.crashed else "")
        unit = ("training step(s) of a hand-written loop" if self.steps and self.steps[0].source == "backward"
                else "optimizer step(s)")
        out = ["## Gradient Health Report", "",
               f"Script: `{cmd}`; {n} {unit} checked{how}. Overall status: **{self.status.upper()}**.",
               "", "### Summary", "", "| Metric | Value | Status |", "|---|---|---|"]
        out += [f"| {m} | {v} | {s} |" for m, v, s in self.summary]
        out += ["", "### Gradient Norm Trend", "", f"Trend: **{self.trend}**.", ""]
        sample = _sample(self.steps, 12, self.key_steps)
        multi = len(self.series) > 1
        if sample:
            out += ["| Step |" + (" Optimizer |" if multi else "") + " Norm (used) | Norm before clip | Loss |",
                    "|---|" + ("---|" if multi else "") + "---|---|---|"]
            out += [f"| {r.step}{' (skipped)' if r.skipped else ''}{' (guard skipped)' if r.guard_skipped else ''}{' (!)' if r.step in self.key_steps else ''} |"
                    + (f" {self.series[r.series]} |" if multi else "")
                    + f" {_fmt(r.total_norm)} | {_fmt(r.clip_norm)} | {_fmt(r.loss)} |" for r in sample]
            if self.key_steps:
                out += ["", "(!) a step where a finding was triggered; always shown."]
        out += ["", "### Issues Detected", ""]
        ordered = sorted(self.findings, key=lambda f: -_RANK[f.severity])
        if not ordered:
            out.append("No issues detected: the gradients look healthy.")
        for i, f in enumerate(ordered, 1):
            aff = _layers_text(f)
            out.append(f"{i}. **{f.severity.upper()}** `{f.code}`: {f.title}. {f.detail}"
                       + (f" Affected: {aff}." if aff != "-" else ""))
        recs = _recs(ordered, self.context)
        out += ["", "### Recommendations", ""]
        if not recs:
            out.append("Nothing could be checked: see above." if not self.steps else "None: keep training.")
        out += [f"{i}. `{code}`: {text}" for i, (code, text, _) in enumerate(recs, 1)]
        code = [f"# {code}\n{snippet}" for code, _, snippet in recs if snippet]
        out += ["", "### Code to Add", ""]
        out += ["```python", "\n\n".join(code), "```"] if code else ["Nothing to add."]
        out += ["", f"Exit code: {self.exit_code}."]
        return "\n".join(out) + "\n"

    def to_dict(self) -> dict:
        return {
            "script": self.script, "args": self.args, "status": self.status, "exit_code": self.exit_code,
            "crashed": self.crashed, "crash": self.crash_text, "stopped_by_steps": self.stopped,
            "trend": self.trend, "first_nonfinite_output": self.origin, "red_flags": self.flags,
            "series": self.series, "key_steps": self.key_steps,
            "summary": [{"metric": m, "value": v, "status": s} for m, v, s in self.summary],
            "findings": [asdict(f) for f in self.findings],
            "steps": [asdict(r) | {"grad_norm": r.grad_norm} for r in self.steps],
            "last_step_report": None if self.last is None else self.last.to_dict(),
        }

    def plot(self, path: str) -> str:
        """Gradient norm per step and optimizer (log scale, healthy band shaded, the 100/1000 thresholds
        drawn, non-finite steps marked red) and the loss."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError("the plot needs matplotlib: pip install matplotlib") from e
        fig = Figure(figsize=(8, 4.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        th = Thresholds()
        ax.axhspan(th.healthy_low, th.healthy_high, color="green", alpha=0.08, label="healthy range")
        ax.axhline(th.exploding, color="orange", lw=0.8, ls=":", label="warning (100)")
        ax.axhline(th.critical, color="red", lw=0.8, ls=":", label="critical (1000)")
        names = self.series or ["steps"]
        for k, name in enumerate(names):
            rows = [r for r in self.steps if r.series == k]
            pts = [(r.step, r.grad_norm) for r in rows if math.isfinite(r.grad_norm) and r.grad_norm > 0]
            if pts:
                ax.plot(*zip(*pts), lw=1.2, label=f"grad norm ({name})" if len(names) > 1 else "grad norm")
        bad = sorted({r.step for r in self.steps if r.bad}
                     | {r.step for r in self.steps if r.loss is not None and not math.isfinite(r.loss)})
        for i, s in enumerate(bad):
            ax.axvline(s, color="red", alpha=0.4, label="non-finite step" if i == 0 else None)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("gradient norm (before clipping)")
        losses = [(r.step, r.loss) for r in self.steps if r.loss is not None and math.isfinite(r.loss)]
        if losses:
            ax2 = ax.twinx()
            ax2.plot(*zip(*losses), color="gray", lw=0.8, alpha=0.7)
            ax2.set_ylabel("loss (gray)")
            if min(v for _, v in losses) > 0 and max(v for _, v in losses) > 100 * min(v for _, v in losses):
                ax2.set_yscale("log")
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title(f"{self.script}: {self.status.upper()}; trend: {self.trend}"[:120])
        fig.savefig(path, dpi=100, bbox_inches="tight")
        return path


def _sample(steps: list[StepRecord], k: int, must: list[int] = ()) -> list[StepRecord]:
    """About ``k`` steps spread over the run, plus every step in ``must`` (where a finding fired)."""
    if len(steps) <= k:
        return list(steps)
    idx = {round(i * (len(steps) - 1) / (k - 1)) for i in range(k)}
    want = set(must)
    idx |= {i for i, r in enumerate(steps) if r.step in want}
    return [steps[i] for i in sorted(idx)]


_RELU_FAMILY = {"ReLU", "ReLU6", "RReLU", "Hardtanh", "Threshold"}
_RECURRENT = {"LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell"}


def _recs(findings: list[Finding], ctx: dict | None = None) -> list[tuple[str, str, str]]:
    """(code, text, snippet) per finding code, the advice fitted to what the script uses: the clip snippets
    unscale first under a GradScaler; no LeakyReLU advice for a model without ReLUs (an LSTM/GRU)."""
    ctx = ctx or {}
    seen, out = set(), []
    for f in findings:
        if f.code in seen:
            continue
        seen.add(f.code)
        text, snippet = _FIXES.get(f.code) or _RECOMMEND.get(f.code) or ("", "")
        if f.code == "dead" and not (set(ctx.get("modules", ())) & _RELU_FAMILY):
            rec = sorted(set(ctx.get("modules", ())) & _RECURRENT)
            text = ("Most gradient values are exactly zero and the model has no ReLU units"
                    + (f" (it uses {', '.join(rec)})" if rec else "")
                    + ": look for parameters the loss does not reach (unused embedding rows or heads, a "
                      "detached branch) or saturated gates (sigmoid/tanh at their limits).")
            snippet = ("unused = [n for n, p in model.named_parameters()\n"
                       "          if p.grad is not None and (p.grad == 0).float().mean() > 0.5]\n"
                       "print('mostly-zero gradients:', unused)")
        if ctx.get("scaler") and "clip_grad_norm_(" in snippet and "unscale_" not in snippet:
            # under a GradScaler the gradients must be unscaled before the clip (or use the fused call)
            snippet = snippet.replace("loss.backward()\n", "scaler.scale(loss).backward()\n")
            snippet = _indent_replace(snippet)
            snippet = snippet.replace("optimizer.step()", "scaler.step(optimizer); scaler.update()")
        if text:
            out.append((f.code, text, snippet))
    return out


def _indent_replace(snippet: str) -> str:
    lines = []
    for line in snippet.split("\n"):
        if "clip_grad_norm_(" in line:
            pad = line[:len(line) - len(line.lstrip())]
            lines.append(pad + "scaler.unscale_(optimizer)   # the GradScaler's gradients are scaled: unscale first")
        lines.append(line)
    return "\n".join(lines)


def _steps_text(steps: list[int], limit: int = 8) -> str:
    more = len(steps) - limit
    return ", ".join(map(str, steps[:limit])) + (f", ... (+{more})" if more > 0 else "")


def _rate(v: float, th: Thresholds) -> str:
    """The guide's status of one total norm, by its own value."""
    if not math.isfinite(v):
        return "critical"
    if v == 0:
        return "critical"
    if v > th.critical:
        return "critical"
    if v > th.exploding:
        return "warning"
    if v < th.vanishing:
        return "warning"
    return "notice" if v > th.healthy_high or v < th.healthy_low else "healthy"


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# ---------------------------------------------------------------------------------------------- findings
_NORM_CODES = ("nonfinite", "no_learning", "elevated", "low", "vanishing", "small_but_learning")
_DIVERGE_RATIO = 10.0  # a loss this many times its first value, held for consecutive steps: diverging
_DIVERGE_HOLD = 2
_RISE_RATIO = 3.0  # the warning tier: this many times its start, held for _RISE_HOLD consecutive steps
_RISE_HOLD = 3


def _loss_divergence(recs: list[StepRecord], ratio: float = _DIVERGE_RATIO, hold: int = _DIVERGE_HOLD):
    """(base step, base loss, first step at >= 10x, its loss, peak step, peak loss) when the finite loss of
    one series rises to ``_DIVERGE_RATIO`` times its starting level and stays there for ``_DIVERGE_HOLD``
    consecutive steps (or to the end of the run). The start is the smaller of the first loss and the median of
    the first three (one odd first batch does not set it). A series whose loss ever goes negative (a policy
    gradient's signed objective) is not judged: a ratio means nothing there."""
    pts = [(r.step, r.loss) for r in recs if r.loss is not None and math.isfinite(r.loss)]
    if len(pts) < 3 or min(v for _, v in pts) < 0:
        return None
    vals = [v for _, v in pts]
    base = min(vals[0], _median(vals[:3]))
    if base <= 0:
        return None
    for i in range(1, len(pts)):
        win = vals[i:i + hold]  # shorter at the end of the run: held to the end
        if min(win) >= ratio * base:
            j = max(range(i, len(pts)), key=lambda t: vals[t])
            b = next(k for k in range(len(pts)) if vals[k] == base)
            return pts[b][0], base, pts[i][0], vals[i], pts[j][0], vals[j]
    return None


def build_result(chk, *, script: str, args: list[str], crashed: bool, crash_text: str | None, stopped: bool,
                 max_steps: int | None) -> CheckResult:
    """Turn a finished :class:`fastgrad.check.Checker` into findings, a summary and an exit code. Reads the
    device state left by the run (the watcher's key, the last statistics): a few syncs, once, at the end."""
    from .monitor import detect_trends

    th = Thresholds()
    steps = chk.steps
    # a step a StepGuard skipped never reached the weights: it is reported as such (guard_skipped), not judged
    used = [r for r in steps if not r.skipped and not r.unread and not r.guard_skipped]
    guarded = [r for r in steps if r.guard_skipped]
    manual = bool(steps) and steps[0].source == "backward"
    names = (["hand-written loop"] if manual else list(chk.series_names)) or ["steps"]
    multi = len(names) > 1
    per = {k: [r for r in used if r.series == k] for k in range(len(names))}
    lrs = list(getattr(chk, "series_lr", [])) if not manual else []
    ctx = {"scaler": getattr(chk, "scaler_used", False), "modules": sorted(getattr(chk, "module_types", ()))}
    findings: list[Finding] = []
    key: set[int] = set()

    def label(k: int) -> str:
        return f"{names[k]}: " if multi else ""

    def lr_text(k: int) -> str:
        lr = lrs[k] if k < len(lrs) else None
        return f" The learning rate was {lr:g}" + (f" ({names[k]})" if multi else "") + "." if lr is not None \
            else ""

    # The last step's statistics: the per-step statuses (NaN names, dead, depth, norm range).
    last = None
    last_series = used[-1].series if used else 0
    if chk.last_stats is not None and len(chk.last_stats) and used:
        hist = [r.loss for r in per[last_series] if r.loss is not None]
        last = GradientReport.from_stats(chk.last_stats, None, loss_history=hist or None, step=used[-1].step)
        # run-wide rules below replace the report's own loss and range findings
        findings += [f for f in last.findings if f.code not in ("decaying", "nonfinite_loss", "exploding",
                                                               "loss_spike")]

    # Where the first NaN/Inf was born in the forward pass (the watcher counts steps from 0).
    o = chk.watcher.first_nonfinite() if chk.watcher is not None else None
    origin = None if o is None else f"{o.module} ({o.module_type}) at step {o.step + 1}"
    if manual and o is not None:
        origin = f"{o.module} ({o.module_type})"  # the watcher counts optimizer steps: none here
    born = (f" The first non-finite module output was {origin}." if origin else
            " Every module output stayed finite: the NaN/Inf was born outside the modules (a functional loss, "
            "the data) or in backward (use torch.autograd.detect_anomaly() to find the op).")

    bad_loss = [r.step for r in steps if r.loss is not None and not math.isfinite(r.loss)]
    bad_grad = [r.step for r in used if r.bad]
    if bad_loss:
        key.add(bad_loss[0])
        finite_grads = all(math.isfinite(r.total_norm) and r.nonfinite == 0 for r in used if r.step >= bad_loss[0])
        findings.append(Finding(
            "nonfinite_loss", "critical", "NaN/Inf loss; check the loss before backward()",
            f"The loss was non-finite at {len(bad_loss)} step(s), first at step {bad_loss[0]}"
            + (", while every gradient stayed finite (the optimizer kept stepping on garbage)." if finite_grads
               else ".") + born,
            [o.module] if o else [], bad_loss))

    bad_params = []
    if chk._bad_steps is not None:
        bad_params = [n for n, c in zip(chk._bad_names, chk._bad_steps.tolist()) if c]
    if bad_grad:
        first = bad_grad[0]
        key.add(first)
        later = [r.step for r in used if r.bad and r.evals > 1 and math.isfinite(r.total_norm)]
        text = (f" NaN/Inf gradients at {len(bad_grad)} step(s), first at step {first}."
                + (f" At step(s) {_steps_text(later)} they appeared in a later evaluation of the step's closure "
                   "(the first evaluation was finite)." if later else "") + born)
        nf = next((f for f in findings if f.code == "nonfinite"), None)
        if nf is not None:  # the last step is itself non-finite: extend its finding
            nf.detail += text
            nf.steps = bad_grad
            nf.layers = nf.layers or bad_params
        else:
            findings.append(Finding("nonfinite_history", "critical",
                                    "the optimizer stepped on NaN/Inf gradients", text.strip(), bad_params,
                                    bad_grad))

    # Gradients zeroed by the clip itself (max_norm=0): not frozen parameters or dead units.
    zeroed_by_clip = [r for r in used if r.clipped and (r.clip_max == 0 or (
        r.clip_norm is not None and r.clip_norm > 0 and r.total_norm == 0))]
    if zeroed_by_clip:
        r0 = zeroed_by_clip[0]
        key.add(r0.step)
        bound = "max_norm=0" if r0.clip_max == 0 else "its bound"
        findings = [f for f in findings if f.code not in ("no_learning", "dead", "vanishing", "low")]
        findings.append(Finding(
            "clip_zeroes", "critical", f"the gradient clip ({bound}) sets every gradient to zero: no learning",
            f"At {len(zeroed_by_clip)} step(s) the clip call got a gradient norm of {_fmt(r0.clip_norm)} (step "
            f"{r0.step}) and the step then saw a norm of {_fmt(r0.total_norm)}: the parameters are not frozen "
            "and the units are not dead, the clip zeroes the update.", steps=[r.step for r in zeroed_by_clip]))

    # The guide's norm thresholds judged at every step (from the first), on the norm before any clip.
    owner: dict[int, int] = {}  # id(finding) -> the series it is about
    max_norm, peak = math.nan, None
    for k, recs in per.items():
        fin = [r for r in recs if math.isfinite(r.grad_norm)]
        if not fin:
            continue
        pk = max(fin, key=lambda r: r.grad_norm)
        if peak is None or pk.grad_norm > max_norm:
            max_norm, peak = pk.grad_norm, pk
        crit = [r for r in fin if r.grad_norm > th.critical]
        warn = [r for r in fin if r.grad_norm > th.exploding]
        hit = crit or warn
        if not hit:
            continue
        key |= {hit[0].step, pk.step}
        clipped = any(r.clipped for r in hit)
        first_text = f"first at step {hit[0].step} ({_fmt(hit[0].grad_norm)})"
        start = fin[0]
        detail = (f"{label(k) or 'T'}{'t' if label(k) else ''}he gradient norm exceeded {_fmt(th.critical if crit else th.exploding)} at "
                  f"{len(hit)} step(s), {first_text}; peak {_fmt(pk.grad_norm)} at step {pk.step}; step "
                  f"{start.step} had {_fmt(start.grad_norm)}."
                  + (" The script clips, so the update was bounded, but the raw gradients are out of range."
                     if clipped else "") + (lr_text(k) if crit else ""))
        if crit:
            findings.append(Finding("exploding", "critical",
                                    f"{label(k)}gradient norm above 1000: clip now, lower the learning rate",
                                    detail, _largest_layers(last) if k == last_series else [],
                                    [r.step for r in crit]))
            owner[id(findings[-1])] = k
        else:
            findings.append(Finding("exploding", "warning", f"{label(k)}gradient norm above 100: clip "
                                    "(max_norm=1.0)", detail, _largest_layers(last) if k == last_series else [],
                                    [r.step for r in warn]))
            owner[id(findings[-1])] = k

    # A finite loss that rises by orders of magnitude: divergence, judged from the first steps.
    for k, recs in per.items():
        sev, ratio, hold = "critical", _DIVERGE_RATIO, _DIVERGE_HOLD
        d = _loss_divergence(recs)
        if d is None:  # the warning tier: a smaller rise, held longer
            sev, ratio, hold = "warning", _RISE_RATIO, _RISE_HOLD
            d = _loss_divergence(recs, ratio, hold)
        if d is None:
            continue
        s0, v0, s1, v1, sp, vp = d
        key |= {s1, sp}
        nrm = {r.step: r.grad_norm for r in recs}
        findings.append(Finding(
            "loss_diverging", sev,
            f"{label(k)}the loss is {'diverging' if sev == 'critical' else 'rising'} ({vp / v0:.3g}x its start): "
            "the learning rate is the first suspect",
            f"{label(k)}{'loss' if label(k) else 'Loss'} {_fmt(v0)} at step {s0} -> {_fmt(v1)} at step {s1} "
            f"(>= {ratio:g}x, held for {hold - 1} more step(s) or to the end of the run) -> peak {_fmt(vp)} at step "
            f"{sp}; the gradient norm went "
            f"{_fmt(nrm.get(s0))} -> {_fmt(nrm.get(sp))} over the same steps." + lr_text(k)
            + " A loss that stays many times above where it started is not noise: lower the learning rate "
              "(10x), clip the gradient norm and warm up.", steps=[s1, sp]))
        owner[id(findings[-1])] = k

    # Trends of the norm the gradients had before any clipping, one series per optimizer (their
    # hand-overs are not spikes).
    trends = []
    for k, recs in per.items():
        # indexed by the series' own steps (its warm-up, its baseline), reported with the run's step numbers
        tf = detect_trends(list(range(1, len(recs) + 1)), [r.grad_norm for r in recs], thresholds=th)
        glob = {i: r.step for i, r in enumerate(recs, 1)}
        for f in tf:
            f.steps = [glob.get(s, s) for s in f.steps]
            if multi:
                f.title = f"{names[k]}: {f.title}"
                f.detail = f"{names[k]} (its own step count): {f.detail}"
            owner[id(f)] = k
            key |= set(f.steps[:3])
        findings += tf
        label_k = _trend_label(recs, tf, findings) if recs else "no steps read"
        bl = [r.step for r in recs if r.loss is not None and not math.isfinite(r.loss)]
        if bl and not label_k.startswith("diverged"):  # finite norms, broken loss: the trend says both
            label_k = f"loss non-finite from step {bl[0]} (norm: {label_k})"
        trends.append(label_k)
    trend = "; ".join((f"{names[k]}: " if multi else "") + t for k, t in enumerate(trends)) or "no steps"

    # Red flags seen at run time.
    flags = {k: list(v) for k, v in chk.flags.items()}
    if flags["clip_scaled"]:
        findings.append(Finding("clip_scaled", "critical", "clipping gradients that are still scaled (AMP)",
                                "A clip ran between scaler.scale(loss).backward() and scaler.unscale_ at "
                                f"step(s) {_steps_text(flags['clip_scaled'])}.", steps=flags["clip_scaled"]))
    if flags["clip_after_step"]:
        findings.append(Finding("clip_after_step", "warning", "clipping after optimizer.step()",
                                f"A clip ran after the step of step(s) {_steps_text(flags['clip_after_step'])} "
                                "and before the next backward.", steps=flags["clip_after_step"]))
    if flags["clip_partial"]:
        findings.append(Finding("clip_partial", "warning", "clipping partial gradients in an accumulation window",
                                "A clip was followed by more backward() calls before the step at step(s) "
                                f"{_steps_text(flags['clip_partial'])}.", steps=flags["clip_partial"]))
    checked = [r for r in used if r.leftover is not None or r.leftover_checked]
    stale = [r.step for r in used if r.leftover is not None and r.leftover > 0 and not r.zeroed]
    flags["no_zero_grad"] = stale
    if len(stale) >= 2 and len(stale) * 2 >= len(checked):
        findings.append(Finding("no_zero_grad", "critical", "gradients are never zeroed between steps",
                                f"At {len(stale)} of {len(checked)} steps the next backward() added to the "
                                "previous gradients (no zero_grad() / set_to_none seen).", steps=stale))
    if chk.clip_calls == 0 and math.isfinite(max_norm) and max_norm > th.exploding:
        flags["no_clipping"] = [r.step for r in used if math.isfinite(r.grad_norm) and r.grad_norm > th.exploding]
        findings.append(Finding("no_clipping", "warning", "no gradient clipping while the norm exceeds 100",
                                f"The norm reached {_fmt(max_norm)} and no clip function was called.",
                                _largest_layers(last) or bad_params, flags["no_clipping"]))
    if guarded:
        gbad = [r for r in guarded if not math.isfinite(r.grad_norm) or r.nonfinite > 0]
        sev = "warning" if gbad or len(guarded) * 10 > len(steps) else "notice"
        ev = ", ".join(f"{r.step} ({_fmt(r.grad_norm)})" for r in guarded[:8]) + (" ..." if len(guarded) > 8 else "")
        findings.append(Finding(
            "guard_skipped", sev, "steps skipped by the step guard",
            f"fastgrad.StepGuard kept {len(guarded)} of {len(steps)} step(s) out of the weights and the optimizer "
            f"state ({len(gbad)} with NaN/Inf gradients, {len(guarded) - len(gbad)} spikes); step (norm before "
            f"clipping): {ev}. The run is protected; if skips keep coming, find their source (the data at those "
            "steps, the loss, the learning rate).", steps=[r.step for r in guarded]))
    if chk.skipped:
        findings.append(Finding("amp_skipped", "notice", "steps skipped by the GradScaler",
                                f"{chk.skipped} step(s) had Inf/NaN gradients and were skipped."))
    if manual:
        per_zero = getattr(chk, "_any_zero", False)
        findings.append(Finding(
            "hand_written_loop", "notice", "no torch.optim step: the loop was checked at its backward() calls",
            f"No optimizer stepped, so each step is the gradients after {'the backward() calls between two zero_grad() calls' if per_zero else 'one scalar backward() (the script never calls zero_grad())'}, read where they are next zeroed or consumed; its loss is the sum of the losses backpropagated in it."))
    if not steps or not used and not chk.skipped and not guarded:
        findings.append(Finding("not_checked", "warning", "nothing could be checked", _why_unchecked(chk, crashed)))
    if chk.errors:
        findings.append(Finding("checker_error", "notice", "the checker could not read some steps",
                                "; ".join(chk.errors[:3]) + (f" (+{len(chk.errors) - 3} more)"
                                                             if len(chk.errors) > 3 else "")))
    if crashed:
        findings.append(Finding("script_crashed", "critical", "the script crashed", crash_text or ""))

    summary = _summary(chk, steps, used, per, names, last, last_series, findings, trends, origin, bad_loss,
                       bad_grad, stopped, manual, owner)
    status = max((f.severity for f in findings), key=_RANK.__getitem__, default="healthy")
    exit_code = 3 if crashed else (4 if not steps or not used and not chk.skipped and not guarded else
                                   (1 if status == "critical" else 0))
    return CheckResult(script, args, steps, findings, summary, trend, origin, last, crashed, crash_text,
                       stopped, exit_code, flags, names if steps else [], sorted(key), ctx)


def _why_unchecked(chk, crashed: bool) -> str:
    why = []
    if crashed:
        why.append("the script crashed before its first step")
    made = getattr(chk, "optimizers_made", 0)
    if made:
        why.append(f"{made} optimizer(s) were created but step() never ran")
    bw, sbw = getattr(chk, "backward_calls", 0), getattr(chk, "scalar_backward_calls", 0)
    if not bw:
        why.append("no backward() call was seen (torch.autograd.grad and custom update rules are not watched)")
    elif not sbw:
        why.append(f"{bw} backward() call(s), none on a scalar loss")
    if chk.errors:
        why.append("the checker failed to read the gradients: " + chk.errors[0])
    return ("Not a single step could be read, so there is no verdict on this run (it is not HEALTHY): "
            + "; ".join(why or ["no reason recorded"]) + ".")


def _trend_label(recs, tf, findings) -> str:
    """The trend of one series, never contradicting the findings: divergence and the threshold findings
    name themselves first; without a finding, the first and last quarters' medians are compared."""
    pre = ""
    steps = {r.step for r in recs}
    bad = [r.step for r in recs if r.bad]
    if bad:
        return f"{pre}diverged: non-finite from step {bad[0]}"
    mine = [f for f in findings if f.steps and set(f.steps) & steps]
    div = next((f for f in mine if f.code == "loss_diverging"), None)
    exp = next((f for f in mine if f.code == "exploding"), None)
    codes = {f.code for f in tf}
    if (div is not None and div.severity == "critical") or (
            exp is not None and exp.severity == "critical" and recs[-1].step in exp.steps):
        fin = [r for r in recs if math.isfinite(r.grad_norm)]
        pk = max(fin, key=lambda r: r.grad_norm)
        return (f"{pre}diverging: norm {_fmt(fin[0].grad_norm)} at step {fin[0].step} -> {_fmt(pk.grad_norm)} "
                f"at step {pk.step}")
    if div is not None:
        return f"{pre}loss rising ({div.title.split('(')[1].split(')')[0]})"
    if "increasing" in codes:
        return f"{pre}increasing"
    if "decaying" in codes:
        return f"{pre}decaying"
    if "spike" in codes:
        return f"{pre}spikes (steps {_steps_text(next(f for f in tf if f.code == 'spike').steps)})"
    if exp is not None:
        fin = [r for r in recs if math.isfinite(r.grad_norm)]
        pk = max(fin, key=lambda r: r.grad_norm)
        lim = "1000" if exp.severity == "critical" else "100"
        return (f"{pre}above {lim} at {len(exp.steps)} step(s) (peak {_fmt(pk.grad_norm)} at step {pk.step}), "
                f"{_fmt(recs[-1].grad_norm)} at the last step")
    fin = [r.grad_norm for r in recs if math.isfinite(r.grad_norm) and r.grad_norm > 0]
    if len(fin) >= 4:
        q = max(1, len(fin) // 4)
        ratio = _median(fin[-q:]) / _median(fin[:q])
        if ratio >= 10 or ratio <= 0.1:
            return (f"{pre}{'rising' if ratio > 1 else 'falling'} {ratio:.3g}x (first to last quarter's median; "
                    "inside the guide's ranges)")
    return f"{pre}stable"


def _largest_layers(last: GradientReport | None, k: int = 3) -> list[str]:
    if last is None:
        return []
    finite = [r for r in last.layers if math.isfinite(r.norm)]
    return [r.name for r in sorted(finite, key=lambda r: -r.norm)[:k]]


def _sev(findings: list[Finding], *codes: str, series: int | None = None, owner: dict | None = None) -> str:
    """The worst severity of the findings with these codes (about ``series`` only, when given)."""
    sev = [f.severity for f in findings if f.code in codes
           and (series is None or (owner or {}).get(id(f), series) == series)]
    return max(sev, key=_RANK.__getitem__, default="healthy")


def _worst(*sev: str) -> str:
    return max(sev, key=_RANK.__getitem__)


def _summary(chk, steps, used, per, names, last, last_series, findings, trends, origin, bad_loss, bad_grad,
             stopped, manual, owner):
    th = Thresholds()
    rows = []
    n = len(steps)
    multi = len(names) > 1
    what = (" (hand-written loop: no torch.optim step)" if manual else "")
    if multi:
        what += " (" + ", ".join(f"{names[k]}: {len(per[k])}" for k in per) + ")"
    ng = sum(1 for r in steps if r.guard_skipped)
    rows.append(("Steps checked", f"{n}{what}" + (f" ({chk.skipped} skipped by the GradScaler)" if chk.skipped
                                                  else "") + (f" ({ng} skipped by the step guard)" if ng else "") + (" (stopped by --steps)" if stopped else ""),
                 "healthy" if n else "warning"))
    for k, recs in per.items():
        sfx = f" [{names[k]}]" if multi else ""
        lastn = recs[-1] if recs else None
        if lastn is None:
            continue
        own = _rate(lastn.total_norm, th)
        if k == last_series:  # the last step's own classification (small but learning, no learning...)
            rep = _sev(findings, *_NORM_CODES, "clip_zeroes")
            own = rep if (lastn.total_norm < th.vanishing or lastn.total_norm == 0) else _worst(own, rep)
        rows.append((f"Total grad norm (last step){sfx}", _fmt(lastn.total_norm), own))
        if lastn.clip_norm is not None:
            rows.append((f"Norm before clipping (last step){sfx}", _fmt(lastn.clip_norm),
                         _worst(_rate(lastn.clip_norm, th) if lastn.clip_norm > 0 else "healthy",
                                _sev(findings, "clip_scaled"))))
        fin = [r for r in recs if math.isfinite(r.grad_norm)]
        if fin:
            pk = max(fin, key=lambda r: r.grad_norm)
            rows.append((f"Max grad norm (run){sfx}", f"{_fmt(pk.grad_norm)} at step {pk.step}",
                         _rate(pk.grad_norm, th) if pk.grad_norm > 0 else _sev(findings, "clip_zeroes",
                                                                                "no_learning")))
        trend_sev = _sev(findings, "spike", "increasing", "decaying", "exploding", "loss_diverging", series=k,
                         owner=owner)
        broken = any(r.bad or (r.loss is not None and not math.isfinite(r.loss)) for r in recs)
        rows.append((f"Norm trend{sfx}", trends[k] if k < len(trends) else "-",
                     "critical" if broken else trend_sev))
        losses = [r for r in recs if r.loss is not None]
        if losses:
            first_f = next((r.loss for r in losses if math.isfinite(r.loss)), math.nan)
            val = f"{_fmt(first_f)} -> {_fmt(losses[-1].loss)}"
            bl = [r.step for r in losses if not math.isfinite(r.loss)]
            if bl:
                val += f" (non-finite at {len(bl)} step(s), first at step {bl[0]})"
            rows.append((f"Loss (first -> last step){sfx}", val,
                         "critical" if bl else _sev(findings, "loss_diverging", series=k, owner=owner)))
        elif manual or steps:
            rows.append((f"Loss{sfx}", "not seen (no scalar backward() in the step)", "notice"))
    nparams = len(last.params) if last else 0
    nbad = len(set(_flat_layers(findings, "nonfinite", "nonfinite_history")))
    whose = f" ({names[last_series]}'s, last step)" if multi else ""
    rows.append(("NaN/Inf parameters", f"{nbad} of {nparams}{whose}"
                 + (f" (first at step {bad_grad[0]})" if bad_grad else ""),
                 "critical" if bad_grad else "healthy"))
    if last is not None and last.numel:
        dead = sum(1 for r in last.params if r.numel and r.zero / r.numel > last.thresholds.dead_fraction)
        rows.append(("Zero-gradient parameters", f"{dead} of {nparams} tensors mostly zero ({last.zero / last.numel:.1%} "
                     "of values)", _sev(findings, "dead", "no_learning", "clip_zeroes")))
    rows.append(("First non-finite module output", origin or "none", "critical" if origin else "healthy"))
    clip = f"{chk.clip_calls} call(s)" if chk.clip_calls else "none"
    rows.append(("Gradient clipping", clip, _sev(findings, "clip_scaled", "clip_after_step", "clip_partial",
                                                 "no_clipping", "clip_zeroes")))
    rows.append(("Gradient zeroing", f"{chk.zero_grad_calls} zero_grad() call(s)",
                 _sev(findings, "no_zero_grad")))
    return rows


def _flat_layers(findings, *codes):
    for f in findings:
        if f.code in codes:
            yield from f.layers
