"""Test inputs and comparison rules shared by the test modules."""

from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from . import oracle

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DTYPE_IDS = ["fp32", "fp16", "bf16", "fp64"]

# Odd sizes, a 0-size tensor and sizes that cross the usual 1K/4K block and 64K chunk boundaries.
SHAPES = [(7,), (3, 5), (1,), (0,), (17, 33), (4, 3, 3, 3), (1025,), (2, 0, 3), (4097,), (257, 3), (65537,)]
SMALL_SHAPES = [(7,), (3, 5), (1,), (0,), (17, 33), (4, 3, 3, 3), (1025,)]


def randn(shape, dtype, device, gen: torch.Generator, scale: float = 1.0, noncontig: bool = False) -> Tensor:
    """Fresh random non-zero values (never zeros); non-contiguous when asked and possible."""
    if noncontig and len(shape) >= 1:
        base = torch.randn(*shape[:-1], shape[-1] * 2, generator=gen, dtype=torch.float64) * scale
        t = base[..., ::2]  # every other element of the last dim: non-contiguous, not dense
    else:
        t = torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale
    t = torch.where(t == 0, torch.full_like(t, 0.5), t)
    if noncontig and len(shape) >= 1:
        out = torch.empty(*shape[:-1], shape[-1] * 2, dtype=dtype, device=device)[..., ::2]
        out.copy_(t)
        return out
    return t.to(device, dtype)


def make_params(shapes: Sequence[tuple], dtypes, device: str, seed: int = 0, scale: float = 1.0,
                noncontig: bool = False, none_every: int = 0) -> list[torch.nn.Parameter]:
    """Parameters with random non-zero values and gradients; ``dtypes`` cycles over the shapes;
    every ``none_every``-th parameter (if > 0) gets no gradient."""
    if isinstance(dtypes, torch.dtype):
        dtypes = [dtypes]
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, shape in enumerate(shapes):
        dt = dtypes[i % len(dtypes)]
        p = torch.nn.Parameter(randn(shape, dt, device, gen))
        if not (none_every and i % none_every == none_every - 1):
            p.grad = randn(shape, dt, device, gen, scale=scale, noncontig=noncontig)
        params.append(p)
    return params


def clone_params(params: Sequence[torch.nn.Parameter], device=None) -> list[torch.nn.Parameter]:
    """Deep copies that keep each gradient's strides (so non-contiguous stays non-contiguous), on
    ``device`` if given (a reference that torch can only compute there), else on the originals' device."""
    out = []
    for p in params:
        dev = p.device if device is None else torch.device(device)
        q = torch.nn.Parameter(p.detach().to(dev, copy=True))
        if p.grad is not None:
            g = p.grad
            if g.is_contiguous():
                q.grad = g.to(dev, copy=True)
            else:
                storage = torch.empty(g.untyped_storage().nbytes() // g.element_size(), dtype=g.dtype,
                                      device=dev)
                c = storage.as_strided(g.shape, g.stride(), g.storage_offset())
                c.copy_(g)
                q.grad = c
        out.append(q)
    return out


def grads(params) -> list[Tensor]:
    return [p.grad for p in params if p.grad is not None]


def optimizer_state(opt) -> list[Tensor]:
    """Every state value of ``opt``, parameter by parameter in group order, keys sorted (scalars as tensors)."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for k in sorted(opt.state[p]):
                v = opt.state[p][k]
                out.append(v if isinstance(v, Tensor) else torch.tensor(float(v)))
    return out


def ulp(x, dtype: torch.dtype) -> np.ndarray:
    """One unit in the last place of |x| in ``dtype`` (long double array); the smallest normal's at 0."""
    fi = torch.finfo(dtype)
    a = np.maximum(np.abs(oracle.ld(x)), oracle.LD(fi.tiny))
    _, e = np.frexp(a)  # a = m * 2**e with m in [0.5, 1)
    return np.ldexp(oracle.LD(fi.eps), e - 1)


def _split_nonfinite(o, r, t, what):
    """Where the oracle or the reference is non-finite, ours must match the reference exactly
    (NaN where NaN, the same infinities); returns the finite mask."""
    nonfinite = ~np.isfinite(t) | ~np.isfinite(r)
    if nonfinite.any():
        a, b = o[nonfinite], r[nonfinite]
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        assert same.all(), f"{what}: non-finite values differ: ours {a[~same][:3]} ref {b[~same][:3]}"
    return ~nonfinite


