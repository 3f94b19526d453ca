"""Sharded gradients (issue 8): DTensor grads (FSDP2, tensor parallel) and hand-sharded grads with
``process_group=``, on 2 and 4 gloo ranks spawned on the CPU.

Every scenario builds the same full tensors on every rank (one seed), shards them, runs fastgrad on the
shards and compares with (a) torch.nn.utils on the very same DTensors, (b) a single-process torch run on the
whole tensors, and (c) the float64 oracle (docs/contract.md section 3 accuracy rule). Processes use a FileStore (no
port), a collective timeout and a wall-clock limit, and always destroy their process group.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch

import fastgrad
from fastgrad import distributed

from . import oracle
from .conftest import BACKEND_DEVICES
from .helpers import (CollectiveCount, assert_close_to_torch, assert_no_worse_than, norm_ulps, randn, rtol_vs_torch,
                      run_scenarios, scenario_outcome, spawn_ranks)

dist = torch.distributed
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

INF = float("inf")
# Norm orders with fused kernels plus 0 (torch's fallback semantics: tensors with a nonzero).
NORMS = [2.0, 1.0, INF, 3.0, 0.0]
# The Triton interpreter is far too slow for several processes; the C++ cpu kernels are covered.
CPU_BACKENDS = [b for b, d in BACKEND_DEVICES if d == "cpu" and b != "triton"]
WALL_LIMIT_S = 180


# ------------------------------------------------------------------------------------------ harness
# Starting a rank costs seconds (importing torch and DTensor), so each world size is spawned ONCE and its
# ranks run every scenario in turn; each scenario's outcome is written to a file and reported by its own
# test. A failure aborts the remaining scenarios of that world (its peers may be waiting in a collective).
def _plan(world: int) -> list[tuple[str, str]]:
    plan = [("amp", b) for b in CPU_BACKENDS]
    plan += [("dtensor_1d", b) for b in CPU_BACKENDS] + [("process_group", b) for b in CPU_BACKENDS]
    if world == 4:
        plan += [("dtensor_2d", b) for b in CPU_BACKENDS]
    if _fully_shard() is not None:
        plan += [("fsdp2", b) for b in CPU_BACKENDS]
    return plan


def _worker(rank: int, world: int, out_dir: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    run_scenarios(rank, world, out_dir, [
        (f"{scenario}-{backend}", functools.partial(SCENARIOS[scenario], rank, world, backend))
        for scenario, backend in _plan(world)])


def _launch(world: int, out_dir) -> str:
    """Run every scenario on ``world`` ranks; returns the launcher's error text ('' when all passed)."""
    return spawn_ranks(_worker, world, out_dir, WALL_LIMIT_S)


_RUNS: dict[int, tuple[str, str]] = {}


@pytest.fixture(scope="module")
def spawned():
    # A private directory, not pytest's tmp_path: concurrent pytest sessions prune each other's basetemp.
    root = tempfile.mkdtemp(prefix="fastgrad-dist-")

    def run(world: int) -> tuple[str, str]:
        if world not in _RUNS:
            out = os.path.join(root, f"world{world}")
            os.makedirs(out)
            _RUNS[world] = (out, _launch(world, out))
        return _RUNS[world]

    yield run
    _RUNS.clear()
    shutil.rmtree(root, ignore_errors=True)


def _outcome(spawned, world: int, scenario: str, backend: str) -> None:
    scenario_outcome(*spawned(world), f"{scenario}-{backend}", f" on {world} ranks")


class Holder:
    """A stand-in parameter: clip functions read only ``.grad``."""

    def __init__(self, grad):
        self.grad = grad


def _full_tensors(shapes, dtypes, seed=0, zero_index=None):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        t = randn(shape, dtypes[i % len(dtypes)], "cpu", gen, scale=0.5 + i)
        if i == zero_index:
            t.zero_()
        out.append(t)
    return out


def _norms(backend):
    """p = 0 has no fused kernel: only the torch backend serves it when asked for by name."""
    return NORMS if backend == "torch" else [p for p in NORMS if p != 0]


