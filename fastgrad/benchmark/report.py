"""Writes a benchmark result: a console table with a legend, ``results.csv`` (one row per implementation,
header first), ``results.md``, ``meta.json`` (the run's metadata) and two plots: fastgrad's speedup over
torch eager with its interval, and each implementation's share of its op's memory floor.

The plots use one visual cue per meaning: a bar's colour is its implementation (the same colours in both
plots, named in the legend with its role), hatching means only "the floor pass ran from the cache" (the
floor plot), whiskers are confidence intervals, and the dashed line is the reference (1x, or 100%)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from . import ops as benchmark_ops
from .runner import (ALTERNATIVE, AUTO, AUTOMATIC, BASELINE, CACHE_FLOOR, COMPILE, COMPILED, EAGER,
                     MIN_FLOOR_BYTES, OVER_FLOOR_PCT, REFERENCE, Result)
from .timing import FASTER, NO_INTERVAL, NOISE, NOT_MEASURED, PROBLEM, SLOWER

COLUMNS = ["workload", "op", "impl", "role", "backend", "baseline", "tensors", "grad_mb", "median_ms", "min_ms",
           "host_ms", "rounds", "inner", "spread_pct", "speedup", "speedup_lo", "speedup_hi", "verdict",
           "verdict_why", "vs_compile", "vs_compile_lo", "vs_compile_hi", "compile_verdict", "compile_verdict_why",
           "vs_other", "vs_other_lo", "vs_other_hi", "other_impl", "read_mb", "written_mb", "gbps", "floor_ms",
           "pct_floor", "floor_kind", "floor_problem", "median_ratio", "ops_per_call", "kernels_per_call",
           "syncs_per_call", "note"]

META_KEYS = ["device", "date", "command", "git_commit", "fastgrad", "torch", "cuda", "triton", "python", "quick",
             "cpu_threads", "cores", "load_average", "load_average_after"]

#: Mark of a % of floor figure whose floor pass ran from the CPU cache (the working set fits there).
CACHE_MARK = "c"
#: What the % floor column shows for a row over its floor (runner.OVER_FLOOR_PCT): faster than the op's own
#: floor pass, so the floor model or the timing is wrong for that case; a measurement problem, not a figure.
OVER_MARK = "!"
OVER_CELL = "n/a" + OVER_MARK


def _num(x, fmt: str) -> str:
    if isinstance(x, float) and math.isnan(x):
        width = fmt.split(".")[0]
        return format("-", ">" + width) if width else "-"
    return format(x, fmt)


def _host_workloads(res: Result) -> set[str]:
    return {name for name, w in res.meta.get("workloads", {}).items() if w.get("host")}


def _ratio(r: dict, key: str = "speedup") -> str:
    """``1.40x [1.31-1.52]``; without an interval ``1.40x [no interval]``."""
    med, lo, hi = r[key], r[key + "_lo"], r[key + "_hi"]
    if math.isnan(med):
        return "-"
    if math.isnan(lo):
        return f"{med:.2f}x [no interval]"
    return f"{med:.2f}x [{lo:.2f}-{hi:.2f}]"


def _verdict(r: dict, key: str = "verdict") -> str:
    v, why = r[key], r[key + "_why"]
    if v == NO_INTERVAL:  # "3 rounds: no interval": no verdict either way, whatever the ratio
        return f"{why}: {v}" if why else v
    return f"{v} ({why})" if why and v in (NOISE, PROBLEM) else v or "-"


def _pct(r: dict) -> str:
    if r.get("floor_problem"):
        return OVER_CELL
    p = r["pct_floor"]
    if math.isnan(p):
        return "-"
    return f"{p:.0f}%{CACHE_MARK if r.get('floor_kind') == CACHE_FLOOR else ''}"


def _floor_value(r: dict) -> float:
    """The % of the floor as a figure to plot or hold to a goal: none for a row over its floor."""
    return float("nan") if r.get("floor_problem") else r["pct_floor"]


def _count(x) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else f"{int(x)}"


def _per_call_pair(base: dict | None, cand: dict) -> str:
    """Counts of torch eager -> fastgrad, e.g. ``kernels 23 -> 3, syncs 0 -> 0, ops 8 -> 1``."""
    parts = []
    for name, key in (("kernels", "kernels_per_call"), ("syncs", "syncs_per_call"), ("ops", "ops_per_call")):
        a = base.get(key, float("nan")) if base else float("nan")
        b = cand.get(key, float("nan"))
        if isinstance(b, float) and math.isnan(b) and isinstance(a, float) and math.isnan(a):
            continue
        parts.append(f"{name} {_count(a)} -> {_count(b)}")
    return ", ".join(parts) or "-"


def meta_lines(res: Result) -> list[str]:
    m = res.meta
    lines = [f"{k}: {m[k]}" for k in META_KEYS if k in m]  # (the load after the run: only once it ended)
    if "read_gbps" in m:
        lines.append(f"memory rates (for reference; each % of floor comes from the case's own floor pass): "
                     f"read-only stream {m['read_gbps']:.1f} GB/s; read+write {m['rw_gbps']:.1f} GB/s "
                     f"(read + write counted; copy {m['copy_gbps']:.1f}, in place {m['inplace_gbps']:.1f}); "
                     f"{m['stream_bytes'] / 2**20:.0f} MiB buffers"
                     + (f"; last-level cache {m['cache_bytes'] / 2**20:.0f} MiB" if m.get("cache_bytes") else ""))
    lines.append(f"fastgrad backends benchmarked: {', '.join(m['backends']) or 'the automatic choice only'}")
    for b, why in m["backends_not_benchmarked"].items():
        lines.append(f"not benchmarked: {b} ({why})")
    lines += [f"note: {n}" for n in res.notes]
    return lines


def legend_lines(res: Result) -> list[str]:
    """What the tables' columns and marks mean (printed under the terminal tables, and in results.md)."""
    m = res.meta
    conf = 100 * m.get("confidence", 0.95)
    band = 100 * m.get("noise_band", 0.05)
    return [
        "fastgrad auto: the call with backend=None, i.e. the backend fastgrad picks on its own (named in the",
        "  backend column); what you get without configuring anything.",
        "speedup: torch's time over fastgrad's, > 1 = fastgrad is faster. The implementations are timed in",
        "  interleaved rounds, a few ms apart, so both sides of a ratio see the same machine; in a round, an",
        "  implementation whose calls are short (< 25 ms) is called 3 times back to back and its fastest call",
        "  kept (one the rest of a busy machine did not interrupt). The speedup is the median of the",
        f"  per-round ratios and [lo-hi] its {conf:.0f}% confidence interval (order statistics of the ratios,",
        "  no distribution assumed). Rounds go on until the interval is clear of the thresholds below or",
        "  tight, or the case's time budget is spent.",
        f"verdict: 'faster' = the whole interval above 1 and the median at least {band:.0f}% faster; 'slower' =",
        f"  the mirror image; 'within noise' otherwise, saying why: the interval straddles 1, or the median is",
        f"  within +-{band:.0f}% of 1 (a difference a shared machine does not reliably repeat).",
        f"  'N rounds: {NO_INTERVAL}': too few rounds for a {conf:.0f}% interval (the rows beside the headline run",
        "  in the first rounds only): no verdict either way, however far the ratio is from 1.",
        f"  '{PROBLEM}': the row's figures disagree, so it is no result either way: the ratio of its two ms",
        f"  columns lies outside the speedup's interval widened by {band:.0f}% (the times jumped between levels",
        f"  during the case), or the op ran faster than its own floor pass (% floor '{OVER_CELL}').",
        "ms: median over the rounds of each round's time (CUDA events on a GPU, wall time on the CPU); the",
        "  speedup is the median of the per-round ratios, which the two medians agree with unless the row",
        f"  says '{PROBLEM}'.",
        "  host-* workloads: clip_grad_norm_ over thousands of tiny tensors, where only the host time per call",
        "  counts; their times are host times.",
        "baselines: 'torch eager' is the code a user reaches for (see the ops table: torch's own function; timm's",
        "  adaptive_clip_grad for AGC, transcribed as shipped; the GC authors' formula; torch._foreach_norm for",
        "  per-tensor statistics, which does less than grad_stats: no NaN/Inf/zero counts). 'torch: own loop' rows",
        "  are this benchmark's own loops, kept beside it; 'vs own loop' is fastgrad auto's speedup over them.",
        "% floor: the op's floor pass time over the op's time, round by round (the median of the per-round",
        "  ratios, as for the speedup), 100% = as fast as the memory allows. The floor model counts the",
        "  op's bytes in passes over N (gradient bytes) and P",
        "  (parameter bytes), see the ops table; the floor pass does exactly those passes as contiguous streams",
        "  (a float32 sum per read pass, an in-place int32 OR with 0 per read+write pass) over buffers of the",
        "  op's working-set size, timed in every round beside the op, so each pair runs under the same load and",
        f"  from the same level of the memory hierarchy. '-': no floor, for working sets under "
        f"{MIN_FLOOR_BYTES / 2**20:g} MiB (there a call's",
        "  fixed cost, not its bytes, sets its time) and the host-* workloads.",
        f"  '{CACHE_MARK}': the working set fits in the CPU's last-level cache, so the floor is the cache's, not",
        "  memory's (rows without the mark: a memory floor; on a GPU the L2 is flushed before every call).",
        f"  '{OVER_CELL}': over {OVER_FLOOR_PCT:.0f}%, i.e. faster than the op's own floor pass: the floor model or",
        f"  the timing does not fit that case; the row is a '{PROBLEM}' (the figure is in its note).",
        "GB/s: the floor model's bytes (read + written) over the median time.",
        "per call (the counts, one call per implementation after its timed rounds): ops = torch operators",
        "  dispatched (TorchDispatchMode; a Triton kernel launched from Python is no operator, see kernels);",
        "  on a GPU also kernels = CUDA kernels, copies and memsets launched",
        "  (torch.profiler) and syncs = host syncs (torch.cuda.set_sync_debug_mode('warn')); '-': not counted",
        "  (kernels and syncs on the CPU, operators of a torch.compile function).",
        "Rows beside the headline: torch.compile and the other torch baselines (each against torch eager), and",
        "  the other fastgrad backends, run only when asked for by name (backend=...). The other baselines and",
        "  backends are timed in the first rounds only: they are not the answer to 'is fastgrad faster here'.",
    ]


