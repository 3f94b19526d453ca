"""Copies you declare (``fastgrad.distributed.Copies``, issue 48): plain tensors that several ranks hold whole (a
tied embedding on the first and last pipeline stage, LayerNorms under hand-written tensor parallelism) count
once, with the same collectives as without the declaration; on 4 gloo ranks spawned once for the module.

Each scenario builds the whole model on every rank (one seed) and compares with the float64 oracle of the
whole model, each tensor once (tests/oracle.py), and with ``exact=True`` with the single-process exact norm, bit
for bit. The layout fuzz (tests/test_layout_fuzz.py) runs ``Copies`` on random layouts too; here: every entry
that takes it (AMP, the step guard included), per-tensor results and ``norm_type=0`` across stages, and the
argument checks."""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
import tempfile

import pytest
import torch

import fastgrad
from fastgrad import distributed
from fastgrad.distributed import Copies, Partition, Shards

from . import oracle
from .helpers import CollectiveCount, run_scenarios, scenario_outcome, spawn_ranks

dist = torch.distributed
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")
WORLD = 4
WALL_LIMIT_S = 240
INF = math.inf


def _bits(t) -> bytes:
    t = t._local_tensor if distributed.is_dtensor(t) else t
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _close(got, want, what, rtol=1e-6):
    got = float(got._local_tensor if distributed.is_dtensor(got) else got)
    assert math.isclose(got, want, rel_tol=rtol, abs_tol=0) or (math.isnan(got) and math.isnan(want)), \
        f"{what}: {got!r} != {want!r}"


def _param(grad) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    return p


class _Megatron:
    """2 pipeline stages x 2 tensor-parallel ranks of plain tensors: a vocabulary-parallel embedding tied
    between the stages, per stage a LayerNorm (both tp ranks hold it whole) and a column-parallel weight."""

    def __init__(self, rank, dtype=torch.float32):
        self.stage, self.tp = divmod(rank, 2)
        gen = torch.Generator().manual_seed(3)
        self.whole = {k: (torch.randn(s, generator=gen, dtype=torch.float64) * 3).to(dtype)
                      for k, s in [("emb", (9, 4)), ("norm0", (4,)), ("fc0", (7, 4)), ("norm1", (4,)), ("fc1", (5, 4))]}
        self.embedding_ranks = [self.tp, 2 + self.tp]
        self.tp_ranks = [2 * self.stage, 2 * self.stage + 1]

    def grads(self):
        """This rank's gradients, fresh: (embedding piece, LayerNorm, linear piece)."""
        w = self.whole
        return [w["emb"].tensor_split(2)[self.tp].clone(), w[f"norm{self.stage}"].clone(),
                w[f"fc{self.stage}"].tensor_split(2)[self.tp].clone()]

    def params(self):
        return [_param(g) for g in self.grads()]

    def copies(self, params, base=None):
        return Copies(dist.group.WORLD if base is None else base,
                      {params[0]: self.embedding_ranks, params[1]: self.tp_ranks})