def _close(ours, ref, what):
    """Two runs of the same maths whose inputs differ only by reduction rounding (FSDP2's gradient
    averaging, a whole-tensor partition): the contract's fp32 rtol."""
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _vs_torch(ours, theirs, want, dtype, what, p=2.0, same=True, single=None, ulps=None):
    """docs/contract.md section 3 for sharded inputs. ``theirs``: torch on the same sharded inputs (its DTensor
    implementation, or the hand-written all-reduce ZeRO codes use): ours is no worse against the oracle
    (+1 ulp). ``single`` (default ``theirs``): torch on the whole tensors in one process: equal within the
    the contract's rtol for all-fp32 / all-fp64 lists (mixed lists: fastgrad accumulates everything in fp64, torch
    only the fp64 tensors, so the oracle rule alone applies). A sharded sum is rounded in pieces, so only
    the sharded reference bounds the error ulp by ulp."""
    assert_no_worse_than(ours, theirs, want, dtype, what, ulps=norm_ulps(p) if ulps is None else ulps)
    rtol = rtol_vs_torch(dtype)
    if same and rtol is not None:
        assert_close_to_torch(ours, theirs if single is None else single, want, rtol, what + " (rtol)")


def _torch_per_tensor(ts, p, acc):
    """torch's per-tensor norms (0 for a zero-size tensor, where torch raises for inf), as one plain
    tensor: torch._foreach_norm (what torch.nn.utils uses) for plain tensors, vector_norm for DTensors."""
    if not any(distributed.is_dtensor(t) for t in ts):
        idx = [i for i, t in enumerate(ts) if t.numel()]
        out = torch.zeros(len(ts), dtype=acc)
        if idx:
            out[idx] = torch.stack(torch._foreach_norm([ts[i] for i in idx], p, dtype=acc))
        return out
    out = []
    for t in ts:
        n = torch.linalg.vector_norm(t, p, dtype=acc) if t.numel() else torch.zeros((), dtype=acc)
        out.append(n.full_tensor() if distributed.is_dtensor(n) else n)
    return torch.stack(out)