def _main_rows(res: Result) -> list[dict]:
    return [r for r in res.rows if r["role"] == AUTOMATIC]


def _eager(res: Result, r: dict) -> dict | None:
    return next((x for x in res.rows if x["workload"] == r["workload"] and x["op"] == r["op"]
                 and x["role"] == BASELINE), None)


def _has_compile(res: Result) -> bool:
    return any(r["role"] == COMPILED for r in res.rows)


def _ms(r: dict | None, host: bool) -> float:
    if r is None:
        return float("nan")
    return r["host_ms"] if host else r["median_ms"]


def _has_other(res: Result) -> bool:
    return any(r["role"] == ALTERNATIVE for r in res.rows)


def main_table(res: Result) -> list[str]:
    """One line per (workload, op): fastgrad auto against torch eager (and torch.compile when run, and the
    op's other torch baseline where it has one)."""
    hosts = _host_workloads(res)
    comp = _has_compile(res)
    other = _has_other(res)
    head = (f"{'workload':<11} {'op':<10} {'backend':<7} {'eager ms':>9} {'fastgrad ms':>11}  "
            f"{'speedup [CI]':<21} {'verdict':<34} {'% floor':>7}")
    if comp:
        head += f"  {'vs compile [CI]':<21} {'verdict vs compile':<34}"
    if other:
        head += f"  {'vs own loop [CI]':<21}"
    out = [head, "-" * len(head)]
    prev = None
    for r in _main_rows(res):
        if prev is not None and r["workload"] != prev:
            out.append("")
        prev = r["workload"]
        host = r["workload"] in hosts
        line = (f"{r['workload']:<11} {r['op']:<10} {r['backend']:<7} {_num(_ms(_eager(res, r), host), '9.3f')} "
                f"{_num(_ms(r, host), '11.3f')}  {_ratio(r):<21} {_verdict(r):<34} {_pct(r):>7}")
        if comp:
            line += f"  {_ratio(r, 'vs_compile'):<21} {_verdict(r, 'compile_verdict'):<34}"
        if other:
            line += f"  {_ratio(r, 'vs_other'):<21}"
        if r["note"]:
            line += f"  {r['note']}"
        out.append(line.rstrip())
    return out


