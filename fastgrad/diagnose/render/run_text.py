"""Renderings of a checked run (``CheckResult``): the Markdown report and the JSON document. Presentation
only: findings, advice and verdict are decided before."""

from __future__ import annotations

import math
from dataclasses import asdict

from ..advice import advise
from ..finding import fmt

__all__ = ["to_markdown", "to_dict", "sample", "not_checked_lines", "SCHEMA_VERSION"]


def sample(steps: list, k: int, must=()) -> list:
    """About ``k`` steps spread over the run, plus every step in ``must`` (where a finding fired)."""
    if len(steps) <= k:
        return list(steps)
    idx = {round(i * (len(steps) - 1) / (k - 1)) for i in range(k)}
    want = set(must)
    idx |= {i for i, r in enumerate(steps) if r.step in want}
    return [steps[i] for i in sorted(idx)]


def _affected(layers: list[str], limit: int = 8) -> str:
    uniq = list(dict.fromkeys(layers))  # once each, in order
    more = len(uniq) - limit
    return ", ".join(uniq[:limit]) + (f", ... (+{more})" if more > 0 else "")


#: the JSON document's schema version: raised when a key is removed or changes meaning (docs/diagnostics-run.md)
SCHEMA_VERSION = 1

#: how each kind of log is named in a report
LOG_KINDS = {"hf": "Hugging Face trainer_state.json", "lightning": "Lightning CSVLogger metrics.csv",
             "tensorboard": "TensorBoard event files", "csv": "CSV"}


def _header(res) -> str:
    n = len(res.steps)
    if res.source is not None:
        src = res.source
        cols = ", ".join(f"{k} from `{v}`" for k, v in src["columns"].items())
        return (f"Log: `{src['path']}` ({LOG_KINDS.get(src['kind'], src['kind'])}); {n} logged step(s) checked"
                + (f" (steps {res.steps[0].step} to {res.steps[-1].step})" if n else "") + f"; {cols}. "
                f"Overall status: **{res.status.upper()}**.")
    cmd = " ".join([res.script] + res.args)
    how = " (stopped by --steps)" if res.stopped else (" (the script crashed)" if res.crashed else "")
    unit = ("training step(s) of a hand-written loop" if res.steps and res.steps[0].source == "backward"
            else "optimizer step(s)")
    return f"Script: `{cmd}`; {n} {unit} checked{how}. Overall status: **{res.status.upper()}**."


def not_checked_lines(res) -> list[str]:
    """The "Not checked" section: every rule that could not judge the run, grouped by why."""
    out = ["", "### Not Checked", ""]
    # an item without codes is a question no rule judges (a validation loss): listed apart from the rules
    rules = [i for i in res.not_checked if i["codes"]]
    beyond = [i for i in res.not_checked if not i["codes"]]
    if rules:
        by: dict[str, list[str]] = {}
        for item in rules:
            by.setdefault(item["reason"], []).extend(item["codes"])
        out.append("These rules could not judge this run, so a clean report says nothing about them:")
        out.append("")
        out += [f"- {', '.join(f'`{c}`' for c in codes)}: {why}." for why, codes in by.items()]
    else:
        out.append("Every rule judged this run.")
    if beyond:
        out += ["", "No rule judges these:", ""] + [f"- {i['rule']}: {i['reason']}." for i in beyond]
    return out


