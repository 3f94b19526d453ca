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

A repeat call on DTensor grads with CPU shards takes the one-pass local part (``fastgrad.distributed.local_cpu_norm``:
each grad, its spec and local tensor and the local norm in one C++ call, the scale in a second); ``general`` is
the same call with that pass declined, the path it replaced, timed in the same rounds (the before/after ratio).

Where fastgrad's time goes, measured in the same run on the same rank: ``local clip`` is fastgrad's
single-process ``clip_grad_norm_`` of the very same local tensors (plain tensors, no collective: the floor of
the read and write work, one C++ call on the CPU), ``kernel calls`` is the two backend calls the general path
makes around its all-reduce (the local norm, then the scale of the local tensors, each a
``torch.ops.fastgrad`` call over the list), ``prepare`` is the sharded layer's per-call host work alone
(``fastgrad.distributed.prepare`` on a repeat call: the cached layout's checks and the local tensors), and
``fresh grads`` times the clip when every gradient is a new DTensor object built on its parameter's spec
before each call, as FSDP2's reduce-scatter hands them out each step (the cached layout keys on the spec).
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


NAMES = ("fastgrad", "general", "torch", "local_clip", "kernel_calls", "prepare", "fresh_grads")


def _rank_main(rank: int, world: int, store_dir: str, args, out_file: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    import fastgrad
    from fastgrad import _scan
    from fastgrad import passes
    from fastgrad import distributed
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

        locals_ = [prm.grad._local_tensor for prm in params]
        local_params = []
        for loc in locals_:  # the same local tensors as plain gradients, for the single-process floor
            q = torch.nn.Parameter(torch.zeros_like(loc))
            q.grad = loc
            local_params.append(q)
        specs = [prm.grad._spec for prm in params]

        def ours():
            fastgrad.clip_grad_norm_(params, 1e-3)

        def theirs():
            torch.nn.utils.clip_grad_norm_(params, 1e-3)

        one_pass = distributed.local_cpu_norm

        def general():  # the same call with the one-pass local part declined: the path before it
            distributed.local_cpu_norm = lambda *a, **k: None
            try:
                fastgrad.clip_grad_norm_(params, 1e-3)
            finally:
                distributed.local_cpu_norm = one_pass

        def local_clip():
            fastgrad.clip_grad_norm_(local_params, 1e-3)

        checked_locals = _scan.checked(locals_)
        coef = torch.tensor(0.5)

        def kernel_calls():
            passes.list_norm(checked_locals, 2.0, None, None)
            passes.scale_(checked_locals, coef, None, None)

        grads = [prm.grad for prm in params]

        def prepare():
            distributed.prepare(grads)

        def refresh():  # FSDP2 hands out new gradient DTensors on the parameter's spec each step
            for prm, loc, spec in zip(params, locals_, specs):
                prm.grad = DTensor(loc, spec, requires_grad=False)

        def timed(fn, before=None) -> tuple[float, float]:
            """(wall, CPU) seconds of one call. The CPU time of the process is the host cost proper: on a
            loaded machine the wall time of a call with a collective also holds the wait for the other rank
            to be scheduled."""
            if before is not None:
                before()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            return time.perf_counter() - t0, time.process_time() - c0

        with_torch = n <= args.torch_max_params
        first = {"fastgrad": timed(ours)[0]}  # warm-up (sharding propagation caches)
        if with_torch:
            first["torch"] = timed(theirs)[0]
        timed(local_clip)
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in NAMES}
        for r in range(args.reps):
            runs["fastgrad"].append(timed(ours))
            runs["general"].append(timed(general))
            runs["local_clip"].append(timed(local_clip))
            runs["kernel_calls"].append(timed(kernel_calls))
            runs["prepare"].append(timed(prepare))
            runs["fresh_grads"].append(timed(ours, refresh))
            if with_torch and r < args.torch_reps:
                runs["torch"].append(timed(theirs))
        med = statistics.median
        row = {"params": n, "reps": args.reps, "torch_reps": len(runs["torch"]),
               "first_call_ms": {k: 1e3 * v for k, v in first.items()},
               "fastgrad_best_wall_ms": 1e3 * min(w for w, _ in runs["fastgrad"])}
        for k, v in runs.items():
            row[f"{k}_wall_us_per_param"] = 1e6 * med([w for w, _ in v]) / n if v else None
            row[f"{k}_cpu_us_per_param"] = 1e6 * med([c for _, c in v]) / n if v else None
        row["general_over_fastgrad_cpu"] = row["general_cpu_us_per_param"] / row["fastgrad_cpu_us_per_param"]
        row["torch_over_fastgrad_cpu"] = (row["torch_cpu_us_per_param"] / row["fastgrad_cpu_us_per_param"]
                                          if runs["torch"] else None)
        if rank == 0:
            print(f"{n:>6} params: " + ", ".join(
                f"{k} {row[f'{k}_wall_us_per_param']:.2f} wall / {row[f'{k}_cpu_us_per_param']:.2f} CPU us/param"
                for k in NAMES if runs[k]) + f"; first call {row['first_call_ms']}", flush=True)
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
        f"# Host cost of one clip call on small DTensor gradients ({args.world} gloo "
        f"rank{'s' if args.world > 1 else ''}, CPU)", "",
        f"Command: `{meta['command']}`; {meta['date_utc']} UTC; torch {meta['torch']}; commit {meta['git_commit']}; "
        f"{meta['cpu_count']} CPUs, 1 thread per rank; load average before {load_before[0]:.2f}, after "
        f"{meta['loadavg_after'][0]:.2f}. Per parameter, the median of {args.reps} repetitions (torch: at most "
        f"{args.torch_reps}) of rank 0's CPU time (process time: the host cost) and, in brackets, its wall time; "
        "the first call of each is an untimed warm-up (its wall time in the last column).", "",
        "| params | fastgrad clip, us/param: CPU (wall) | general path: CPU (wall) | general / fastgrad (CPU) "
        "| torch clip: CPU (wall) | torch / fastgrad (CPU) "
        "| local clip CPU | kernel calls CPU | prepare CPU | fresh grads CPU | first call ms: fastgrad, torch |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(r, k):
        if r[f"{k}_cpu_us_per_param"] is None:
            return "not run"
        return f"{r[f'{k}_cpu_us_per_param']:.2f} ({r[f'{k}_wall_us_per_param']:.2f})"

    for r in rows:
        fc = r["first_call_ms"]
        ratio = f"{r['torch_over_fastgrad_cpu']:.1f}x" if r["torch_over_fastgrad_cpu"] else "-"
        firsts = f"{fc['fastgrad']:.0f}, " + (f"{fc['torch']:.0f}" if "torch" in fc else "-")
        lines.append(f"| {r['params']:,} | {cell(r, 'fastgrad')} | {cell(r, 'general')} | "
                     f"{r['general_over_fastgrad_cpu']:.2f}x | {cell(r, 'torch')} | {ratio} | "
                     f"{r['local_clip_cpu_us_per_param']:.2f} | {r['kernel_calls_cpu_us_per_param']:.2f} | "
                     f"{r['prepare_cpu_us_per_param']:.2f} | {r['fresh_grads_cpu_us_per_param']:.2f} | {firsts} |")
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
