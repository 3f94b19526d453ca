"""Cost of ``exact=True`` on the CPU backend: ``fastgrad.get_total_norm`` with and without it on 64 MB of float32
gradients (the default against the correctly rounded norm), and how often torch's own ``get_total_norm`` is not
the correctly rounded norm on random float32 lists.

    python -m benchmarks.bench_exact                       # prints the table
    python -m benchmarks.bench_exact --out benchmarks/results/exact-cpu

The gradients: 64 MB of float32 in tensors of a transformer's shapes (hidden 1024: square and 4x projections,
vectors), values N(0, 1) scaled per tensor. Calls alternate (default, exact, default, ...) so a load change
hits both; each figure is the median of ``--reps`` calls after a warm-up, with the spread (the interquartile
range) and the load average before and after. ``exact/default`` is the ratio of the medians.

The accuracy count draws ``--lists`` random lists (1-8 tensors of 1-5000 float32 values, magnitudes spread
over 10^-3..10^3 per tensor), and compares torch's ``get_total_norm``, fastgrad's default and ``exact=True``
with the correctly rounded 2-norm (an independent integer computation on the values): how many differ and by
how many float32 units at most.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import time
from datetime import datetime, timezone
from fractions import Fraction
from math import isqrt

import torch

import fastgrad


def _grads(total_bytes: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1024, 1024), (4096, 1024), (1024, 4096), (1024,), (4096,)]
    out, left, i = [], total_bytes // 4, 0
    while left > 0:
        shape = shapes[i % len(shapes)]
        n = math.prod(shape)
        if n > left:
            shape = (left,)
            n = left
        out.append(torch.randn(shape, generator=gen) * (0.01 * (1 + i % 7)))
        left -= n
        i += 1
    return out


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _iqr(xs):
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def speed(mb: int, reps: int) -> dict:
    grads = _grads(mb << 20)
    default = lambda: fastgrad.get_total_norm(grads, backend="cpu")  # noqa: E731
    exact = lambda: fastgrad.get_total_norm(grads, backend="cpu", exact=True)  # noqa: E731
    for _ in range(3):
        default(), exact()
    load_before = os.getloadavg()
    d, e = [], []
    for _ in range(reps):
        d += _time(default, 1)
        e += _time(exact, 1)
    load_after = os.getloadavg()
    md, me = statistics.median(d), statistics.median(e)
    return {"mb": mb, "tensors": len(grads), "reps": reps, "threads": torch.get_num_threads(),
            "default_ms": md * 1e3, "exact_ms": me * 1e3, "default_iqr_ms": _iqr(d) * 1e3,
            "exact_iqr_ms": _iqr(e) * 1e3, "ratio": me / md, "load_before": load_before, "load_after": load_after}


def _rounded_norm(vals: list[float]) -> float:
    """The 2-norm of ``vals`` correctly rounded to float32 (normal range), with integers only."""
    total = 0
    for v in vals:
        n, d = abs(v).as_integer_ratio()
        i = n << (200 - (d.bit_length() - 1))
        total += i * i
    s = Fraction(total, 1 << 400)
    e = s.numerator.bit_length() - s.denominator.bit_length()
    if Fraction(2) ** e > s:
        e -= 1
    q = e // 2 - 23
    r = s / Fraction(4) ** q
    k = isqrt(r.numerator // r.denominator)
    mid = Fraction(2 * k + 1, 2) ** 2
    if r > mid or (r == mid and k % 2):
        k += 1
    return math.ldexp(k, q)


def _ulps(a: float, b: float) -> int:
    ia = torch.tensor(a, dtype=torch.float32).view(torch.int32).item()
    ib = torch.tensor(b, dtype=torch.float32).view(torch.int32).item()
    return abs(ia - ib)


def accuracy(lists: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    counts = {"torch": [0, 0], "fastgrad default": [0, 0], "fastgrad exact": [0, 0]}
    for _ in range(lists):
        ts = [torch.randn(rng.randint(1, 5000), generator=gen) * 10.0 ** rng.uniform(-3, 3)
              for _ in range(rng.randint(1, 8))]
        want = float(torch.tensor(_rounded_norm([v for t in ts for v in t.double().tolist()]), dtype=torch.float32))
        got = {"torch": torch.nn.utils.get_total_norm(ts), "fastgrad default": fastgrad.get_total_norm(ts),
               "fastgrad exact": fastgrad.get_total_norm(ts, exact=True)}
        for name, g in got.items():
            u = _ulps(g.item(), want)
            counts[name][0] += u != 0
            counts[name][1] = max(counts[name][1], u)
    return {"lists": lists, **{k: {"differ": v[0], "max_ulps": v[1]} for k, v in counts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--lists", type=int, default=200)
    ap.add_argument("--out", default=None, help="folder for results.json and results.md")
    args = ap.parse_args()
    sp = speed(args.mb, args.reps)
    acc = accuracy(args.lists)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or
            platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "command": f"python -m benchmarks.bench_exact --mb {args.mb} --reps {args.reps} --lists {args.lists}"}
    lines = [
        f"# exact=True on the CPU backend ({meta['date']})", "",
        f"`{meta['command']}`; {meta['cpus']} CPUs, {sp['threads']} torch threads, torch {meta['torch']}; load average "
        f"{sp['load_before'][0]:.2f} before, {sp['load_after'][0]:.2f} after.", "",
        f"## get_total_norm on {sp['mb']} MB of float32 ({sp['tensors']} tensors), median of {sp['reps']} calls", "",
        "| call | median ms | IQR ms |", "|---|---|---|",
        f"| default (`backend='cpu'`) | {sp['default_ms']:.2f} | {sp['default_iqr_ms']:.2f} |",
        f"| `exact=True` | {sp['exact_ms']:.2f} | {sp['exact_iqr_ms']:.2f} |", "",
        f"exact / default: **{sp['ratio']:.2f}x**", "",
        f"## Not the correctly rounded 2-norm, on {acc['lists']} random float32 lists", "",
        "| function | lists that differ | max float32 units off |", "|---|---|---|",
    ]
    for name in ("torch", "fastgrad default", "fastgrad exact"):
        lines.append(f"| {name} | {acc[name]['differ']} | {acc[name]['max_ulps']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "speed": sp, "accuracy": acc}, f, indent=1)


if __name__ == "__main__":
    main()