def _check_norms_and_clip(rank, backend, fulls, dts, tag):
    """All checks on one list of DTensors ``dts`` whose full values are ``fulls``."""
    DTensor = distributed.dtensor.dtensor_class()
    acc = torch.float64 if any(f.dtype == torch.float64 for f in fulls) else torch.float32
    # torch raises for the inf norm of a zero-size tensor (fastgrad: 0, docs/contract.md section 3), so torch's
    # references leave those out; they add nothing to any norm of order >= 0. It also raises for the inf
    # norm of a DTensor with an empty local shard (3 rows on 4 ranks), so for inf its reference is the
    # single-process run (a max is exact whatever the order, so that is the same value).
    nonempty = [i for i, f in enumerate(fulls) if f.numel()]
    same = len({f.dtype for f in fulls}) == 1
    for p in _norms(backend):
        ours = fastgrad.get_total_norm(dts, p, backend=backend)
        assert isinstance(ours, DTensor) and all(pl.is_replicate() for pl in ours.placements), ours
        if p == INF:
            theirs = torch.nn.utils.get_total_norm([fulls[i] for i in nonempty], p)
        else:
            theirs = torch.nn.utils.get_total_norm([dts[i] for i in nonempty], p).full_tensor()
        ours = ours.full_tensor()
        assert ours.dtype == theirs.dtype
        want = oracle.total_norm(fulls, p)
        single = torch.nn.utils.get_total_norm([fulls[i] for i in nonempty], p)
        _vs_torch(ours, theirs, want, ours.dtype, f"{tag} get_total_norm p={p} rank {rank}", p, same, single)

        total, per = fastgrad.multi_tensor_norm(dts, p, per_tensor=True, backend=backend)
        assert isinstance(total, DTensor) and isinstance(per, DTensor) and per.dtype == acc
        per_want = [oracle.tensor_norm(f, p) for f in fulls]
        per_single = _torch_per_tensor(fulls, p, acc)
        per_theirs = per_single if p == INF else _torch_per_tensor(dts, p, acc)
        _vs_torch(per.full_tensor(), per_theirs, per_want, acc, f"{tag} multi_tensor_norm per-tensor p={p}", p,
                  single=per_single)
        _vs_torch(total.full_tensor(), theirs.to(acc), want, acc, f"{tag} multi_tensor_norm total p={p}", p, same)

    for p in (2.0, INF):
        for max_norm in (0.25, 1e6):  # clipping, and not
            ours_h = [Holder(d.clone()) for d in dts]
            ptrs = [h.grad._local_tensor.data_ptr() for h in ours_h]
            ref_h = [Holder(d.clone()) for d in dts]
            single = [Holder(f.clone()) for f in fulls]
            t_ours = fastgrad.clip_grad_norm_(ours_h, max_norm, p, backend=backend)
            t_single = torch.nn.utils.clip_grad_norm_([single[i] for i in nonempty], max_norm, p)
            if p == INF:
                t_ref, ref_h = t_single, single
            else:
                t_ref = torch.nn.utils.clip_grad_norm_([ref_h[i] for i in nonempty], max_norm, p).full_tensor()
            assert isinstance(t_ours, DTensor)
            t_ours = t_ours.full_tensor()
            want_total, want_grads = oracle.clipped(fulls, max_norm, p)
            what = f"{tag} clip p={p} max_norm={max_norm}"
            _vs_torch(t_ours, t_ref, want_total, t_ours.dtype, f"{what} total", p, same, t_single)
            for i, (o, r, s, w) in enumerate(zip(ours_h, ref_h, single, want_grads)):
                assert type(o.grad) is DTensor and o.grad.placements == dts[i].placements
                assert o.grad._local_tensor.data_ptr() == ptrs[i], "clipped in place"
                of = o.grad.full_tensor()
                rg = r.grad if p == INF else r.grad.full_tensor()
                _vs_torch(of, rg, w, of.dtype, f"{what} grad {i}", p, same, s.grad)

    # clip_grads_with_norm_ takes torch's own (Partial(max) for inf) DTensor norm; clip_grad_value_.
    ours_h = [Holder(d.clone()) for d in dts]
    ref_h = [Holder(d.clone()) for d in dts]
    n = torch.nn.utils.get_total_norm([dts[0], dts[-1]], INF)  # Partial(max); no empty local shard
    coef = min(0.3 / (oracle.LD(float(n.full_tensor())) + oracle.LD(1e-6)), 1)
    fastgrad.clip_grads_with_norm_(ours_h, 0.3, n, backend=backend)
    torch.nn.utils.clip_grads_with_norm_(ref_h, 0.3, n)
    for i, (o, r, f) in enumerate(zip(ours_h, ref_h, fulls)):
        _vs_torch(o.grad.full_tensor(), r.grad.full_tensor(), oracle.ld(f) * coef, f.dtype,
                  f"{tag} clip_grads_with_norm_ grad {i}", 2.0, same)
    ours_h = [Holder(d.clone()) for d in dts]
    ref_h = [Holder(d.clone()) for d in dts]
    fastgrad.clip_grad_value_(ours_h, 0.4, backend=backend)
    torch.nn.utils.clip_grad_value_(ref_h, 0.4)
    for o, r in zip(ours_h, ref_h):
        assert torch.equal(o.grad.full_tensor(), r.grad.full_tensor()), f"{tag} clip_grad_value_"