def to_markdown(res) -> str:
    numbering = ("Steps are the log's step numbers (a Lightning CSV's counted from 1, as a live check counts them); "
                 "the norm is the one the log holds (the Trainer's is before its clip)." if res.source is not None else
                 "Steps are numbered from 1: step N is the N-th step (`step == N - 1` in a loop counted from 0).")
    out = ["## Gradient Health Report", "", _header(res), "", numbering,
           "", "### Summary", "", "| Metric | Value | Status |", "|---|---|---|"]
    out += [f"| {m} | {v} | {s} |" for m, v, s in res.summary]
    out += ["", "### Gradient Norm Trend", "", f"Trend: **{res.trend}**.", ""]
    rows = sample(res.steps, 12, res.key_steps)
    multi = len(res.series) > 1
    if rows:
        out += ["| Step |" + (" Optimizer |" if multi else "") + " Norm (used) | Norm before clip | Loss |",
                "|---|" + ("---|" if multi else "") + "---|---|---|"]
        for r in rows:
            mark = ((" (skipped)" if r.skipped else "") + (" (guard skipped)" if r.guard_skipped else "")
                    + (" (!)" if r.step in res.key_steps else ""))
            before = ("inf (overflow)" if r.overflow else fmt(r.clip_norm)) if r.clip_norm is not None else (
                "not readable (scaled)" if r.clipped and not r.clip_read and res.flags.get("clip_scaled") else "-")
            out.append(f"| {r.step}{mark} |" + (f" {res.series[r.series]} |" if multi else "")
                       + f" {fmt(r.total_norm)} | {before} | {fmt(r.loss)} |")
        if res.key_steps:
            out += ["", "(!) a step where a finding was triggered; always shown."]
    out += _update_table(res.context.get("updates") or [], multi, res.series)
    out += ["", "### Issues Detected", ""]
    if not res.findings:
        out.append("No issues detected: the gradients look healthy.")
    for i, f in enumerate(res.findings, 1):
        out.append(f"{i}. **{f.severity.upper()}** `{f.code}`: {f.title}. {f.detail}"
                   + (f" Affected: {_affected(f.layers)}." if f.layers else ""))
    out += not_checked_lines(res)
    if res.ignored:
        out += ["", "### Ignored", "", "Left out of the verdict and the exit code by the check's policy:", ""]
        out += [f"- `{g['code']}` ({g['severity']}): {g['title']} (ignored: {g['reason']})." for g in res.ignored]
    recs = advise(res.findings, res.context)
    out += ["", "### Recommendations", ""]
    if not recs:
        out.append("Nothing could be checked: see above." if not res.steps else "None: keep training.")
    out += [f"{i}. `{code}`: {text}" for i, (code, text, _) in enumerate(recs, 1)]
    code = [f"# {code}\n{snippet}" for code, _, snippet in recs if snippet]
    out += ["", "### Code to Add", ""]
    out += ["```python", "\n\n".join(code), "```"] if code else ["Nothing to add."]
    out += ["", f"Exit code: {res.exit_code}" + ("" if res.fail_on == "critical" else
                                                f" (fails on {res.fail_on} or worse)") + "."]
    return "\n".join(out) + "\n"


def _update_table(updates: list[dict], multi: bool, series: list[str], limit: int = 12) -> list[str]:
    """Per layer, the median update/weight ratio over the measured steps (a learning rate's effect, read
    without a sync while the script ran)."""
    if not updates:
        return []
    per: dict[tuple[int, str], list[float]] = {}
    for u in updates:
        for layer, r in u["layers"].items():
            per.setdefault((u["series"], layer), []).append(r)
    steps = ", ".join(str(u["step"]) for u in updates[:10]) + (", ..." if len(updates) > 10 else "")
    out = ["", "### Update Size", "",
           f"The size of each layer's update relative to its weights, ||w_after - w_before|| / ||w_before||, "
           f"measured at steps {steps} (about 1e-3 is typical; far below, the learning rate barely moves the "
           "weights; near or above 1, one step rewrites them).", "",
           "| Layer |" + (" Optimizer |" if multi else "") + " Update/weight (median) | Largest |",
           "|---|" + ("---|" if multi else "") + "---|---|"]
    items = list(per.items())
    for (k, layer), rs in items[:limit]:
        s = sorted(r for r in rs if not math.isnan(r))  # an update of NaN weights has no size
        out.append(f"| {layer} |" + (f" {series[k]} |" if multi and k < len(series) else "")
                   + (f" {fmt(s[len(s) // 2])} | {fmt(s[-1])} |" if s else " - | - |"))
    if len(items) > limit:
        out.append(f"| ... (+{len(items) - limit} layers: report.json) |" + (" |" if multi else "") + " | |")
    return out


def to_dict(res) -> dict:
    return {
        "schema_version": SCHEMA_VERSION, "log": res.source, "not_checked": res.not_checked,
        "ignored": res.ignored, "fail_on": res.fail_on,
        "script": res.script, "args": res.args, "status": res.status, "exit_code": res.exit_code,
        "crashed": res.crashed, "crash": res.crash_text, "stopped_by_steps": res.stopped,
        "trend": res.trend, "updates": res.context.get("updates"), "rank_norms": res.context.get("rank_norms"), "first_nonfinite_output": res.origin, "nan_born": res.born, "red_flags": res.flags,
        "series": res.series, "key_steps": res.key_steps,
        "summary": [{"metric": m, "value": v, "status": s} for m, v, s in res.summary],
        "findings": [asdict(f) for f in res.findings],
        "recommendations": [{"code": c, "text": t, "code_to_add": s} for c, t, s in advise(res.findings, res.context)],
        "steps": [asdict(r) | {"grad_norm": r.grad_norm, "overflow": r.overflow} for r in res.steps],
        "last_step_report": None if res.last is None else res.last.to_dict(),
    }
