"""Cost of "clip + monitor every step": ``GradientMonitor.clip_grad_norm_`` (one fused statistics read, then
the scale pass only when clipping) against ``fastgrad.clip_grad_norm_`` alone, the two-read alternative
(clip, then ``monitor()``), torch's clip, and the single read passes (``get_total_norm``, ``grad_stats``).

    python -m benchmarks.bench_monitor                       # CPU, default workloads
    python -m benchmarks.bench_monitor --device cuda --max-mib 4096 --json out.json

Every op is timed in interleaved rounds (A B C ... A B C ...) and the median of all repetitions is kept, so a
load change on a shared machine hits every op alike. The fastest repetition of each op ("best") is reported
too: on a machine shared with CPU-bound jobs the medians mostly measure preemption, and the best of many
repetitions is the closest to the op's own cost. Two regimes: ``max_norm`` large (no clipping: the scale
pass is skipped on the device) and small (every gradient is rewritten; gradients are restored, untimed,
before each repetition). The monitor never logs here (``every=None``): that is the per-step cost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

import fastgrad

from fastgrad.benchmark.timing import Timer
from fastgrad.benchmark.workloads import WORKLOADS, materialize, prepare

_DEFAULT = ["gpt2-124m", "resnet50", "small-4000"]


def _ops(params, backend):
    mon = fastgrad.GradientMonitor(params, every=None, per_layer=True, backend=backend)
    mon2 = fastgrad.GradientMonitor(params, every=None, per_layer=True, backend=backend)
    grads = [p.grad for p in params]

    def two_reads(mn):
        fastgrad.clip_grad_norm_(params, mn, backend=backend)
        mon2()

    return {
        "clip": lambda mn: fastgrad.clip_grad_norm_(params, mn, backend=backend),
        "monitor.clip_grad_norm_": lambda mn: mon.clip_grad_norm_(mn),
        "clip + monitor() (two reads)": two_reads,
        "torch clip_grad_norm_": lambda mn: torch.nn.utils.clip_grad_norm_(params, mn),
        "get_total_norm (read only)": lambda mn: fastgrad.get_total_norm(grads, backend=backend),
        "grad_stats (read only)": lambda mn: fastgrad.grad_stats(params, backend=backend),
    }


def run(workload: str, device: str, max_mib: int, backend: str | None, rounds: int, budget: float) -> dict:
    w = prepare(workload, max_mib * 2**20)
    params = materialize(w, device)
    saved = [p.grad.clone() for p in params]

    def restore():
        for p, s in zip(params, saved):
            p.grad.copy_(s)

    timer = Timer(torch.device(device), budget_s=budget, warmup=2, min_reps=3, max_reps=30)
    ops = _ops(params, backend)
    out = {"workload": workload, "note": w.note, "tensors": w.n_tensors, "grad_mib": w.grad_bytes / 2**20,
           "regimes": {}}
    for regime, mn in (("no clip (max_norm=1e9)", 1e9), ("clipping (max_norm=1e-3)", 1e-3)):
        samples: dict[str, list[float]] = {k: [] for k in ops}
        mins: dict[str, list[float]] = {k: [] for k in ops}
        for _ in range(rounds):
            for name, fn in ops.items():
                m = timer.measure(lambda fn=fn: fn(mn), reset=restore if mn < 1 else None)
                samples[name].append(m.median_ms)
                mins[name].append(m.min_ms)
        restore()
        med = {k: statistics.median(v) for k, v in samples.items()}
        best = {k: min(v) for k, v in mins.items()}
        out["regimes"][regime] = {
            "median_ms": med,
            "best_ms": best,
            "ratio_monitor_clip_to_clip": med["monitor.clip_grad_norm_"] / med["clip"],
            "ratio_two_reads_to_clip": med["clip + monitor() (two reads)"] / med["clip"],
            "best_ratio_monitor_clip_to_clip": best["monitor.clip_grad_norm_"] / best["clip"],
            "best_ratio_two_reads_to_clip": best["clip + monitor() (two reads)"] / best["clip"],
            "round_medians_ms": samples,
            "round_best_ms": mins,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workloads", nargs="*", default=_DEFAULT, choices=sorted(WORKLOADS))
    ap.add_argument("--max-mib", type=int, default=128, help="cap on gradient MiB (bigger models are scaled)")
    ap.add_argument("--backend", default=None, help="fastgrad backend (default: automatic)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per op")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per op per round")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "torch": torch.__version__,
            "device": a.device, "threads": torch.get_num_threads(), "backend": a.backend or "auto",
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "command": " ".join(["python -m benchmarks.bench_monitor"] + (argv or sys.argv[1:]))}
    if a.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    print(f"# bench_monitor  {meta}")
    results = []
    for wl in a.workloads:
        r = run(wl, a.device, a.max_mib, a.backend, a.rounds, a.budget)
        results.append(r)
        print(f"\n## {wl}: {r['tensors']} tensors, {r['grad_mib']:.1f} MiB of grads {r['note']}")
        for regime, d in r["regimes"].items():
            print(f"### {regime}  (median; best)")
            for k, v in d["median_ms"].items():
                b = d["best_ms"][k]
                print(f"  {k:<32} {v:9.3f} ms  ({v / d['median_ms']['clip']:.3f}x clip);  best {b:9.3f} ms  "
                      f"({b / d['best_ms']['clip']:.3f}x clip)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