# ---------------------------------------------------------------------------------------- scenarios
def _scenario_dtensor_1d(rank, world, backend):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    # Sizes with uneven and empty shards (3 rows on 4 ranks, 1 row, 0 rows), an all-zero tensor (p=0 counts
    # it out) and replicated tensors that must be counted once.
    shapes = [(13, 7), (5,), (3, 2), (64, 9), (1, 4), (0, 3), (6, 5), (11,)]
    placements = [Shard(0), Replicate(), Shard(0), Shard(1), Replicate(), Shard(0), Shard(0), Shard(0)]
    for dtypes in ([torch.float32], [torch.float64, torch.float32]):
        fulls = _full_tensors(shapes, dtypes, seed=1, zero_index=6)
        dts = [distribute_tensor(f, mesh, [pl]) for f, pl in zip(fulls, placements)]
        _check_norms_and_clip(rank, backend, fulls, dts, f"1d mesh {dtypes}")

    # Partial: each rank holds a term; the tensor is their sum (needs care: norm of a sum).
    gen = torch.Generator().manual_seed(7)
    terms = [torch.randn(9, 4, generator=gen) for _ in range(world)]
    full_partial = torch.stack(terms).sum(0)
    fulls = _full_tensors([(10, 3), (7,)], [torch.float32], seed=3) + [full_partial]
    from torch.distributed.tensor import DTensor

    dts = [distribute_tensor(fulls[0], mesh, [Shard(0)]), distribute_tensor(fulls[1], mesh, [Replicate()]),
           DTensor.from_local(terms[rank].clone(), mesh, [Partial()], run_check=False)]
    for p in (2.0, INF, 1.0):
        ours = fastgrad.get_total_norm(dts, p, backend=backend).full_tensor()
        theirs = torch.nn.utils.get_total_norm(dts, p).full_tensor()
        _vs_torch(ours, theirs, oracle.total_norm(fulls, p), torch.float32, f"partial p={p}", p)

    def holders():  # clone() of a Partial DTensor reduces it, so the Partial one is built afresh
        return [Holder(d.clone()) for d in dts[:2]] + [
            Holder(DTensor.from_local(terms[rank].clone(), mesh, [Partial()], run_check=False))]

    h, ref_h = holders(), holders()
    t = fastgrad.clip_grad_norm_(h, 0.5, backend=backend).full_tensor()
    t_ref = torch.nn.utils.clip_grad_norm_(ref_h, 0.5).full_tensor()
    want_total, want_grads = oracle.clipped(fulls, 0.5, 2.0)
    _vs_torch(t, t_ref, want_total, torch.float32, "partial clip total")
    assert h[2].grad.placements[0].is_partial()  # the local term was scaled in place, not reduced
    for i, (o, r, w) in enumerate(zip(h, ref_h, want_grads)):
        _vs_torch(o.grad.full_tensor(), r.grad.full_tensor(), w, torch.float32, f"partial clip grad {i}")

    # A mixed list (torch raises): the plain tensor is replicated on every rank and counted once, whatever
    # its position; process_group= containing the mesh (the world) reduces over it (tests/
    # test_distributed_meshes.py covers the layouts).
    for mixed, whole in (([dts[0], fulls[1]], fulls[:2]), ([fulls[1], dts[0]], [fulls[1], fulls[0]])):
        ours = fastgrad.get_total_norm(mixed, backend=backend)
        assert type(ours) is torch.Tensor  # not all DTensors on one mesh: a plain tensor, the same everywhere
        _close(ours.double(), torch.tensor(oracle.total_norm(whole, 2.0), dtype=torch.float64), "mixed list")
    t = fastgrad.clip_grad_norm_([Holder(dts[0].clone())], 1e6, process_group=dist.group.WORLD)
    _close(t.full_tensor().double(), torch.tensor(oracle.total_norm(fulls[:1], 2.0), dtype=torch.float64),
           "process_group=WORLD with DTensors")

    # A NaN on one rank's shard: every rank sees the non-finite norm, raises, and writes nothing.
    fulls = _full_tensors([(8, 3), (5,)], [torch.float32], seed=4)
    dts = [distribute_tensor(f, mesh, [Shard(0)]) for f in fulls]
    if rank == world - 1:
        dts[0]._local_tensor[0, 0] = float("nan")
    before = [d._local_tensor.clone() for d in dts]
    for p in (2.0, INF):
        assert math.isnan(fastgrad.get_total_norm(dts, p, backend=backend).full_tensor())
        with pytest.raises(RuntimeError, match="non-finite"):
            fastgrad.clip_grad_norm_([Holder(d) for d in dts], 1.0, p, error_if_nonfinite=True, backend=backend)
        for d, b in zip(dts, before):
            assert torch.equal(d._local_tensor.nan_to_num(), b.nan_to_num())


def _scenario_dtensor_2d(rank, world, backend):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    shapes = [(12, 6), (9, 5), (4, 7), (10,), (3, 3), (6, 8)]
    placements = [
        [Replicate(), Shard(0)],  # HSDP: replicated across dp, sharded within
        [Shard(0), Shard(1)],
        [Shard(1), Replicate()],
        [Replicate(), Replicate()],
        [Shard(0), Replicate()],
        [Replicate(), Shard(1)],
    ]
    fulls = _full_tensors(shapes, [torch.float32], seed=5, zero_index=4)
    dts = [distribute_tensor(f, mesh, pl) for f, pl in zip(fulls, placements)]
    _check_norms_and_clip(rank, backend, fulls, dts, "2d mesh")


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard  # torch 2.4, 2.5
        except ImportError:
            return None
    return fully_shard


