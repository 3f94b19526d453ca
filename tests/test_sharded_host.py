"""The sharded clip's one-pass local part (``fastgrad.distributed.local_cpu_norm``, csrc/host.cpp
``dtensor_local_norm``/``dtensor_local_scale``): DTensor grads with CPU shards, on 2 gloo ranks.

A repeat ``clip_grad_norm_`` on DTensor grads whose layout the general path cached reads every grad, spec and
local tensor and takes the local norm in one C++ pass, and scales in a second one. Pinned here, on every rank:

* the same bits as the general path (the total, its type and dtype, every local shard) for mixed dtypes,
  Shard/Replicate placements, uneven and empty shards, 1-D and 2-D meshes, p = 2, 1, inf, 3, clipping or not,
  and for FSDP2's own gradients over two backward passes;
* a list that changed is never served from the stale layout: another spec at one position, a grad gone, another
  list of the same length, a plain tensor among the DTensors, a function mode, another backend; each takes the
  general path (same results as it) and a changed list that stays is cached anew;
* ``error_if_nonfinite`` raises on every rank before anything is written; a spent or foreign handle raises;
* a list in use keeps its layout while more lists than the cache holds come and go (least recently used
  eviction: an earlier whole-cache clear dropped it depending on how many lists earlier code had clipped);
* None grads at fixed positions take the pass (same bits); p = 0 and -inf, a Partial grad, plain tensors among
  the DTensors and an all-None list never do (the general path's results).
"""

from __future__ import annotations

import functools
import shutil
import tempfile

import pytest
import torch

import fastgrad
from fastgrad import distributed, route

from .helpers import run_scenarios, scenario_outcome, spawn_ranks

dist = torch.distributed
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WORLD = 2
WALL_LIMIT_S = 240
INF = float("inf")


# ------------------------------------------------------------------------------------------ harness
def _worker(rank: int, world: int, out_dir: str) -> None:
    run_scenarios(rank, world, out_dir, [(name, functools.partial(fn, rank, world)) for name, fn in SCENARIOS.items()])


@pytest.fixture(scope="module")
def spawned():
    root = tempfile.mkdtemp(prefix="fastgrad-shhost-")
    err = spawn_ranks(_worker, WORLD, root, WALL_LIMIT_S)
    yield root, err
    shutil.rmtree(root, ignore_errors=True)


def _outcome(spawned, name: str) -> None:
    scenario_outcome(*spawned, name)


# ------------------------------------------------------------------------------------------ building blocks
class Seen:
    """Records what local_cpu_norm answered (None: the general path ran) during a block."""

    def __enter__(self):
        self.answers = []
        self._real = distributed.local_cpu_norm

        def spy(*a, **k):
            out = self._real(*a, **k)
            self.answers.append(out is not None)
            return out

        distributed.local_cpu_norm = spy
        return self

    def __exit__(self, *exc):
        distributed.local_cpu_norm = self._real

    @property
    def fast(self) -> bool:
        return self.answers == [True]


class General:
    """The general path only (the one-pass local part switched off) during a block."""

    def __enter__(self):
        self._real = distributed.local_cpu_norm
        distributed.local_cpu_norm = lambda *a, **k: None
        return self

    def __exit__(self, *exc):
        distributed.local_cpu_norm = self._real


def _dt():
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    return DTensor, Replicate, Shard, distribute_tensor


# (shape, dtype, placement kind) per parameter; "S": Shard(0) on the last mesh dim, "R": Replicate, "S1": Shard(1).
LAYOUT = [((7, 5), torch.float32, "S"), ((1, 6), torch.float32, "S"), ((33,), torch.bfloat16, "S"),
          ((4, 3), torch.float16, "R"), ((5, 4), torch.float32, "S1"), ((9,), torch.float32, "R"),
          ((2, 2, 3), torch.bfloat16, "S"), ((0, 4), torch.float32, "S")]
LAYOUT64 = LAYOUT[:3] + [((6, 2), torch.float64, "S"), ((3,), torch.float64, "R")]


def _placements(kind: str, ndim: int):
    _, Replicate, Shard, _ = _dt()
    last = {"S": Shard(0), "S1": Shard(1), "R": Replicate()}[kind]
    return [Replicate()] * (ndim - 1) + [last]


