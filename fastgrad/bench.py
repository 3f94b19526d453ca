"""python -m fastgrad.bench: benchmark fastgrad against torch on this machine's device.

Answers "is fastgrad's automatic choice faster than torch eager (and torch.compile where run) for this
workload and op?" with a speedup, its confidence interval and a verdict per (workload, op); other backends
and other torch baselines follow in a reference table. Writes ``results.csv`` (plain CSV), ``results.md``,
``meta.json``, ``speedup.png`` and ``pct_floor.png`` under ``--out`` (default ``bench_results/``). The
workloads, timing, counting and report code live in ``fastgrad.benchmark``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .benchmark import ops as benchmark_ops
from .benchmark import report, runner
from .benchmark import workloads as benchmark_workloads

DESCRIPTION = "Benchmark fastgrad against torch on this machine's device (CUDA when available, else the CPU)."
EPILOG = ("How to read the results: `python -m fastgrad.bench --explain` prints what every column, mark and "
          "baseline means and each op's floor model (the same text results.md carries under 'How to read the "
          "tables' and 'Ops: floor model and baselines'); `--list` prints the workloads and ops. Both come "
          "from this installed package; nothing is looked up elsewhere.")


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    """Every option's help ends with its default (argparse prints none by itself for most of them)."""
    p = argparse.ArgumentParser(prog="python -m fastgrad.bench", description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--device", default="auto",
                   help="auto (cuda when available, else cpu), cpu, cuda, cuda:N (default: auto)")
    p.add_argument("--quick", action="store_true",
                   help="24 MiB workloads, fewer rounds, no reference backends, 3 rounds of the other torch "
                        "baselines (what `make bench` runs) (default: off)")
    p.add_argument("--workloads", default="all", help="comma list or 'all' (see --list) (default: all)")
    p.add_argument("--ops", default="all", help="comma list or 'all' (see --list) (default: all)")
    p.add_argument("--backends", default=None,
                   help="fastgrad backends, comma list or 'all' usable on the device; the ones the automatic "
                        "choice does not pick are timed as reference rows (default: all; with --quick only the "
                        "automatic choice's)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="also time torch.compile of each op's headline torch baseline; auto: on CUDA only "
                        "(default: auto)")
    p.add_argument("--compile-workloads", default="all",
                   help="workloads for the torch.compile baseline; compiling takes seconds to minutes each "
                        "(default: all)")
    p.add_argument("--max-mb", type=float, default=None,
                   help="cap on gradient MiB per workload; larger ones are scaled down (default: from the "
                        "device's free memory; on the CPU 128, with --quick 24)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of timed rounds per (workload, op) before it stops with its interval still "
                        "wide; most cases settle and stop long before (default: 20; with --quick 10)")
    p.add_argument("--min-rounds", "--min-reps", dest="min_rounds", type=int, default=None,
                   help="rounds before any stop (default: 8; with --quick 6, the fewest that give a 95%% "
                        "interval)")
    p.add_argument("--max-rounds", "--max-reps", dest="max_rounds", type=int, default=None,
                   help="most rounds per case, ten times that for host-* (default: 400; with --quick 100)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads, for fastgrad and torch alike (on a shared machine more threads "
                        "than free cores make timings erratic); 0: torch's own choice (default: 1 on the CPU, "
                        "0 on CUDA)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random gradients (default: 0)")
    p.add_argument("--out", default="bench_results", help="results folder, created (default: bench_results)")
    p.add_argument("--no-counts", action="store_true",
                   help="skip counting one call per implementation (torch operators; on CUDA kernels and "
                        "host syncs), which runs after the timed rounds (default: off, i.e. counted)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plots (default: off)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: off)")
    p.add_argument("--list", action="store_true", help="list workloads and ops, then exit (default: off)")
    p.add_argument("--explain", action="store_true",
                   help="print how to read the results (columns, marks, baselines, floor model), then exit "
                        "(default: off)")
    return p


def _backends_arg(value: str | None, quick: bool) -> list[str] | None:
    """``--backends`` as the runner takes it: None (every usable backend), a list, or, for ``--quick``
    without the option, the empty list (no reference rows: the automatic choice alone, about half the time)."""
    if value is None:
        return [] if quick else None
    return None if value == "all" else _csv(value)