def _scenario_fsdp2(rank, world, backend):
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = _fully_shard()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.LayerNorm(33),
                                torch.nn.Linear(33, 3))
    ref = copy.deepcopy(model)  # the single-process twin, same initial weights
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))  # same batch everywhere
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()

    DTensor = distributed.dtensor.dtensor_class()
    params = list(model.parameters())
    assert all(isinstance(p.grad, DTensor) and p.grad.placements[0].is_shard() for p in params)
    twins = [Holder(p.grad.clone()) for p in params]  # torch's clip on the same DTensors
    fulls = [p.grad.full_tensor() for p in params]  # the oracle's inputs
    for max_norm in (0.5, 1e6):
        total = fastgrad.clip_grad_norm_(model.parameters(), max_norm, backend=backend)
        t_twin = torch.nn.utils.clip_grad_norm_(twins, max_norm).full_tensor()
        t_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        assert isinstance(total, DTensor)
        total = total.full_tensor()
        want_total, want_grads = oracle.clipped(fulls, max_norm, 2.0)
        _vs_torch(total, t_twin, want_total, torch.float32, f"fsdp2 total vs torch on the DTensors {max_norm}")
        _close(total, t_ref, f"fsdp2 total vs single process max_norm={max_norm}")
        for (name, p), q, tw, w in zip(model.named_parameters(), ref.parameters(), twins, want_grads):
            g = p.grad.full_tensor()
            # The total is allowed 1 ulp beside torch's (it sums rounded per-shard partials in another order),
            # and the coefficient carries that ulp: a clipped element can then be 2 ulps off where torch's own
            # total happened to land closer. Seen on 4 ranks (0.weight, 1.02-1.05 ulps over the 1-ulp
            # allowance) where this machine's matmuls gave other gradient bits than earlier machines'.
            _vs_torch(g, tw.grad.full_tensor(), w, torch.float32, f"fsdp2 {name} vs torch on the DTensors",
                      ulps=2.0)
            _close(g, q.grad, f"fsdp2 {name} vs single process")
        fulls = [p.grad.full_tensor() for p in params]  # the next round starts from the clipped grads


def _shard_of(t, rank, world):
    """This rank's piece of ``t`` flattened (a tensor or an oracle array): every rank gets one, possibly
    empty, the first ``numel % world`` one element longer (tensor_split and array_split agree)."""
    if isinstance(t, np.ndarray):
        return np.array_split(t.reshape(-1), world)[rank]
    return t.reshape(-1).tensor_split(world)[rank].clone()


def _by_hand(shards, p, group, acc, per_tensor=False):
    """torch's answer for hand-sharded gradients, written as ZeRO-style codes do: torch's local norm
    (torch.nn.utils.get_total_norm, or per-tensor norms), an all-reduce of its p-th power (MAX for inf),
    the root. The combine is done in float64 as fastgrad does it, so the accuracy rule compares what the
    backends compute (the local norms) with torch's; rounding the combine in fp32 instead makes the
    reference better or worse by luck, an ulp either way. The rtol check against the single-process run
    bounds the combine itself."""
    if per_tensor:
        vals = _torch_per_tensor(shards, p, acc).double()
    else:
        local = [s for s in shards if s.numel()]
        vals = (torch.nn.utils.get_total_norm(local, p) if local else torch.zeros(())).double().reshape(1)
    if p == INF:
        dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
    else:
        vals = vals.pow(p)
        dist.all_reduce(vals, group=group)
        vals = vals.pow(1.0 / p)
    return (vals if per_tensor else vals[0]).to(acc)