def _three(ours, ref, oracle_values, what):
    o, r, t = oracle.ld(ours), oracle.ld(ref), oracle.ld(oracle_values)
    assert o.shape == t.shape == r.shape, f"{what}: shapes {o.shape}, {r.shape}, oracle {t.shape}"
    return o, r, t


def assert_no_worse_than(ours, ref, oracle_values, dtype: torch.dtype, what: str = "", ulps: float = 1.0) -> None:
    """docs/contract.md section 3 accuracy rule, elementwise: |ours - oracle| <= |ref - oracle| + 1 ulp of ``dtype``.
    Non-finite values must match the reference exactly. ``ulps`` widens the slack only where the maths
    amplifies rounding (see ``norm_ulps``)."""
    o, r, t = _three(ours, ref, oracle_values, what)
    f = _split_nonfinite(o, r, t, what)
    err = np.abs(o[f] - t[f])
    allowed = np.abs(r[f] - t[f]) + oracle.LD(ulps) * ulp(t[f], dtype)
    bad = err > allowed
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {int(f.sum())} elements worse than the reference; worst: ours "
        f"{o[f][bad][:3]} ref {r[f][bad][:3]} oracle {t[f][bad][:3]}"
    )


def norm_ulps(norm_type: float, values=None) -> float:
    """Slack (in ulps) for p-norms, from the maths rather than from what a kernel gives:

    * the final root multiplies the power sum's relative error by 1/p, so for p < 1 even a correctly
      rounded power sum is up to 0.5/p + 0.5 ulp off (1 ulp suffices for p >= 1);
    * when 1/p is not a power of two it is itself rounded, and ``S ** (1/p)`` then carries a relative error
      of |ln S| x that rounding (at most a quarter ulp per unit of |ln S| for 1/p < 1), which torch's and
      fastgrad's different summation orders expose differently. ``values`` are the norms being checked.
    """
    if not 0 < norm_type < float("inf"):
        return 1.0
    slack = max(1.0, 1.0 / norm_type)
    if values is not None and not math.log2(norm_type).is_integer():
        v = np.abs(oracle.ld(values)).astype(np.float64).reshape(-1)
        v = v[(v > 0) & np.isfinite(v)]
        if v.size:
            slack += float(np.abs(np.log(v)).max()) * norm_type / 4
    return slack


def assert_max_error_within(ours, ref, oracle_values, dtype: torch.dtype, what: str = "",
                            factor: float = 2.0) -> None:
    """For ops whose outputs can cancel to near zero (GC) or hinge on a per-unit ratio (AGC): the largest
    error over the tensor is at most ``factor`` x a same-precision reference implementation's largest
    error, plus 1 ulp of the largest oracle value. Non-finite values must match the reference exactly."""
    o, r, t = _three(ours, ref, oracle_values, what)
    f = _split_nonfinite(o, r, t, what)
    if not f.any():
        return
    err = np.abs(o[f] - t[f]).max()
    allowed = factor * np.abs(r[f] - t[f]).max() + ulp(np.abs(t[f]).max(), dtype)
    assert err <= allowed, f"{what}: max error {err} > {factor} x reference's ({np.abs(r[f] - t[f]).max()}) + 1 ulp"


def assert_close_to_torch(ours, ref, oracle_values, rtol: float, what: str = "") -> None:
    """docs/contract.md section 3: fp32/fp64 results equal torch's within rtol. Where torch's own result is further than that from
    the exact answer, ours may differ from torch by torch's error too (an accurate kernel cannot be closer
    to torch than torch is to the truth)."""
    o, r, t = _three(ours, ref, oracle_values, what)
    f = _split_nonfinite(o, r, t, what)
    diff = np.abs(o[f] - r[f])
    allowed = oracle.LD(rtol) * np.abs(r[f]) + np.abs(r[f] - t[f])
    bad = diff > allowed
    assert not bad.any(), f"{what}: {int(bad.sum())} elements differ from torch by more than rtol {rtol}: " \
        f"ours {o[f][bad][:3]} torch {r[f][bad][:3]} oracle {t[f][bad][:3]}"


def rtol_vs_torch(dtype: torch.dtype) -> float | None:
    """docs/contract.md section 3: fp32 results equal torch's within rtol 1e-6, fp64 within 1e-12 (others: oracle rule only)."""
    return {torch.float32: 1e-6, torch.float64: 1e-12}.get(dtype)


