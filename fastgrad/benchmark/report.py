"""Writes a benchmark result as a console table (with a legend), CSV, Markdown, meta.json and two PNG plots:
the speedup over torch eager, and the share of the measured copy bandwidth reached (the roofline view)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from . import ops as O
from .runner import COMPILE, EAGER, Result
from .timing import UNSTABLE_SPREAD

COLUMNS = ["workload", "op", "impl", "backend", "tensors", "grad_mb", "floor_mb", "median_ms", "min_ms", "host_ms",
           "reps", "spread_pct", "host_spread_pct", "unstable", "gbps", "pct_copy", "x_eager", "x_compile", "note"]

META_KEYS = ["device", "date", "command", "fastgrad", "git_commit", "torch", "cuda", "triton", "python", "quick",
             "cpu_threads", "cores", "load_average", "load_average_after", "copy_gbps"]

UNSTABLE_MARK = "UNSTABLE"


def _num(x, fmt: str) -> str:
    if isinstance(x, float) and math.isnan(x):
        width = fmt.split(".")[0]
        return format("-", ">" + width) if width else "-"
    return format(x, fmt)


def _host_workloads(res: Result) -> set[str]:
    return {name for name, w in res.meta.get("workloads", {}).items() if w.get("host")}


def meta_lines(res: Result) -> list[str]:
    m = res.meta
    lines = []
    for k in META_KEYS:
        if k not in m:
            continue  # e.g. the load after the run, in a table written part-way
        lines.append(f"{k}: {m[k]:.1f} GB/s (copy of {m['copy_bytes'] / 2**20:.0f} MiB)" if k == "copy_gbps"
                     else f"{k}: {m[k]}")
    lines.append(f"fastgrad backends benchmarked: {', '.join(m['backends']) or 'none'}")
    for b, why in m["backends_not_benchmarked"].items():
        lines.append(f"not benchmarked: {b} ({why})")
    lines += [f"note: {n}" for n in res.notes]
    return lines


def legend_lines() -> list[str]:
    """What the table's columns and marks mean (printed under the terminal table, and in results.md)."""
    lim = f"{100 * UNSTABLE_SPREAD:.0f}%"
    return [
        "ms: median time per call over the repetitions (CUDA events on a GPU, wall time on the CPU); the",
        "  implementations of one (workload, op) are timed interleaved, round-robin, so drift hits all alike.",
        "host ms: median time until the call returns (on a GPU the Python + launch cost; on the CPU = ms).",
        "spread%: interquartile range / median, (p75 - p25) / median, of the repetitions' times, in %",
        "  (of the host times for host-* workloads).",
        f"{UNSTABLE_MARK}: spread over {lim}, or fewer than 2 repetitions: the figure is not steady enough to",
        "  quote; such rows (and rows whose torch eager baseline is unstable) never enter the best-speedup table.",
        "GB/s: the op's byte floor (docs/contract.md section 9) / ms; %copy: that over the copy bandwidth measured in this run.",
        "x eager / x compile: torch eager's / torch.compile's time over this row's (> 1: this row is faster).",
        "host-* workloads: clip_grad_norm_ on many tiny tensors, where only host cost counts; their x eager",
        "  compares host ms, and they have no GB/s.",
    ]


def console_table(res: Result) -> str:
    head = f"{'workload':<11} {'op':<10} {'impl':<16} {'ms':>9} {'host ms':>8} {'spread%':>7} {'GB/s':>7} " \
           f"{'%copy':>6} {'x eager':>8} {'x compile':>9}"
    out = [head, "-" * len(head)]
    prev = None
    for r in res.rows:
        key = (r["workload"], r["op"])
        if prev is not None and key[0] != prev[0]:
            out.append("")
        prev = key
        line = (f"{r['workload']:<11} {r['op']:<10} {r['impl']:<16} {_num(r['median_ms'], '9.3f')} "
                f"{_num(r['host_ms'], '8.3f')} {_num(_shown_spread(res, r), '7.1f')} {_num(r['gbps'], '7.2f')} "
                f"{_num(r['pct_copy'], '6.1f')} {_num(r['x_eager'], '8.2f')} {_num(r['x_compile'], '9.2f')}")
        marks = [UNSTABLE_MARK] if r["unstable"] else []
        if r["note"]:
            marks.append(r["note"])
        if marks:
            line += "  " + "  ".join(marks)
        out.append(line)
    host = host_table(res)
    if host:
        out += ["", "Host time per call (clip_grad_norm_, perf_counter around the call, device synchronised "
                "outside it):"] + host
    out += ["", "Legend:"] + ["  " + line for line in legend_lines()]
    return "\n".join(out)