def _params(mesh, layout, seed: int):
    """nn.Parameter(DTensor) with DTensor grads: every rank builds the same full tensors (one seed) and keeps
    its shard (no collective)."""
    _, _, _, distribute_tensor = _dt()
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (shape, dt, kind) in enumerate(layout):
        pl = _placements(kind, mesh.ndim)
        w = torch.randn(shape, generator=g)
        grad = (torch.randn(shape, generator=g) * 10.0 ** (i % 3 - 1)).to(dt)
        prm = torch.nn.Parameter(distribute_tensor(w.to(dt), mesh, pl, src_data_rank=None))
        prm.grad = distribute_tensor(grad, mesh, pl, src_data_rank=None)
        out.append(prm)
    return out


def _locals(params):
    return [None if p.grad is None else p.grad._local_tensor.clone() for p in params]


def _restore(params, saved):
    for p, s in zip(params, saved):
        if s is not None:
            p.grad._local_tensor.copy_(s)


def _same(a, b, what):
    DTensor = _dt()[0]
    assert type(a) is type(b), (what, type(a), type(b))
    if isinstance(a, DTensor):
        assert a.placements == b.placements and a.device_mesh == b.device_mesh, what
        a, b = a._local_tensor, b._local_tensor
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype)
    assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all()), (what, a, b)


def _same_grads(ps, qs, what):
    for i, (p, q) in enumerate(zip(ps, qs)):
        if p.grad is None or q.grad is None:
            assert p.grad is None and q.grad is None, (what, i)
            continue
        a, b = p.grad._local_tensor, q.grad._local_tensor
        assert a.dtype == b.dtype and a.stride() == b.stride(), (what, i)
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), (what, i)


def _fast_vs_general(make, what, **kw):
    """Call 1 (general path: plans the list, keeping its layout), values restored, call 2 (must be the one-pass
    path) against a twin list whose two calls both take the general path: the same totals and grads bit for
    bit."""
    ps, qs = make(), make()
    saved = _locals(ps)
    with Seen() as s1:
        t1 = fastgrad.clip_grad_norm_(ps, **kw)
    assert s1.answers == [], (what, "first call: an unplanned list takes the general path", s1.answers)
    with General():
        r1 = fastgrad.clip_grad_norm_(qs, **kw)
    _same(t1, r1, what + " call 1")
    _restore(ps, saved)
    _restore(qs, saved)
    with Seen() as s2:
        t2 = fastgrad.clip_grad_norm_(ps, **kw)
    assert s2.fast, (what, "repeat call did not take the one-pass path", s2.answers)
    with General():
        r2 = fastgrad.clip_grad_norm_(qs, **kw)
    _same(t2, r2, what)
    _same_grads(ps, qs, what)
    return ps, t2


# ------------------------------------------------------------------------------------------ scenarios
def _scenario_same_bits(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    meshes = [init_device_mesh("cpu", (world,)), init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))]
    for mi, mesh in enumerate(meshes):
        for layout, tag in ((LAYOUT, "mixed16"), (LAYOUT64, "with64")):
            for p in (2.0, 1.0, INF, 3.0):
                for max_norm in (1e-2, 1e6):
                    seed = 100 * mi + int(p if p != INF else 9) + (0 if max_norm < 1 else 50)
                    what = f"mesh{mi} {tag} p={p} max_norm={max_norm}"
                    ps, total = _fast_vs_general(lambda: _params(mesh, layout, seed), what,
                                                 max_norm=max_norm, norm_type=p)
    # the result is the float64 total of the whole tensors, on every rank alike
    mesh = meshes[0]
    ps = _params(mesh, LAYOUT64, 7)
    fulls = [p.grad.full_tensor().double() for p in ps]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(f) for f in fulls]))
    fastgrad.clip_grad_norm_(ps, 1e6)
    with Seen() as s:
        total = fastgrad.clip_grad_norm_(ps, 1e6)
    assert s.fast
    got = total.full_tensor()
    assert abs(got.item() - want.item()) <= 1e-12 * want.item(), (got, want)
    every = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, got.reshape(()).clone())
    assert all(torch.equal(e, every[0]) for e in every)


