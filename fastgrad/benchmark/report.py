"""Writes a benchmark result: a console table with a legend, ``results.csv`` (one row per implementation,
header first), ``results.md``, ``meta.json`` (the run's metadata) and two plots: fastgrad's speedup over
torch eager with its interval, and each implementation's share of its op's memory floor."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from . import ops as O
from .runner import AUTO, AUTOMATIC, BASELINE, COMPILE, COMPILED, EAGER, REFERENCE, Result
from .timing import FASTER, NOISE, SLOWER

COLUMNS = ["workload", "op", "impl", "role", "backend", "tensors", "grad_mb", "median_ms", "min_ms", "host_ms",
           "rounds", "inner", "spread_pct", "speedup", "speedup_lo", "speedup_hi", "verdict", "verdict_why",
           "vs_compile", "vs_compile_lo", "vs_compile_hi", "compile_verdict", "compile_verdict_why",
           "floor_read_mb", "floor_rw_mb", "floor_ms", "pct_floor", "in_cache", "note"]

META_KEYS = ["device", "date", "command", "git_commit", "fastgrad", "torch", "cuda", "triton", "python", "quick",
             "cpu_threads", "cores", "load_average", "load_average_after"]

#: Mark of a % of floor figure from a workload small enough to stay in the CPU cache between repetitions.
CACHE_MARK = "c"
#: Mark of a % of floor figure over 100% from a workload that does not fit in the cache.
OVER_MARK = "!"


def _num(x, fmt: str) -> str:
    if isinstance(x, float) and math.isnan(x):
        width = fmt.split(".")[0]
        return format("-", ">" + width) if width else "-"
    return format(x, fmt)


def _host_workloads(res: Result) -> set[str]:
    return {name for name, w in res.meta.get("workloads", {}).items() if w.get("host")}


def _ratio(r: dict, key: str = "speedup") -> str:
    """``1.40x [1.31-1.52]``; without an interval ``1.40x [too few rounds]``."""
    med, lo, hi = r[key], r[key + "_lo"], r[key + "_hi"]
    if math.isnan(med):
        return "-"
    if math.isnan(lo):
        return f"{med:.2f}x [no interval]"
    return f"{med:.2f}x [{lo:.2f}-{hi:.2f}]"


def _verdict(r: dict, key: str = "verdict") -> str:
    v, why = r[key], r[key + "_why"]
    return f"{v} ({why})" if why and v == NOISE else v or "-"


def _pct(r: dict) -> str:
    p = r["pct_floor"]
    if math.isnan(p):
        return "-"
    mark = CACHE_MARK if r["in_cache"] else OVER_MARK if p > 100 else ""
    return f"{p:.0f}%{mark}"


def meta_lines(res: Result) -> list[str]:
    m = res.meta
    lines = [f"{k}: {m[k]}" for k in META_KEYS if k in m]  # (the load after the run: only once it ended)
    if "read_gbps" in m:
        lines.append(f"memory floors: read-only stream {m['read_gbps']:.1f} GB/s; read+write {m['rw_gbps']:.1f} GB/s "
                     f"(read + write counted; copy {m['copy_gbps']:.1f}, in place {m['inplace_gbps']:.1f}); "
                     f"{m['stream_bytes'] / 2**20:.0f} MiB buffers"
                     + (f"; last-level cache {m['cache_bytes'] / 2**20:.0f} MiB" if m.get("cache_bytes") else ""))
    lines.append(f"fastgrad backends benchmarked: {', '.join(m['backends']) or 'none'}")
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
        "ms: median over the rounds of each round's time (CUDA events on a GPU, wall time on the CPU).",
        "  host-* workloads: clip_grad_norm_ over thousands of tiny tensors, where only the host time per call",
        "  counts; their times are host times.",
        "% floor: the op's memory floor over its median time, 100% = as fast as the memory allows. The floor",
        "  prices the bytes the op must move (see the ops table: N = gradient bytes, P = parameter bytes) at",
        "  rates measured in this run: read-only passes at a read-only stream's rate (an fp32 sum), passes that",
        "  read and write at a read+write pass's rate (the faster of a copy and an in-place multiply by one,",
        "  read + write counted).",
        f"  '{CACHE_MARK}': the bytes the op touches are under twice the CPU's last-level cache, so part of them",
        "  can stay in the cache between repetitions, faster than memory: such figures can pass 100%.",
        f"  '{OVER_MARK}': over 100% although the workload does not fit in the cache: the floor's streams and the",
        "  op were timed at different moments of a busy machine; read it as 'at the floor'.",
        "Reference rows: the other fastgrad backends, run only when asked for by name (backend=...); they are",
        "  timed in the first rounds only, and are not the answer to 'is fastgrad faster here'.",
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


def main_table(res: Result) -> list[str]:
    """One line per (workload, op): fastgrad auto against torch eager (and torch.compile when run)."""
    hosts = _host_workloads(res)
    comp = _has_compile(res)
    head = (f"{'workload':<11} {'op':<10} {'backend':<7} {'eager ms':>9} {'fastgrad ms':>11}  "
            f"{'speedup [CI]':<21} {'verdict':<34} {'% floor':>7}")
    if comp:
        head += f"  {'vs compile [CI]':<21} {'verdict vs compile'}"
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
            line += f"  {_ratio(r, 'vs_compile'):<21} {_verdict(r, 'compile_verdict')}"
        if r["note"]:
            line += f"  {r['note']}"
        out.append(line)
    return out


def verdict_counts(res: Result) -> dict[str, int]:
    counts = {FASTER: 0, SLOWER: 0, NOISE: 0}
    for r in _main_rows(res):
        if r["verdict"] in counts:
            counts[r["verdict"]] += 1
    return counts


def reference_table(res: Result) -> list[str]:
    hosts = _host_workloads(res)
    refs = [r for r in res.rows if r["role"] in (REFERENCE, COMPILED)]
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
    return (f"fastgrad auto vs torch eager: {c[FASTER]} faster, {c[SLOWER]} slower, {c[NOISE]} within noise "
            f"(of {sum(c.values())} cases)")


def console_table(res: Result) -> str:
    out = ["Is fastgrad faster than torch here? fastgrad's automatic choice vs torch eager"
           + (" and torch.compile" if _has_compile(res) else "") + ", per workload and op:", ""]
    out += main_table(res)
    out += ["", _summary(res)]
    ref = reference_table(res)
    if ref:
        out += ["", "For reference only (not fastgrad's automatic choice: other backends, by name; and "
                "torch.compile against eager):", ""] + ref
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


def markdown(res: Result) -> str:
    m = res.meta
    workloads = list(dict.fromkeys(r["workload"] for r in res.rows))
    ops = list(dict.fromkeys(r["op"] for r in res.rows))
    out = [f"# fastgrad benchmark: {m['device']}", ""]
    out += [f"- {line}" for line in meta_lines(res)]
    comp = _has_compile(res)
    hosts = _host_workloads(res)
    out += ["", "## Is fastgrad faster here?", "",
            "fastgrad's automatic choice (`backend=None`) against torch eager" + (" and torch.compile" if comp else "")
            + ". " + _summary(res) + ".", ""]
    head = "| workload | op | backend | eager ms | fastgrad ms | speedup [CI] | verdict | % floor |"
    sep = "|---|---|---|---:|---:|---|---|---:|"
    if comp:
        head += " vs compile [CI] | verdict vs compile |"
        sep += "---|---|"
    out += [head + " note |", sep + "---|"]
    for r in _main_rows(res):
        host = r["workload"] in hosts
        line = (f"| {r['workload']} | {r['op']} | {r['backend']} | {_num(_ms(_eager(res, r), host), '.3f')} | "
                f"{_num(_ms(r, host), '.3f')} | {_ratio(r)} | {_verdict(r)} | {_pct(r)} |")
        if comp:
            line += f" {_ratio(r, 'vs_compile')} | {_verdict(r, 'compile_verdict')} |"
        out.append(line + f" {r['note']} |")
    ref = [r for r in res.rows if r["role"] in (REFERENCE, COMPILED)]
    if ref:
        out += ["", "## For reference: other backends (not the automatic choice)", "",
                "A user gets these only by naming them (`backend=...`); torch.compile is compared with eager here.",
                "", "| workload | op | impl | ms | vs eager [CI] | verdict | % floor | note |",
                "|---|---|---|---:|---|---|---:|---|"]
        for r in ref:
            out.append(f"| {r['workload']} | {r['op']} | {r['impl']} | "
                       f"{_num(_ms(r, r['workload'] in hosts), '.3f')} | {_ratio(r)} | {_verdict(r)} | {_pct(r)} | "
                       f"{r['note']} |")
    out += ["", "## How to read the tables", ""] + [("- " if not line.startswith("  ") else "  ") + line.strip()
                                                    for line in legend_lines(res)]
    out += ["", "## Workloads", "", "| workload | description | tensors | grad MiB | full-size MiB | note |",
            "|---|---|---:|---:|---:|---|"]
    for name in workloads:
        w = m["workloads"][name]
        out.append(f"| {name} | {w['title']} | {w['tensors']} | {w['grad_bytes'] / 2**20:.1f} | "
                   f"{w['full_grad_bytes'] / 2**20:.1f} | {w['note'] or 'full size'} |")
    out += ["", "## Ops, floors and baselines", "", "| op | what | memory floor (bytes moved) | baseline |",
            "|---|---|---|---|"]
    for op in ops:
        s = O.OPS[op]
        out.append(f"| {op} | {s.title} | {s.floor_text} | {s.baseline} |")
    out += ["", "## All rows", "",
            "| workload | op | impl | role | ms | host ms | rounds | spread % | floor ms | % floor |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in res.rows:
        out.append(f"| {r['workload']} | {r['op']} | {r['impl']} | {r['role']} | {_num(r['median_ms'], '.3f')} | "
                   f"{_num(r['host_ms'], '.3f')} | {r['rounds']} | {_num(r['spread_pct'], '.1f')} | "
                   f"{_num(r['floor_ms'], '.3f')} | {_pct(r)} |")
    return "\n".join(out) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    return plt, matplotlib.ticker


def _panels(res: Result, path: Path, impls: list[str], value, *, ylabel: str, log: bool, ref: float,
            ref_label: str, title: str, tick_fmt, hatch_of, hatch_label: str, interval=None) -> None:
    """One panel per op, one group of bars per workload, one bar per implementation in ``impls``;
    ``value(row)`` gives the bar (NaN: none), ``interval(row)`` its (lo, hi) whisker, ``hatch_of(row)``
    whether it is hatched."""
    plt, ticker = _pyplot()
    rows = {(r["workload"], r["op"], r["impl"]): r for r in res.rows}
    ops = [op for op in dict.fromkeys(r["op"] for r in res.rows)
           if any(r["op"] == op and r["impl"] in impls and not math.isnan(value(r)) for r in res.rows)]
    ncols = min(4, len(ops))
    nrows = math.ceil(len(ops) / ncols)
    width_in, height_in = 4.4 * ncols + 1.4, 3.6 * nrows + 2.2
    fig, axes = plt.subplots(nrows, ncols, figsize=(width_in, height_in), squeeze=False)
    width = 0.8 / len(impls)
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    colors = {EAGER: "#555555", COMPILE: "#aaaaaa"}
    for i, impl in enumerate(i for i in impls if i not in colors):
        colors[impl] = palette[i % len(palette)]
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
                hs.append(bool(hatch_of(r)))
                lo, hi = interval(r) if interval else (float("nan"), float("nan"))
                errs[0].append(0.0 if math.isnan(lo) else max(y - lo, 0.0))
                errs[1].append(0.0 if math.isnan(hi) else max(hi - y, 0.0))
            bars = ax.bar(xs, ys, width, label=impl, color=colors[impl], edgecolor="white", linewidth=0.3,
                          yerr=errs if interval else None, error_kw={"elinewidth": 0.7, "capsize": 1.5})
            for b, h in zip(bars, hs):
                if h:
                    hatched = True
                    b.set_hatch("////")
                    b.set_edgecolor("black")
        ax.axhline(ref, color="black", linewidth=0.8, linestyle="--")
        ax.text(1.0, ref, f" {ref_label}", transform=ax.get_yaxis_transform(), fontsize=7, va="center")
        if log:
            ax.set_yscale("log")
            # Minor labels at 2 and 5 times a power of ten only: all eight crowd into each other.
            ax.yaxis.set_minor_formatter(ticker.FuncFormatter(
                lambda y, pos: tick_fmt(y, pos) if y > 0 and f"{y:.0e}"[0] in "25" else ""))
            ax.tick_params(axis="y", which="minor", labelsize=6)
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(tick_fmt))
        ax.set_title(f"{op}: {O.OPS[op].title}", fontsize=9)
        ax.set_xticks(range(len(wls)))
        ax.set_xticklabels(wls, rotation=40, ha="right", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="y", linewidth=0.3, alpha=0.5)
    for k in range(len(ops), nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if hatched:
        import matplotlib.patches as mpatches

        handles.append(mpatches.Patch(facecolor="white", edgecolor="black", hatch="////"))
        labels.append(hatch_label)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    m = res.meta
    fig.suptitle(f"{title}\n{m['device']} | {m['date']} | load {m.get('load_average', '?')} | torch {m['torch']}",
                 fontsize=9)
    # Fixed margins in inches instead of tight_layout, which costs seconds of text measuring.
    fig.subplots_adjust(left=0.8 / width_in, right=1 - 0.75 / width_in, bottom=1.5 / height_in,
                        top=1 - (0.45 + 0.17 * (title.count("\n") + 2)) / height_in, wspace=0.45, hspace=0.9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(res: Result, path: Path) -> str | None:
    """fastgrad auto's speedup over torch eager with its interval, per workload (x) and op (panel); the
    reference backends and torch.compile beside it. Returns None, or why no plot was written."""
    try:
        _pyplot()
    except Exception as exc:  # noqa: BLE001 - plotting is optional
        return f"matplotlib unavailable ({type(exc).__name__}: {exc})"
    if not any(not math.isnan(r["speedup"]) for r in res.rows):
        return "no implementation besides torch eager was measured"
    impls = [AUTO] + [i for i in dict.fromkeys(r["impl"] for r in res.rows
                                                     if r["role"] in (REFERENCE, COMPILED))]
    _panels(res, path, impls, lambda r: r["speedup"], ylabel="speedup vs torch eager", log=True, ref=1.0,
            ref_label="eager", title="Speedup over torch eager (log scale; > 1 = faster; whiskers: confidence "
            "interval). Hatched: reference backends, not the automatic choice",
            tick_fmt=lambda y, _: f"{y:g}x", hatch_of=lambda r: r["role"] == REFERENCE,
            hatch_label="reference backend (by name only)", interval=lambda r: (r["speedup_lo"], r["speedup_hi"]))
    return None



def plot_floor(res: Result, path: Path) -> str | None:
    """Each implementation's % of its op's own memory floor (read stream for read passes, copy for
    read+write passes), per workload (x) and op (panel); cache-resident workloads hatched."""
    try:
        _pyplot()
    except Exception as exc:  # noqa: BLE001
        return f"matplotlib unavailable ({type(exc).__name__}: {exc})"
    if not any(not math.isnan(r["pct_floor"]) for r in res.rows):
        return "no floor figure was measured"
    impls = list(dict.fromkeys(r["impl"] for r in res.rows))
    m = res.meta
    _panels(res, path, impls, lambda r: r["pct_floor"], ylabel="% of the op's memory floor", log=False,
            ref=100.0, ref_label="floor", title=(
                f"Share of each op's memory floor (100% = its bytes at the measured rates: read-only stream "
                f"{m['read_gbps']:.1f} GB/s for read passes,\nread+write pass {m['rw_gbps']:.1f} GB/s for "
                "read+write passes)"),
            tick_fmt=lambda y, _: f"{y:g}%", hatch_of=lambda r: r["in_cache"] or r["pct_floor"] > 100,
            hatch_label="fits in the CPU cache (can pass 100%), or over 100% by timing noise")
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