def _scenario_process_group(rank, world, backend):
    shapes = [(13, 7), (5,), (3,), (64, 9), (1,), (0,), (6, 5)]
    world_group = dist.group.WORLD
    # Tensor i on every rank is a piece of one tensor: per-tensor results (and norm_type 0's count of tensors
    # with a nonzero) are the whole tensors'. Totals are the same with the bare group (tested below).
    pieces = distributed.Shards(world_group)
    for dtypes in ([torch.float32], [torch.float32, torch.bfloat16, torch.float64]):
        fulls = _full_tensors(shapes, dtypes, seed=2, zero_index=6)
        acc = torch.float64 if torch.float64 in dtypes else torch.float32
        nonempty = [f for f in fulls if f.numel()]  # torch raises for the inf norm of a zero-size tensor
        same = len(dtypes) == 1
        for p in _norms(backend):
            shards = [_shard_of(f, rank, world) for f in fulls]
            with CollectiveCount() as c:
                ours = fastgrad.get_total_norm(shards, p, backend=backend, process_group=pieces)
            # docs/distributed.md: a total is one collective; per-tensor results of pieces, and norm_type 0's
            # count of tensors with a nonzero, one more (the vector, once the header said the lists agree)
            assert c.n == (2 if p == 0 else 1), (p, c.kinds)
            assert type(ours) is torch.Tensor
            with CollectiveCount() as c:
                total, per = fastgrad.multi_tensor_norm(shards, p, per_tensor=True, backend=backend,
                                                        process_group=pieces)
            assert c.n == 2, (p, c.kinds)
            if p != 0:  # a total is the same whether the lists are pieces of one another or not
                assert torch.equal(fastgrad.get_total_norm(shards, p, backend=backend, process_group=world_group),
                                   ours)
            assert per.dtype == total.dtype == acc
            want = oracle.total_norm(fulls, p)
            per_want = [oracle.tensor_norm(f, p) for f in fulls]
            if p == 0:  # counts of tensors (per tensor: of elements) with a nonzero: exact
                assert float(ours) == want and float(total) == want
                assert per.tolist() == per_want
                continue
            single = torch.nn.utils.get_total_norm(nonempty, p)
            hand = _by_hand(shards, p, world_group, acc)
            _vs_torch(ours, hand.to(ours.dtype), want, ours.dtype, f"pg get_total_norm p={p} {dtypes}", p, same,
                      single)
            _vs_torch(per, _by_hand(shards, p, world_group, acc, True), per_want, acc, f"pg per-tensor p={p}", p,
                      single=_torch_per_tensor(fulls, p, acc))
            _vs_torch(total, hand, want, acc, f"pg multi_tensor_norm p={p}", p, same, single.to(acc))

            for max_norm in (0.25, 1e6):
                params = [Holder(s.clone()) for s in shards]
                by_hand = [Holder(s.clone()) for s in shards]
                single = [Holder(f.clone()) for f in fulls]
                t = fastgrad.clip_grad_norm_(params, max_norm, p, backend=backend, process_group=world_group)
                t_hand = _by_hand(shards, p, world_group, acc).to(t.dtype)
                torch.nn.utils.clip_grads_with_norm_(by_hand, max_norm, t_hand)
                t_single = torch.nn.utils.clip_grad_norm_([h for h in single if h.grad.numel()], max_norm, p)
                want_total, want_grads = oracle.clipped(fulls, max_norm, p)
                what = f"pg clip p={p} max_norm={max_norm} {dtypes}"
                _vs_torch(t, t_hand, want_total, t.dtype, what + " total", p, same, t_single)
                for i, (h, r, s, w) in enumerate(zip(params, by_hand, single, want_grads)):
                    _vs_torch(h.grad, r.grad, _shard_of(w, rank, world), h.grad.dtype, f"{what} grad {i}", p, same,
                              _shard_of(s.grad, rank, world))

    # Negative orders (torch backend only: no fused kernel): a rank with an empty shard adds nothing.
    if backend == "torch":
        fulls = _full_tensors([(13, 7), (3,), (5,)], [torch.float32], seed=13)
        shards = [_shard_of(f, rank, world) for f in fulls]
        for p in (-1.0, -INF):
            ours = fastgrad.get_total_norm(shards, p, backend=backend, process_group=world_group)
            single = torch.nn.utils.get_total_norm(fulls, p)
            _vs_torch(ours, single, oracle.total_norm(fulls, p), torch.float32, f"pg p={p}", 1.0)

    # Two independent groups at once (world 4): ranks {0,1} and {2,3} shard different tensors.
    if world >= 4:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = rank // 2
        fulls = _full_tensors([(9, 4), (7,)], [torch.float32], seed=10 + mine)
        shards = [_shard_of(f, rank % 2, 2) for f in fulls]
        ours = fastgrad.get_total_norm(shards, backend=backend, process_group=groups[mine])
        _vs_torch(ours, torch.nn.utils.get_total_norm(fulls), oracle.total_norm(fulls, 2.0), torch.float32,
                  "pg subgroup")

    # ZeRO-1 style: whole tensors dealt round-robin; with 3 tensors on 4 ranks one rank owns none and still
    # takes part in the collective.
    fulls = _full_tensors([(10, 3), (4,), (6, 6)], [torch.float32], seed=11)
    mine = [i for i in range(len(fulls)) if i % world == rank]
    owned = [Holder(fulls[i].clone()) for i in mine]
    single = [Holder(f.clone()) for f in fulls]
    t = fastgrad.clip_grad_norm_(owned, 0.5, backend=backend, process_group=world_group)
    t_single = torch.nn.utils.clip_grad_norm_(single, 0.5)
    want_total, want_grads = oracle.clipped(fulls, 0.5, 2.0)
    _vs_torch(t, t_single, want_total, torch.float32, "pg whole-tensor partition total")
    for h, i in zip(owned, mine):
        _vs_torch(h.grad, single[i].grad, want_grads[i], torch.float32, f"pg whole-tensor partition grad {i}")

    # NaN in one rank's shard: NaN everywhere; error_if_nonfinite raises on every rank before any write.
    fulls = _full_tensors([(8, 3), (5,)], [torch.float32], seed=12)
    shards = [_shard_of(f, rank, world) for f in fulls]
    if rank == 1:
        shards[0][0] = float("nan")
    for p in (2.0, INF, 1.0):
        assert math.isnan(fastgrad.get_total_norm(shards, p, backend=backend, process_group=world_group))
        params = [Holder(s.clone()) for s in shards]
        with pytest.raises(RuntimeError, match="non-finite"):
            fastgrad.clip_grad_norm_(params, 1.0, p, error_if_nonfinite=True, backend=backend,
                                     process_group=world_group)
        for h, s in zip(params, shards):
            assert torch.equal(h.grad.nan_to_num(), s.nan_to_num())