def explain_text() -> str:
    """The legend and the ops' floor model and baselines, without running anything."""
    empty = runner.Result([], {"confidence": runner.CONFIDENCE, "noise_band": runner.BAND})
    lines = ["How to read python -m fastgrad.bench's results", ""] + report.legend_lines(empty)
    lines += ["", "Ops: floor model and baselines (N = gradient bytes, P = parameter bytes)", ""]
    lines += report.ops_table(list(benchmark_ops.OPS))
    return "\n".join(lines)


def _progress(total: int, enabled: bool):
    """A tqdm bar when tqdm is installed, else a plain line per case on stderr."""
    if not enabled:
        return None, lambda: None
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True)

        def step(desc: str) -> None:
            bar.set_description_str(desc[:48])
            bar.update(1)

        return step, bar.close
    except ImportError:
        count = [0]

        def step(desc: str) -> None:
            count[0] += 1
            print(f"[{count[0]}/{total}] {desc}", file=sys.stderr, flush=True)

        return step, lambda: None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.explain:
        print(explain_text())
        return 0
    if args.list:
        print("workloads:")
        for name, spec in benchmark_workloads.WORKLOADS.items():
            only = f"; ops: {', '.join(spec.ops)} only" if spec.ops else ""
            mib = benchmark_workloads.nbytes(spec.build()) / 2**20
            print(f"  {name:<11} {spec.title}  ({mib:.0f} MiB of grads{only})")
        print("ops:")
        for name, spec in benchmark_ops.OPS.items():
            print(f"  {name:<11} {spec.title}  (floor: {spec.floor.text()}; baseline: {spec.baseline})")
        return 0

    import torch

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else 0)
    if threads > 0:
        torch.set_num_threads(threads)
    workloads = list(benchmark_workloads.DEFAULT_WORKLOADS) if args.workloads == "all" else _csv(args.workloads)
    ops = list(benchmark_ops.OPS) if args.ops == "all" else _csv(args.ops)
    for name in workloads:
        if name not in benchmark_workloads.WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; known: {', '.join(benchmark_workloads.WORKLOADS)}")
    for name in ops:
        if name not in benchmark_ops.OPS:
            raise SystemExit(f"unknown op {name!r}; known: {', '.join(benchmark_ops.OPS)}")
    use_compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    quick = args.quick
    busy = runner.busy_warning("before")
    if busy:
        # Once, on its own line, before the progress bar starts.
        print(f"warning: {busy}", file=sys.stderr, flush=True)
    cfg = runner.Config(
        device=device, workloads=workloads, ops=ops,
        backends=_backends_arg(args.backends, quick),
        quick=quick,
        max_bytes=None if args.max_mb is None else int(args.max_mb * 2**20),
        compile=use_compile,
        compile_workloads=None if args.compile_workloads == "all" else _csv(args.compile_workloads),
        budget_s=args.budget if args.budget is not None else (10.0 if quick else 20.0),
        min_rounds=args.min_rounds if args.min_rounds is not None else (6 if quick else 8),
        max_rounds=args.max_rounds if args.max_rounds is not None else (100 if quick else 400),
        warmup=1 if quick else 2,
        # The own loops are side rows and the slowest calls of a run: --quick gives them a median, no interval.
        other_rounds=3 if quick else None,
        seed=args.seed,
        busy_before=busy,
        counts=not args.no_counts,
        command="python -m fastgrad.bench" + "".join(" " + shlex.quote(a) for a in
                                                     (sys.argv[1:] if argv is None else argv)),
    )
    total = sum(len(runner.ops_for(w, ops)) for w in workloads)
    out = Path(args.out)
    step, close = _progress(total, not args.no_progress)
    try:
        # Tables after every workload, so a run cut short (timeout, out of memory) still leaves results.
        res = runner.run(cfg, step, on_workload=lambda r: report.write_all(r, out, png=False))
    finally:
        close()
    paths = report.write_all(res, out, png=not args.no_plot)
    print("\n".join(report.meta_lines(res)))
    print()
    print(report.console_table(res))
    print()
    print("wrote: " + ", ".join(str(p) for p in paths.values()))
    if not busy:
        after = next((n for n in res.notes if n.startswith("machine busy after")), None)
        if after:
            print(f"warning: {after}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
