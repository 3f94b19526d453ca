"""exact=True over gloo ranks (1, 2 and 4): hand-sharded pieces (``Shards``), pipeline stages (``process_group=``),
DTensors on a 1-D mesh (FSDP-style Shard(0), Replicate) and a 2-D mesh (HSDP, TP): the norm is the same bytes
as the single-process exact norm of the whole tensors (itself the fractions oracle's), and clipped shards are
the slices of the single-process clip, bit for bit."""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile

import pytest
import torch

import fastgrad
from fastgrad import distributed

from .exact_oracle import correctly_rounded
from .helpers import CollectiveCount, run_scenarios, scenario_outcome, spawn_ranks

dist = torch.distributed
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")
WALL_LIMIT_S = 240
DTYPE_MIXES = ([torch.float32], [torch.float32, torch.bfloat16, torch.float64])


class Holder:
    def __init__(self, grad):
        self.grad = grad


def _bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _fulls(dtypes, shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * 10.0 ** (i % 5 - 2)).to(dtypes[i % len(dtypes)])
            for i, s in enumerate(shapes)]


def _single(fulls, p):
    """The single-process exact results on the whole tensors, checked against the oracle once."""
    total = fastgrad.get_total_norm(fulls, p, exact=True)
    vals = [v for f in fulls for v in f.double().reshape(-1).tolist()]
    assert _bits(total) == _bits(correctly_rounded(vals, p, total.dtype))
    return total


def _clipped(fulls, p, max_norm=0.5):
    grads = [f.clone() for f in fulls]
    total = fastgrad.clip_grad_norm_([Holder(g) for g in grads], max_norm, p, exact=True)
    return total, grads


def _piece(t, rank, world):
    return t.reshape(-1).tensor_split(world)[rank]


def _scenario_shards(rank, world):
    shapes = [(13, 7), (5,), (0,), (64, 9), (1,), (301,)]
    pieces = distributed.Shards(dist.group.WORLD)
    for dtypes in DTYPE_MIXES:
        fulls = _fulls(dtypes, shapes, seed=2)
        for p in (2.0, 1.0):
            mine = [_piece(f, rank, world).clone() for f in fulls]
            want = _single(fulls, p)
            with CollectiveCount() as c:  # the digits ride the one all-reduce
                got = fastgrad.get_total_norm(mine, p, process_group=pieces, exact=True)
            assert c.n == 1, c.kinds
            assert _bits(got) == _bits(want), (p, dtypes, got.item(), want.item())
            with CollectiveCount() as c:  # per-tensor pieces: the usual second one
                total, per = fastgrad.multi_tensor_norm(mine, p, per_tensor=True, process_group=pieces, exact=True)
            assert c.n == 2, c.kinds
            w_total, w_per = fastgrad.multi_tensor_norm(fulls, p, per_tensor=True, exact=True)
            assert _bits(total) == _bits(w_total) and _bits(per) == _bits(w_per)
            if p == 2.0:  # grad_stats' total
                params = [torch.nn.Parameter(torch.zeros_like(m)) for m in mine]
                for prm, m in zip(params, mine):
                    prm.grad = m
                st = fastgrad.grad_stats(params, process_group=pieces, exact=True)
                assert _bits(st.total_norm) == _bits(want)
            # clipped pieces are the slices of the single-process clip
            c_total, c_grads = _clipped(fulls, p)
            t = fastgrad.clip_grad_norm_([Holder(g) for g in mine], 0.5, p, process_group=pieces, exact=True)
            assert _bits(t) == _bits(c_total)
            for g, c in zip(mine, c_grads):
                assert _bits(g) == _bits(_piece(c, rank, world))


def _scenario_stages(rank, world):
    # pipeline stages: tensor i lives on rank i % world only
    shapes = [(13, 7), (5,), (64, 9), (1,), (301,), (2, 2), (7,)]
    for dtypes in DTYPE_MIXES:
        fulls = _fulls(dtypes, shapes, seed=3)
        mine = [f for i, f in enumerate(fulls) if i % world == rank]
        for p in (2.0, 1.0):
            want = _single(fulls, p)
            got = fastgrad.get_total_norm(mine, p, process_group=dist.group.WORLD, exact=True)
            # each stage gets the norm of all stages' values, rounded once to its own list's dtype
            vals = [v for f in fulls for v in f.double().reshape(-1).tolist()]
            assert _bits(got) == _bits(correctly_rounded(vals, p, got.dtype))
            if got.dtype == want.dtype:
                assert _bits(got) == _bits(want)