def _shown_spread(res: Result, r: dict) -> float:
    return r["host_spread_pct"] if r["workload"] in _host_workloads(res) else r["spread_pct"]


def host_table(res: Result) -> list[str]:
    """One line per host-overhead workload: host time per call of each implementation, in microseconds."""
    hosts = _host_workloads(res)
    rows = [r for r in res.rows if r["workload"] in hosts]
    if not rows:
        return []
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    out = [f"  {'workload':<11} " + " ".join(f"{i + ' us':>18}" for i in impls)]
    for name in dict.fromkeys(r["workload"] for r in rows):
        cells = []
        for impl in impls:
            r = next((x for x in rows if x["workload"] == name and x["impl"] == impl), None)
            cell = "-" if r is None or math.isnan(r["host_ms"]) else f"{1e3 * r['host_ms']:.1f}"
            if r is not None and r["unstable"]:
                cell += "!"
            cells.append(f"{cell:>18}")
        out.append(f"  {name:<11} " + " ".join(cells))
    out.append("  (! = unstable)")
    return out


def write_csv(res: Result, path: Path) -> None:
    with open(path, "w", newline="") as f:
        # Metadata as leading comment lines: pandas.read_csv(path, comment="#") reads the table.
        for line in meta_lines(res):
            f.write(f"# {line}\n")
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in res.rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else int(v) if isinstance(v, bool) else v)
                        for k, v in r.items()})


def best_speedups(res: Result) -> dict[tuple[str, str], tuple[float, str] | None]:
    """Best fastgrad speedup over torch eager per (workload, op), with the backend that got it. Only steady
    figures are quoted: when the fastest fastgrad row of a (workload, op) is unstable, or torch eager's row
    is, the pair maps to None ("unstable"), never to a slower steady backend standing in as "best".
    Host-overhead workloads have their own table."""
    hosts = _host_workloads(res)
    eager_unstable = {(r["workload"], r["op"]) for r in res.rows if r["impl"] == EAGER and r["unstable"]}
    fastest: dict[tuple[str, str], dict] = {}
    for r in res.rows:
        if not r["backend"] or math.isnan(r["x_eager"]) or r["workload"] in hosts:
            continue
        key = (r["workload"], r["op"])
        if key not in fastest or r["x_eager"] > fastest[key]["x_eager"]:
            fastest[key] = r
    return {key: None if r["unstable"] or key in eager_unstable else (r["x_eager"], r["backend"])
            for key, r in fastest.items()}


