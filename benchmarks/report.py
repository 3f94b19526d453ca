"""Writes a benchmark result as a console table, CSV, Markdown and a PNG plot."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from . import ops as O
from .runner import COMPILE, EAGER, Result

COLUMNS = ["workload", "op", "impl", "backend", "tensors", "grad_mb", "floor_mb", "median_ms", "min_ms", "host_ms",
           "reps", "gbps", "pct_copy", "x_eager", "x_compile", "note"]

META_KEYS = ["device", "date", "command", "fastgrad", "git_commit", "torch", "cuda", "triton", "python", "quick",
             "cpu_threads", "load_average", "copy_gbps"]


def _num(x, fmt: str) -> str:
    if isinstance(x, float) and math.isnan(x):
        width = fmt.split(".")[0]
        return format("-", ">" + width) if width else "-"
    return format(x, fmt)


def meta_lines(res: Result) -> list[str]:
    m = res.meta
    lines = [f"{k}: {m[k]:.1f} GB/s (copy of {m['copy_bytes'] / 2**20:.0f} MiB)" if k == "copy_gbps"
             else f"{k}: {m[k]}" for k in META_KEYS]
    lines.append(f"fastgrad backends benchmarked: {', '.join(m['backends']) or 'none'}")
    for b, why in m["backends_not_benchmarked"].items():
        lines.append(f"not benchmarked: {b} ({why})")
    lines += [f"note: {n}" for n in res.notes]
    return lines


def console_table(res: Result) -> str:
    head = f"{'workload':<11} {'op':<10} {'impl':<16} {'ms':>9} {'host ms':>8} {'GB/s':>7} {'%copy':>6} " \
           f"{'x eager':>8} {'x compile':>9}"
    out = [head, "-" * len(head)]
    prev = None
    for r in res.rows:
        key = (r["workload"], r["op"])
        if prev is not None and key[0] != prev[0]:
            out.append("")
        prev = key
        line = (f"{r['workload']:<11} {r['op']:<10} {r['impl']:<16} {_num(r['median_ms'], '9.3f')} "
                f"{_num(r['host_ms'], '8.3f')} {_num(r['gbps'], '7.2f')} {_num(r['pct_copy'], '6.1f')} "
                f"{_num(r['x_eager'], '8.2f')} {_num(r['x_compile'], '9.2f')}")
        if r["note"]:
            line += f"  {r['note']}"
        out.append(line)
    return "\n".join(out)


def write_csv(res: Result, path: Path) -> None:
    with open(path, "w", newline="") as f:
        # Metadata as leading comment lines: pandas.read_csv(path, comment="#") reads the table.
        for line in meta_lines(res):
            f.write(f"# {line}\n")
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in res.rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def best_speedups(res: Result) -> dict[tuple[str, str], tuple[float, str]]:
    """Best fastgrad speedup over torch eager per (workload, op), with the backend that got it."""
    best: dict[tuple[str, str], tuple[float, str]] = {}
    for r in res.rows:
        if not r["backend"] or math.isnan(r["x_eager"]):
            continue
        key = (r["workload"], r["op"])
        if key not in best or r["x_eager"] > best[key][0]:
            best[key] = (r["x_eager"], r["backend"])
    return best


def markdown(res: Result) -> str:
    m = res.meta
    workloads = list(dict.fromkeys(r["workload"] for r in res.rows))
    ops = list(dict.fromkeys(r["op"] for r in res.rows))
    out = [f"# fastgrad benchmark: {m['device']}", ""]
    out += [f"- {line}" for line in meta_lines(res)]
    out += ["", "Time is the median per call; GB/s counts the SPEC section 9 byte floor of the op (not what an "
            "implementation actually moves), so it is comparable across implementations; % copy is that over the "
            "measured copy bandwidth of this run. x eager / x compile: speedup over torch eager / "
            "torch.compile of the same torch code (baselines per op below). host ms: time until the call "
            "returns (equals the time on the CPU; on a GPU the Python + launch overhead).", ""]
    out += ["## Workloads", "", "| workload | description | tensors | grad MiB | full-size MiB | note |",
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
        out += ["", "## Best fastgrad speedup over torch eager", "",
                "| workload | " + " | ".join(ops) + " |", "|---|" + "---:|" * len(ops)]
        for name in workloads:
            cells = []
            for op in ops:
                v = best.get((name, op))
                cells.append(f"{v[0]:.2f}x ({v[1]})" if v else "-")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += ["", "## All results", "",
            "| workload | op | impl | ms | host ms | GB/s | % copy | x eager | x compile | note |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in res.rows:
        out.append(f"| {r['workload']} | {r['op']} | {r['impl']} | {_num(r['median_ms'], '.3f')} | "
                   f"{_num(r['host_ms'], '.3f')} | {_num(r['gbps'], '.2f')} | {_num(r['pct_copy'], '.1f')} | "
                   f"{_num(r['x_eager'], '.2f')} | {_num(r['x_compile'], '.2f')} | {r['note']} |")
    return "\n".join(out) + "\n"


def plot(res: Result, path: Path) -> str | None:
    """Speedup over torch eager per workload (x) and op (panel), one bar per fastgrad backend (and
    torch.compile when measured). Returns None, or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception as exc:  # noqa: BLE001 - plotting is optional
        return f"matplotlib unavailable ({type(exc).__name__}: {exc})"
    workloads = list(dict.fromkeys(r["workload"] for r in res.rows))
    ops = list(dict.fromkeys(r["op"] for r in res.rows))
    impls = [i for i in dict.fromkeys(r["impl"] for r in res.rows) if i != EAGER]
    if not impls:
        return "no implementation besides torch eager was measured"
    val = {(r["workload"], r["op"], r["impl"]): r["x_eager"] for r in res.rows}
    ncols = min(4, len(ops))
    nrows = math.ceil(len(ops) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows + 0.8), squeeze=False)
    width = 0.8 / len(impls)
    colors = {COMPILE: "#999999"}
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    for i, impl in enumerate(i for i in impls if i != COMPILE):
        colors[impl] = palette[i % len(palette)]
    for k, op in enumerate(ops):
        ax = axes[k // ncols][k % ncols]
        for j, impl in enumerate(impls):
            ys = [val.get((w, op, impl), float("nan")) for w in workloads]
            xs = [x + (j - (len(impls) - 1) / 2) * width for x in range(len(workloads))]
            ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, label=impl, color=colors[impl])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        fmt = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x")
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(fmt)
        ax.tick_params(axis="y", which="minor", labelsize=6)
        ax.set_title(f"{op}: {O.OPS[op].title}", fontsize=9)
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("speedup vs torch eager", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
    for k in range(len(ops), nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8)
    m = res.meta
    fig.suptitle(f"fastgrad speedup over torch eager (log scale; >1 is faster)\n{m['device']} | {m['date']} | "
                 f"torch {m['torch']}, CUDA {m['cuda']}, triton {m['triton']}", fontsize=9)
    # Fixed margins instead of tight_layout, which costs seconds of text measuring.
    fig.subplots_adjust(left=0.06, right=0.9, bottom=0.14, top=0.86, wspace=0.35, hspace=0.75)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_all(res: Result, out_dir: Path, png: bool = True) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "results.csv", "md": out_dir / "results.md", "json": out_dir / "meta.json"}
    write_csv(res, paths["csv"])
    paths["md"].write_text(markdown(res))
    paths["json"].write_text(json.dumps(res.meta | {"notes": res.notes}, indent=2, default=str) + "\n")
    if png:
        why = plot(res, out_dir / "speedup.png")
        if why is None:
            paths["png"] = out_dir / "speedup.png"
        else:
            res.notes.append(f"no plot: {why}")
    return paths