def _dtensor_checks(rank, fulls, dts, what):
    for p in (2.0, 1.0):
        want = _single(fulls, p)
        got = fastgrad.get_total_norm(dts, p, exact=True)
        assert _bits(got.full_tensor()) == _bits(want), (what, p)
        total, per = fastgrad.multi_tensor_norm(dts, p, per_tensor=True, exact=True)
        w_total, w_per = fastgrad.multi_tensor_norm(fulls, p, per_tensor=True, exact=True)
        assert _bits(total.full_tensor()) == _bits(w_total) and _bits(per.full_tensor()) == _bits(w_per), what
        c_total, c_grads = _clipped(fulls, p)
        hs = [Holder(d.clone()) for d in dts]
        t = fastgrad.clip_grad_norm_(hs, 0.5, p, exact=True)
        assert _bits(t.full_tensor()) == _bits(c_total), what
        for h, c in zip(hs, c_grads):
            assert _bits(h.grad.full_tensor()) == _bits(c), what


def _scenario_dtensor_1d(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    shapes = [(13, 7), (5,), (3, 2), (64, 9), (1, 4), (0, 3), (11,)]
    placements = [Shard(0), Replicate(), Shard(0), Shard(1), Replicate(), Shard(0), Shard(0)]
    for dtypes in DTYPE_MIXES:
        fulls = _fulls(dtypes, shapes, seed=1)
        dts = [distribute_tensor(f, mesh, [pl]) for f, pl in zip(fulls, placements)]
        _dtensor_checks(rank, fulls, dts, f"1d {dtypes}")


def _scenario_dtensor_2d(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    shapes = [(12, 6), (9, 5), (4, 7), (10,), (3, 3), (6, 8)]
    placements = [[Replicate(), Shard(0)], [Shard(0), Shard(1)], [Shard(1), Replicate()],
                  [Replicate(), Replicate()], [Shard(0), Replicate()], [Replicate(), Shard(1)]]
    fulls = _fulls([torch.float32], shapes, seed=5)
    dts = [distribute_tensor(f, mesh, pl) for f, pl in zip(fulls, placements)]
    _dtensor_checks(rank, fulls, dts, "2d")


def _scenario_fsdp2(rank, world):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.LayerNorm(33), torch.nn.Linear(33, 3))
    ref = copy.deepcopy(model)
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))  # the same batch on every rank
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    # the same batch everywhere: FSDP2's averaged gradients are the single-process ones (a power-of-two mean)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _bits(p.grad.full_tensor()) == _bits(q.grad)
    for norm_type in (2.0, 1.0):
        total = fastgrad.clip_grad_norm_(model.parameters(), 0.5, norm_type, exact=True)
        want = fastgrad.clip_grad_norm_(ref.parameters(), 0.5, norm_type, exact=True)
        assert _bits(total.full_tensor()) == _bits(want)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert _bits(p.grad.full_tensor()) == _bits(q.grad)