def _scaled_setup(fulls, makers, scale):
    """Parameters (``makers[i](full)`` builds a DTensor or a shard) with gradients ``full * scale``, an SGD
    optimizer and a CPU GradScaler whose scale is initialised to ``scale``."""
    params = []
    for f, make in zip(fulls, makers):
        prm = torch.nn.Parameter(make(torch.ones_like(f)))
        prm.grad = make(f * scale)
        params.append(prm)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))  # creates the scale tensor
    return params, opt, scaler


def _local(t):
    return t._local_tensor if distributed.is_dtensor(t) else t


def _scenario_amp(rank, world, backend):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    shapes = [(13, 7), (5,), (64, 9), (3,)]
    fulls = _full_tensors(shapes, [torch.float32], seed=21)
    placements = [Shard(0), Replicate(), Shard(1), Shard(0)]
    scale = 1024.0
    for overflow in (False, True):
        if overflow:  # an inf in the last rank's piece of the first tensor only
            rows = fulls[0].shape[0]
            first_row_of_last = rows - rows // world if rows % world == 0 else (world - 1) * -(-rows // world)
            fulls = [f.clone() for f in fulls]
            fulls[0][min(first_row_of_last, rows - 1), 0] = float("inf")
        for kind in ("dtensor", "process_group"):
            if kind == "dtensor":
                makers = [lambda f, pl=pl: distribute_tensor(f, mesh, [pl]) for pl in placements]
                pg = None
            else:
                makers = [lambda f: _shard_of(f, rank, world).reshape(-1)] * len(fulls)
                pg = dist.group.WORLD

            def build():
                return _scaled_setup(fulls, makers, scale)

            params, opt, scaler = build()
            total = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, backend=backend, process_group=pg)
            if kind == "dtensor":
                r_params, r_opt, r_scaler = build()
                r_scaler.unscale_(r_opt)  # torch's own, on the same DTensors
                r_total = torch.nn.utils.clip_grad_norm_(r_params, 0.5).full_tensor()
                total = total.full_tensor()
            else:  # the single-process run on whole tensors
                r_params, r_opt, r_scaler = _scaled_setup(fulls, [torch.clone] * len(fulls), scale)
                r_scaler.unscale_(r_opt)
                r_total = torch.nn.utils.clip_grad_norm_(r_params, 0.5)
            what = f"amp {kind} overflow={overflow}"
            found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
            r_found = r_scaler._per_optimizer_states[id(r_opt)]["found_inf_per_device"]
            assert list(found) == [torch.device("cpu")], found
            assert float(found[torch.device("cpu")]) == float(overflow) == float(r_found[torch.device("cpu")]), \
                (what, found, r_found)
            if overflow:
                assert not math.isfinite(float(total)) and not math.isfinite(float(r_total)), what
            else:
                unscaled = [f.double() for f in fulls]
                want_total, want_grads = oracle.clipped(unscaled, 0.5, 2.0)
                _vs_torch(total, r_total, want_total, torch.float32, what + " total")
                for i, (q, r, w) in enumerate(zip(params, r_params, want_grads)):
                    g = q.grad.full_tensor() if kind == "dtensor" else q.grad
                    rg = r.grad.full_tensor() if kind == "dtensor" else _shard_of(r.grad, rank, world)
                    ww = w if kind == "dtensor" else _shard_of(w, rank, world)
                    # The fused read pass (the backends' amp_norm) yields one fp32 total per rank, not
                    # per-tensor norms, so the norm may sit 1 ulp from torch's and the coefficient with
                    # it: a clipped element can then be 2 ulps off where torch is exact.
                    _vs_torch(g, rg, ww, torch.float32, f"{what} grad {i}", ulps=2.0)
            # The step is skipped on overflow on every rank, and the scale backs off, as torch's.
            before = [_local(q).clone() for q in params]
            scaler.step(opt)
            scaler.update()
            r_scaler.step(r_opt)
            r_scaler.update()
            assert float(scaler.get_scale()) == float(r_scaler.get_scale()), what
            for q, b in zip(params, before):
                if b.numel():  # (an empty local shard is unchanged either way)
                    assert torch.equal(_local(q), b) == overflow, what + " step skipped iff overflow"