def markdown(res: Result) -> str:
    m = res.meta
    workloads = list(dict.fromkeys(r["workload"] for r in res.rows))
    ops = list(dict.fromkeys(r["op"] for r in res.rows))
    out = [f"# fastgrad benchmark: {m['device']}", ""]
    out += [f"- {line}" for line in meta_lines(res)]
    out += ["", "How to read the tables:", ""] + [("- " if not line.startswith("  ") else "  ") + line.strip()
                                                  for line in legend_lines()]
    out += ["", "## Workloads", "", "| workload | description | tensors | grad MiB | full-size MiB | note |",
            "|---|---|---:|---:|---:|---|"]
    for name in workloads:
        w = m["workloads"][name]
        out.append(f"| {name} | {w['title']} | {w['tensors']} | {w['grad_bytes'] / 2**20:.1f} | "
                   f"{w['full_grad_bytes'] / 2**20:.1f} | {w['note'] or 'full size'} |")
    out += ["", "## Ops and baselines", "", "| op | what | byte floor | baseline |", "|---|---|---|---|"]
    floors = {"norm": "N", "clip": "N", "clip_trig": "3N", "clip_value": "2N", "amp_clip": "3N", "agc": "P + 2N",
              "gc": "2N", "grad_stats": "N"}
    for op in ops:
        s = O.OPS[op]
        out.append(f"| {op} | {s.title} | {floors.get(op, '?')} | {s.baseline} |")
    best = best_speedups(res)
    if best:
        bw = [name for name in workloads if any(k[0] == name for k in best)]
        out += ["", "## Best fastgrad speedup over torch eager", "",
                f"Steady rows only: \"unstable\" where the fastest fastgrad row (or torch eager's) had a spread over "
                f"{100 * UNSTABLE_SPREAD:.0f}%.", "",
                "| workload | " + " | ".join(ops) + " |", "|---|" + "---:|" * len(ops)]
        for name in bw:
            cells = []
            for op in ops:
                key = (name, op)
                v = best.get(key)
                cells.append(f"{v[0]:.2f}x ({v[1]})" if v else "unstable" if key in best else "-")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    host = host_table(res)
    if host:
        out += ["", "## Host time per call", "", "clip_grad_norm_ (not triggered), perf_counter around the call, "
                "the device synchronised outside the timed region; microseconds, median.", "", "```"]
        out += host + ["```"]
    out += ["", "## All results", "",
            "| workload | op | impl | ms | host ms | spread % | stable | GB/s | % copy | x eager | x compile | note |",
            "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in res.rows:
        out.append(f"| {r['workload']} | {r['op']} | {r['impl']} | {_num(r['median_ms'], '.3f')} | "
                   f"{_num(r['host_ms'], '.3f')} | {_num(_shown_spread(res, r), '.1f')} | "
                   f"{'**' + UNSTABLE_MARK + '**' if r['unstable'] else 'yes'} | {_num(r['gbps'], '.2f')} | "
                   f"{_num(r['pct_copy'], '.1f')} | {_num(r['x_eager'], '.2f')} | {_num(r['x_compile'], '.2f')} | "
                   f"{r['note']} |")
    return "\n".join(out) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    return plt, matplotlib.ticker


def _bar_panels(res: Result, path: Path, key: str, impls: list[str], *, ylabel: str, log: bool, ref: float,
                ref_label: str, title: str, tick_fmt) -> None:
    """One panel per op, one group of bars per workload, one bar per implementation; unstable rows hatched."""
    plt, ticker = _pyplot()
    rows = {(r["workload"], r["op"], r["impl"]): r for r in res.rows}
    ops = list(dict.fromkeys(r["op"] for r in res.rows))
    ops = [op for op in ops if any(not math.isnan(r[key]) for r in res.rows if r["op"] == op and r["impl"] in impls)]
    ncols = min(4, len(ops))
    nrows = math.ceil(len(ops) / ncols)
    width_in, height_in = 4.4 * ncols + 1.4, 3.6 * nrows + 2.2
    fig, axes = plt.subplots(nrows, ncols, figsize=(width_in, height_in), squeeze=False)
    width = 0.8 / len(impls)
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    colors = {EAGER: "#555555", COMPILE: "#aaaaaa"}
    for i, impl in enumerate(i for i in impls if i not in colors):
        colors[impl] = palette[i % len(palette)]
    for k, op in enumerate(ops):
        ax = axes[k // ncols][k % ncols]
        # Only the workloads that have a figure for this op (host-* workloads have no bandwidth, etc.).
        wls = [w for w in dict.fromkeys(r["workload"] for r in res.rows)
               if any(not math.isnan(rows[(w, op, i)][key]) for i in impls if (w, op, i) in rows)]
        for j, impl in enumerate(impls):
            xs, ys, hatch = [], [], []
            for x, w in enumerate(wls):
                r = rows.get((w, op, impl))
                if r is None or math.isnan(r[key]):
                    continue
                xs.append(x + (j - (len(impls) - 1) / 2) * width)
                ys.append(r[key])
                hatch.append(bool(r["unstable"]))
            bars = ax.bar(xs, ys, width, label=impl, color=colors[impl], edgecolor="white", linewidth=0.3)
            for b, h in zip(bars, hatch):
                if h:
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
    import matplotlib.patches as mpatches

    handles.append(mpatches.Patch(facecolor="white", edgecolor="black", hatch="////"))
    labels.append(f"unstable (spread > {100 * UNSTABLE_SPREAD:.0f}%)")
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    m = res.meta
    fig.suptitle(f"{title}\n{m['device']} | {m['date']} | torch {m['torch']}, CUDA {m['cuda']}, "
                 f"triton {m['triton']}", fontsize=9)
    # Fixed margins in inches (room for the y label, the reference line's label, the rotated workload
    # names and the legend) instead of tight_layout, which costs seconds of text measuring.
    fig.subplots_adjust(left=0.8 / width_in, right=1 - 0.75 / width_in, bottom=1.5 / height_in,
                        top=1 - 0.8 / height_in, wspace=0.45, hspace=0.9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(res: Result, path: Path) -> str | None:
    """Speedup over torch eager per workload (x) and op (panel), one bar per fastgrad backend (and
    torch.compile when measured). Returns None, or why no plot was written."""
    try:
        _pyplot()
    except Exception as exc:  # noqa: BLE001 - plotting is optional
        return f"matplotlib unavailable ({type(exc).__name__}: {exc})"
    impls = [i for i in dict.fromkeys(r["impl"] for r in res.rows) if i != EAGER]
    if not any(not math.isnan(r["x_eager"]) for r in res.rows):
        return "no implementation besides torch eager was measured"
    _bar_panels(res, path, "x_eager", impls, ylabel="speedup vs torch eager", log=True, ref=1.0,
                ref_label="eager", title="fastgrad speedup over torch eager (log scale; > 1 is faster; host-* "
                "workloads: host time)", tick_fmt=lambda y, _: f"{y:g}x")
    return None


def plot_bandwidth(res: Result, path: Path) -> str | None:
    """The roofline view: % of the measured copy bandwidth each implementation reaches, counting the op's
    byte floor, per workload (x) and op (panel). 100% is the memory limit."""
    try:
        _pyplot()
    except Exception as exc:  # noqa: BLE001
        return f"matplotlib unavailable ({type(exc).__name__}: {exc})"
    if not any(not math.isnan(r["pct_copy"]) for r in res.rows):
        return "no bandwidth figure was measured"
    impls = list(dict.fromkeys(r["impl"] for r in res.rows))
    gbps = res.meta["copy_gbps"]
    _bar_panels(res, path, "pct_copy", impls, ylabel="% of copy bandwidth", log=False, ref=100.0,
                ref_label=f"copy\n{gbps:.0f} GB/s", title="Share of the copy bandwidth reached (op's byte floor / "
                "time, over a large copy timed in the same run; 100% = memory limit)",
                tick_fmt=lambda y, _: f"{y:g}%")
    return None


def write_all(res: Result, out_dir: Path, png: bool = True) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "results.csv", "md": out_dir / "results.md", "json": out_dir / "meta.json"}
    write_csv(res, paths["csv"])
    paths["md"].write_text(markdown(res))
    paths["json"].write_text(json.dumps(res.meta | {"notes": res.notes}, indent=2, default=str) + "\n")
    if png:
        for name, fn in (("png", plot), ("png_bandwidth", plot_bandwidth)):
            target = out_dir / ("speedup.png" if name == "png" else "pct_copy.png")
            why = fn(res, target)
            if why is None:
                paths[name] = target
            else:
                res.notes.append(f"no plot {target.name}: {why}")
    return paths