def _scenario_fresh_grad_objects(rank, world):
    # New grad DTensors on the same spec objects (as FSDP2 hands them out each step): still one pass.
    from torch.distributed.device_mesh import init_device_mesh

    DTensor = _dt()[0]
    mesh = init_device_mesh("cpu", (world,))
    ps, qs = _params(mesh, LAYOUT, 3), _params(mesh, LAYOUT, 3)
    fastgrad.clip_grad_norm_(ps, 1e6)
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        for p, q in zip(ps, qs):
            loc = torch.randn(p.grad._local_tensor.shape, generator=g).to(p.grad.dtype)
            spec = p.grad._spec
            p.grad = DTensor(loc.clone(), spec, requires_grad=False)
            q.grad = DTensor(loc.clone(), q.grad._spec, requires_grad=False)
        with Seen() as s:
            t = fastgrad.clip_grad_norm_(ps, 0.05)
        assert s.fast, step
        with General():
            r = fastgrad.clip_grad_norm_(qs, 0.05)
        _same(t, r, f"fresh grads step {step}")
        _same_grads(ps, qs, f"fresh grads step {step}")


def _scenario_fsdp2(rank, world):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover - older torch
        return
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.LayerNorm(33),
                               torch.nn.Linear(33, 3))
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    for m in models:
        for layer in (m[0], m[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for m in models:
            m.zero_grad(set_to_none=True)
            m(x).pow(2).sum().backward()
        with Seen() as s:
            t = fastgrad.clip_grad_norm_(models[0].parameters(), 0.5)
        assert s.answers == ([True] if step else []), (step, s.answers)  # the first call plans the list
        with General():
            r = fastgrad.clip_grad_norm_(models[1].parameters(), 0.5)
        _same(t, r, f"fsdp2 step {step}")
        _same_grads(list(models[0].parameters()), list(models[1].parameters()), f"fsdp2 step {step}")


def _scenario_many_lists(rank, world):
    # A list clipped every step keeps its one-pass layout while more lists than the cache holds come and go
    # between its calls (the least recently used one goes, never the whole cache); an evicted list takes the
    # general path once and is cached anew.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    ps, qs = _params(mesh, LAYOUT, 5), _params(mesh, LAYOUT, 5)
    fastgrad.clip_grad_norm_(ps, 1e6)
    others = []  # kept alive, so no other list reuses their first parameter's id
    for k in range(2 * distributed.layout._LIST_CAP + 3):
        o = _params(mesh, LAYOUT[:2], 1000 + k)
        with Seen() as s:
            fastgrad.clip_grad_norm_(o, 1e6)
        assert s.answers == [], (k, s.answers)  # a new list: planned by this call
        others.append(o)
        if k % 8 == 0:
            with Seen() as s:
                fastgrad.clip_grad_norm_(ps, 1e6)
            assert s.fast, ("the list in use lost its layout", k, s.answers)
    layout = distributed.layout
    assert len(route._PLANS) <= route._CAP and len(layout._LAYOUTS) <= layout._LIST_CAP
    with Seen() as s:  # long evicted: planned anew
        fastgrad.clip_grad_norm_(others[0], 1e6)
    assert s.answers == [], s.answers
    with Seen() as s:  # cached anew
        fastgrad.clip_grad_norm_(others[0], 1e6)
    assert s.fast, s.answers
    with Seen() as s:
        t = fastgrad.clip_grad_norm_(ps, 0.05)
    assert s.fast
    fastgrad.clip_grad_norm_(qs, 1e6)
    with General():
        r = fastgrad.clip_grad_norm_(qs, 0.05)
    _same(t, r, "many lists")
    _same_grads(ps, qs, "many lists")


def _changed(kind, mesh, ps):
    """``ps`` (whose layout is cached) changed in one way; returns the list to clip."""
    DTensor, Replicate, Shard, distribute_tensor = _dt()
    if kind == "other_spec":  # same length, position 2 now Replicate instead of Shard(0)
        full = ps[2].grad.full_tensor()
        ps[2].grad = distribute_tensor(full, mesh, [Replicate()], src_data_rank=None)
    elif kind == "equal_spec_object":  # an equal but new spec object: the general path (it compares by value)
        p = ps[0]
        p.grad = DTensor.from_local(p.grad._local_tensor, mesh, p.grad.placements, run_check=False,
                                    shape=p.grad.shape, stride=p.grad.stride())
    elif kind == "grad_gone":
        ps[1].grad = None
    elif kind == "other_list":  # another list of the same length: other shapes and placements
        ps = _params(mesh, [((3, 8), torch.float32, "R")] * len(ps), 77)
    elif kind == "plain_among":  # a plain parameter with a plain grad at the last position
        q = torch.nn.Parameter(torch.randn(5))
        q.grad = torch.randn(5, generator=torch.Generator().manual_seed(5))
        ps = ps[:-1] + [q]
    elif kind == "local_dtype":  # the same spec object over a local tensor of another dtype
        g = ps[0].grad  # (a new DTensor of another dtype would not pass torch's grad dtype check)
        g._local_tensor = g._local_tensor.double()
    return ps


def _scenario_changed_lists(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    mesh = init_device_mesh("cpu", (world,))
    kinds = ["other_spec", "equal_spec_object", "grad_gone", "other_list", "plain_among", "local_dtype"]
    for kind in kinds:
        # local_dtype keeps every spec object: the layout holds (it is decided by the specs) and the pass reads
        # the local tensors' own dtypes, as the general path does; every other change is declined
        declined = kind != "local_dtype"
        made = []
        for _ in range(2):
            ps = _params(mesh, LAYOUT, 21)
            fastgrad.clip_grad_norm_(ps, 1e6)  # caches the layout of these grads
            made.append(_changed(kind, mesh, ps))
        ps, qs = made
        with Seen() as s:
            t = fastgrad.clip_grad_norm_(ps, 0.05)
        # another list is planned by its first call; the same list, changed, tries its route and is declined
        assert s.answers == ([] if kind == "other_list" else [not declined]), (kind, s.answers)
        with General():
            r = fastgrad.clip_grad_norm_(qs, 0.05)
        _same(t, r, kind)
        for p, q in zip(ps, qs):
            if p.grad is None or q.grad is None:
                assert p.grad is None and q.grad is None
            elif isinstance(p.grad, _dt()[0]):
                assert torch.equal(p.grad._local_tensor, q.grad._local_tensor), kind
            else:
                assert torch.equal(p.grad, q.grad), kind
        if kind != "plain_among":  # a changed list that stays is served again once the general path cached it
            with Seen() as s:
                fastgrad.clip_grad_norm_(ps, 0.05)
            assert s.fast, (kind, "after re-caching", s.answers)
    # a function mode sees .grad reads: declined while it is active
    ps = _params(mesh, LAYOUT, 22)
    fastgrad.clip_grad_norm_(ps, 1e6)
    with Mode(), Seen() as s:
        fastgrad.clip_grad_norm_(ps, 1e6)
    assert s.answers == [False]
    # another backend named: declined (the C++ pass runs the cpu backend's kernels only)
    with Seen() as s:
        fastgrad.clip_grad_norm_(ps, 1e6, backend="torch")
    assert s.answers == [False]
    with Seen() as s:
        fastgrad.clip_grad_norm_(ps, 1e6)
    assert s.fast


def _scenario_nonfinite_and_handles(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    ps = _params(mesh, LAYOUT, 31)
    fastgrad.clip_grad_norm_(ps, 1e6)
    if rank == 1:  # a NaN only rank 1 holds (its shard of a Shard(0) tensor)
        ps[0].grad._local_tensor.view(-1)[0] = float("nan")
    before = _locals(ps)
    with Seen() as s:
        with pytest.raises(RuntimeError, match="non-finite"):
            fastgrad.clip_grad_norm_(ps, 1e-3, error_if_nonfinite=True)
    assert s.fast
    for p, b in zip(ps, before):  # nothing written, on either rank
        a = p.grad._local_tensor
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    # a handle scales once; a foreign object is refused
    _restore(ps, [b.nan_to_num() for b in before])
    plan = route.plan_of(ps)
    assert plan.route == "sharded-cpu", plan
    out = distributed.local_cpu_norm(ps, plan.layout, 2.0, None)
    assert out is not None
    sh, local_total, handle = out
    distributed.reduced_norm(sh, 2.0, False, None, local_total=local_total)  # (the collective every rank makes)
    distributed.scale_local_cpu(handle, torch.tensor(0.5))
    with pytest.raises(RuntimeError, match="already used"):
        distributed.scale_local_cpu(handle, torch.tensor(0.5))
    with pytest.raises((ValueError, TypeError)):
        distributed.scale_local_cpu((handle[0], object()), torch.tensor(0.5))
    for p, b in zip(ps, before):
        assert torch.equal(p.grad._local_tensor, b.nan_to_num() * torch.tensor(0.5).to(b.dtype)) or b.numel() == 0


def _scenario_none_grads_and_declined(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial

    mesh = init_device_mesh("cpu", (world,))

    # None grads at the same positions on every call: the pass skips them, as the general path does
    def with_nones():
        ps = _params(mesh, LAYOUT, 41)
        ps[1].grad = None
        ps[4].grad = None
        return ps

    _fast_vs_general(with_nones, "none grads", max_norm=0.05)

    # p = 0 and -inf: no fused kernel, so never the pass (the general path, same results as itself)
    for p in (0.0, -INF):
        ps, qs = _params(mesh, LAYOUT, 42), _params(mesh, LAYOUT, 42)
        for call in range(2):
            with Seen() as s:
                t = fastgrad.clip_grad_norm_(ps, 0.05, norm_type=p)
            assert s.answers == ([False] if call else []), (p, s.answers)
            with General():
                r = fastgrad.clip_grad_norm_(qs, 0.05, norm_type=p)
            _same(t, r, f"p={p}")
            _same_grads(ps, qs, f"p={p}")

    def declined_twice(make, what):
        ps, qs = make(), make()
        for call in range(2):
            with Seen() as s:
                t = fastgrad.clip_grad_norm_(ps, 0.05)
            assert s.answers in ([False], []), (what, call, s.answers)
            with General():
                r = fastgrad.clip_grad_norm_(qs, 0.05)
            _same(t, r, f"{what} call {call}")
            for p, q in zip(ps, qs):
                a = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                b = q.grad._local_tensor if isinstance(q.grad, DTensor) else q.grad
                assert torch.equal(a, b), what

    # a Partial grad (its norm is read from a redistributed copy): never remembered
    def with_partial():
        ps = _params(mesh, LAYOUT[:4], 43)
        g = torch.Generator().manual_seed(44 + rank)
        loc = torch.randn(6, 5, generator=g)
        q = torch.nn.Parameter(DTensor.from_local(torch.zeros(6, 5), mesh, [Partial()], run_check=False))
        q.grad = DTensor.from_local(loc, mesh, [Partial()], run_check=False)
        return ps + [q]

    declined_twice(with_partial, "partial")

    # plain tensors among the DTensors from the first call on (not all DTensors): never remembered
    def with_plain():
        q = torch.nn.Parameter(torch.randn(5))
        q.grad = torch.randn(5, generator=torch.Generator().manual_seed(45))
        return _params(mesh, LAYOUT[:4], 46) + [q]

    declined_twice(with_plain, "plain among")

    # every grad None: nothing to clip, nothing remembered
    ps = _params(mesh, LAYOUT[:3], 47)
    for p in ps:
        p.grad = None
    for _ in range(2):
        with Seen() as s:
            t = fastgrad.clip_grad_norm_(ps, 0.05)
        assert s.answers in ([False], []) and float(t) == 0.0, s.answers


SCENARIOS = {
    "same_bits": _scenario_same_bits,
    "fresh_grad_objects": _scenario_fresh_grad_objects,
    "fsdp2": _scenario_fsdp2,
    "many_lists": _scenario_many_lists,
    "changed_lists": _scenario_changed_lists,
    "nonfinite_and_handles": _scenario_nonfinite_and_handles,
    "none_grads_and_declined": _scenario_none_grads_and_declined,
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sharded_local_pass(spawned, name):
    _outcome(spawned, name)