def _scenario_amp_guard(rank, world):
    """scaler_unscale_and_clip and StepGuard.clip_(scaler) with exact=True on hand-sharded pieces: the norm of
    the unscaled pieces in one all-reduce, the same bytes as the single-process exact clip (a power-of-two
    scale: the unscaled values are the gradients themselves), the clipped pieces its slices."""
    from torch.amp.grad_scaler import GradScaler

    from fastgrad.guard import StepGuard

    pieces = distributed.Shards(dist.group.WORLD)
    scale = 2.0 ** 8
    for dtypes in ([torch.float32], [torch.float32, torch.bfloat16]):
        fulls = _fulls(dtypes, [(13, 7), (5,), (64, 9), (1,), (301,)], seed=4)
        c_total, c_grads = _clipped(fulls, 2.0)
        for how in ("amp", "guard"):
            params = [torch.nn.Parameter(_piece(f, rank, world).clone()) for f in fulls]
            for prm in params:
                prm.grad = prm.detach() * scale
            opt = torch.optim.SGD(params, lr=0.1)
            scaler = GradScaler("cpu", init_scale=scale)
            scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
            with CollectiveCount() as c:
                if how == "amp":
                    got = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, process_group=pieces, exact=True)
                else:
                    got = StepGuard(opt, 0.5, process_group=pieces, exact=True).clip_(scaler)
            assert c.n == 1, c.kinds
            assert _bits(got) == _bits(c_total), (how, dtypes)
            for prm, cg in zip(params, c_grads):
                assert _bits(prm.grad) == _bits(_piece(cg, rank, world)), (how, dtypes)
            flags = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
            assert [f.item() for f in flags.values()] == [0.0]
        # an overflow on one rank: every rank records it and skips
        params = [torch.nn.Parameter(_piece(f, rank, world).clone()) for f in fulls]
        for prm in params:
            prm.grad = prm.detach() * scale
        if rank == world - 1:
            params[-1].grad[0] = math.inf
        opt = torch.optim.SGD(params, lr=0.1)
        scaler = GradScaler("cpu", init_scale=scale)
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        got = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, process_group=pieces, exact=True)
        assert not math.isfinite(got.item())
        flags = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        assert [f.item() for f in flags.values()] == [1.0]
    # a ShardedGradScaler: the overflow verdict is the reduced exact norm's, the same on every rank, so its own
    # reduction of the flags (a second collective, which would count the ranks) does not run
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    fulls = _fulls([torch.float32], [(13, 7), (5,), (64, 9)], seed=5)
    c_total, _ = _clipped(fulls, 2.0)
    # also a scaler whose own group is not the ranks the norm reached (each rank alone): an exact read's verdict
    # is global already, so it still takes no second collective (a default read there would run the scaler's own)
    singles = [dist.new_group([r]) for r in range(world)]
    for overflow, scaler_group in ((False, None), (True, None), (True, singles[rank])):
        params = [torch.nn.Parameter(_piece(f, rank, world).clone()) for f in fulls]
        for prm in params:
            prm.grad = prm.detach() * scale
        if overflow and rank == world - 1:
            params[-1].grad[0] = math.inf
        opt = torch.optim.SGD(params, lr=0.1)
        kw = {} if scaler_group is None else {"process_group": scaler_group}
        scaler = ShardedGradScaler(device="cpu", init_scale=scale, **kw)
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        with CollectiveCount() as c:
            got = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, process_group=pieces, exact=True)
        assert c.n == 1, c.kinds
        assert overflow or _bits(got) == _bits(c_total)
        flags = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        assert [tuple(f.shape) for f in flags.values()] == [(1,)]
        assert [f.item() for f in flags.values()] == [float(overflow)]


def _scenario_guard_copy(rank, world):
    """A NaN in a Replicate() copy that only the last rank holds uncounted: every rank's exact verdict is NaN
    (one collective), so every rank skips alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fastgrad.guard import StepGuard

    mesh = init_device_mesh("cpu", (world,))
    fulls = _fulls([torch.float32], [(8, 3), (5,)], seed=5)
    params = [torch.nn.Parameter(distribute_tensor(f, mesh, [pl])) for f, pl in zip(fulls, (Shard(0), Replicate()))]
    for prm, f in zip(params, fulls):
        prm.grad = prm.detach().clone()
    if world > 1 and rank == world - 1:
        params[1].grad.to_local()[0] = math.nan
    opt = torch.optim.SGD(params, lr=0.1)
    with CollectiveCount() as c:
        got = StepGuard(opt, 0.5, exact=True).clip_().full_tensor()
    assert c.n == 1, c.kinds
    if world > 1:
        assert math.isnan(got.item())
    else:
        assert _bits(got) == _bits(_single(fulls, 2.0))


SCENARIOS = {"amp_guard": _scenario_amp_guard, "guard_copy": _scenario_guard_copy,
             "shards": _scenario_shards, "fsdp2": _scenario_fsdp2, "stages": _scenario_stages, "dtensor_1d": _scenario_dtensor_1d,
             "dtensor_2d": _scenario_dtensor_2d}


def _plan(world):
    return [s for s in SCENARIOS if s != "dtensor_2d" or world == 4]


def _worker(rank: int, world: int, out_dir: str) -> None:
    run_scenarios(rank, world, out_dir, [(s, functools.partial(SCENARIOS[s], rank, world)) for s in _plan(world)])


_RUNS: dict[int, tuple[str, str]] = {}


@pytest.fixture(scope="module")
def spawned():
    root = tempfile.mkdtemp(prefix="fastgrad-exact-")

    def run(world):
        if world not in _RUNS:
            out = os.path.join(root, f"world{world}")
            os.makedirs(out)
            _RUNS[world] = (out, spawn_ranks(_worker, world, out, WALL_LIMIT_S))
        return _RUNS[world]

    yield run
    _RUNS.clear()
    shutil.rmtree(root, ignore_errors=True)


# only the pairs a world can run (a 2-D mesh needs 4 ranks): a pair that can never apply is not generated
_CASES = [(scenario, world) for world in (1, 2, 4) for scenario in SCENARIOS if scenario in _plan(world)]


@pytest.mark.parametrize("scenario,world", _CASES, ids=[f"{s}-{w}" for s, w in _CASES])
def test_exact_across_ranks_and_layouts(spawned, world, scenario):
    scenario_outcome(*spawned(world), scenario, f" on {world} ranks")
