"""Start-up cost of fastgrad against torch's own: `import fastgrad` vs `import torch`, and the CLI entry points.

Each command runs in a fresh interpreter; the commands are interleaved round by round (so a change in machine
load hits all of them alike) and each one's median wall time is reported, with its ratio to `import torch`,
and its median CPU time (user + system of the child process), which a busy shared machine disturbs far less
than the wall time. The target for `import fastgrad` is at most 1.15x `import torch`.

    python benchmarks/import_time.py              # 11 rounds of `import torch` / `import fastgrad`
    python benchmarks/import_time.py --cli        # also check --help, a check usage error, fastgrad.info
    python benchmarks/import_time.py --rounds 21 --json out.json

Run it from the repository root (or with PYTHONPATH pointing at the checkout you mean to measure).
The children run without PYTHONDONTWRITEBYTECODE (an untimed first run writes fastgrad's bytecode cache, as
any normal first import does; torch's came with its install), unless --keep-env: with it set, every import
compiles fastgrad's modules from source again, about 0.1 s that no installed fastgrad pays.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

BASE = ("import torch", [sys.executable, "-c", "import torch"])
COMMANDS = [("import fastgrad", [sys.executable, "-c", "import fastgrad"])]
CLI = [
    ("fastgrad.check --help", [sys.executable, "-m", "fastgrad.check", "--help"]),
    ("fastgrad.check (usage error)", [sys.executable, "-m", "fastgrad.check"]),
    ("fastgrad.info", [sys.executable, "-m", "fastgrad.info"]),
]


_ENV = dict(os.environ)


def _once(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run; the children's rusage delta is this child's alone, since the
    runs are sequential."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, env=_ENV)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=11, help="interleaved rounds (default 11)")
    ap.add_argument("--cli", action="store_true", help="also time the command-line entry points")
    ap.add_argument("--json", metavar="PATH", help="write the raw times and medians here")
    ap.add_argument("--keep-env", action="store_true", help="keep PYTHONDONTWRITEBYTECODE if it is set")
    args = ap.parse_args(argv)
    if not args.keep_env:
        _ENV.pop("PYTHONDONTWRITEBYTECODE", None)

    cmds = [BASE] + COMMANDS + (CLI if args.cli else [])
    for _, a in cmds:  # warm the file cache once, untimed
        _once(a)
    times: dict[str, list[float]] = {name: [] for name, _ in cmds}
    cpu: dict[str, list[float]] = {name: [] for name, _ in cmds}
    for _ in range(args.rounds):
        for name, a in cmds:
            w, c = _once(a)
            times[name].append(w)
            cpu[name].append(c)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    med_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
    base, base_cpu = med[BASE[0]], med_cpu[BASE[0]]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.rounds} interleaved rounds, medians (load average at the end: {load:.2f}, {os.cpu_count()} CPUs)")
    print(f"  {'':<30} {'wall':>7}  {'ratio':>6}  {'(min - max)':<15} {'CPU':>7}  {'ratio':>6}")
    for name, _ in cmds:
        ts = sorted(times[name])
        print(f"  {name:<30} {med[name]:6.2f}s  {med[name] / base:5.2f}x  ({ts[0]:5.2f} - {ts[-1]:5.2f})"
              f" {med_cpu[name]:6.2f}s  {med_cpu[name] / base_cpu:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "load": load, "wall": times, "cpu": cpu, "median_wall": med,
                       "median_cpu": med_cpu}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
