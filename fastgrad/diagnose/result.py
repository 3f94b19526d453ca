"""The result of a checked run (``CheckResult``) and how it is built from a finished ``Checker``
(``build_result``): the host view of the run (``RunView``), every rule of ``rules.registry`` evaluated on it,
then the verdict (status, exit code), the per-series trend labels and the summary table, which never say
more than the findings do. Renderings: ``render.run_text`` (Markdown, JSON) and ``render.plot``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .advice import reword_notices
from .collect.steps import StepRecord
from .collect.targets import environment_module
from .consistency import link_causes, reconcile
from .finding import Finding, fmt, place_causes, steps_text
from .render import plot as _plot, run_text
from .report import GradientReport
from .policy import Policy
from .rules.base import RunView, median
from .rules.nonfinite import trace_origin
from .rules.registry import evaluate, not_checked
from .rules.rewrite import rewritten_layer
from .rules.run_state import nothing_checked
from .rules.validation import validation_item
from .thresholds import RANK, Thresholds, rate_norm, worst

__all__ = ["CheckResult", "build_result", "build_log_result", "EXIT_CODES"]

EXIT_CODES = {
    0: "no critical finding (warnings and notices may be present). A run whose every NaN/Inf step a StepGuard or "
       "GradScaler skipped is protected: its NaN findings are warnings, so it exits 0",
    1: "a critical finding (NaN/Inf gradients or loss, a norm > 1000 with harm the run shows or overflowed, a "
       "diverging loss, no learning, a critical red flag); with --fail-on warning or notice, a finding of that "
       "severity or worse",
    2: "usage error: a bad command line (an option out of range, an --out folder that cannot be written, a "
       "missing script, an unknown --ignore code, a log it cannot read or a column it cannot find), found before "
       "the script runs or the log is judged",
    3: "the script raised an exception or exited with a non-zero status (the report covers what ran)",
    4: "nothing could be checked: no optimizer step and no scalar backward() (the report says why)",
}


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
    #: where the run's first NaN/Inf was born (``rules.nonfinite.trace_origin``): where ("forward", "loss",
    #: "backward"), step, module, text; None when everything stayed finite
    born: dict | None = None
    #: the rules that could not judge this run: {"rule", "codes", "reason"} (``rules.registry.not_checked``)
    not_checked: list[dict] = field(default_factory=list)
    #: findings left out by the policy (``--ignore``, fastgrad-check.toml): {"code", "severity", "title", "reason"}
    ignored: list[dict] = field(default_factory=list)
    fail_on: str = "critical"
    #: a run read from its logs: {"kind", "path", "columns", "absent"}; None for a live run
    source: dict | None = None

    @property
    def status(self) -> str:
        if not self.steps or all(r.unread for r in self.steps):
            return "not checked"
        return worst(*(f.severity for f in self.findings))

    def codes(self, severity: str | None = None) -> list[str]:
        return [f.code for f in self.findings if severity is None or f.severity == severity]

    def to_markdown(self) -> str:
        return run_text.to_markdown(self)

    def to_dict(self) -> dict:
        return run_text.to_dict(self)

    def plot(self, path: str) -> str:
        """Gradient norm per step and optimizer and the loss, as a PNG (``render.plot.plot_run``)."""
        return _plot.plot_run(self, path)


def _order(findings: list[Finding]) -> list[Finding]:
    """Most severe first; within a severity, the earliest step first (the cause before its consequences),
    findings without steps after those with; at the same step an overflowed norm (the largest explosion), then
    a diverging loss (what the user sees, and the learning rate behind both), then rule order. Then each cause
    moves before the first finding that follows from it (``finding.place_causes``)."""
    idx = {id(f): i for i, f in enumerate(findings)}

    def lead(f: Finding) -> int:
        if f.code == "exploding" and f.evidence.get("variant") == "overflow":
            return 0
        if f.code == "norm_miscounted":  # a cause: the clip acted on a wrong number from the first step
            return 0
        return 1 if f.code == "loss_diverging" else 2
    return sorted(findings, key=lambda f: (-RANK[f.severity], min(f.steps) if f.steps else math.inf, lead(f),
                                           idx[id(f)]))


def build_result(chk, *, script: str, args: list[str], crashed: bool, crash_text: str | None, stopped: bool,
                 max_steps: int | None, policy: Policy | None = None) -> CheckResult:
    """Turn a finished :class:`~fastgrad.diagnose.collect.hooks.Checker` into findings, a summary and an exit
    code. Reads the device state left by the run (the watcher's key, the last statistics): a few syncs, once,
    at the end."""
    steps = chk.steps
    manual = bool(steps) and steps[0].source == "backward"
    names = (["hand-written loop"] if manual else list(chk.series_names)) or ["steps"]
    run = RunView(steps=steps, names=names, manual=manual,
                  lrs=list(getattr(chk, "series_lr", [])) if not manual else [],
                  flags={k: list(v) for k, v in chk.flags.items()}, clip_calls=chk.clip_calls,
                  zero_grad_calls=chk.zero_grad_calls, amp_skipped=chk.skipped,
                  optimizers_made=getattr(chk, "optimizers_made", 0), backward_calls=chk.backward_calls,
                  processes_started=getattr(chk, "processes_started", 0),
                  processes_read=getattr(chk, "processes_wrapped", 0),
                  scalar_backward_calls=chk.scalar_backward_calls, errors=list(chk.errors), crashed=crashed,
                  crash_text=crash_text,
                  ctx={"scaler": getattr(chk, "scaler_used", False),
                       "modules": sorted(getattr(chk, "module_types", ())),
                       "classes": getattr(chk, "ce_classes", None),
                       "ce_inputs": {"calls": getattr(chk, "ce_calls", 0), "softmax": getattr(chk, "ce_softmax", 0),
                                     "probabilities": getattr(chk, "ce_probs", 0)},
                       "windows": list(getattr(chk, "windows", [])),
                       "loss_signs": dict(getattr(chk, "loss_signs", {})),
                       "maximize": list(getattr(chk, "series_maximize", [])),
                       "moving_targets": list(getattr(chk, "targets_moved", [])),
                       "environment": environment_module(),
                       "target_syncs": list(getattr(chk, "target_syncs", [])),
                       "child": getattr(chk, "child_index", None),
                       "saturation": list(getattr(chk, "saturation", [])),
                       "decay": dict(getattr(chk, "decay", {})),
                       "live": dict(getattr(chk, "live", {})), "frozen": list(getattr(chk, "frozen", {})),
                       "misplaced_clip_max": getattr(chk, "misplaced_clip_max", None),
                       "misplaced_clip_bare": getattr(chk, "misplaced_clip_bare", None),
                       "clips_found_grads": getattr(chk, "clips_found_grads", 0),
                       "clip_not_params": getattr(chk, "clip_not_params", None),
                       # the parameters whose module ran in a forward (None: not known)
                       "ran": getattr(chk, "ran_params", None),
                       "frozen_held": dict(getattr(chk, "frozen_held", {})),
                       "names": _script_names(chk, manual),
                       # the models' floating buffers that were NaN/Inf at some read (collect.buffers)
                       "buffers": list(getattr(chk, "buffers", [])),
                       # a multi-process run, on rank 0: every rank's record of each recorded clip
                       "ranks": getattr(chk, "rank_calls", None),
                       # ranks that sent rank 0 no records: {rank: why}
                       "ranks_silent": dict(getattr(chk, "ranks_silent", {}))})
    used = run.used
    per = run.per
    run.ctx["clip"] = _clip_setup(used)
    run.ctx["updates"] = update_sizes(getattr(chk, "updates", []), {r.step: r for r in steps})
    run.last_series = used[-1].series if used else 0
    if chk.last_stats is not None and len(chk.last_stats) and used:
        hist = [r.loss for r in per[run.last_series] if r.loss is not None]
        run.last = GradientReport.from_stats(chk.last_stats, None, loss_history=hist or None, step=used[-1].step)
    run.forward_origin = chk.watcher.first_nonfinite() if chk.watcher is not None else None
    if chk._bad_steps is not None:
        run.bad_params = [n for n, c in zip(chk._bad_names, chk._bad_steps.tolist()) if c]
    return _judge(run, script, args, crashed, crash_text, stopped, policy)


def build_log_result(log, policy: Policy | None = None) -> CheckResult:
    """Judge a finished run from its logs (``collect.logs.read_log``'s ``LogRun``) with the same rules as a
    live run: those whose evidence the log lacks (per-tensor gradients, the script's own calls, a series it
    did not log) are not evaluated and the report lists them under "Not checked"."""
    run = RunView(steps=list(log.steps), lrs=[next((r.lr for r in reversed(log.steps) if r.lr is not None), None)],
                  source=log.kind, ctx={"live": {}, "frozen": [], "modules": [], "classes": None, "ranks": None,
                                        "scaler": False, "names": {"optimizer": [None], "model": None, "lr": None,
                                                                   "manual": False}})
    run.ctx["clip"] = None
    run.ctx["updates"] = []
    run.ctx["validation"] = log.validation
    res = _judge(run, log.path, [], False, None, False, policy)
    res.source = {"kind": log.kind, "path": log.path, "columns": dict(log.columns), "absent": sorted(log.absent)}
    # a log records no script's calls: the rows about them would read as facts ("no clip call")
    gone = ("NaN/Inf parameters", "Gradient clipping", "Gradient zeroing", "NaN/Inf born in")
    res.summary = [row for row in res.summary if row[0] not in gone and not (
        "grad_norm" in log.absent and ("norm" in row[0].lower()))]
    if "grad_norm" in log.absent:
        res.trend = "no gradient norm in the log"
    return res


def _judge(run: RunView, script: str, args: list[str], crashed: bool, crash_text: str | None, stopped: bool,
           policy: Policy | None) -> CheckResult:
    """The rules on ``run``, then the verdict, the trends and the summary (shared by live runs and logs)."""
    policy = policy or Policy()
    steps, names, manual, per = run.steps, run.names, run.manual, run.per
    last_losses = [r.loss for r in per.get(run.last_series, []) if r.loss is not None and math.isfinite(r.loss)]
    found = evaluate(run)
    ignored = [f for f in found if f.code in policy.ignore]
    findings = reconcile([f for f in found if f.code not in policy.ignore], last_losses, run.th)
    findings = place_causes(_order(link_causes(findings, list(run.ctx["live"]))))
    reword_notices(findings)
    trends = [_trend_label(recs, [f for f in findings if f.evidence.get("series", k) == k])
              if recs else "no steps read" for k, recs in per.items()]
    trend = "; ".join(run.label(k) + t for k, t in enumerate(trends)) or "no steps"
    o = trace_origin(run)
    fo = run.forward_origin
    # the watcher's own answer, kept as it was: the first non-finite module output
    pre = "input of " if fo is not None and getattr(fo, "where", "output") == "input" else ""
    first_output = None if fo is None else (f"{pre}{fo.module} ({fo.module_type})" if manual
                                            else f"{pre}{fo.module} ({fo.module_type}) at step {fo.step + 1}")
    status = worst(*(f.severity for f in findings))
    summary = _summary(run, findings, trends, o, stopped)
    if status == "healthy":
        # a row's "notice" (a peak between 10 and 100 at some step) with no finding behind it would read as a
        # verdict the report does not give: the value stays, the row is healthy like the run
        summary = [(m, v, "healthy" if st == "notice" else st) for m, v, st in summary]
    fails = status != "healthy" and RANK[status] >= RANK[policy.fail_on]
    exit_code = 3 if crashed else (4 if nothing_checked(run) else (1 if fails else 0))
    born = None if o is None else {"where": o.where, "step": o.step, "module": o.module, "text": o.text}
    res = CheckResult(script, args, steps, findings, summary, trend, first_output, run.last, crashed, crash_text,
                      stopped, exit_code, run.flags, names if steps else [], sorted(run.key_steps), run.ctx, born)
    res.not_checked = not_checked(run) + [validation_item(run.ctx.get("validation"), run.source == "live")]
    res.ignored = [{"code": f.code, "severity": f.severity, "title": f.title, "reason": policy.ignore[f.code]}
                   for f in ignored]
    res.fail_on = policy.fail_on
    return res


def _script_names(chk, manual: bool) -> dict:
    """The script's own names the code to add may use: its optimizer variable per series, its model's, and (a
    loop without torch.optim) its learning-rate variable, its scheduler variable per series; None where the
    script has none."""
    v = getattr(chk, "script_vars", {})
    opts = [n.split(" (", 1)[1].rstrip(")") if " (" in n else None for n in getattr(chk, "series_names", [])]
    return {"optimizer": None if manual else opts, "model": v.get("model"), "lr": v.get("lr") if manual else None,
            "manual": manual, "models": dict(v.get("models") or {}),
            "scheduler": list(getattr(chk, "series_sched", []))}


def _ratio(sq_update: float, sq_weight: float) -> float:
    """sqrt(update^2 / weight^2): NaN where either is not finite (an update on NaN weights), inf for an update
    of weights that were all zero (a zero-initialised head), 0 for no update."""
    if not (math.isfinite(sq_update) and math.isfinite(sq_weight)):
        return math.nan
    if sq_weight == 0:
        return math.inf if sq_update > 0 else 0.0
    return math.sqrt(sq_update / sq_weight)


def update_sizes(rows, by_step: dict) -> list[dict]:
    """Per measured step: the update/weight ratio of the whole model and of each layer (its parameters' update
    norm over the norm of the weights it was applied to), the series and the learning rate of that step."""
    out = []
    for step, names, (upd, size) in rows:
        layers: dict[str, list[float]] = {}
        for n, u, w in zip(names, upd, size):
            acc = layers.setdefault(n.rsplit(".", 1)[0] if "." in n else n, [0.0, 0.0])
            acc[0] += u * u
            acc[1] += w * w
        r = by_step.get(step)
        out.append({"step": step, "series": r.series if r else 0, "lr": r.lr if r else None,
                    "ratio": _ratio(sum(u * u for u in upd), sum(w * w for w in size)),
                    "weight_norm": math.sqrt(sum(w * w for w in size)),
                    "layers": {k: _ratio(a, b) for k, (a, b) in layers.items()}})
    return out


def _clip_setup(used: list[StepRecord]) -> dict | None:
    """The script's own norm clip, for advice that fits it: its bound (the last one passed), the steps that
    clipped, and at how many of those whose norm was readable the clip acted (the norm above the bound)."""
    clipped = [r for r in used if r.clipped]
    if not clipped:
        return None
    bounds = [r.clip_max for r in clipped if r.clip_max is not None]
    read = [r for r in clipped if r.clip_norm is not None and r.clip_max is not None]
    return {"bound": bounds[-1] if bounds else None, "steps": len(clipped), "of": len(used), "read": len(read),
            "acted": sum(1 for r in read if r.clip_norm > r.clip_max)}


# ---------------------------------------------------------------------------------------------- trend labels
def _trend_label(recs: list[StepRecord], mine: list[Finding]) -> str:
    """The trend of one series, never contradicting its findings: a broken series names itself first, then
    divergence and the threshold findings; without a finding, the first and last quarters' medians."""
    bad = [r.step for r in recs if r.bad]
    bl = [r.step for r in recs if r.loss is not None and not math.isfinite(r.loss)]
    if bad:
        return f"diverged: non-finite from step {bad[0]}"
    label = _norm_label(recs, mine)
    if bl:  # finite norms, broken loss: the trend says both
        return f"loss non-finite from step {bl[0]} (norm: {label})"
    return label


def _norm_label(recs: list[StepRecord], mine: list[Finding]) -> str:
    by = {f.code: f for f in mine}
    div, exp, zero = by.get("loss_diverging"), by.get("exploding"), by.get("zero_grads")
    over = [r for r in recs if r.overflow]
    if over:
        return (f"exploding: the norm overflowed float32 at {len(over)} step(s) from step {over[0].step} "
                f"({len([r for r in recs if r.overflow or r.grad_norm > 1000])} step(s) above 1000)")
    if zero is not None:
        return f"all zero from step {zero.evidence['first_step']} ({zero.evidence['count']} step(s))"
    fin = [r for r in recs if math.isfinite(r.grad_norm)]
    if (div is not None and div.severity == "critical") or (
            exp is not None and exp.severity == "critical" and recs[-1].step in exp.steps):
        pk = max(fin, key=lambda r: r.grad_norm)
        return f"diverging: norm {fmt(fin[0].grad_norm)} at step {fin[0].step} -> {fmt(pk.grad_norm)} at step {pk.step}"
    if div is not None and div.evidence.get("variant") == "unrecovered":
        return (f"loss jumped {div.evidence['ratio']:.3g}x and stayed above its start "
                f"({div.evidence['end_level'] / div.evidence['start']:.3g}x at the end)")
    if div is not None and div.severity == "warning":
        return f"loss rising ({div.evidence['ratio']:.3g}x its start)"
    codes = {f.code for f in mine}
    if exp is not None:
        pk = max(fin, key=lambda r: r.grad_norm)
        lim = "1000" if exp.severity == "critical" else "100"
        return (f"above {lim} at {len(exp.steps)} step(s) (peak {fmt(pk.grad_norm)} at step {pk.step}), "
                f"{fmt(recs[-1].grad_norm)} at the last step")
    if "increasing" in codes and by["increasing"].severity != "notice":
        return "increasing"
    if "decaying" in codes:
        return "decaying"
    if "spike" in codes:
        return f"spikes (steps {steps_text(by['spike'].steps)})"
    vals = [r.grad_norm for r in fin if r.grad_norm > 0]
    if len(vals) >= 4:
        q = max(1, len(vals) // 4)
        ratio = median(vals[-q:]) / median(vals[:q])
        if ratio >= 10 or ratio <= 0.1:
            return (f"{'rising' if ratio > 1 else 'falling'} {ratio:.3g}x (first to last quarter's median; "
                    "inside the guide's ranges)")
    if "increasing" in codes:
        return "rising inside the healthy range while the loss falls"
    return "stable"


# ---------------------------------------------------------------------------------------------- summary table
def _sev(findings: list[Finding], *codes: str, series: int | None = None) -> str:
    """The worst severity of the findings with these codes (about ``series`` only, when given)."""
    return worst(*(f.severity for f in findings if f.code in codes
                   and (series is None or f.evidence.get("series", series) == series)))


_NORM_CODES = ("nonfinite", "no_learning", "elevated", "low", "vanishing", "small_but_learning")
#: the findings that judge one series' norm (its rows are never more severe than these)
_NORM_JUDGED = ("exploding", "spike", "increasing", "decaying", "zero_grads", "clip_zeroes", "nonfinite_history",
                "loss_diverging")


def _cap(status: str, limit: str) -> str:
    """``status``, no worse than ``limit``."""
    return status if RANK[status] <= RANK[limit] else limit


def _names_text(names: list[str], limit: int = 6) -> str:
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f", ... (+{more})" if more > 0 else "")


def _never_text(never: Finding | None) -> str:
    """The never_learns part of the zero-gradient row, as its finding tells it: tensors that never learn, and
    apart from them the tensors the loss does not depend on (zero by construction, nothing wrong)."""
    if never is None:
        return ""
    invariant = never.evidence.get("invariant") or []
    stuck = [n for n in never.layers if n not in invariant]
    return ((f"; never learning: {_names_text(stuck)} (never_learns)" if stuck else "")
            + (f"; zero by construction (the loss does not depend on them): {_names_text(invariant)}"
               if invariant else ""))


def _protected(findings: list[Finding]) -> bool:
    """Every NaN/Inf the run met was kept out of the weights (a StepGuard or GradScaler skipped its steps)."""
    nf = [f for f in findings if f.code in ("nonfinite", "nonfinite_history", "nonfinite_loss")]
    return bool(nf) and all(f.evidence.get("protected") for f in nf)


#: the findings about NaN/Inf values: a summary row showing one is rated no milder than they are
_NONFINITE_CODES = ("nonfinite", "nonfinite_history", "nonfinite_loss", "nonfinite_buffers", "guard_skipped",
                    "amp_skipped")


def _not_healthy_if_nonfinite(value: float | None, status: str, findings: list[Finding]) -> str:
    """A row's status, never "healthy" for a NaN/Inf value: at least the severity of the run's NaN/Inf
    findings (a notice when none names it)."""
    if value is None or math.isfinite(value):
        return status
    return worst(status, _sev(findings, *_NONFINITE_CODES), "notice")


def _summary(run: RunView, findings: list[Finding], trends: list[str], born, stopped: bool):
    th = Thresholds()
    rows = []
    steps, used, per, names, last = run.steps, run.used, run.per, run.names, run.last
    n = len(steps)
    what = " (hand-written loop: no torch.optim step)" if run.manual else ""
    if run.multi:
        what += " (" + ", ".join(f"{names[k]}: {len(per[k])}" for k in per) + ")"
    ng = len(run.guarded)
    crashed_child = run.crashed and not n
    rows.append(("Steps checked", f"{n}{what}" + (f" ({run.amp_skipped} skipped by the GradScaler)"
                                                  if run.amp_skipped else "")
                 + (f" ({ng} skipped by the step guard" + (": the run is protected)" if _protected(findings)
                                                           else ")") if ng else "") + (" (stopped by --steps)" if stopped else "")
                 + (f" (in child process {run.ctx['child'] + 1}, "
                    + ("which crashed" if crashed_child else "the first the script started that trained")
                    + "; the others ran beside it unread)" if run.ctx.get("child") is not None else ""),
                 "healthy" if n else "warning"))
    for k, recs in per.items():
        sfx = f" [{names[k]}]" if run.multi else ""
        if not recs:
            continue
        # a norm's row is never more severe than the findings that judge that norm: the guide's limit alone is
        # the findings' question, not the row's verdict
        limit = worst(_sev(findings, *_NORM_JUDGED, series=k),
                      _sev(findings, *_NORM_CODES) if k == run.last_series else "healthy")
        lastn = recs[-1]
        own = rate_norm(lastn.total_norm, th)
        if lastn.total_norm == 0 and (lastn.overflow or (lastn.clipped and lastn.clip_norm)):
            own = _sev(findings, "exploding", "clip_zeroes", series=k)  # the clip's zeros: judged there
        elif k == run.last_series:  # the last step's own classification (small but learning, no learning...)
            # another optimizer's zero_grads is not about this series' norm
            rep = worst(_sev(findings, *_NORM_CODES, "clip_zeroes"), _sev(findings, "zero_grads", series=k))
            own = rep if (lastn.total_norm < th.vanishing or lastn.total_norm == 0) else worst(own, rep)
        else:
            own = worst(own, _sev(findings, "zero_grads", series=k)) if lastn.total_norm == 0 else own
        rows.append((f"Total grad norm (last step){sfx}", fmt(lastn.total_norm),
                     _not_healthy_if_nonfinite(lastn.total_norm, _cap(own, limit), findings)))
        if lastn.clip_norm is not None:
            rows.append((f"Norm before clipping (last step){sfx}",
                         fmt(lastn.clip_norm) + (" (overflowed float32)" if lastn.overflow else ""),
                         _not_healthy_if_nonfinite(lastn.clip_norm, worst(
                             _cap(rate_norm(lastn.clip_norm, th), limit) if lastn.clip_norm > 0 else "healthy",
                             _sev(findings, "clip_scaled")), findings)))
        fin = [r for r in recs if math.isfinite(r.grad_norm)]
        over = [r for r in recs if r.overflow]
        if over:
            rows.append((f"Max grad norm (run){sfx}", f"inf (overflowed float32) at step {over[0].step}", "critical"))
        elif fin:
            pk = max(fin, key=lambda r: r.grad_norm)
            rows.append((f"Max grad norm (run){sfx}", f"{fmt(pk.grad_norm)} at step {pk.step}",
                         _cap(rate_norm(pk.grad_norm, th), limit) if pk.grad_norm > 0 else
                         _sev(findings, "clip_zeroes", "no_learning", "zero_grads", series=k)))
        trend_sev = _sev(findings, "spike", "increasing", "decaying", "exploding", "loss_diverging", "zero_grads",
                         series=k)
        broken = any(r.bad or (r.loss is not None and not math.isfinite(r.loss)) for r in recs)
        rows.append((f"Norm trend{sfx}", trends[k] if k < len(trends) else "-", "critical" if broken else trend_sev))
        ups = [u for u in run.ctx.get("updates") or () if u["series"] == k and math.isfinite(u["ratio"])]
        # the step the series stepped on a NaN/Inf loss or gradient (not one a GradScaler or guard skipped): the
        # updates from there on made or carried NaN weights, a size no finite ratio describes, measured or not
        gone = next((r.step for r in recs if (r.bad or (r.loss is not None and not math.isfinite(r.loss)))
                     and not (r.skipped or r.guard_skipped)), None)
        if ups:
            top = max(ups, key=lambda u: u["ratio"])
            # ... or one layer's: a small head beside a large body can be rewritten while the whole stays under 1x
            lay = max(((*hit, u["step"]) for u in ups if (hit := rewritten_layer(u, run.limits)) is not None),
                      default=None)
            rewrote = top["ratio"] >= run.limits.blowup_update or lay is not None
            # the findings that rest on the update size (an update that rewrote the weights, steps that bounce)
            blame = worst(*(f.severity for f in findings if f.evidence.get("series", k) == k and (
                "rewrite" in f.evidence.get("harm", ()) or f.evidence.get("rewrite")
                or f.evidence.get("variant") in ("large_update", "tiny_update", "learning_rate"))))
            # an update that rewrote the weights is never "healthy" (a notice at least, as far as the findings go)
            run_worst = worst(*(f.severity for f in findings))
            st = worst(blame, _cap("notice", run_worst)) if rewrote else blame
            if gone is not None:   # never "healthy" beside weights an update made non-finite
                st = worst(st, "critical")
            rows.append((f"Update/weight ratio{sfx}", f"median {fmt(median([u['ratio'] for u in ups]))} over {len(ups)} "
                         f"measured step(s), largest {fmt(top['ratio'])} at step {top['step']} (about 1e-3 is typical"
                         + ("; 1 or more: that step rewrote the weights" if top["ratio"] >= run.limits.blowup_update
                            else f"; layer {lay[1]} moved {fmt(lay[0])}x its weights at step {lay[2]}: rewritten"
                            if lay is not None else "")
                         + (f"; not finite from step {gone}: the run went NaN/Inf there" if gone is not None else "")
                         + ")", st))
        lrs = [r.lr for r in recs if r.lr is not None]
        if lrs:  # the evidence the rules that blame a learning rate quote
            # a schedule gone wrong (negative, collapsed) is never "healthy": the finding's severity
            bad = worst(*(f.severity for f in findings if f.code == "lr_schedule" and f.evidence.get("series") == k))
            rows.append((f"Learning rate{sfx}", f"{lrs[0]:g}" + (f" -> {lrs[-1]:g} (last step)" if lrs[-1] != lrs[0]
                                                                 else "") + (f" (min {min(lrs):g})" if min(lrs) < 0 <= lrs[-1]
                                                                             else ""),
                         _not_healthy_if_nonfinite(
                             next((x for x in lrs if not math.isfinite(x)), lrs[0]), bad, findings)))
        losses = [r for r in recs if r.loss is not None]
        if losses:
            fl = [r for r in losses if math.isfinite(r.loss)]
            first_f = fl[0].loss if fl else math.nan
            val = f"{fmt(first_f)} -> {fmt(losses[-1].loss)}"
            top = max(fl, key=lambda r: r.loss) if fl else None
            if top is not None and first_f > 0 and top.loss >= run.limits.far_ratio * first_f:
                val += f" (peak {fmt(top.loss)} at step {top.step})"
            bl = [r.step for r in losses if not math.isfinite(r.loss)]
            if bl:
                val += f" (non-finite at {len(bl)} step(s), first at step {bl[0]})"
            st = next((f for f in findings if f.code == "stall" and f.evidence.get("series") == k), None)
            if st is not None:
                val += (f" (not improved over {st.evidence['window']} steps: quarter means "
                        f"{fmt(st.evidence['first_mean'])} -> {fmt(st.evidence['last_mean'])}, "
                        + ("back to its first loss" if st.evidence.get("back") else "within its noise")
                        + (", at chance" if st.evidence["at_chance"] else "") + ")")
            # the findings that rest on the loss: its divergence, its stall, a jump or rise as a norm's harm
            on_loss = worst(*(f.severity for f in findings if f.evidence.get("series", k) == k
                              and set(f.evidence.get("harm", ())) & {"loss_jump", "loss_rose", "not_recovered"}))
            rows.append((f"Loss (first -> last step){sfx}", val,
                         "critical" if bl else worst(_sev(findings, "loss_diverging", "stall", series=k), on_loss)))
        else:
            rows.append((f"Loss{sfx}", "not seen (no scalar backward() in the step)", "notice"))
    nparams = len(last.params) if last else 0
    nbad = len({n for f in findings if f.code in ("nonfinite", "nonfinite_history") for n in f.layers})
    whose = f" ({names[run.last_series]}'s, last step)" if run.multi else ""
    bad_grad = [r.step for r in used if r.bad]
    rows.append(("NaN/Inf parameters", f"{nbad} of {nparams}{whose}" + (f" (first at step {bad_grad[0]})"
                                                                         if bad_grad else ""),
                 "critical" if bad_grad else "healthy"))
    if last is not None and last.numel:
        dead = sum(1 for r in last.params if r.numel and r.zero / r.numel > last.thresholds.dead_fraction)
        lastr = used[-1] if used else None
        by_clip = lastr is not None and lastr.total_norm == 0 and (lastr.overflow or bool(lastr.clip_norm))
        never = next((f for f in findings if f.code == "never_learns"), None)
        rows.append(("Zero-gradient parameters",
                     f"{dead} of {nparams} tensors mostly zero ({last.zero / last.numel:.1%} of values)"
                     + (" (made by the clip, not by the model)" if by_clip else "")
                     + _never_text(never),
                     worst(_sev(findings, "dead", "no_learning", "clip_zeroes", "mostly_zero", "never_learns"),
                           _sev(findings, "zero_grads", series=run.last_series))))
    frozen = run.ctx.get("frozen") or []
    if frozen:  # not a finding: the script chose it, and the report says so
        rows.append(("Frozen parameters", f"{len(frozen)} tensor(s) with requires_grad=False, not trained: "
                     + _names_text(frozen), _sev(findings, "frozen_in_optimizer")))
    rows.append(("NaN/Inf born in", "nowhere" if born is None else f"{born.where} at step {born.step}"
                 + (f": {born.module}" if born.module else ""),
                 "healthy" if born is None else (_sev(findings, "nonfinite", "nonfinite_history", "nonfinite_loss")
                                                 if _protected(findings) else "critical")))
    clip = f"{run.clip_calls} call(s)" if run.clip_calls else "none"
    rows.append(("Gradient clipping", clip, _sev(findings, "clip_scaled", "clip_after_step", "clip_not_params",
                                                 "clip_partial", "no_clipping", "clip_zeroes")))
    rows.append(("Gradient zeroing", f"{run.zero_grad_calls} zero_grad() call(s)", _sev(findings, "no_zero_grad")))
    compared = run.ctx.get("rank_norms")
    if compared:  # a multi-process run: the norm the script clipped with, against every rank's gradients
        off = [c for c in compared if c["differs"]]
        rows.append((f"Clip norm vs true norm ({compared[0]['ranks']} ranks)",
                     f"{len(compared) - len(off)} of {len(compared)} recorded clip(s) equal within float32 rounding"
                     + (" (norm_miscounted)" if off else ""), _sev(findings, "norm_miscounted")))
    return rows