def _scenario_megatron(rank):
    """Every entry on the Megatron layout: the oracle's norm (each tensor once), ONE collective each, and without
    the declaration the over-count the declaration removes."""
    from fastgrad.guard import StepGuard

    m = _Megatron(rank)
    whole = list(m.whole.values())
    for p in (2.0, 1.0, INF):
        params = m.params()
        pg = m.copies(params)
        with CollectiveCount() as c:
            got = fastgrad.get_total_norm([q.grad for q in params], p, process_group=pg)
        assert c.n == 1, c.kinds
        _close(got, oracle.total_norm(whole, p), f"get_total_norm p={p}")
        with CollectiveCount() as c:
            ex = fastgrad.clip_grad_norm_(params, 0.5, p, process_group=pg, exact=True)
        assert c.n == 1, c.kinds
        ref = [w.clone() for w in whole]
        want = fastgrad.clip_grad_norm_([_Holder(r) for r in ref], 0.5, p, exact=True)
        assert _bits(ex) == _bits(want), (p, ex, want)
        emb, norm, fc = (q.grad for q in params)  # the clipped pieces are the single-process clip's
        assert _bits(emb) == _bits(ref[0].tensor_split(2)[m.tp])
        assert _bits(norm) == _bits(ref[1 + 2 * m.stage])
        assert _bits(fc) == _bits(ref[2 + 2 * m.stage].tensor_split(2)[m.tp])
    # without the declaration: the embedding counted twice, each LayerNorm twice (the bug Copies removes)
    over = fastgrad.get_total_norm(m.grads(), 2.0, process_group=dist.group.WORLD)
    twice = whole + [whole[0], whole[1], whole[3]]
    _close(over, oracle.total_norm(twice, 2.0), "undeclared copies count once per holder")
    # p = 0: each rank's own tensors (plain stages), a copy on its lowest rank only: 5 distinct tensors,
    # 4 ranks' linear pieces are 4 tensors of their own: emb pieces 2 + norms 2 + fc pieces 4
    params = m.params()
    zero = fastgrad.get_total_norm([q.grad for q in params], 0.0, process_group=m.copies(params))
    assert float(zero) == 8.0, float(zero)
    # per-tensor results: this rank's own tensors, copies included (nothing more to reduce: one collective)
    params = m.params()
    for exact in (False, True):
        with CollectiveCount() as c:
            total, per = fastgrad.multi_tensor_norm([q.grad for q in params], 2.0, per_tensor=True,
                                                    process_group=m.copies(params), exact=exact)
        assert c.n == 1, c.kinds
        want = [oracle.tensor_norm(g, 2.0) for g in m.grads()]
        for k in range(3):
            _close(per[k], want[k], f"per-tensor {k} exact={exact}")
        _close(total, oracle.total_norm(whole, 2.0), f"per-tensor call's total exact={exact}")
    with CollectiveCount() as c:
        st = fastgrad.grad_stats(params, process_group=m.copies(params))
    assert c.n == 1, c.kinds
    _close(st.total_norm, oracle.total_norm(whole, 2.0), "grad_stats total")
    assert st.numel.tolist() == [g.numel() for g in m.grads()]
    # AMP: unscale and clip, the norm of the unscaled values, one collective
    scale = 256.0
    params = m.params()
    for q in params:
        q.grad.mul_(scale)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    with CollectiveCount() as c:
        total = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, process_group=m.copies(params))
    assert c.n == 1, c.kinds
    want_total, want_grads = oracle.clipped(whole, 0.5, 2.0)
    _close(total, want_total, "scaler_unscale_and_clip")
    # the step guard: the norm, and a NaN in the copy that does not count (rank 3's LayerNorm) reaches every rank
    for bad in (False, True):
        params = m.params()
        if bad and rank == 3:
            params[1].grad[0] = math.nan
        opt = torch.optim.SGD(params, lr=0.1)
        guard = StepGuard(opt, 0.5, process_group=m.copies(params))
        try:
            total = guard.clip_()
            assert guard.last_step_skipped() == bad, (bad, rank)
            if not bad:
                _close(total, oracle.total_norm(whole, 2.0), "StepGuard")
        finally:
            guard.remove()


class _Holder:
    def __init__(self, grad):
        self.grad = grad


def _scenario_keys(rank):
    """A key is a parameter (its current .grad matched) or the gradient itself; keys not in the list are
    ignored; a Copies built once serves step after step (new .grad objects)."""
    m = _Megatron(rank)
    whole = list(m.whole.values())
    want = oracle.total_norm(whole, 2.0)
    grads = m.grads()
    by_grad = Copies(dist.group.WORLD, {grads[0]: m.embedding_ranks, grads[1]: m.tp_ranks})
    _close(fastgrad.get_total_norm(grads, process_group=by_grad), want, "gradients as keys")
    params = m.params()
    extra = _param(torch.ones(3))  # declared, not in the list (a per-group clip): ignored
    pg = Copies(dist.group.WORLD, {params[0]: m.embedding_ranks, params[1]: m.tp_ranks, extra: [rank]})
    for step in range(3):  # new gradient objects each step, as zero_grad(set_to_none=True) leaves them
        for q, g in zip(params, m.grads()):
            q.grad = g
        _close(fastgrad.clip_grad_norm_(params, 1e9, process_group=pg), want, f"step {step}")
    # Shards pieces with copies: small tensors held whole on every rank, the rest split; per-tensor: whole norms
    gen = torch.Generator().manual_seed(5)
    fulls = [torch.randn(s, generator=gen) for s in [(13,), (3,), (6, 2), (2,)]]
    whole_on = {1, 3}
    mine = [f.clone() if i in whole_on else f.reshape(-1).tensor_split(WORLD)[rank].clone() for i, f in enumerate(fulls)]
    pg = Copies(Shards(dist.group.WORLD), {mine[i]: list(range(WORLD)) for i in whole_on})
    with CollectiveCount() as c:
        total, per = fastgrad.multi_tensor_norm(mine, 2.0, per_tensor=True, process_group=pg)
    assert c.n == 2, c.kinds
    _close(total, oracle.total_norm(fulls, 2.0), "Shards + Copies total")
    for k, f in enumerate(fulls):
        _close(per[k], oracle.tensor_norm(f, 2.0), f"Shards + Copies per-tensor {k}")
    ex = fastgrad.get_total_norm(mine, 2.0, process_group=pg, exact=True)
    assert _bits(ex) == _bits(fastgrad.get_total_norm(fulls, 2.0, exact=True))