def bits(t: Tensor) -> Tensor:
    """Raw bits for bitwise comparisons (NaN payloads included)."""
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def is_nan(x) -> bool:
    return math.isnan(float(x))


# ------------------------------------------------------------------- per-row ops (AGC, GC) on the cuda backend
# Row classes of the cuda backend's row plan (csrc/cuda/apply.cu, plan_rows): a row spanning at most 8
# 16-byte windows per lane is held in registers by a team of 1, 2, 4, ..., 32 lanes (up to 4 KB), up to
# 2048 windows (32 KB) by a whole block; longer rows are split into 32768-element chunks. Row starts off a
# 16-byte boundary span one window more.
CUDA_TEAM_BYTES = 4096
CUDA_BLOCK_ROW_BYTES = 32768
CUDA_CHUNK = 1 << 15


def cuda_row_lengths(dtype: torch.dtype) -> list[int]:
    """Row lengths (elements) on both sides of every class boundary for ``dtype``, and a row of several
    chunks."""
    size = torch.empty((), dtype=dtype).element_size()
    e = 16 // size
    team, block = CUDA_TEAM_BYTES // size, CUDA_BLOCK_ROW_BYTES // size
    return sorted({1, 2, e - 1, 31, 32, 33, 8 * e, 8 * e + 1, team - 1, team, team + 1, block - e, block - 1, block,
                   block + 1, block + e, 3 * CUDA_CHUNK + 5})


def cuda_row_shapes(dtype: torch.dtype) -> list[tuple]:
    """2-D shapes with rows of every class (many rows for the shortest, so that blocks pack several passes
    of teams and end part-full), and a few 1-D ones (a whole tensor is one unit)."""
    shapes = []
    for n in cuda_row_lengths(dtype):
        rows = 2500 if n <= 2 else (37 if n <= 64 else (5 if n * torch.empty((), dtype=dtype).element_size()
                                                              <= CUDA_BLOCK_ROW_BYTES else 2))
        shapes.append((rows, n))
    return shapes + [(1,), (33,), (CUDA_CHUNK + 3,)]


def mix_row_scales(params, small: float = 1e-3) -> None:
    """Scales every other dim-0 row of each 2-D gradient by ``small``, so that with a moderate clip factor
    some AGC units keep their gradient and others clip."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None and p.grad.dim() > 1:
                p.grad[::2].mul_(small)


def params_in_poisoned_buffer(shapes, dtype, device, seed: int, offset: int, gap: int = 5):
    """Parameters whose gradients are views into one NaN-filled buffer, starting ``offset`` elements in (row
    starts off 16-byte boundaries, as gradient-bucket views are) with ``gap`` NaN elements between them.
    Returns (params, buffer, guard mask): a kernel that reads a guard element gets NaN, one that writes one
    changes its bits."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [math.prod(s) for s in shapes]
    buf = torch.full((offset + sum(n + gap for n in sizes),), float("nan"), dtype=dtype, device=device)
    guard = torch.ones(buf.numel(), dtype=torch.bool, device=device)
    params, pos = [], offset
    for s, n in zip(shapes, sizes):
        p = torch.nn.Parameter(randn(s, dtype, device, gen))
        g = buf[pos:pos + n].view(s)
        g.copy_(randn(s, dtype, device, gen))
        guard[pos:pos + n] = False
        p.grad = g
        params.append(p)
        pos += n + gap
    return params, buf, guard