def verdict_counts(res: Result) -> dict[str, int]:
    counts = {FASTER: 0, SLOWER: 0, NOISE: 0, NO_INTERVAL: 0, NOT_MEASURED: 0, PROBLEM: 0}
    for r in _main_rows(res):
        if r["verdict"] in counts:
            counts[r["verdict"]] += 1
    return counts


def _side_rows(res: Result) -> list[dict]:
    """Rows beside the headline: other torch baselines, torch.compile, the other fastgrad backends."""
    return [r for r in res.rows if r["role"] in (ALTERNATIVE, COMPILED, REFERENCE)]


#: What the table beside the headline holds, per role, in the order named in its heading.
SIDE_KINDS = {REFERENCE: "other fastgrad backends, by name", COMPILED: "torch.compile against torch eager",
              ALTERNATIVE: "the other torch baselines against torch eager"}


def side_kinds(res: Result) -> list[str]:
    """What the rows beside the headline are, only the kinds present (so no heading names an absent kind)."""
    roles = {r["role"] for r in _side_rows(res)}
    return [what for role, what in SIDE_KINDS.items() if role in roles]


def reference_heading(res: Result) -> str:
    """The heading of the table beside the headline ('' when it has no rows)."""
    kinds = side_kinds(res)
    return f"For reference only (not fastgrad's automatic choice: {'; '.join(kinds)}):" if kinds else ""