def _scenario_dtensor_stages(rank):
    """DTensor pipeline stages (pp 2 x dp 2) with an embedding tied between them, sharded over dp on each stage
    and declared a copy of the shard at the same dp coordinate: the total counts it once, each stage's
    per-tensor norms hold its whole norm, and norm_type=0 (stage counts added) counts it once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, coord = divmod(rank, 2)
    gen = torch.Generator().manual_seed(7)
    emb = torch.randn(7, 4, generator=gen)
    own = [[torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)],
           [torch.randn(3, generator=gen), torch.randn(2, 6, generator=gen), torch.zeros(3)]]
    fulls = [emb] + own[0] + own[1]
    mine = [emb] + own[stage]
    pls = [Shard(0), Replicate(), Shard(0)]

    def grads():
        return [distribute_tensor(t.clone(), mesh["dp"], [pls[i % 3]], src_data_rank=None) for i, t in enumerate(mine)]

    for group in (mesh["pp"].get_group(), dist.group.WORLD):
        g = grads()
        pg = Copies(group, {g[0]: [coord, 2 + coord]})
        with CollectiveCount() as c:
            total = fastgrad.get_total_norm(g, 2.0, process_group=pg)
        assert c.n == 1, c.kinds
        _close(total, oracle.total_norm(fulls, 2.0), "tied DTensor stages")
        assert _bits(fastgrad.get_total_norm(g, 2.0, process_group=pg, exact=True)) == \
            _bits(fastgrad.get_total_norm(fulls, 2.0, exact=True))
        for exact in (False, True):
            with CollectiveCount() as c:
                total, per = fastgrad.multi_tensor_norm(g, 2.0, per_tensor=True, process_group=pg, exact=exact)
            assert c.n == 2, c.kinds
            for k, t in enumerate(mine):
                _close(per[k], oracle.tensor_norm(t, 2.0), f"stage {stage} per-tensor {k} exact={exact}")
        with CollectiveCount() as c:
            zero = fastgrad.get_total_norm(g, 0.0, process_group=pg)
        assert c.n == 3, c.kinds
        assert float(zero) == 5.0, float(zero)  # 6 tensors, one of them all zeros; the tied one once
        params = [_param(t) for t in g]  # (new gradient objects: the parameter is the key that follows them)
        st = fastgrad.grad_stats(params, process_group=Copies(group, {params[0]: [coord, 2 + coord]}))
        _close(st.total_norm, oracle.total_norm(fulls, 2.0), "grad_stats total")
        for k, t in enumerate(mine):
            _close(st.norm[k], oracle.tensor_norm(t, 2.0), f"grad_stats norm {k}")


def _raises(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def _scenario_arguments(rank):
    """Bad declarations: a clear error before any work, gradients untouched."""
    g = torch.randn(5)
    _raises(TypeError, "a parameter or gradient tensor", lambda: Copies(dist.group.WORLD, {"w": [0]}))
    _raises(TypeError, "process group or a list of global ranks", lambda: Copies(dist.group.WORLD, {g: 3}))
    _raises(TypeError, "non-empty list of ints", lambda: Copies(dist.group.WORLD, {g: [0.5, rank]}))
    _raises(TypeError, "non-empty list of ints", lambda: Copies(dist.group.WORLD, {g: []}))
    _raises(TypeError, "non-empty list of ints", lambda: Copies(dist.group.WORLD, {g: [True, rank]}))
    _raises(TypeError, "dict", lambda: Copies(dist.group.WORLD, [g]))
    other = (rank + 1) % WORLD
    _raises(ValueError, f"do not include this rank \\({rank}\\)", lambda: Copies(dist.group.WORLD, {g: [other]}))
    _raises(ValueError, "not all ranks of the world", lambda: Copies(dist.group.WORLD, {g: [rank, WORLD]}))
    _raises(ValueError, "not all ranks of the world", lambda: Copies(dist.group.WORLD, {g: [rank, -1]}))
    _raises(ValueError, "declared twice", lambda: Copies(dist.group.WORLD, [(g, [rank]), (g, [rank])]))
    _raises(ValueError, "needs a process group", lambda: Copies(None, {g: [rank]}))
    _raises(ValueError, "needs a process group", lambda: Copies(Shards(None), {g: [rank]}))
    base = Copies(dist.group.WORLD, {g: [rank]})
    _raises(TypeError, "not another Copies", lambda: Copies(base, {}))
    assert "Copies(" in repr(base) and "1 tensors" in repr(base)
    # a process group as ranks; a tensor of ints as ranks
    pair = dist.new_group([0, 1])
    dist.new_group([2, 3])  # (every rank creates every group)
    if rank < 2:
        assert repr(Copies(dist.group.WORLD, {g: pair}))
    assert repr(Copies(dist.group.WORLD, {g: torch.tensor([rank])}))
    # in a call: copies declared over ranks the call does not reduce over (Shards over ranks 0, 1 only), before
    # anything is read or written
    if rank < 2:
        h = torch.randn(6)
        before = h.clone()
        pg = Copies(Shards(pair), {h: [0, 1, 2]})
        _raises(ValueError, "reduces over ranks \\[0, 1\\] only", lambda: fastgrad.clip_grad_norm_([_Holder(h)], 1e-3, process_group=pg))
        assert torch.equal(h, before)


def _scenario_disagreeing_declarations(rank):
    """Ranks of one copy that declare it differently (one leaves it out, one names other ranks): the checksum in
    the header of a finite norm's collective raises RankMismatchError on every rank, nothing written, no extra
    collective; declarations that agree pass."""
    m = _Megatron(rank)
    for how in ("left out", "other ranks", "agree"):
        params = m.params()
        declared = {params[0]: m.embedding_ranks, params[1]: m.tp_ranks}
        if how == "left out" and rank == 1:
            del declared[params[1]]  # rank 1 forgets that it holds a copy of stage 0's LayerNorm
        if how == "other ranks" and rank == 3:
            declared[params[0]] = [3]  # rank 3 calls its embedding piece its own
        before = [q.grad.clone() for q in params]
        for exact in (False, True):
            with CollectiveCount() as c:
                if how == "agree":
                    fastgrad.clip_grad_norm_(params, 1e9, process_group=Copies(dist.group.WORLD, declared), exact=exact)
                else:
                    with pytest.raises(distributed.RankMismatchError, match="declared different copies"):
                        fastgrad.clip_grad_norm_(params, 1e-3, process_group=Copies(dist.group.WORLD, declared),
                                                 exact=exact)
            assert c.n == 1, (how, c.kinds)
            assert all(torch.equal(q.grad, b) for q, b in zip(params, before)), how
        with pytest.raises(distributed.RankMismatchError, match="declared different copies") if how != "agree" \
                else contextlib.nullcontext():
            fastgrad.grad_stats(params, process_group=Copies(dist.group.WORLD, declared))


class _ZeroTP:
    """ZeRO over dp=2 of a tp=2 model of plain tensors (rank = 2 * dp + tp): each tp rank's local model (a
    LayerNorm and a row-parallel bias whole on both tp ranks, a column-parallel weight split by rows) flattened
    and cut in two partitions, partition d held by the ranks of dp coordinate d."""

    def __init__(self, rank):
        self.dp, self.tp = divmod(rank, 2)
        gen = torch.Generator().manual_seed(5)
        self.whole = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in
                      [("ln", (6,)), ("fc", (8, 6)), ("bias", (5,))]}
        self.tp_ranks = [2 * self.dp, 2 * self.dp + 1]
        local = torch.cat([self.whole["ln"], self.whole["fc"].tensor_split(2)[self.tp].reshape(-1), self.whole["bias"]])
        self.cut = 18  # of 35: ln [0, 6) and fc [6, 18) | fc [18, 30) and bias [30, 35)
        self.flat = (local[:self.cut] if self.dp == 0 else local[self.cut:]).to(torch.float32)

    def buffer(self):
        b = torch.nn.Parameter(torch.zeros_like(self.flat))
        b.grad = self.flat.clone()
        return b

    def declare(self, b):
        if self.dp == 0:
            return Partition(b, [(0, 6, "ln.weight", self.tp_ranks), (6, 12, "fc.weight", None)])
        return Partition(b, [(0, 12, "fc.weight", None), (12, 5, "fc2.bias", self.tp_ranks)])

    def truth(self):
        return float(torch.cat([t.reshape(-1).to(torch.float32).double() for t in self.whole.values()]).norm())


def _scenario_partition(rank):
    """A declared flat partition counts each element once (against the float64 oracle of the whole model), the
    clip scales the whole buffer, and without the declaration the replicated slices count twice."""
    m = _ZeroTP(rank)
    b = m.buffer()
    plain = fastgrad.clip_grad_norm_([b], 1e9, process_group=dist.group.WORLD)
    rep = math.fsum(float(x) ** 2 for x in torch.cat([m.whole["ln"], m.whole["bias"]]).to(torch.float32).double())
    _close(plain, math.sqrt(m.truth() ** 2 + rep), "undeclared: the replicated slices on both tp ranks")
    part = m.declare(b)
    try:
        for exact in (False, True):
            b = m.buffer()
            part = m.declare(b)
            with CollectiveCount() as c:
                got = fastgrad.clip_grad_norm_([b], 0.5, process_group=dist.group.WORLD, exact=exact)
            assert c.n == 1, c.kinds
            _close(got, m.truth(), f"declared partition, exact={exact}")
            # the clip scales every element of the buffer, the slices this rank does not count included
            coef = min(1.0, 0.5 / (float(got) + 1e-6))
            assert torch.allclose(b.grad, m.flat * coef, rtol=1e-6, atol=0)
        # a rank that declares its replicated slice as its own: the checksum disagrees on every rank
        b = m.buffer()
        part = m.declare(b)
        if rank == 1:
            part = Partition(b, [(0, 6, "ln.weight", None), (6, 12, "fc.weight", None)])
        with pytest.raises(distributed.RankMismatchError, match="declared different copies"):
            fastgrad.clip_grad_norm_([b], 1e-3, process_group=dist.group.WORLD)
        assert torch.equal(b.grad, m.flat)
    finally:
        part.remove()
    assert not distributed.declared_partitions([b])


def _scenario_partition_arguments(rank):
    """Bad partition declarations: a clear error naming the problem, before any work."""
    b = torch.nn.Parameter(torch.zeros(10))
    _raises(TypeError, "buffer is a tensor", lambda: Partition([0.0] * 10, []))
    _raises(TypeError, "offset, length, owner, replicated_over", lambda: Partition(b, [(0, 4)]))
    _raises(TypeError, "are ints", lambda: Partition(b, [(0.0, 4, "w", None)]))
    _raises(ValueError, "not inside the buffer's 10 elements", lambda: Partition(b, [(8, 4, "w", None)]))
    _raises(ValueError, "not inside", lambda: Partition(b, [(0, 0, "w", None)]))
    _raises(ValueError, "overlap", lambda: Partition(b, [(0, 4, "a", None), (3, 2, "b", None)]))
    _raises(TypeError, "its parameter or a name", lambda: Partition(b, [(0, 4, 3, None)]))
    other = (rank + 1) % WORLD
    _raises(ValueError, f"do not include this rank \\({rank}\\)", lambda: Partition(b, [(0, 4, "w", [other])]))
    assert not distributed.declared_partitions([b])  # nothing registered by a failed declaration
    p = Partition(b, [(2, 3, "w", [rank])])
    assert [x[:2] for x in p.pieces()] == [(0, 2), (2, 5), (5, 10)] and "3 slices" not in repr(p)
    b.grad = torch.ones(10)
    wrong = torch.nn.Parameter(torch.zeros(5))
    try:
        Partition(wrong, [(0, 2, "w", None)])
        wrong.grad = torch.ones(5)
        wrong.data = torch.zeros(4)  # the buffer re-made smaller than its gradient after the declaration
        _raises(ValueError, "declared buffer has 4 elements, its gradient at position 0 has 5",
                lambda: fastgrad.clip_grad_norm_([wrong], 1.0, process_group=dist.group.WORLD))
        assert torch.equal(wrong.grad, torch.ones(5))
    finally:
        distributed.plan._PARTITIONS.clear()


SCENARIOS = {"megatron": _scenario_megatron, "keys": _scenario_keys, "dtensor_stages": _scenario_dtensor_stages,
             "arguments": _scenario_arguments, "disagreeing_declarations": _scenario_disagreeing_declarations,
             "partition": _scenario_partition, "partition_arguments": _scenario_partition_arguments}


def _worker(rank: int, world: int, out_dir: str) -> None:
    run_scenarios(rank, world, out_dir, [(name, functools.partial(fn, rank)) for name, fn in SCENARIOS.items()])


@pytest.fixture(scope="module")
def spawned():
    root = tempfile.mkdtemp(prefix="fastgrad-copies-")
    error = spawn_ranks(_worker, WORLD, root, WALL_LIMIT_S)
    yield root, error
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_declared_copies(spawned, scenario):
    scenario_outcome(*spawned, scenario, f" on {WORLD} ranks")