SCENARIOS = {
    "dtensor_1d": _scenario_dtensor_1d,
    "dtensor_2d": _scenario_dtensor_2d,
    "fsdp2": _scenario_fsdp2,
    "process_group": _scenario_process_group,
    "amp": _scenario_amp,
}


# -------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_1d_mesh(spawned, world, backend):
    _outcome(spawned, world, "dtensor_1d", backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_dtensor_2d_mesh(spawned, backend):
    _outcome(spawned, 4, "dtensor_2d", backend)


@pytest.mark.skipif(_fully_shard() is None, reason="FSDP2 fully_shard is not in this torch")
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_fully_shard_matches_single_process(spawned, world, backend):
    _outcome(spawned, world, "fsdp2", backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("world", [2, 4])
def test_process_group_hand_sharded(spawned, world, backend):
    _outcome(spawned, world, "process_group", backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("world", [2, 4])
def test_scaler_unscale_and_clip_sharded(spawned, world, backend):
    _outcome(spawned, world, "amp", backend)


def test_plain_calls_do_not_touch_distributed():
    """The common call pays one type check and never imports torch.distributed.tensor for it."""
    g = [torch.randn(4)]
    assert not distributed.has_dtensor(g)
    assert not distributed.is_dtensor(torch.tensor(1.0))
    assert fastgrad.clip_grad_norm_([Holder(g[0])], 1.0, backend="torch").dim() == 0


def test_no_group_keys_the_caches_by_a_constant():
    """A call without a process group keys its cached layouts by 0, not ``id(None)``: the Dynamo of torch 2.11
    cannot trace ``id(None)``, which ``clip_grad_norm_`` reaches under ``torch.compile(fullgraph=True)``. A
    group keys by its identity (the caches check the object itself on a hit)."""
    from fastgrad.distributed.plan import group_key

    group = object()
    assert group_key(None) == 0
    assert group_key(group) == id(group) != 0