def reference_table(res: Result) -> list[str]:
    hosts = _host_workloads(res)
    refs = _side_rows(res)
    if not refs:
        return []
    head = (f"{'workload':<11} {'op':<10} {'impl':<16} {'ms':>9}  {'vs eager [CI]':<21} {'verdict':<34} "
            f"{'% floor':>7}")
    out = [head, "-" * len(head)]
    for r in refs:
        line = (f"{r['workload']:<11} {r['op']:<10} {r['impl']:<16} {_num(_ms(r, r['workload'] in hosts), '9.3f')}  "
                f"{_ratio(r):<21} {_verdict(r):<34} {_pct(r):>7}")
        if r["note"]:
            line += f"  {r['note']}"
        out.append(line)
    return out


def _summary(res: Result) -> str:
    c = verdict_counts(res)
    extra = "".join(f", {c[k]} {what}" for k, what in (
        (NO_INTERVAL, f"with {NO_INTERVAL} (too few rounds)"), (NOT_MEASURED, NOT_MEASURED),
        (PROBLEM, f"{PROBLEM}{'s' if c[PROBLEM] != 1 else ''} (no result)")) if c[k])
    return (f"fastgrad auto vs torch eager: {c[FASTER]} faster, {c[SLOWER]} slower, {c[NOISE]} within noise"
            f"{extra} (of {sum(c.values())} cases)")


def console_table(res: Result) -> str:
    out = ["Is fastgrad faster than torch here? fastgrad's automatic choice vs torch eager"
           + (" and torch.compile" if _has_compile(res) else "") + ", per workload and op:", ""]
    out += main_table(res)
    out += ["", _summary(res)]
    ref = reference_table(res)
    if ref:
        out += ["", reference_heading(res), ""] + ref
    out += ["", "Legend:"] + ["  " + line for line in legend_lines(res)]
    return "\n".join(out)


def _cell(v):
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return v