def cuda_profile(fn) -> tuple[list[str], set[str]]:
    """``fn()`` under torch.profiler: the names of the CUDA kernels (and copies) it runs, in order, and the
    aten ops it calls on the host."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    # Kineto can book its own CUPTI buffer allocation as a device-side row ("Activity Buffer Request"), most
    # often in a process's first profile: not a launch, so the launch counts must not see it.
    return ([e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA
             and e.name != "Activity Buffer Request"],
            {e.name for e in events if e.name.startswith("aten::")})


def cuda_kernels_run(fn) -> list[str]:
    """Names of the CUDA kernels (and copies) that ``fn()`` runs, from torch.profiler."""
    return cuda_profile(fn)[0]


def zero_and_nan_rows(params) -> list[int]:
    """In every 2-D gradient of more than 2 rows: row 1 zeroed, one NaN in row 2. Returns their indices."""
    picked = []
    with torch.no_grad():
        for i, p in enumerate(params):
            if p.grad is not None and p.grad.dim() > 1 and p.grad.shape[0] > 2:
                p.grad[1].zero_()
                p.grad[2, -1] = float("nan")
                picked.append(i)
    return picked


def assert_zero_and_nan_rows(params, orig, picked) -> None:
    """A zeroed row keeps its bits; NaN fills its own row and no other."""
    for i in picked:
        g, o = params[i].grad, orig[i].grad
        assert torch.equal(bits(g[1]), bits(o[1])), f"grad {i}: a zero row was changed"
        assert torch.isnan(g[2]).all(), f"grad {i}: NaN did not fill its row"
        assert not torch.isnan(g[0]).any() and not torch.isnan(g[3:]).any(), f"grad {i}: NaN left its row"


def assert_repeatable_without_host_sync(params, op, runs: int = 4) -> None:
    """``op(copy of params)`` ``runs`` times gives bitwise identical gradients; every call after the first
    (which may build and upload a kernel table) runs under set_sync_debug_mode("error")."""
    outs = []
    for i in range(runs):
        mine = clone_params(params)
        if i:
            torch.cuda.set_sync_debug_mode("error")
        try:
            op(mine)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        outs.append([bits(g) for g in grads(mine)])
    assert all(all(torch.equal(a, b) for a, b in zip(o, outs[0])) for o in outs)


def spawn_ranks(worker, world: int, out_dir: str, wall_limit_s: float, args: tuple | None = None) -> str:
    """Run ``worker(rank, world, out_dir)`` (or ``worker(rank, *args)``) on ``world`` spawned processes (the gloo
    tests' launcher); returns the launcher's error text, '' when every rank finished in time. Ranks still alive
    at the end are killed (a hung collective must not hang the suite)."""
    import torch.multiprocessing as mp

    args = (world, str(out_dir)) if args is None else args
    ctx = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + wall_limit_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                return f"{world} ranks did not finish in {wall_limit_s} s"
        return ""
    except Exception as exc:  # a rank failed: its traceback is in the worker's own files too
        return f"{type(exc).__name__}: {exc}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()


def run_scenarios(rank: int, world: int, out_dir: str, scenarios) -> None:
    """The body of a gloo test worker (launched by :func:`spawn_ranks`): joins the group through a FileStore in
    ``out_dir``, runs each ``(name, fn)`` of ``scenarios`` as ``fn()`` then a barrier, and leaves ``name.ok``
    (rank 0) or ``name.fail.<rank>`` with the traceback. The first failure ends the run: its peers may be
    waiting in a collective, so the later scenarios report that they did not run (:func:`scenario_outcome`)."""
    import os
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.FileStore(os.path.join(out_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        torch.set_num_threads(1)  # several ranks share few cores
        for name, fn in scenarios:
            try:
                fn()
                dist.barrier()
            except BaseException:
                with open(os.path.join(out_dir, f"{name}.fail.{rank}"), "w") as f:
                    f.write(traceback.format_exc())
                raise
            if rank == 0:
                open(os.path.join(out_dir, f"{name}.ok"), "w").close()
    finally:
        dist.destroy_process_group()


def scenario_outcome(out_dir: str, launch_error: str, name: str, where: str = "") -> None:
    """Pass, or fail with the traceback a rank left for scenario ``name`` (:func:`run_scenarios`), or with why
    it did not run. ``where`` is added to the scenario's name in the message (e.g. " on 4 ranks")."""
    import os

    import pytest

    if os.path.exists(os.path.join(out_dir, name + ".ok")):
        return
    fails = sorted(f for f in os.listdir(out_dir) if f.startswith(name + ".fail."))
    if fails:
        with open(os.path.join(out_dir, fails[0])) as f:
            pytest.fail(f"{name}{where}, rank {fails[0].rsplit('.', 1)[1]}:\n{f.read()}")
    pytest.fail(f"{name}{where} did not run: {launch_error or 'an earlier scenario failed'}")


class CollectiveCount:
    """Counts the collectives a block really runs, from torch.profiler's ``gloo:*`` events (one per
    collective the gloo backend executes: ``gloo:all_reduce``, ``gloo:broadcast``, ...), not from a wrapped
    Python function, so a collective issued by torch itself (e.g. a DTensor redistribute) counts too.

        with CollectiveCount() as c:
            fastgrad.clip_grad_norm_(...)
        assert c.n == 1 and c.kinds == {"all_reduce": 1}
    """

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        names = [e.name for e in self._prof.events() if e.name.startswith("gloo:")]
        self.kinds: dict[str, int] = {}
        for name in names:
            kind = name.split(":", 1)[1]
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.n = len(names)
        return False
