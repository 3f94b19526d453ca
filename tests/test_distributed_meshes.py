"""One global norm for any sharding (issue 22): gradients on several DeviceMeshes (mixture of experts), a
2-stage pipeline, HSDP, tensor parallel plus FSDP, DTensor and plain tensors mixed, tied and replicated
parameters, a rank with an empty list, on 4 gloo ranks spawned ONCE for the whole module.

Every scenario builds the whole model's gradients on every rank (one seed), so each rank can compute the
single-process float64 reference (tests/oracle.py) of the norm and of the clipped gradients. Checks: within
rtol 1e-6 of that reference (fp32), the same bits on every rank, and the number of collectives the
documentation promises (docs/distributed.md's table), counted from torch.profiler's gloo events.
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
from .helpers import CollectiveCount, randn, run_scenarios, scenario_outcome, spawn_ranks

dist = torch.distributed
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

INF = float("inf")
WORLD = 4
CPU_BACKENDS = [b for b, d in BACKEND_DEVICES if d == "cpu" and b != "triton"]
NORMS = [2.0, 1.0, INF, 3.0]
WALL_LIMIT_S = 240


# ------------------------------------------------------------------------------------------ harness
def _worker(rank: int, world: int, out_dir: str) -> None:
    only = os.environ.get("FASTGRAD_TEST_MESHES_ONLY")  # narrowing while debugging
    run_scenarios(rank, world, out_dir, [
        (f"{name}-{backend}", functools.partial(fn, rank, backend))
        for name, fn in SCENARIOS.items() for backend in CPU_BACKENDS
        if not only or f"{name}-{backend}" in only.split(",")])


_RUN: dict = {}


@pytest.fixture(scope="module")
def spawned():
    root = tempfile.mkdtemp(prefix="fastgrad-meshes-")
    error = spawn_ranks(_worker, WORLD, root, WALL_LIMIT_S)  # a failed rank's traceback is in its .fail file
    yield root, error
    shutil.rmtree(root, ignore_errors=True)


def _outcome(spawned, name: str, backend: str) -> None:
    scenario_outcome(*spawned, f"{name}-{backend}")


def _Count():
    """The collectives a block really runs (torch.profiler's gloo events; tests/helpers.py)."""
    return CollectiveCount()


class Holder:
    """A stand-in parameter: clip functions read only ``.grad``."""

    def __init__(self, grad):
        self.grad = grad


def _param(grad) -> torch.nn.Parameter:
    """A parameter (DTensor or plain, like ``grad``) whose gradient is ``grad``, for grad_stats."""
    prm = torch.nn.Parameter(torch.zeros_like(grad))
    prm.grad = grad
    return prm


def _fulls(shapes, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [randn(s, dtype, "cpu", gen, scale=0.5 + i) for i, s in enumerate(shapes)]


def _value(t) -> torch.Tensor:
    """A returned norm as a plain tensor: a Replicate DTensor's local value (no collective)."""
    if distributed.is_dtensor(t):
        assert all(pl.is_replicate() for pl in t.placements), t.placements
        return t._local_tensor
    return t


def _full(g) -> torch.Tensor:
    return g.full_tensor() if distributed.is_dtensor(g) else g


def _same_on_every_rank(x: torch.Tensor, what: str) -> None:
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, x.detach().double().reshape(-1).tolist())
    assert all(repr(g) == repr(got[0]) for g in got), f"{what}: ranks disagree: {got}"


def _close(ours, want, what, rtol=1e-6):
    ours = torch.as_tensor(ours).double()
    want = torch.from_numpy(np.asarray(want, dtype=np.float64))
    torch.testing.assert_close(ours, want, rtol=rtol, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


# The collectives per call that docs/distributed.md's table documents (test_docs_table_is_pinned reads the
# table and compares): a total (clip_grad_norm_, get_total_norm, scaler_unscale_and_clip) takes ONE; results
# per tensor that combine shards take one more (the vector, reduced once the header said the lists agree),
# norm_type=0 across DTensor stages one more again (the stages' counts); grad_stats two more (a SUM and a MAX);
# plain pipeline stages keep their own per-tensor results (nothing more to reduce).
COUNTS = {
    "total": 1, "per_tensor": 2, "per_tensor_plain_stages": 1, "zero_dtensor_stages": 3,
    "grad_stats": 3, "grad_stats_plain_stages": 1, "monitor_clip": 4, "sharded_scaler": 1,
    "sharded_scaler_other_group": 2,
}


def _check(rank, backend, fulls, mine, make, tag, *, group=None, staged=False, plain=False):
    """The checks of one layout. ``fulls``: every gradient of the model; ``mine``: the indices this rank's
    list holds (in order); ``make(i)``: this rank's gradient object for ``fulls[i]`` (fresh each call);
    ``group``: the process_group= to pass; ``staged``: the ranks hold different stages' DTensors;
    ``plain``: each rank holds its own plain tensors (per-tensor results are local)."""
    n_norm = COUNTS["total"]
    n_per = COUNTS["per_tensor_plain_stages"] if plain else COUNTS["per_tensor"]
    n_zero = n_per if plain or not staged else COUNTS["zero_dtensor_stages"]
    n_stats = COUNTS["grad_stats_plain_stages"] if plain else COUNTS["grad_stats"]
    kw = {} if group is None else {"process_group": group}
    for p in NORMS:
        want = oracle.total_norm(fulls, p)
        grads = [make(i) for i in mine]  # (built outside: distribute_tensor runs collectives of its own)
        with _Count() as c:
            ours = fastgrad.get_total_norm(grads, p, backend=backend, **kw)
        assert c.n == n_norm, f"{tag} get_total_norm p={p}: {c.n} collectives {c.kinds}, documented {n_norm}"
        ours = _value(ours)
        _close(ours, want, f"{tag} get_total_norm p={p}")
        _same_on_every_rank(ours, f"{tag} get_total_norm p={p}")

        max_norm = 0.3 * want  # clips
        holders = [Holder(make(i)) for i in mine]
        with _Count() as c:
            total = fastgrad.clip_grad_norm_(holders, max_norm, p, backend=backend, **kw)
        assert c.n == n_norm, f"{tag} clip p={p}: {c.n} collectives {c.kinds}"
        total = _value(total)
        want_total, want_grads = oracle.clipped(fulls, max_norm, p)
        _close(total, want_total, f"{tag} clip total p={p}")
        _same_on_every_rank(total, f"{tag} clip total p={p}")
        for h, i in zip(holders, mine):
            _close(_full(h.grad), want_grads[i], f"{tag} clipped grad {i} p={p}")

        # Per-tensor norms of this rank's list (across pipeline stages: its stage's), the total over all.
        grads = [make(i) for i in mine]
        with _Count() as c:
            total, per = fastgrad.multi_tensor_norm(grads, p, per_tensor=True, backend=backend, **kw)
        assert c.n == n_per, f"{tag} per-tensor p={p}: {c.n} collectives {c.kinds}, documented {n_per}"
        _close(_value(total), want, f"{tag} multi_tensor_norm total p={p}")
        _close(_value(per), [oracle.tensor_norm(fulls[i], p) for i in mine], f"{tag} per-tensor norms p={p}")
        _same_on_every_rank(_value(total), f"{tag} multi_tensor_norm total p={p}")

    if backend == "torch":  # norm_type 0 (tensors with a nonzero; torch's semantics): per-tensor counts
        grads = [make(i) for i in mine]
        with _Count() as c:
            zero = fastgrad.get_total_norm(grads, 0.0, backend=backend, **kw)
        assert c.n == n_zero, f"{tag} p=0: {c.n} collectives {c.kinds}, documented {n_zero}"
        assert float(_value(zero)) == oracle.total_norm(fulls, 0.0), f"{tag} p=0"

    params = [_param(make(i)) for i in mine]
    with _Count() as c:
        st = fastgrad.grad_stats(params, backend=backend, **kw)
    assert c.n == n_stats, f"{tag} grad_stats: {c.n} collectives {c.kinds}, documented {n_stats}"
    _close(st.total_norm, oracle.total_norm(fulls, 2.0), f"{tag} grad_stats total")
    _close(st.norm, [oracle.tensor_norm(fulls[i], 2.0) for i in mine], f"{tag} grad_stats norms")
    _close(st.max_abs, [fulls[i].abs().max().item() for i in mine], f"{tag} grad_stats max_abs", rtol=0)
    assert st.numel.tolist() == [fulls[i].numel() for i in mine], f"{tag} grad_stats numel"
    assert st.nan.sum().item() == 0 and st.inf.sum().item() == 0
    assert st.shapes == [tuple(fulls[i].shape) for i in mine]
    _same_on_every_rank(st.total_norm, f"{tag} grad_stats total")


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.4, 2.5
    return fully_shard


def _model_grads(model, shard, seed=1):
    """Run one forward/backward of ``model`` (after ``shard(model)``) on the same batch everywhere; returns
    the parameters and their gradients' full values."""
    shard(model)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()
    params = list(model.parameters())
    return params, [_full(p.grad).clone() for p in params]


def _from_param(params):
    """``make`` for model parameters: a fresh copy of the i-th gradient (DTensor clone keeps placements)."""
    return lambda i: params[i].grad.clone()


# ---------------------------------------------------------------------------------------- scenarios
def _scenario_moe(rank, backend):
    """Dense layers fully_shard'ed on a 1-D mesh of 4, experts on a 2-D ep x dp mesh: experts split by ep,
    each expert's weight sharded by dp, a router replicated on the expert mesh. ONE all-reduce."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dense_mesh = init_device_mesh("cpu", (WORLD,))
    ep_mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("ep", "dp"))
    torch.manual_seed(0)
    dense = torch.nn.Sequential(torch.nn.Linear(16, 11), torch.nn.GELU(), torch.nn.Linear(11, 16))
    params, dense_fulls = _model_grads(dense, lambda m: _fully_shard()(m, mesh=dense_mesh))
    expert_fulls = _fulls([(4, 9, 16), (4, 16, 9), (16, 4), (4, 5)], seed=3)
    placements = [(Shard(0), Shard(1)), (Shard(0), Shard(2)), (Replicate(), Replicate()), (Shard(0), Replicate())]
    fulls = dense_fulls + expert_fulls
    nd = len(dense_fulls)

    def make(i):
        if i < nd:
            return params[i].grad.clone()
        return distribute_tensor(fulls[i].clone(), ep_mesh, placements[i - nd])

    mine = list(range(len(fulls)))
    _check(rank, backend, fulls, mine, make, "moe")
    # the expert mesh alone (torch's 2-D case): the result is torch's Replicate DTensor on that mesh
    out = fastgrad.get_total_norm([make(i) for i in range(nd, len(fulls))], backend=backend)
    assert distributed.is_dtensor(out) and out.device_mesh is ep_mesh
    _close(_value(out), oracle.total_norm(expert_fulls, 2.0), "moe experts only")
    # a mixed-mesh result is a plain tensor, the same on every rank
    assert type(fastgrad.get_total_norm([make(i) for i in mine], backend=backend)) is torch.Tensor

    # The fused AMP path on the same layout: unscale + clip with one all-reduce (norm and overflow flag).
    scale = 1024.0  # a power of two: unscaling is exact, so the oracle's inputs are `fulls`
    params_amp = [_param(make(i) * scale) for i in mine]
    opt = torch.optim.SGD(params_amp, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))  # creates the scale tensor
    want_total, want_grads = oracle.clipped(fulls, 0.5, 2.0)
    with _Count() as c:
        total = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, backend=backend)
    assert c.n == COUNTS["total"], f"moe amp: {c.n} collectives {c.kinds}"
    _close(_value(total), want_total, "moe amp total")
    _same_on_every_rank(_value(total), "moe amp total")
    for q, i in zip(params_amp, mine):
        # one fp32 total per rank from the fused read pass: the coefficient may sit an ulp or two off
        _close(_full(q.grad), want_grads[i], f"moe amp grad {i}", rtol=2e-6)

    # NaN in one expert shard on one rank: NaN on every rank, and error_if_nonfinite raises on all of them
    # before anything is written.
    for p in (2.0, INF):
        grads = [make(i) for i in mine]
        if rank == 2:
            grads[nd]._local_tensor.view(-1)[0] = float("nan")
        assert math.isnan(float(_value(fastgrad.get_total_norm(grads, p, backend=backend)))), p
        before = [_full(g).nan_to_num() for g in grads]
        with pytest.raises(RuntimeError, match="non-finite"):
            fastgrad.clip_grad_norm_([Holder(g) for g in grads], 1.0, p, error_if_nonfinite=True, backend=backend)
        for g, b in zip(grads, before):
            assert torch.equal(_full(g).nan_to_num(), b)


def _scenario_pipeline(rank, backend):
    """2 stages x 2 data-parallel ranks: stage s = rank // 2 owns its layers, sharded over the stage's dp
    slice of a pp x dp mesh. The pipeline group (one rank per stage) or the world: ONE all-reduce (the
    stages tile the world); per-tensor results: the stage's vector, then the stage totals (2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("pp", "dp"))
    dp = mesh["dp"]
    pp_group = mesh["pp"].get_group()
    stage = rank // 2
    fulls = _fulls([(10, 6), (7,), (5, 3), (12, 4), (9,), (3, 3)], seed=5)
    placements = [Shard(0), Replicate(), Shard(1), Shard(0), Shard(0), Replicate()]
    mine = [0, 1, 2] if stage == 0 else [3, 4, 5]

    def make(i):
        return distribute_tensor(fulls[i].clone(), dp, [placements[i]])

    _check(rank, backend, fulls, mine, make, "pipeline pp group", group=pp_group, staged=True)
    _check(rank, backend, fulls, mine, make, "pipeline world", group=dist.group.WORLD, staged=True)

    # Forgetting the pipeline group would give this stage's norm only: an error, nothing written.
    grads = [make(i) for i in mine]
    before = [g._local_tensor.clone() for g in grads]
    with pytest.raises(ValueError, match="pipeline"):
        fastgrad.clip_grad_norm_([Holder(g) for g in grads], 1e-3, backend=backend)
    assert all(torch.equal(g._local_tensor, b) for g, b in zip(grads, before))
    # The stage's own group says "these ranks only": the stage's norm, one collective.
    with _Count() as c:
        own = fastgrad.get_total_norm(grads, backend=backend, process_group=dp.get_group())
    assert c.n == 1
    _close(_value(own), oracle.total_norm([fulls[i] for i in mine], 2.0), "pipeline stage only")

    # Plain (unsharded) stages: each stage's 2 dp ranks hold the same whole tensors, which is a DTensor
    # replicated on the stage's slice; as plain tensors they are disjoint across stages only, so the
    # pipeline group is the group: ranks 0 and 1 are stage 0's two replicas, in different pp groups.
    _check(rank, backend, fulls, mine, lambda i: fulls[i].clone(), "pipeline plain", group=pp_group, plain=True)


def _scenario_plain_stages(rank, backend):
    """Each rank holds a different pipeline stage's plain tensors (issue 31): per-tensor norms are the rank's
    own, the total is over every stage; lists of different lengths (1, 2, 3 and 2 tensors), then of equal
    lengths (where element-wise reduction across stages would silently give wrong per-tensor numbers)."""
    fulls = _fulls([(5, 4), (7,), (3, 3), (6, 2), (9,), (2, 5), (4,), (8, 3)], seed=15)
    layouts = {"different lengths": [[0], [1, 2], [3, 4, 5], [6, 7]],
               "equal lengths": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    for name, stages in layouts.items():
        mine = stages[rank]
        _check(rank, backend, fulls, mine, lambda i: fulls[i].clone(), f"plain stages, {name}",
               group=dist.group.WORLD, plain=True)
    # A stage without parameters still takes part (and adds nothing).
    mine = [[0, 1, 2], [], [3, 4], [5, 6, 7]][rank]
    t = fastgrad.get_total_norm([fulls[i].clone() for i in mine], backend=backend, process_group=dist.group.WORLD)
    _close(t, oracle.total_norm(fulls, 2.0), "plain stages with an empty stage")


def _scenario_fsdp2_stages(rank, backend):
    """2 pipeline stages of different depth (2 and 3 Linear layers), each fully_shard'ed on its dp slice of a
    pp x dp mesh: per-tensor norms of the stage's whole tensors on its ranks, the total over both stages."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("pp", "dp"))
    stage = rank // 2
    models, fulls_of = [], []
    for s in range(2):  # every rank builds both stages (one seed), shards and runs only its own
        torch.manual_seed(20 + s)
        widths = [16, 12, 16] if s == 0 else [16, 9, 7, 16]
        models.append(torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]))
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))  # _model_grads' batch
    for s, m in enumerate(models):  # the single-process reference of every stage's gradients
        ref = copy.deepcopy(m)
        ref(x).pow(2).sum().backward()
        fulls_of.append([q.grad.clone() for q in ref.parameters()])
    fulls = fulls_of[0] + fulls_of[1]
    offset = 0 if stage == 0 else len(fulls_of[0])
    params, got = _model_grads(models[stage], lambda m: _fully_shard()(m, mesh=mesh["dp"]))
    for g, w in zip(got, fulls_of[stage]):
        _close(g, w.double().numpy(), "fsdp2 stage gradient vs single process", rtol=1e-5)
    mine = [offset + j for j in range(len(params))]
    _check(rank, backend, fulls, mine, lambda i: params[i - offset].grad.clone(), "fsdp2 stages",
           group=mesh["pp"].get_group(), staged=True)


def _scenario_hsdp(rank, backend):
    """HSDP: fully_shard on a 2-D (replicate, shard) mesh, grads Replicate x Shard(0). ONE all-reduce."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 13), torch.nn.Tanh(), torch.nn.LayerNorm(13),
                                torch.nn.Linear(13, 5))
    params, fulls = _model_grads(model, lambda m: _fully_shard()(m, mesh=mesh))
    assert params[0].grad.placements[0].is_replicate() and params[0].grad.placements[1].is_shard()
    _check(rank, backend, fulls, list(range(len(fulls))), _from_param(params), "hsdp")

    # GradientMonitor through grad_stats: the statistics (a SUM and a MAX) then the clip (one more).
    mon = fastgrad.GradientMonitor(model, every=None, backend=backend)
    max_norm = 0.5 * oracle.total_norm(fulls, 2.0)
    want_total, want_grads = oracle.clipped(fulls, max_norm, 2.0)
    with _Count() as c:
        total = mon.clip_grad_norm_(max_norm)
    assert c.n == COUNTS["monitor_clip"], f"hsdp monitor clip: {c.n} collectives {c.kinds}"
    _close(_value(total), want_total, "hsdp monitor clip total")
    for q, w in zip(model.parameters(), want_grads):
        _close(_full(q.grad), w, "hsdp monitor clipped grad")


def _scenario_tp_fsdp(rank, backend):
    """Tensor parallel on the tp dimension, FSDP2 on the dp dimension of a dp x tp mesh. ONE all-reduce."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 16),
                                torch.nn.LayerNorm(16))

    def shard(m):
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        _fully_shard()(m, mesh=mesh["dp"])

    params, fulls = _model_grads(model, shard)
    assert any(len(p.grad.placements) == 2 for p in params)
    _check(rank, backend, fulls, list(range(len(fulls))), _from_param(params), "tp+fsdp")


def _scenario_mixed(rank, backend):
    """DTensors on a 1-D mesh and plain tensors replicated on every rank (a parameter left out of
    fully_shard), a plain one first in the list. ONE all-reduce."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    fulls = _fulls([(7, 3), (13, 5), (6,), (9, 2), (4,)], seed=7)
    dtensors = {1, 3}

    def make(i):
        return distribute_tensor(fulls[i].clone(), mesh, [Shard(0)]) if i in dtensors else fulls[i].clone()

    _check(rank, backend, fulls, list(range(len(fulls))), make, "mixed")


def _scenario_tied(rank, backend):
    """A tied embedding/output weight (one Parameter, listed once by parameters()) and parameters
    replicated on both dimensions of a 2-D mesh: each element counted once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh1 = init_device_mesh("cpu", (WORLD,))

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 16)
            self.mid = torch.nn.Linear(16, 16)
            self.out = torch.nn.Linear(16, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x):
            return self.out(torch.tanh(self.mid(self.emb(x))))

    torch.manual_seed(0)
    model = Tied()
    fully_shard = _fully_shard()
    fully_shard(model, mesh=mesh1)
    x = torch.randint(0, 10, (5, 3), generator=torch.Generator().manual_seed(2))
    model(x).pow(2).sum().backward()
    params = list(model.parameters())
    assert len(params) == 3  # the tied weight once
    fulls = [p.grad.full_tensor() for p in params]
    _check(rank, backend, fulls, list(range(3)), _from_param(params), "tied")

    mesh2 = init_device_mesh("cpu", (2, WORLD // 2))
    rep = _fulls([(6, 4), (5,), (8, 2)], seed=9)
    pls = [(Replicate(), Replicate()), (Replicate(), Shard(0)), (Shard(1), Replicate())]
    _check(rank, backend, rep, [0, 1, 2], lambda i: distribute_tensor(rep[i].clone(), mesh2, pls[i]), "replicated",
)


def _scenario_empty_rank(rank, backend):
    """Experts on a 3-rank mesh; rank 3 holds none (all its grads None) and still takes part: every rank
    passes process_group=WORLD. ONE all-reduce, no hang."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0, 1, 2])  # every rank constructs it (its group is created collectively)
    fulls = _fulls([(7, 5), (4,), (3, 8)], seed=11)
    pls = [Shard(0), Replicate(), Shard(1)]
    mine = [0, 1, 2] if rank < 3 else []

    def make(i):
        return distribute_tensor(fulls[i].clone(), mesh, [pls[i]])

    for p in (2.0, INF, 1.0):
        grads = [make(i) for i in mine]
        with _Count() as c:
            t = fastgrad.get_total_norm(grads, p, backend=backend, process_group=dist.group.WORLD)
        assert c.n == 1
        _close(_value(t), oracle.total_norm(fulls, p), f"empty rank p={p}")
        _same_on_every_rank(_value(t), f"empty rank p={p}")
        params = [Holder(make(i)) for i in mine] + [Holder(None)]
        with _Count() as c:
            t = fastgrad.clip_grad_norm_(params, 0.5, p, backend=backend, process_group=dist.group.WORLD)
        assert c.n == 1
        want_total, want_grads = oracle.clipped(fulls, 0.5, p)
        _close(_value(t), want_total, f"empty rank clip p={p}")
        for h, i in zip(params, mine):
            _close(_full(h.grad), want_grads[i], f"empty rank clipped {i} p={p}")
    st = fastgrad.grad_stats([_param(make(i)) for i in mine], backend=backend, process_group=dist.group.WORLD)
    _close(st.total_norm, oracle.total_norm(fulls, 2.0), "empty rank grad_stats")


def _scenario_errors(rank, backend):
    """Bad layouts raise a clear error before anything is written."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    g = distribute_tensor(_fulls([(8, 3)], seed=13)[0], mesh, [Shard(0)])
    before = g._local_tensor.clone()
    pair = dist.new_group([0, 1])  # every rank creates it; ranks 2, 3 are not members
    if rank < 2:
        # A group that shares ranks with the mesh without containing it (neither the world nor a pipeline
        # group): the reduction cannot count every element once.
        with pytest.raises(ValueError, match="shares ranks"):
            fastgrad.clip_grad_norm_([Holder(g)], 1e-3, backend=backend, process_group=pair)
    else:
        with pytest.raises(ValueError, match="not a member"):
            fastgrad.clip_grad_norm_([Holder(g)], 1e-3, backend=backend, process_group=pair)
    assert torch.equal(g._local_tensor, before)


def _same_error_everywhere(fn, tag: str, n: int | None = None) -> str:
    """``fn()`` raises RankMismatchError on every rank, with the same text, after ``n`` collectives (if
    given: the header rides in the norm's own); returns the text."""
    try:
        with _Count() as c:
            fn()
        text = None
    except distributed.RankMismatchError as e:
        text = str(e)
    assert n is None or c.n == n, f"{tag}: {c.n} collectives {c.kinds} before the error, documented {n}"
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, text)
    assert got[0] is not None and all(g == got[0] for g in got), f"{tag}: not the same error on every rank: {got}"
    return got[0]


def _scenario_mismatch(rank, backend):
    """Ranks that disagree (issue 31): the same RankMismatchError on every rank, raised from the header that
    rides in the norm's own collective, before anything is written; never a hang or a wrong number."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (WORLD,))
    fulls = _fulls([(8, 3), (12,), (4, 5), (8, 2)], seed=17)

    def local_dt(full, m, coord):
        # no collective (unlike distribute_tensor): ranks build lists that differ
        piece = full.chunk(m.size())[coord].clone()
        return DTensor.from_local(piece, m, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())

    def make(i):
        return local_dt(fulls[i], mesh, rank)

    # One rank's list has a tensor more (the total would silently be wrong): clip raises, nothing written.
    for p in (2.0, INF):
        grads = [make(i) for i in (range(4) if rank == 1 else range(3))]
        before = [g._local_tensor.clone() for g in grads]
        holders = [Holder(g) for g in grads]
        text = _same_error_everywhere(lambda: fastgrad.clip_grad_norm_(holders, 1e-3, p, backend=backend), "extra",
                                      COUNTS["total"])
        assert "gradient lists differ" in text, text
        assert all(torch.equal(g._local_tensor, b) for g, b in zip(grads, before))
    # Same length, another order: the per-tensor vector would add up different tensors.
    order = [0, 1, 2] if rank != 2 else [0, 2, 1]
    _same_error_everywhere(lambda: fastgrad.multi_tensor_norm([make(i) for i in order], per_tensor=True,
                                                              backend=backend), "order")
    # Different calls: another norm_type; per_tensor on one rank only.
    _same_error_everywhere(lambda: fastgrad.get_total_norm([make(i) for i in range(3)], 1.0 if rank == 3 else 2.0,
                                                           backend=backend), "norm_type")
    _same_error_everywhere(lambda: fastgrad.multi_tensor_norm([make(i) for i in range(3)], per_tensor=rank == 0,
                                                              backend=backend), "per_tensor")
    _same_error_everywhere(lambda: fastgrad.grad_stats([_param(make(i)) for i in range(2 + (rank == 0))],
                                                       backend=backend), "grad_stats")
    # ZeRO-style pieces (Shards): lists of different lengths, then the same length with another dtype.
    pieces = [fulls[i][rank::WORLD].clone() for i in range(3)]
    whole = distributed.Shards(dist.group.WORLD)
    _same_error_everywhere(lambda: fastgrad.multi_tensor_norm(pieces[: 2 + (rank == 1)], per_tensor=True,
                                                              backend=backend, process_group=whole), "shards length")
    typed = [x.double() if rank == 3 and i == 1 else x for i, x in enumerate(pieces)]
    _same_error_everywhere(lambda: fastgrad.get_total_norm(typed, backend=backend, process_group=whole),
                           "shards dtype")
    # A pipeline stage whose ranks disagree: stage 1's rank 3 lacks a tensor (the others agree).
    pp_mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("pp", "dp"))
    stage_list = [0, 1] if rank < 2 else ([2, 3] if rank == 2 else [2])
    text = _same_error_everywhere(
        lambda: fastgrad.multi_tensor_norm([local_dt(fulls[i], pp_mesh["dp"], rank % 2) for i in stage_list],
                                           per_tensor=True, backend=backend, process_group=pp_mesh["pp"].get_group()),
        "stage")
    assert "pipeline stage 1" in text, text
    # The fused AMP path: the scaler's state is left as it was (no flags recorded).
    params = [_param(make(i) * 8.0) for i in range(3 + (rank == 0))]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    _same_error_everywhere(lambda: fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0, backend=backend), "amp")
    assert scaler._per_optimizer_states[id(opt)]["stage"].name == "READY"
    # ... and a good call right after works (nothing stale).
    t = fastgrad.get_total_norm([make(i) for i in range(4)], backend=backend)
    _close(_value(t), oracle.total_norm(fulls, 2.0), "after the errors")


def _scenario_sharded_scaler(rank, backend):
    """ShardedGradScaler over FSDP-style DTensor gradients: its overflow reduction rides in the norm's
    all-reduce (ONE collective; found_inf 0/1 on every rank, the step skipped everywhere on an overflow in
    one rank's shard); a scaler whose process group is not the ranks the norm reaches keeps its own (2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    base = _fulls([(8, 5), (7,), (12, 3)], seed=19)
    pls = [Shard(0), Replicate(), Shard(0)]
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]  # every rank creates both
    scale = 256.0
    for scaler_group, n_want in ((dist.group.WORLD, COUNTS["sharded_scaler"]),
                                 (pair, COUNTS["sharded_scaler_other_group"])):
        for overflow in (False, True):
            fulls = [f.clone() for f in base]
            if overflow:
                fulls[2][7, 1] = INF  # rows 6..7 of 8: rank 3's shard only
            params = [_param(distribute_tensor(f * scale, mesh, [pl])) for f, pl in zip(fulls, pls)]
            opt = torch.optim.SGD(params, lr=0.1)
            scaler = ShardedGradScaler(device="cpu", init_scale=scale, process_group=scaler_group)
            scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
            with _Count() as c:
                total = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, backend=backend)
            assert c.n == n_want, f"sharded scaler: {c.n} collectives {c.kinds}, documented {n_want}"
            found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
            flags = [float(v.sum()) for v in found.values()]
            if scaler_group is dist.group.WORLD:
                assert flags == [float(overflow)], flags
            else:  # torch's own reduction over the pair: the number of its ranks that overflowed
                assert flags == [float(overflow and rank >= 2)], flags
            if not overflow:
                want_total, want_grads = oracle.clipped(fulls, 0.5, 2.0)
                _close(_value(total), want_total, "sharded scaler total")
                for q, w in zip(params, want_grads):
                    _close(_full(q.grad), w, "sharded scaler grad", rtol=2e-6)
            before = [q._local_tensor.clone() for q in params]
            scaler.step(opt)
            scaler.update()
            skipped = overflow and (scaler_group is dist.group.WORLD or rank >= 2)  # where found_inf says so
            assert float(scaler.get_scale()) == (scale / 2 if skipped else scale)
            if scaler_group is dist.group.WORLD:  # (elsewhere a clip by an inf norm zeroes the gradients)
                unchanged = all(torch.equal(q._local_tensor, b) for q, b in zip(params, before))
                assert unchanged == overflow, "step skipped iff overflow, on every rank"


def _scenario_cache(rank, backend):
    """The cached layout never gives a stale answer: the same list again (a hit), fresh gradient objects with
    the same spec objects, new specs with the same placements, then a changed placement, a changed mesh and
    a changed list, each checked against the float64 reference."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    fulls = _fulls([(8, 3), (6,), (4, 4)], seed=23)
    grads = [distribute_tensor(f.clone(), mesh, [Shard(0)]) for f in fulls]
    want = oracle.total_norm(fulls, 2.0)
    for _ in range(2):
        _close(_value(fastgrad.get_total_norm(grads, backend=backend)), want, "cache: same list")
    same_specs = [DTensor(g._local_tensor.clone(), g._spec, requires_grad=False) for g in grads]
    _close(_value(fastgrad.get_total_norm(same_specs, backend=backend)), want, "cache: same spec objects")
    new_specs = [DTensor.from_local(g._local_tensor.clone(), mesh, [Shard(0)], run_check=False,
                                    shape=g.shape, stride=g.stride()) for g in grads]
    _close(_value(fastgrad.get_total_norm(new_specs, backend=backend)), want, "cache: equal new specs")
    # Replicate() on the last one: counted on rank 0 only now (a stale layout would count it 4 times).
    changed = grads[:2] + [distribute_tensor(fulls[2].clone(), mesh, [Replicate()])]
    _close(_value(fastgrad.get_total_norm(changed, backend=backend)), want, "cache: changed placement")
    other = DeviceMesh("cpu", list(range(WORLD)))  # another mesh object over the same ranks
    moved = [distribute_tensor(f.clone(), other, [Replicate()]) for f in fulls]
    _close(_value(fastgrad.get_total_norm(moved, backend=backend)), want, "cache: another mesh")
    shorter = grads[:2]
    _close(_value(fastgrad.get_total_norm(shorter, backend=backend)), oracle.total_norm(fulls[:2], 2.0),
           "cache: another list")
    _close(_value(fastgrad.get_total_norm(grads, backend=backend)), want, "cache: the first list again")


SCENARIOS = {
    "moe": _scenario_moe,
    "pipeline": _scenario_pipeline,
    "plain_stages": _scenario_plain_stages,
    "fsdp2_stages": _scenario_fsdp2_stages,
    "hsdp": _scenario_hsdp,
    "tp_fsdp": _scenario_tp_fsdp,
    "mixed": _scenario_mixed,
    "tied": _scenario_tied,
    "empty_rank": _scenario_empty_rank,
    "errors": _scenario_errors,
    "mismatch": _scenario_mismatch,
    "sharded_scaler": _scenario_sharded_scaler,
    "cache": _scenario_cache,
}


# -------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_global_norm_any_sharding(spawned, scenario, backend):
    _outcome(spawned, scenario, backend)


def test_has_dtensor_sees_past_a_plain_first_tensor():
    """Mixed lists work whatever the order: has_dtensor looks at the whole list unless it is a Checked one."""
    from fastgrad import _scan

    plain = [torch.randn(3), torch.randn(2)]
    assert not distributed.has_dtensor(plain) and not distributed.has_dtensor([])
    assert not distributed.has_dtensor(_scan.checked(plain))


# Every row of docs/distributed.md's table, by its first cell, and the COUNTS entry that the scenarios above
# assert for it (each with a profiler count of the collectives gloo ran).
DOC_ROWS = {
    "FSDP2 (`fully_shard` on a 1-D mesh)": "total",  # fsdp2 in test_distributed, moe/mixed/tied here
    "HSDP (`fully_shard` on a 2-D replicate x shard mesh)": "total",  # hsdp
    "TP + FSDP2 (`parallelize_module` on `mesh[\"tp\"]`, `fully_shard` on `mesh[\"dp\"]`)": "total",  # tp_fsdp
    "EP / MoE (dense layers on a 1-D mesh, experts on an ep x dp mesh)": "total",  # moe
    "PP, DTensor stages (e.g. `fully_shard` per stage on `mesh[\"dp\"]` of a pp x dp mesh)": "total",  # pipeline,
    # fsdp2_stages
    "PP, plain stages (each rank its own tensors)": "total",  # plain_stages, pipeline plain
    "ZeRO-style plain pieces (tensor i on every rank is a piece of one tensor)": "total",  # test_distributed
    "plain tensors that several ranks hold (a tied embedding, LayerNorms under hand-written TP; "
    "[below](#copies-you-declare-tied-and-replicated-plain-tensors))": "total",  # test_distributed_copies, the fuzz
    "AMP, `GradScaler`": "total",  # moe amp
    "AMP, `ShardedGradScaler` whose process group is the ranks the norm reaches (its default `WORLD` with FSDP2 "
    "over the world)": "sharded_scaler",
    "AMP, `ShardedGradScaler` on another process group": "sharded_scaler_other_group",
    "per-tensor results of DTensors or `Shards` pieces (`multi_tensor_norm(per_tensor=True)`, `norm_type=0`)":
        "per_tensor",
    "per-tensor results, plain pipeline stages": "per_tensor_plain_stages",
    "`norm_type=0` across DTensor pipeline stages": "zero_dtensor_stages",
    "statistics": "grad_stats",
    "statistics, plain pipeline stages": "grad_stats_plain_stages",
    "monitoring and clipping (statistics, then the clip)": "monitor_clip",
}


def _doc(name: str) -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parent.parent / "docs" / name).read_text()


def test_docs_table_is_pinned():
    """docs/distributed.md's collective counts are the ones the scenarios assert (a row added, removed or
    changed in the docs without the tests fails here)."""
    rows = {}
    for line in _doc("distributed.md").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].isdigit():
            rows[cells[0]] = int(cells[2])
    assert set(rows) == set(DOC_ROWS), (set(rows) ^ set(DOC_ROWS))
    for label, n in rows.items():
        assert COUNTS[DOC_ROWS[label]] == n, (label, n, COUNTS[DOC_ROWS[label]])
    amp = " ".join(_doc("amp-reference.md").split())
    assert COUNTS["sharded_scaler"] == 1 and "one collective per call" in amp
    assert COUNTS["sharded_scaler_other_group"] == 2 and "(two collectives)" in amp


@pytest.mark.parametrize("op", [distributed.agreement._SUM, distributed.agreement._MAX, distributed.agreement._MIN])
def test_agreement_header_math(op):
    """The header's verdict from reduced headers, simulated: all-equal contributors pass, any differing one
    (in any field, in any group) fails, absent groups pass; exact for 16-bit values on many ranks."""
    agreement = distributed.agreement
    combine = {agreement._SUM: lambda a, b: a + b, agreement._MAX: torch.maximum, agreement._MIN: torch.minimum}[op]

    def reduced(per_rank):
        heads = [torch.tensor(distributed.agreement._header(op, groups), dtype=torch.float64) for groups in per_rank]
        out = heads[0]
        for h in heads[1:]:
            out = combine(out, h)
        return distributed.agreement._bad_groups(out, op).tolist()

    same = [[(0xFFFF, 7), None, (3, 0xBEEF)]] * 1000
    assert reduced(same) == [False, False, False]
    for g, field in ((0, 0), (0, 1), (2, 0), (2, 1)):
        other = [list(r) for r in same]
        vals = list(other[500][g])
        vals[field] = vals[field] - 1 if vals[field] else 1
        other[500][g] = tuple(vals)
        bad = reduced(other)
        assert bad[g] and sum(bad) == 1, (g, field, bad)
    # two values whose mean is an integer (the SUM check cannot be fooled by a symmetric spread)
    spread = [[(10, 0)], [(12, 0)], [(11, 0)]]
    assert reduced(spread) == [True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the deferred verdict is the CUDA path")
def test_deferred_verdict_on_cuda_without_host_sync():
    """On CUDA a totals-only call does not wait for the agreement verdict: it is copied to pinned memory with
    an event (no host sync) and the next sharded call raises it; a clean verdict raises nothing."""
    distributed.clear_cache()
    # the verdicts are made before the watch: a tensor built from a Python list is a pageable host-to-device
    # copy, which the sync debug mode reports (the 2026-11-27 H200 run failed there, not in _settle)
    clean = torch.zeros(3, dtype=torch.bool, device="cuda")
    bad = torch.tensor([False, True, False], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        distributed.agreement._settle(clean, blocking=False)
        distributed.agreement._settle(bad, blocking=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    with pytest.raises(distributed.RankMismatchError, match="gradient lists differ.*previous sharded call"):
        distributed.agreement.raise_pending()
    assert not distributed.agreement.PENDING
