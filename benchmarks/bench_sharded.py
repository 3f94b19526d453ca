"""Host cost of one clip call on many small DTensor gradients: fastgrad's ``clip_grad_norm_`` against torch's
``torch.nn.utils.clip_grad_norm_`` on the very same parameters, in the same run, on 2 gloo ranks (CPU).

    python -m benchmarks.bench_sharded                                   # 1,000 / 5,000 / 20,000 params
    python -m benchmarks.bench_sharded --counts 1000 5000 20000 --out benchmarks/results/sharded-cpu

Each parameter is a small DTensor gradient (16 x 8 floats, ``Shard(0)`` on a 1-D mesh of the 2 ranks, every
8th one ``Replicate()``), the layout FSDP2 gives a model made of many small layers. Only the host matters at
this size: the data is 512 bytes per tensor. Both clips run with a max_norm that clips (every gradient is
rewritten) and the gradients are NOT restored between repetitions (scaling by a coefficient < 1 again only
shrinks them; the timing does not depend on the values). Rounds alternate (fastgrad, torch, fastgrad, ...)
so load changes hit both; the median and the best repetition are reported. torch is slow at 20,000 (its
DTensor ``torch.stack`` of per-parameter norms and per-parameter dispatch), so its repetitions are capped
(``--torch-reps``, default 2; the first call, which pays DTensor's sharding propagation, is a separate
untimed warm-up for both). Rank 0 writes the results; both ranks time the same calls (a collective).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone

import torch


def _rank_main(rank: int, world: int, store_dir: str, args, out_file: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    import fastgrad
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in args.counts:
        params = []
        for i in range(n):
            # from_local, not distribute_tensor: building 20,000 parameters must not cost 20,000 collectives
            full = torch.randn(16, 8, generator=gen)
            pl = Replicate() if i % 8 == 7 else Shard(0)
            local = full if pl.is_replicate() else full.chunk(world)[rank].clone()
            prm = torch.nn.Parameter(DTensor.from_local(torch.zeros_like(local), mesh, [pl], run_check=False))
            prm.grad = DTensor.from_local(local, mesh, [pl], run_check=False)
            params.append(prm)
        dist.barrier()

        def ours():
            fastgrad.clip_grad_norm_(params, 1e-3)

        def theirs():
            torch.nn.utils.clip_grad_norm_(params, 1e-3)

        def timed(fn) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        with_torch = n <= args.torch_max_params
        first = {"fastgrad": timed(ours)}  # warm-up (sharding propagation caches)
        if with_torch:
            first["torch"] = timed(theirs)
        t_ours, t_torch = [], []
        for r in range(args.reps):
            t_ours.append(timed(ours))
            if with_torch and r < args.torch_reps:
                t_torch.append(timed(theirs))
        row = {
            "params": n, "fastgrad_median_ms": 1e3 * statistics.median(t_ours), "fastgrad_best_ms": 1e3 * min(t_ours),
            "fastgrad_reps": len(t_ours), "first_call_ms": {k: 1e3 * v for k, v in first.items()},
            "torch_median_ms": 1e3 * statistics.median(t_torch) if t_torch else None,
            "torch_best_ms": 1e3 * min(t_torch) if t_torch else None, "torch_reps": len(t_torch),
        }
        row["speedup_median"] = row["torch_median_ms"] / row["fastgrad_median_ms"] if t_torch else None
        row["fastgrad_us_per_param"] = 1e3 * row["fastgrad_median_ms"] / n
        if rank == 0:
            tt = (f"torch {row['torch_median_ms']:10.2f} ms (best {row['torch_best_ms']:.2f}, {len(t_torch)} reps, "
                  f"first call {row['first_call_ms']['torch']:.0f} ms)   torch/fastgrad {row['speedup_median']:.1f}x"
                  if t_torch else f"torch not run (above --torch-max-params {args.torch_max_params})")
            print(f"{n:>6} params: fastgrad {row['fastgrad_median_ms']:9.2f} ms (best {row['fastgrad_best_ms']:.2f},"
                  f" {row['fastgrad_us_per_param']:.2f} us/param, first call {row['first_call_ms']['fastgrad']:.0f} ms)"
                  f"   {tt}", flush=True)
            with open(out_file, "a") as f:  # row by row: a run cut short keeps what it measured
                f.write(json.dumps(row) + "\n")
        del params
    dist.destroy_process_group()


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - provenance only
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[1000, 5000, 20000])
    ap.add_argument("--reps", type=int, default=5, help="fastgrad repetitions per count")
    ap.add_argument("--torch-reps", type=int, default=2, help="cap on torch's repetitions per count")
    ap.add_argument("--torch-max-params", type=int, default=20000,
                    help="time torch only up to this many parameters (its first call grows faster than linearly)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for results.json / results.md")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="fastgrad-bench-sharded-")
    out_file = os.path.join(tmp, "rows.json")
    load_before = os.getloadavg()
    started = datetime.now(timezone.utc)
    try:
        mp.start_processes(_rank_main, args=(args.world, tmp, args, out_file), nprocs=args.world,
                           start_method="spawn")
    finally:
        rows = []
        if os.path.exists(out_file):
            with open(out_file) as f:
                rows = [json.loads(line) for line in f if line.strip()]
    meta = {
        "command": "python -m benchmarks.bench_sharded " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date_utc": started.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "git_commit": _git_commit(),
        "ranks": args.world, "threads_per_rank": 1, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "reps": args.reps, "torch_reps_cap": args.torch_reps, "torch_max_params": args.torch_max_params,
    }
    lines = [
        "# Host cost of one clip call on small DTensor gradients (2 gloo ranks, CPU)", "",
        f"Command: `{meta['command']}`; {meta['date_utc']} UTC; torch {meta['torch']}; commit {meta['git_commit']}; "
        f"{meta['cpu_count']} CPUs, 1 thread per rank; load average before {load_before[0]:.2f}, after "
        f"{meta['loadavg_after'][0]:.2f}. Median (best) of {args.reps} fastgrad and at most {args.torch_reps} "
        "torch repetitions; the first call of each is an untimed warm-up (its time in the \"first call\" columns).", "",
        "| params | fastgrad ms | us/param | first call ms | torch ms | torch reps | torch first call ms "
        "| torch / fastgrad |", "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fc = r["first_call_ms"]
        torch_cols = (f"{r['torch_median_ms']:.1f} ({r['torch_best_ms']:.1f}) | {r['torch_reps']} | {fc['torch']:.0f} | "
                      f"{r['speedup_median']:.1f}x" if r["torch_reps"] else "not run | 0 | - | -")
        lines.append(f"| {r['params']:,} | {r['fastgrad_median_ms']:.2f} ({r['fastgrad_best_ms']:.2f}) | "
                     f"{r['fastgrad_us_per_param']:.2f} | {fc['fastgrad']:.0f} | {torch_cols} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