def write_csv(res: Result, path: Path) -> None:
    """Plain CSV, the header on the first line (metadata in meta.json); missing figures are empty cells."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in res.rows:
            w.writerow({k: _cell(r[k]) for k in COLUMNS})


#: The % of its floor fastgrad's automatic choice should reach on a GPU, every op of the workload (the
#: project's goals; host-* have no floor, tiny is a smoke test).
GPU_FLOOR_GOALS = {"llama-7b": 85, "llama-1b": 85, "gpt2-124m": 60, "vit-b16": 60, "mixed": 60, "resnet50": 40,
                   "small-4000": 15}
#: Host time per call over device time at or above which a GPU row is host-bound: the device runs the call's
#: kernels about as fast as the host issues them, so launches and Python work, not bytes, set its time.
HOST_BOUND = 0.8


def goals_table(res: Result) -> list[str]:
    """On a GPU: fastgrad auto's % of the floor per (workload, op) against the goal for its workload, with what
    bounds it (host time over device time, kernels per call). Empty on the CPU, where the goals do not apply."""
    if res.meta.get("device_type") != "cuda":
        return []
    rows = [r for r in _main_rows(res) if r["workload"] in GPU_FLOOR_GOALS]
    if not rows:
        return []
    wmeta = res.meta.get("workloads", {})
    out = ["| workload | op | goal | % floor | goal met | device ms | host ms | host / device | kernels | note |",
           "|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        goal = GPU_FLOOR_GOALS[r["workload"]]
        pct = _floor_value(r)
        met = "-" if math.isnan(pct) else ("yes" if pct >= goal else "no")
        ratio = r["host_ms"] / r["median_ms"] if r["median_ms"] > 0 else float("nan")
        bound = " host-bound" if not math.isnan(ratio) and ratio >= HOST_BOUND else ""
        note = "scaled workload: the goal is for full size" if wmeta.get(r["workload"], {}).get("scale", 1.0) < 1 \
            else ""
        out.append(f"| {r['workload']} | {r['op']} | {goal}% | {_pct(r)} | {met} | {_num(r['median_ms'], '.3f')} | "
                   f"{_num(r['host_ms'], '.3f')} | {_num(ratio, '.2f')}{bound} | {_count(r['kernels_per_call'])} | "
                   f"{note} |")
    return out


def ops_table(ops: list[str]) -> list[str]:
    """The floor model and the baselines of ``ops``, as markdown."""
    out = ["| op | what | bytes read | bytes written | floor passes | torch eager (headline baseline) | "
           "other torch baselines |", "|---|---|---|---|---|---|---|"]
    for op in ops:
        s = benchmark_ops.OPS[op]
        f = s.floor
        read = f.text().split(",")[0].removeprefix("read ")
        written = f.text().split(",")[1].strip().removeprefix("write ")
        others = "; ".join(f"{b.impl}: {b.what}" for b in s.baselines[1:]) or "-"
        out.append(f"| {op} | {s.title} | {read} | {written} | {f.passes_text()} | {s.baseline} | {others} |")
    return out


def markdown(res: Result) -> str:
    m = res.meta
    workloads = list(dict.fromkeys(r["workload"] for r in res.rows))
    ops = list(dict.fromkeys(r["op"] for r in res.rows))
    out = [f"# fastgrad benchmark: {m['device']}", ""]
    out += [f"- {line}" for line in meta_lines(res)]
    comp = _has_compile(res)
    other = _has_other(res)
    hosts = _host_workloads(res)
    out += ["", "## Is fastgrad faster here?", "",
            "fastgrad's automatic choice (`backend=None`) against torch eager (the code a user reaches for; "
            "which code, per op: the ops table below)" + (" and torch.compile" if comp else "")
            + ". " + _summary(res) + ".", ""]
    head = "| workload | op | backend | eager ms | fastgrad ms | speedup [CI] | verdict | % floor |"
    sep = "|---|---|---|---:|---:|---|---|---:|"
    if comp:
        head += " vs compile [CI] | verdict vs compile |"
        sep += "---|---|"
    if other:
        head += " vs own loop [CI] |"
        sep += "---|"
    out += [head + " per call, torch eager -> fastgrad | note |", sep + "---|---|"]
    for r in _main_rows(res):
        host = r["workload"] in hosts
        eager = _eager(res, r)
        line = (f"| {r['workload']} | {r['op']} | {r['backend']} | {_num(_ms(eager, host), '.3f')} | "
                f"{_num(_ms(r, host), '.3f')} | {_ratio(r)} | {_verdict(r)} | {_pct(r)} |")
        if comp:
            line += f" {_ratio(r, 'vs_compile')} | {_verdict(r, 'compile_verdict')} |"
        if other:
            line += f" {_ratio(r, 'vs_other')} |"
        out.append(line + f" {_per_call_pair(eager, r)} | {r['note']} |")
    ref = _side_rows(res)
    if ref:
        named = any(r["role"] == REFERENCE for r in ref)
        out += ["", "## Beside the headline: " + "; ".join(side_kinds(res)), "",
                "Each compared with torch eager." + (" The other fastgrad backends are what a user gets only by "
                                                     "naming them (`backend=...`)." if named else ""),
                "", "| workload | op | impl | ms | vs eager [CI] | verdict | % floor | note |",
                "|---|---|---|---:|---|---|---:|---|"]
        for r in ref:
            out.append(f"| {r['workload']} | {r['op']} | {r['impl']} | "
                       f"{_num(_ms(r, r['workload'] in hosts), '.3f')} | {_ratio(r)} | {_verdict(r)} | {_pct(r)} | "
                       f"{r['note']} |")
    goals = goals_table(res)
    if goals:
        out += ["", "## % of the floor against the GPU goals", "",
                f"fastgrad auto per (workload, op). 'host-bound': host time per call at least {HOST_BOUND:.0%} of "
                "the device time, so the host's launches and Python work, not the bytes, set the call's time.",
                ""] + goals
    out += ["", "## How to read the tables", ""] + [("- " if not line.startswith("  ") else "  ") + line.strip()
                                                    for line in legend_lines(res)]
    out += ["", "## Workloads", "", "| workload | description | tensors | grad MiB | full-size MiB | note |",
            "|---|---|---:|---:|---:|---|"]
    for name in workloads:
        w = m["workloads"][name]
        out.append(f"| {name} | {w['title']} | {w['tensors']} | {w['grad_bytes'] / 2**20:.1f} | "
                   f"{w['full_grad_bytes'] / 2**20:.1f} | {w['note'] or 'full size'} |")
    out += ["", "## Ops: floor model and baselines", "",
            "N = gradient bytes, P = parameter bytes. A read pass reads its bytes once; a read+write pass reads "
            "and writes them once.", ""] + ops_table(ops)
    out += ["", "## All rows", "",
            "| workload | op | impl | role | ms | host ms | rounds | spread % | GB/s | floor ms | % floor | "
            "ops/call | kernels/call | syncs/call |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res.rows:
        out.append(f"| {r['workload']} | {r['op']} | {r['impl']} | {r['role']} | {_num(r['median_ms'], '.3f')} | "
                   f"{_num(r['host_ms'], '.3f')} | {r['rounds']} | {_num(r['spread_pct'], '.1f')} | "
                   f"{_num(r['gbps'], '.1f')} | {_num(r['floor_ms'], '.3f')} | {_pct(r)} | "
                   f"{_count(r['ops_per_call'])} | {_count(r['kernels_per_call'])} | {_count(r['syncs_per_call'])} |")
    return "\n".join(out) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    return plt, matplotlib.ticker


#: Role of each kind of row, in the plots' legends.
ROLE_LABEL = {BASELINE: "headline torch baseline", ALTERNATIVE: "other torch baseline",
              COMPILED: "torch.compile baseline", AUTOMATIC: "fastgrad's automatic choice",
              REFERENCE: "other fastgrad backend, by name only"}
#: Legend text of the one hatching cue (the floor plot only).
CACHE_HATCH_LABEL = "hatched: floor pass from the CPU cache (working set fits in the last-level cache)"


def impl_colors(res: Result) -> dict[str, str]:
    """One colour per implementation, the same in every plot of a run: greys for torch, colours for fastgrad."""
    colors = {EAGER: "#4d4d4d", COMPILE: "#b3b3b3"}
    greys = ["#8c8c8c", "#6f6f6f", "#a6a6a6"]
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    others = list(dict.fromkeys(r["impl"] for r in res.rows if r["role"] == ALTERNATIVE and r["impl"] not in colors))
    for k, impl in enumerate(others):
        colors[impl] = greys[k % len(greys)]
    fast = [AUTO] + [i for i in dict.fromkeys(r["impl"] for r in res.rows if r["role"] == REFERENCE)]
    for k, impl in enumerate(fast):
        colors.setdefault(impl, palette[k % len(palette)])
    return colors


def _role_of(res: Result, impl: str) -> str:
    return next((r["role"] for r in res.rows if r["impl"] == impl), "")


def _panels(res: Result, path: Path, impls: list[str], value, *, ylabel: str, log: bool, ref: float,
            ref_label: str, title: str, tick_fmt, hatch_of=None, hatch_label: str = "", interval=None,
            ref_tag: str = "") -> None:
    """One panel per op, one group of bars per workload, one bar per implementation in ``impls``;
    ``value(row)`` gives the bar (NaN: none), ``interval(row)`` its (lo, hi) whisker, ``hatch_of(row)``
    whether it is hatched (one meaning per plot, named by ``hatch_label``)."""
    plt, ticker = _pyplot()
    import matplotlib.lines as mlines
    import matplotlib.patches as mpatches

    rows = {(r["workload"], r["op"], r["impl"]): r for r in res.rows}
    ops = [op for op in dict.fromkeys(r["op"] for r in res.rows)
           if any(r["op"] == op and r["impl"] in impls and not math.isnan(value(r)) for r in res.rows)]
    ncols = min(4, len(ops))
    nrows = math.ceil(len(ops) / ncols)
    width_in, height_in = 4.4 * ncols + 1.4, 3.6 * nrows + 2.6
    fig, axes = plt.subplots(nrows, ncols, figsize=(width_in, height_in), squeeze=False)
    width = 0.8 / len(impls)
    colors = impl_colors(res)
    hatched = False
    for k, op in enumerate(ops):
        ax = axes[k // ncols][k % ncols]
        wls = [w for w in dict.fromkeys(r["workload"] for r in res.rows)
               if any((w, op, i) in rows and not math.isnan(value(rows[(w, op, i)])) for i in impls)]
        for j, impl in enumerate(impls):
            xs, ys, hs, errs = [], [], [], [[], []]
            for x, w in enumerate(wls):
                r = rows.get((w, op, impl))
                if r is None or math.isnan(value(r)):
                    continue
                xs.append(x + (j - (len(impls) - 1) / 2) * width)
                y = value(r)
                ys.append(y)
                hs.append(bool(hatch_of(r)) if hatch_of else False)
                lo, hi = interval(r) if interval else (float("nan"), float("nan"))
                errs[0].append(0.0 if math.isnan(lo) else max(y - lo, 0.0))
                errs[1].append(0.0 if math.isnan(hi) else max(hi - y, 0.0))
            bars = ax.bar(xs, ys, width, color=colors.get(impl, "#999999"), edgecolor="white", linewidth=0.3,
                          yerr=errs if interval else None, error_kw={"elinewidth": 0.7, "capsize": 1.5})
            for b, h in zip(bars, hs):
                if h:
                    hatched = True
                    b.set_hatch("////")
                    b.set_edgecolor("black")
        ax.axhline(ref, color="black", linewidth=0.8, linestyle="--")
        if ref_tag:
            ax.text(1.0, ref, f" {ref_tag}", transform=ax.get_yaxis_transform(), fontsize=7, va="center")
        if log:
            ax.set_yscale("log")
            # Minor labels at 2 and 5 times a power of ten only: all eight crowd into each other.
            ax.yaxis.set_minor_formatter(ticker.FuncFormatter(
                lambda y, pos: tick_fmt(y, pos) if y > 0 and f"{y:.0e}"[0] in "25" else ""))
            ax.tick_params(axis="y", which="minor", labelsize=6)
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(tick_fmt))
        ax.set_title(f"{op}: {benchmark_ops.OPS[op].title}", fontsize=9)
        ax.set_xticks(range(len(wls)))
        ax.set_xticklabels(wls, rotation=40, ha="right", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="y", linewidth=0.3, alpha=0.5)
    for k in range(len(ops), nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    # The legend names every cue: colour = implementation (with its role), the dashed line, the whiskers,
    # and the hatching where this plot uses it.
    handles = [mpatches.Patch(facecolor=colors.get(i, "#999999"), edgecolor="white") for i in impls]
    labels = [f"{i} ({ROLE_LABEL.get(_role_of(res, i), '')})" for i in impls]
    handles.append(mlines.Line2D([], [], color="black", linewidth=0.8, linestyle="--"))
    labels.append(f"dashed line: {ref_label}")
    if interval:
        handles.append(mlines.Line2D([], [], color="black", linewidth=0.7, marker="_", markersize=6))
        labels.append(f"whiskers: {100 * res.meta.get('confidence', 0.95):.0f}% confidence interval")
    if hatched:
        handles.append(mpatches.Patch(facecolor="white", edgecolor="black", hatch="////"))
        labels.append(hatch_label)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
    m = res.meta
    fig.suptitle(f"{title}\n{m['device']} | {m['date']} | load {m.get('load_average', '?')} | torch {m['torch']}",
                 fontsize=9)
    # Fixed margins in inches instead of tight_layout, which costs seconds of text measuring.
    legend_rows = math.ceil(len(labels) / 3)
    fig.subplots_adjust(left=0.8 / width_in, right=1 - 0.75 / width_in, bottom=(1.3 + 0.2 * legend_rows) / height_in,
                        top=1 - (0.45 + 0.17 * (title.count("\n") + 2)) / height_in, wspace=0.45, hspace=0.9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(res: Result, path: Path) -> str | None:
    """fastgrad auto's speedup over torch eager with its interval, per workload (x) and op (panel); the
    other torch baselines, torch.compile and the reference backends beside it. Returns None, or why no plot
    was written."""
    try:
        _pyplot()
    except Exception as exc:  # noqa: BLE001 - plotting is optional
        return f"matplotlib unavailable ({type(exc).__name__}: {exc})"
    if not any(not math.isnan(r["speedup"]) for r in res.rows):
        return "no implementation besides torch eager was measured"
    impls = [AUTO] + [i for i in dict.fromkeys(r["impl"] for r in _side_rows(res))]
    _panels(res, path, impls, lambda r: r["speedup"], ylabel="speedup vs torch eager", log=True, ref=1.0,
            ref_label="1x = torch eager", ref_tag="eager", title="Speedup over torch eager (log scale; > 1 = faster than torch "
            "eager, the headline torch baseline of each op)",
            tick_fmt=lambda y, _: f"{y:g}x", interval=lambda r: (r["speedup_lo"], r["speedup_hi"]))
    return None


def plot_floor(res: Result, path: Path) -> str | None:
    """Each implementation's % of its op's floor (its floor pass, timed in the same rounds), per workload (x)
    and op (panel); bars whose floor pass ran from the CPU cache hatched."""
    try:
        _pyplot()
    except Exception as exc:  # noqa: BLE001
        return f"matplotlib unavailable ({type(exc).__name__}: {exc})"
    if not any(not math.isnan(_floor_value(r)) for r in res.rows):
        return "no floor figure was measured"
    impls = list(dict.fromkeys(r["impl"] for r in res.rows))
    _panels(res, path, impls, _floor_value, ylabel="% of the op's floor", log=False,
            ref=100.0, ref_label="100% = the op's floor", ref_tag="floor", title=(
                "Share of each op's floor: its floor pass (the op's bytes as contiguous streams over buffers of "
                "its working set's size,\ntimed in the same rounds) over its time"),
            tick_fmt=lambda y, _: f"{y:g}%", hatch_of=lambda r: r["floor_kind"] == CACHE_FLOOR,
            hatch_label=CACHE_HATCH_LABEL)
    return None


def write_all(res: Result, out_dir: Path, png: bool = True) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "results.csv", "md": out_dir / "results.md", "json": out_dir / "meta.json"}
    write_csv(res, paths["csv"])
    paths["md"].write_text(markdown(res))
    paths["json"].write_text(json.dumps(res.meta | {"notes": res.notes, "csv_columns": COLUMNS}, indent=2,
                                        default=str) + "\n")
    if png:
        for name, fn, fname in (("png", plot, "speedup.png"), ("png_floor", plot_floor, "pct_floor.png")):
            target = out_dir / fname
            why = fn(res, target)
            if why is None:
                paths[name] = target
            else:
                res.notes.append(f"no plot {target.name}: {why}")
    return paths
