"""Fixed host cost of one ``clip_grad_norm_`` call on CPU tensors (issue 13's host-overhead case).

Many tiny CPU gradients (one element each by default) make the call's fixed and per-tensor host work
the whole cost. Measured in the same run, interleaved round by round so machine noise hits all alike:

* ``fastgrad``: the public call as it runs now (cpu backend; the one-call C++ path when it applies);
* ``fastgrad_ops``: the same call forced through the op-by-op path (norm op, coefficient in torch, scale
  op), i.e. the code before the one-call path, for the before/after comparison;
* ``torch``: ``torch.nn.utils.clip_grad_norm_`` (foreach);
* ``fastgrad_zw``: ``fastgrad.clip_optimizer_grad_norm_(opt, max_norm)`` on a fused Adam over the same
  parameters (zero-write: the norm, then the coefficient left pending with a snapshot of the grads; each call
  replaces the previous one, no step is taken);
* ``amp`` (with ``--ops``): ``fastgrad.scaler_unscale_and_clip(scaler, opt, max_norm)`` with a CPU
  ``torch.amp.GradScaler`` and a plain Adam over the same parameters, the scaler's per-optimizer state emptied
  before each call (as ``scaler.update()`` leaves it); the scale is 1, so with the default ``--max-norm`` the
  factor is 1 and nothing is written, as for ``fastgrad``;
* ``guard`` (with ``--ops``): ``StepGuard(opt, max_norm).clip_()`` on a plain Adam over the same parameters (no
  step is taken).
* ``guard_step`` (with ``--ops``): ``guard.clip_()`` then ``optimizer.step()`` on an SGD whose own step does
  nothing, so what is timed is the clip plus the guard's step hooks (the check that the step's gradients are
  the ones the decision saw, and the skip path) and torch's hook dispatch.

``--ops`` chooses the variants (default ``fastgrad,fastgrad_ops,torch,fastgrad_zw``).

``--fresh``: every timed call gets new ``.grad`` tensors, made by autograd as a training loop with
``zero_grad(set_to_none=True)`` has them (one multiply per parameter, then ``backward()``; untimed): each
gradient is a new tensor in memory the call has not touched yet, and has no Python object. Without it the
same gradients are reused call after call (warm caches: the best case).

``--clock thread``: each call's CPU time in this thread (``time.thread_time``) instead of wall time: on a
shared, loaded machine the wall time also counts the time other processes held the core, the thread time
does not (the calls here run on this one thread: one-element tensors are below every parallel threshold).

``--max-norm`` large (default) means the coefficient is 1 and nothing is written; small means every
gradient is scaled. Reports the minimum and the median per call over all rounds.

    python benchmarks/host_overhead.py --tensors 4000,148 --rounds 30
    python benchmarks/host_overhead.py --tensors 4000 --rounds 30 --fresh
    python benchmarks/host_overhead.py --tensors 148,4000 --rounds 20 --clock thread --ops fastgrad,amp,guard,torch
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

if __name__ == "__main__":  # run as a script: measure this checkout's fastgrad, not another installed copy
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def params(n: int, numel: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(numel, generator=g)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(numel, generator=g)
    return ps


def fresh_grads(ps, coef) -> None:
    """New ``.grad`` tensors from autograd, as after ``zero_grad(set_to_none=True)`` and ``backward()``."""
    for p in ps:
        p.grad = None
    torch.stack([(p * c).sum() for p, c in zip(ps, coef)]).sum().backward()


class _Still(torch.optim.SGD):
    """An SGD whose step does nothing: torch still runs the step hooks around it. Named as torch's own, so
    the guard treats it as it treats torch's SGD (whose step does not write its gradients: the gradients'
    versions are not read again after it)."""

    def step(self, closure=None):
        return None


_Still.__module__ = "torch.optim.sgd"


def main(argv=None) -> int:
    import fastgrad
    from fastgrad import _scan

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", default="4000,148", help="comma list of list lengths")
    ap.add_argument("--numel", type=int, default=1, help="elements per gradient")
    ap.add_argument("--max-norm", type=float, default=1e9)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=0, help="calls per variant per round (0: ~20 ms worth)")
    ap.add_argument("--fresh", action="store_true", help="new autograd-made .grad tensors before every call")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="wall time (perf_counter) or this thread's CPU time (thread_time)")
    ap.add_argument("--ops", default="fastgrad,fastgrad_ops,torch,fastgrad_zw",
                    help="comma list of variants: fastgrad, fastgrad_ops, torch, fastgrad_zw, amp, guard, "
                         "guard_step")
    args = ap.parse_args(argv)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time

    real = _scan.clip_norm_cpu

    def op_by_op(ps):
        _scan.clip_norm_cpu = lambda *a: None
        try:
            return fastgrad.clip_grad_norm_(ps, args.max_norm)
        finally:
            _scan.clip_norm_cpu = real

    variants = {
        "fastgrad": lambda ps: fastgrad.clip_grad_norm_(ps, args.max_norm),
        "fastgrad_ops": op_by_op,
        "torch": lambda ps: torch.nn.utils.clip_grad_norm_(ps, args.max_norm),
    }
    print(f"# fastgrad {fastgrad.__file__}, torch {torch.__version__}, threads {torch.get_num_threads()}, max_norm {args.max_norm}, "
          f"numel {args.numel}, {'fresh grads every call' if args.fresh else 'same grads every call'}; "
          f"per call, microseconds of {args.clock} time; load average {os.getloadavg()[0]:.2f} at start")
    ops = [x for x in args.ops.split(",") if x]
    unknown = set(ops) - set(variants) - {"fastgrad_zw", "amp", "guard", "guard_step"}
    if unknown:
        ap.error(f"unknown --ops {sorted(unknown)}")
    for n in [int(x) for x in args.tensors.split(",") if x]:
        ps = params(n, args.numel)
        coef = [torch.randn(args.numel) for _ in ps]
        opt = torch.optim.Adam(ps, fused=True)
        variants["fastgrad_zw"] = lambda ps, opt=opt: fastgrad.clip_optimizer_grad_norm_(opt, args.max_norm)
        plain = torch.optim.Adam(ps)
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # factor 1 with a large max_norm: nothing written
        scaler.scale(torch.ones(()))  # the scale exists from the first scale() on
        states = scaler._per_optimizer_states

        def amp(ps, plain=plain, scaler=scaler, states=states):
            states.clear()  # as update() leaves it: the next unscale_ starts from a fresh state
            return fastgrad.scaler_unscale_and_clip(scaler, plain, args.max_norm)

        variants["amp"] = amp
        if "guard" in ops:
            variants["guard"] = lambda ps, g=fastgrad.StepGuard(torch.optim.Adam(ps), args.max_norm): g.clip_()
        if "guard_step" in ops:
            still = _Still(ps, lr=0.0)

            def guard_step(ps, g=fastgrad.StepGuard(still, args.max_norm), opt=still):
                g.clip_()
                opt.step()

            variants["guard_step"] = guard_step
        chosen = {k: variants[k] for k in ops}
        calls = args.calls or (5 if args.fresh else max(3, int(20_000 / (n * 0.15 + 10))))
        times = {k: [] for k in chosen}
        for fn in chosen.values():
            fn(ps)
        for _ in range(args.rounds):
            for name, fn in chosen.items():
                if args.fresh:  # time each call alone, after its own fresh gradients
                    t = 0.0
                    for _ in range(calls):
                        fresh_grads(ps, coef)
                        t0 = clock()
                        fn(ps)
                        t += clock() - t0
                else:
                    t0 = clock()
                    for _ in range(calls):
                        fn(ps)
                    t = clock() - t0
                times[name].append(t / calls * 1e6)
        base = statistics.median(times["torch"]) if "torch" in times else None
        for name, ts in times.items():
            med = statistics.median(ts)
            ratio = f"  (torch / this: {base / med:5.1f}x)" if base is not None else ""
            print(f"{n:6d} tensors  {name:13s} min {min(ts):9.1f}  median {med:9.1f}{ratio}")
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
