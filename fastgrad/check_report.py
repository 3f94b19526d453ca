"""The report of ``python -m fastgrad.check``: findings of a whole run and their Markdown/JSON/plot renderings.

The per-step norm statuses are those of docs/contract.md section 7 (``fastgrad.report`` computes them from the last
step's statistics; this module adds what only a whole run shows):

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
``amp_skipped``             notice      steps the GradScaler skipped (normal while its scale settles)
``script_crashed``          critical    the script raised (exit code 3)
==========================  ==========  ===============================================================

Trends (``spike``, ``increasing``, ``decaying``) come from ``fastgrad.monitor.detect_trends``.
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
    "amp_skipped": ("Skipped steps are how a GradScaler handles fp16 overflow; worry only if they keep coming.",
                    ""),
    "script_crashed": ("The script raised before finishing; the report covers the steps that ran.", ""),
}


@dataclass
class StepRecord:
    """One training step as the host saw it after a flush (norms are of the gradients the optimizer used)."""

    step: int
    skipped: bool = False
    numel: int = 0
    has_loss: bool = False
    clipped: bool = False
    zeroed: bool = False
    leftover_checked: bool = False
    total_norm: float = math.nan
    nonfinite: float = 0.0
    zero: float = 0.0
    loss: float | None = None
    leftover: float | None = None
    clip_norm: float | None = None  # what the clip call returned: the norm before clipping


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

    @property
    def status(self) -> str:
        return max((f.severity for f in self.findings), key=_RANK.__getitem__, default="healthy")

    def codes(self, severity: str | None = None) -> list[str]:
        return [f.code for f in self.findings if severity is None or f.severity == severity]

    # ---------------------------------------------------------------- renderings
    def to_markdown(self) -> str:
        cmd = " ".join([self.script] + self.args)
        n = len(self.steps)
        how = " (stopped by --steps)" if self.stopped else (" (the script crashed)" if self.crashed else "")
        out = ["## Gradient Health Report", "",
               f"Script: `{cmd}`; {n} optimizer step(s) checked{how}. Overall status: **{self.status.upper()}**.",
               "", "### Summary", "", "| Metric | Value | Status |", "|---|---|---|"]
        out += [f"| {m} | {v} | {s} |" for m, v, s in self.summary]
        out += ["", "### Gradient Norm Trend", "", f"Trend: **{self.trend}**.", ""]
        sample = _sample(self.steps, 12)
        if sample:
            out += ["| Step | Total norm | Norm before clip | Loss |", "|---|---|---|---|"]
            out += [f"| {r.step}{' (skipped)' if r.skipped else ''} | {_fmt(r.total_norm)} | "
                    f"{_fmt(r.clip_norm)} | {_fmt(r.loss)} |" for r in sample]
        out += ["", "### Issues Detected", ""]
        ordered = sorted(self.findings, key=lambda f: -_RANK[f.severity])
        if not ordered:
            out.append("No issues detected: the gradients look healthy.")
        for i, f in enumerate(ordered, 1):
            aff = _layers_text(f)
            out.append(f"{i}. **{f.severity.upper()}** `{f.code}`: {f.title}. {f.detail}"
                       + (f" Affected: {aff}." if aff != "-" else ""))
        recs = _recs(ordered)
        out += ["", "### Recommendations", ""]
        if not recs:
            out.append("None: keep training.")
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
            "summary": [{"metric": m, "value": v, "status": s} for m, v, s in self.summary],
            "findings": [asdict(f) for f in self.findings],
            "steps": [asdict(r) for r in self.steps],
            "last_step_report": None if self.last is None else self.last.to_dict(),
        }

    def plot(self, path: str) -> str:
        """Total norm per step (log scale, healthy band shaded, non-finite steps marked) and the loss."""
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
        pts = [(r.step, r.total_norm) for r in self.steps if math.isfinite(r.total_norm) and r.total_norm > 0]
        if pts:
            ax.plot(*zip(*pts), lw=1.2, label="total grad norm (used by the step)")
        pre = [(r.step, r.clip_norm) for r in self.steps if r.clip_norm and math.isfinite(r.clip_norm)]
        if pre:
            ax.plot(*zip(*pre), lw=1, ls="--", label="norm before clipping")
        bad = [r.step for r in self.steps if not r.skipped and not math.isfinite(r.total_norm)]
        for s in bad:
            ax.axvline(s, color="red", alpha=0.3)
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("gradient norm")
        losses = [(r.step, r.loss) for r in self.steps if r.loss is not None and math.isfinite(r.loss)]
        if losses:
            ax2 = ax.twinx()
            ax2.plot(*zip(*losses), color="gray", lw=0.8, alpha=0.7)
            ax2.set_ylabel("loss (gray)")
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title(f"{self.script}: gradient norm ({self.trend})")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        return path


def _sample(steps: list[StepRecord], k: int) -> list[StepRecord]:
    if len(steps) <= k:
        return list(steps)
    idx = sorted({round(i * (len(steps) - 1) / (k - 1)) for i in range(k)})
    return [steps[i] for i in idx]


def _recs(findings: list[Finding]) -> list[tuple[str, str, str]]:
    seen, out = set(), []
    for f in findings:
        if f.code in seen:
            continue
        seen.add(f.code)
        text, snippet = _FIXES.get(f.code) or _RECOMMEND.get(f.code) or ("", "")
        if text:
            out.append((f.code, text, snippet))
    return out


def _steps_text(steps: list[int], limit: int = 8) -> str:
    more = len(steps) - limit
    return ", ".join(map(str, steps[:limit])) + (f", ... (+{more})" if more > 0 else "")


# ---------------------------------------------------------------------------------------------- findings
_NORM_CODES = ("nonfinite", "no_learning", "exploding", "elevated", "low", "vanishing", "small_but_learning")


def build_result(chk, *, script: str, args: list[str], crashed: bool, crash_text: str | None, stopped: bool,
                 max_steps: int | None) -> CheckResult:
    """Turn a finished :class:`fastgrad.check.Checker` into findings, a summary and an exit code. Reads the
    device state left by the run (the watcher's key, the last statistics): a few syncs, once, at the end."""
    from .monitor import detect_trends

    th = Thresholds()
    steps = chk.steps
    used = [r for r in steps if not r.skipped]
    losses = [r.loss for r in steps if r.loss is not None]
    findings: list[Finding] = []

    # The last step's statistics: the section 7 statuses of docs/contract.md (norm range, NaN names, dead, depth).
    last = None
    if chk.last_stats is not None and len(chk.last_stats):
        last = GradientReport.from_stats(chk.last_stats, None, loss_history=losses or None,
                                         step=used[-1].step if used else None)
        # the run-wide loss finding below (every step, where the NaN was born) replaces the report's own
        findings += [f for f in last.findings if f.code not in ("decaying", "nonfinite_loss")]

    # Where the first NaN/Inf was born in the forward pass (the watcher counts steps from 0).
    o = chk.watcher.first_nonfinite() if chk.watcher is not None else None
    origin = None if o is None else f"{o.module} ({o.module_type}) at step {o.step + 1}"
    born = (f" The first non-finite module output was {origin}." if origin else
            " Every module output stayed finite: the NaN/Inf was born outside the modules (a functional loss, "
            "the data) or in backward (use torch.autograd.detect_anomaly() to find the op).")

    bad_loss = [r.step for r in steps if r.loss is not None and not math.isfinite(r.loss)]
    if bad_loss:
        finite_grads = all(math.isfinite(r.total_norm) for r in used if r.step >= bad_loss[0])
        findings.append(Finding(
            "nonfinite_loss", "critical", "NaN/Inf loss; check the loss before backward()",
            f"The loss was non-finite at {len(bad_loss)} step(s), first at step {bad_loss[0]}"
            + (", while every gradient stayed finite (the optimizer kept stepping on garbage)." if finite_grads
               else ".") + born,
            [o.module] if o else [], bad_loss))

    bad_grad = [r.step for r in used if not math.isfinite(r.total_norm)]
    bad_params = []
    if chk._bad_steps is not None:
        bad_params = [n for n, c in zip(chk._bad_names, chk._bad_steps.tolist()) if c]
    if bad_grad:
        first = bad_grad[0]
        nf = next((f for f in findings if f.code == "nonfinite"), None)
        text = f" NaN/Inf gradients at {len(bad_grad)} step(s), first at step {first}." + born
        if nf is not None:  # the last step is itself non-finite: extend its finding
            nf.detail += text
            nf.steps = bad_grad
            nf.layers = nf.layers or bad_params
        else:
            findings.append(Finding("nonfinite_history", "critical",
                                    "the optimizer stepped on NaN/Inf gradients", text.strip(), bad_params,
                                    bad_grad))

    # Trends of the norm the gradients had before any clipping.
    norms = [r.clip_norm if r.clip_norm is not None else r.total_norm for r in used]
    trend_f = detect_trends([r.step for r in used], norms, thresholds=th)
    findings += trend_f
    codes = {f.code for f in trend_f}
    trend = ("increasing" if "increasing" in codes else "decaying" if "decaying" in codes
             else "spikes" if "spike" in codes else "stable")
    if trend == "spikes":
        trend += f" (steps {_steps_text(next(f for f in trend_f if f.code == 'spike').steps)})"
    if bad_grad:  # the trend rules skip non-finite norms; a run that diverged must not read "stable"
        trend = f"diverged: non-finite from step {bad_grad[0]}" + ("" if trend == "stable" else f"; before: {trend}")

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
    finite_norms = [v for v in norms if math.isfinite(v)]
    max_norm = max(finite_norms, default=math.nan)
    if chk.clip_calls == 0 and finite_norms and max_norm > th.exploding:
        flags["no_clipping"] = [r.step for r, v in zip(used, norms) if math.isfinite(v) and v > th.exploding]
        findings.append(Finding("no_clipping", "warning", "no gradient clipping while the norm exceeds 100",
                                f"The norm reached {_fmt(max_norm)} and no clip function was called.",
                                _largest_layers(last) or bad_params, flags["no_clipping"]))
    if chk.skipped:
        findings.append(Finding("amp_skipped", "notice", "steps skipped by the GradScaler",
                                f"{chk.skipped} step(s) had Inf/NaN gradients and were skipped."))
    if chk.errors:
        findings.append(Finding("checker_error", "notice", "the checker could not read some steps",
                                "; ".join(chk.errors[:3]) + (f" (+{len(chk.errors) - 3} more)"
                                                             if len(chk.errors) > 3 else "")))
    if crashed:
        findings.append(Finding("script_crashed", "critical", "the script crashed", crash_text or ""))

    summary = _summary(chk, steps, used, last, findings, trend, origin, max_norm, bad_loss, bad_grad, stopped)
    status = max((f.severity for f in findings), key=_RANK.__getitem__, default="healthy")
    exit_code = 3 if crashed else (4 if not steps else (1 if status == "critical" else 0))
    return CheckResult(script, args, steps, findings, summary, trend, origin, last, crashed, crash_text,
                       stopped, exit_code, flags)


def _largest_layers(last: GradientReport | None, k: int = 3) -> list[str]:
    if last is None:
        return []
    finite = [r for r in last.layers if math.isfinite(r.norm)]
    return [r.name for r in sorted(finite, key=lambda r: -r.norm)[:k]]


def _sev(findings: list[Finding], *codes: str) -> str:
    sev = [f.severity for f in findings if f.code in codes]
    return max(sev, key=_RANK.__getitem__, default="healthy")


def _summary(chk, steps, used, last, findings, trend, origin, max_norm, bad_loss, bad_grad, stopped):
    rows = []
    n = len(steps)
    rows.append(("Steps checked", f"{n}" + (f" ({chk.skipped} skipped by the GradScaler)" if chk.skipped else "")
                 + (" (stopped by --steps)" if stopped else ""), "healthy" if n else "critical"))
    lastn = used[-1] if used else None
    rows.append(("Total grad norm (last step)", _fmt(lastn.total_norm) if lastn else "-",
                 _sev(findings, *_NORM_CODES)))
    if lastn is not None and lastn.clip_norm is not None:
        rows.append(("Norm before clipping (last step)", _fmt(lastn.clip_norm),
                     _sev(findings, "no_clipping", "clip_scaled")))
    rows.append(("Max grad norm (run)", _fmt(max_norm), _peak_status(max_norm, last)))
    rows.append(("Norm trend", trend, "critical" if bad_grad else _sev(findings, "spike", "increasing", "decaying")))
    nparams = len(last.params) if last else 0
    nbad = len(set(_flat_layers(findings, "nonfinite", "nonfinite_history")))
    rows.append(("NaN/Inf parameters", f"{nbad} of {nparams}" + (f" (first at step {bad_grad[0]})" if bad_grad else ""),
                 "critical" if bad_grad else "healthy"))
    if last is not None and last.numel:
        dead = sum(1 for r in last.params if r.numel and r.zero / r.numel > last.thresholds.dead_fraction)
        rows.append(("Zero-gradient parameters", f"{last.zero / last.numel:.1%} of values; {dead} of "
                     f"{nparams} tensors mostly zero", _sev(findings, "dead", "no_learning")))
    losses = [r.loss for r in steps if r.loss is not None]
    if losses:
        first_f = next((v for v in losses if math.isfinite(v)), math.nan)
        val = f"{_fmt(first_f)} -> {_fmt(losses[-1])}"
        if bad_loss:
            val += f" (non-finite at {len(bad_loss)} step(s), first at step {bad_loss[0]})"
        rows.append(("Loss (first -> last step)", val, "critical" if bad_loss else "healthy"))
    else:
        rows.append(("Loss", "not seen (no scalar backward())", "notice"))
    rows.append(("First non-finite module output", origin or "none", "critical" if origin else "healthy"))
    clip = f"{chk.clip_calls} call(s)" if chk.clip_calls else "none"
    rows.append(("Gradient clipping", clip, _sev(findings, "clip_scaled", "clip_after_step", "clip_partial",
                                                 "no_clipping")))
    rows.append(("Gradient zeroing", f"{chk.zero_grad_calls} zero_grad() call(s)",
                 _sev(findings, "no_zero_grad")))
    return rows


def _peak_status(v: float, last: GradientReport | None) -> str:
    """The docs/contract.md section 7 range of the run's peak norm, capped at warning: a past peak is a symptom, and what it
    led to (NaN, a missing clip) is a finding of its own."""
    th = last.thresholds if last is not None else Thresholds()
    if not math.isfinite(v):
        return "healthy"
    if v > th.exploding:
        return "warning"
    return "notice" if v > th.healthy_high or v < th.healthy_low else "healthy"


def _flat_layers(findings, *codes):
    for f in findings:
        if f.code in codes:
            yield from f.layers
