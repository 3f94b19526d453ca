"""A layout fuzz for the sharded norm (issue 48): seeded random layouts on gloo ranks, each checked against the
single-process norm of the gathered model.

A layout is ``(world, seed)``: the seed picks a family (FSDP2, HSDP, TP + FSDP2, TP with replicated biases and
norms, EP with expert data parallelism, several meshes mixed, DTensor and plain pipeline stages with a tied
embedding, ZeRO-style ``Shards`` pieces, a rank with nothing) and, within it, the sizes (uneven and empty
shards, zero-size tensors), the dtypes (fp32, bf16, mixed), parameters left out of ``fully_shard``, the
process group argument and the declared copies (``fastgrad.distributed.Copies``). Every rank builds the same
layout from the seed and holds its part; ``fulls`` is the gathered model, each element once.

Checks on every rank (``check_layout``): ``exact=True`` norms (p = 2, 1, inf), per-tensor norms and the clip
bit-identical to the single-process ``exact=True`` on ``fulls`` (the clipped local shards are the slices of the
single-process clip, so the coefficient is the same bits); the default norm within its documented error of the
float64 oracle (two units in the last place, or torch's own error on the gathered model plus one: docs/api.md,
docs/contract.md's accuracy rule) and the same bits on every rank;
the number of collectives each call runs, counted from torch.profiler's gloo events, as docs/distributed.md's
table says; a NaN in one element held by one rank: every rank's step guard skips, and a NaN in every copy of an
element gives NaN on every rank and ``error_if_nonfinite`` raises on every rank with nothing written.

Replay one layout: ``python -m tests.layout_fuzz --world 4 --seed 7`` (what a failure prints)."""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch

import fastgrad
from fastgrad import distributed

from . import oracle
from .exact_oracle import correctly_rounded
from .helpers import CollectiveCount, spawn_ranks

dist = torch.distributed
INF = math.inf
WORLDS = (2, 3, 4, 5, 6, 7, 8)
# layouts per world: 56 in all; fewer on the large worlds, whose collectives are slowest on few cores
LAYOUTS = {2: 10, 3: 8, 4: 10, 5: 6, 6: 9, 7: 5, 8: 8}
# The collectives each call runs (docs/distributed.md's table): a total takes one; per-tensor results that combine
# shards (DTensors, Shards pieces) one more; grad_stats two more; plain pipeline stages keep their own per-tensor
# results (one in all). Declared copies add none.
COUNTS = {"combined": {"total": 1, "per_tensor": 2, "grad_stats": 3},
          "plain_stages": {"total": 1, "per_tensor": 1, "grad_stats": 1}}


def counts_of(lay) -> dict:
    """The documented counts of ``lay``'s calls: a DTensor stage on a slice of k dimensions reduces each vector
    along each of them (docs/distributed-reference.md, "Collectives"): per-tensor 1 + k, grad_stats 1 + 2k."""
    c = dict(COUNTS[lay.counts])
    if lay.counts == "combined" and lay.vec_dims > 1:
        c["per_tensor"] = 1 + lay.vec_dims
        c["grad_stats"] = 1 + 2 * lay.vec_dims
    return c


def replay_line(world: int, seed: int) -> str:
    return f"python -m tests.layout_fuzz --world {world} --seed {seed}"


# ------------------------------------------------------------------------------------------- a layout
@dataclass
class Entry:
    """One tensor of this rank's list: ``j`` its tensor of the gathered model, ``make()`` a fresh gradient
    (DTensor or plain), ``local_of(full)`` what this rank holds of a full-shaped tensor (its local shard)."""
    j: int
    make: Callable
    local_of: Callable
    whole: bool = False  # per-tensor results are this rank's own tensor (plain pipeline stages)


@dataclass
class Layout:
    name: str
    fulls: list
    entries: list
    pg: object = None  # process_group=
    counts: str = "combined"
    copies: dict = field(default_factory=dict)  # entry index -> the ranks it is declared the same on
    params: list | None = None  # a real module's parameters (FSDP2, TP): their grads are the entries
    backend: str | None = None
    vec_dims: int = 1  # dimensions of a DTensor stage's slice: its vectors take one collective per dimension


class Ctx:
    """What a family builder draws from: the seed's random choices, the world and this rank, cached meshes."""

    def __init__(self, world: int, seed: int):
        self.world, self.seed = world, seed
        self.rank = dist.get_rank()
        self.rng = random.Random(world * 100003 + seed)
        self.gen = torch.Generator().manual_seed(world * 7919 + seed)
        self.dtypes = self.rng.choice(["fp32", "bf16", "mixed"])

    def dtype(self):
        if self.dtypes == "fp32":
            return torch.float32
        if self.dtypes == "bf16":
            return torch.bfloat16
        return self.rng.choice([torch.float32, torch.bfloat16, torch.bfloat16, torch.float16])

    def size(self, small: bool = False) -> int:
        # sizes below the mesh size leave some ranks an empty shard; 0 is a zero-size tensor
        return self.rng.choice([1, 2, 3, 5, 7, 9] if small else [0, 1, 2, 3, 5, 7, 8, 11, 13, 16, 24, 37])

    def shape(self, ndim: int | None = None) -> tuple:
        ndim = ndim or self.rng.choice([1, 1, 2, 2, 2, 3])
        return tuple(self.size(small=ndim == 3) for _ in range(ndim))

    def full(self, shape, dtype=None) -> torch.Tensor:
        scale = 10.0 ** self.rng.randint(-3, 3)
        return (torch.randn(shape, generator=self.gen, dtype=torch.float64) * scale).to(dtype or self.dtype())

    def factor(self, parts: int) -> tuple:
        """A random factorisation of the world into ``parts`` dimensions (dimensions of size 1 included)."""
        dims, left = [], self.world
        for _ in range(parts - 1):
            proper = [f for f in range(2, left) if left % f == 0]
            if not proper or self.rng.random() < 0.25:  # (dimensions of size 1 now and then)
                proper = [f for f in range(1, left + 1) if left % f == 0]
            d = self.rng.choice(proper)
            dims.append(d)
            left //= d
        dims.append(left)
        self.rng.shuffle(dims)
        return tuple(dims)


_MESHES: dict = {}


def mesh(shape: tuple, names: tuple | None = None):
    """One DeviceMesh per shape and names for the world's life (building one runs collectives)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def _dt_local(full, m, placements):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, m, placements, src_data_rank=None).to_local()


def dt_entry(j: int, full, m, placements) -> Entry:
    from torch.distributed.tensor import distribute_tensor

    base = distribute_tensor(full, m, placements, src_data_rank=None)
    return Entry(j, base.clone, lambda f: _dt_local(f, m, placements))


def plain_entry(j: int, full, piece: Callable = lambda f: f, whole: bool = False) -> Entry:
    local = piece(full).clone()
    return Entry(j, local.clone, piece, whole)


def placements_for(ctx: Ctx, shape: tuple, ndim: int) -> list:
    """Random placements of a tensor of ``shape`` on an ``ndim`` mesh: Shard on a random tensor dimension (a
    dimension may be sharded twice, as TP + FSDP2 does), or Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for _ in range(ndim):
        if shape and ctx.rng.random() < 0.65:
            out.append(Shard(ctx.rng.randrange(len(shape))))
        else:
            out.append(Replicate())
    return out


# ------------------------------------------------------------------------------------------ families
class _Block(torch.nn.Module):
    """Linear (+ LayerNorm) in its own dtype; casts its input, returns float32."""

    def __init__(self, i: int, o: int, dtype, bias: bool, norm: bool):
        super().__init__()
        self.lin = torch.nn.Linear(i, o, bias=bias).to(dtype)
        self.norm = torch.nn.LayerNorm(o).to(dtype) if norm else None

    def forward(self, x):
        y = self.lin(x.to(self.lin.weight.dtype))
        if self.norm is not None:
            y = self.norm(y)
        return torch.tanh(y).float()


def _module_layout(ctx: Ctx, name: str, model, x, counts="combined") -> Layout:
    """A real module after one forward/backward on the same batch everywhere: the gradients are its entries,
    the gathered model their full tensors (plain gradients, of parameters left out of fully_shard, must be
    the same on every rank)."""
    model(x).pow(2).mean().backward()
    params = [p for p in model.parameters() if p.grad is not None]
    entries, fulls = [], []
    for j, p in enumerate(params):
        g = p.grad
        if distributed.is_dtensor(g):
            full = g.full_tensor()
            m, pl = g.device_mesh, tuple(g.placements)
            entries.append(Entry(j, g.clone, lambda f, m=m, pl=pl: _dt_local(f, m, pl)))
        else:
            full = g.clone()
            got = [None] * ctx.world
            dist.all_gather_object(got, full.double().reshape(-1).tolist())
            assert all(v == got[0] for v in got), f"{name}: a plain gradient differs between ranks"
            entries.append(plain_entry(j, full))
        fulls.append(full)
    return Layout(name, fulls, entries, counts=counts, params=params)


def _widths(ctx: Ctx, n: int) -> list:
    return [ctx.rng.choice([1, 2, 3, 5, 8, 13, 16, 33]) for _ in range(n)]


def fam_fsdp2(ctx: Ctx) -> Layout:
    """FSDP2 on a 1-D mesh (or HSDP on a 2-D replicate x shard mesh), some blocks left out of fully_shard."""
    from torch.distributed.fsdp import fully_shard

    hsdp = ctx.rng.random() < 0.4
    shape = ctx.factor(2) if hsdp else (ctx.world,)
    m = mesh(shape, ("replicate", "shard") if hsdp else None)
    ws = _widths(ctx, ctx.rng.randint(2, 4) + 1)
    torch.manual_seed(ctx.seed)
    blocks = [_Block(a, b, ctx.dtype(), ctx.rng.random() < 0.7, ctx.rng.random() < 0.5) for a, b in zip(ws, ws[1:])]
    model = torch.nn.Sequential(*blocks)
    left_out = [i for i in range(1, len(blocks)) if ctx.rng.random() < 0.3]  # (the first sharded)
    for i, b in enumerate(blocks):
        if i not in left_out:
            fully_shard(b, mesh=m)
    x = torch.randn(4, ws[0], generator=ctx.gen)
    return _module_layout(ctx, f"{'hsdp' if hsdp else 'fsdp2'} mesh={shape} widths={ws} left_out={left_out}", model, x)


class _Cast(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def fam_tp_fsdp(ctx: Ctx) -> Layout:
    """TP (colwise then rowwise, the rowwise bias replicated over tp) on the tp dimension of a dp x tp mesh,
    FSDP2 on dp, a LayerNorm that TP leaves alone (FSDP2 puts it on the dp slice: a copy on each tp rank's
    slice). Without FSDP2 (dp = 1 only): TP alone, the LayerNorm a plain tensor."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dp, tp = ctx.factor(2)
    if tp == 1:  # (TP over one rank: torch's sharding propagation trips on some shapes)
        dp, tp = tp, dp
    m = mesh((dp, tp), ("dp", "tp"))
    h = tp * ctx.rng.choice([1, 2, 3])  # (torch's TP needs even hidden shards: the rowwise input is rebuilt from them)
    d = ctx.rng.choice([3, 4, 6, 16])
    torch.manual_seed(ctx.seed)
    dt0, dt1 = ctx.dtype(), ctx.dtype()
    model = torch.nn.Sequential(_Cast(dt0), torch.nn.Linear(d, h).to(dt0), torch.nn.ReLU(),
                                torch.nn.Linear(h, d).to(dt0), _Cast(dt1), torch.nn.LayerNorm(d).to(dt1), _Cast(torch.float32))
    parallelize_module(model, m["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    fsdp = dp > 1 or ctx.rng.random() < 0.7
    if fsdp:
        for i in (1, 3, 5):  # (one group per dtype)
            fully_shard(model[i], mesh=m["dp"])
    x = torch.randn(4, d, generator=ctx.gen)
    return _module_layout(ctx, f"tp+fsdp2 dp={dp} tp={tp} h={h} d={d} fsdp={fsdp}", model, x)


def fam_meshes(ctx: Ctx) -> Layout:
    """DTensors on several meshes of the world (1-D, 2-D, 3-D, dimensions of size 1), random Shard/Replicate
    placements (TP with replicated biases and norms among them), uneven and empty shards, and plain tensors
    (parameters left out of fully_shard, the same on every rank)."""
    meshes = [mesh((ctx.world,))]
    for k in range(ctx.rng.randint(0, 2)):
        nd = ctx.rng.choice([2, 2, 3])
        shape = ctx.factor(nd)
        meshes.append(mesh(shape, tuple(f"d{i}" for i in range(nd))))
    fulls, entries = [], []
    for j in range(ctx.rng.randint(3, 9)):
        shape = ctx.shape()
        full = ctx.full(shape)
        fulls.append(full)
        if j and ctx.rng.random() < 0.15:  # (the first a DTensor: a list with one is a sharded call)
            entries.append(plain_entry(j, full))
        else:
            m = ctx.rng.choice(meshes)
            entries.append(dt_entry(j, full, m, placements_for(ctx, shape, m.ndim)))
    pg = ctx.rng.choice([None, None, dist.group.WORLD])
    shapes = [tuple(m.mesh.shape) for m in meshes]
    return Layout(f"meshes {shapes} pg={'world' if pg else None}", fulls, entries, pg=pg)


def fam_tp(ctx: Ctx) -> Layout:
    """Hand TP on DTensors over a 1-D mesh (or 2-D dp x tp): colwise weights Shard(0), rowwise Shard(1), their
    biases Shard(0) and Replicate(), LayerNorms Replicate()."""
    from torch.distributed.tensor import Replicate, Shard

    two_d = ctx.rng.random() < 0.5
    dp, tp = ctx.factor(2) if two_d else (1, ctx.world)
    m = mesh((dp, tp), ("dp", "tp")) if two_d else mesh((ctx.world,))
    fulls, entries = [], []
    h, d = ctx.size(), ctx.rng.choice([3, 4, 8, 16])
    specs = []
    for _ in range(ctx.rng.randint(1, 3)):
        specs += [((h, d), Shard(0)), ((h,), Shard(0)), ((d, h), Shard(1)), ((d,), Replicate()),
                  ((d,), Replicate()), ((d,), Replicate())]
    for j, (shape, pl) in enumerate(specs):
        full = ctx.full(shape)
        fulls.append(full)
        pls = [Shard(0) if (two_d and shape[0] and ctx.rng.random() < 0.5) else Replicate(), pl] if two_d else [pl]
        entries.append(dt_entry(j, full, m, pls))
    return Layout(f"tp dp={dp} tp={tp} h={h} d={d}", fulls, entries)


def fam_ep(ctx: Ctx) -> Layout:
    """Dense layers FSDP-sharded on the world, experts on an ep x edp mesh: the expert dimension split by ep
    (uneven: more or fewer experts than ep ranks), each expert replicated (expert data parallel) or sharded over
    edp; a router replicated; a shared expert replicated on every rank (a DTensor, or a plain tensor)."""
    from torch.distributed.tensor import Replicate, Shard

    ep, edp = ctx.factor(2)
    dense = mesh((ctx.world,))
    em = mesh((ep, edp), ("ep", "edp"))
    fulls, entries = [], []
    d, f, e = ctx.rng.choice([4, 6, 8]), ctx.rng.choice([3, 5, 8]), ctx.rng.choice([1, 2, 3, 4, 6, 8])
    spec = [((d, d), dense, [Shard(0)]), ((d,), dense, [Shard(0)]),
            ((e, d, f), em, [Shard(0), ctx.rng.choice([Replicate(), Shard(1), Shard(2)])]),
            ((e, f, d), em, [Shard(0), ctx.rng.choice([Replicate(), Shard(1)])]),
            ((e, d), em, [Replicate(), Replicate()])]
    shared_plain = ctx.rng.random() < 0.5
    for j, (shape, m, pls) in enumerate(spec):
        full = ctx.full(shape)
        fulls.append(full)
        entries.append(dt_entry(j, full, m, pls))
    full = ctx.full((d, f))
    fulls.append(full)
    entries.append(plain_entry(len(spec), full) if shared_plain else dt_entry(len(spec), full, dense, [Replicate()]))
    return Layout(f"ep ep={ep} edp={edp} experts={e} shared_plain={shared_plain}", fulls, entries)


def _stage_sizes(ctx: Ctx, pp: int) -> list:
    return [ctx.rng.randint(1, 4) for _ in range(pp)]


def fam_dtensor_pp(ctx: Ctx) -> Layout:
    """Pipeline stages of DTensors: a pp x dp (x tp) mesh, each stage's parameters on its dp (or dp x tp) slice;
    a tied embedding on the first and last stage (the same placements on both slices), declared a copy of the
    one at the same coordinate of the other stage. process_group= the pipeline group or the world (Copies of
    it)."""
    from torch.distributed.tensor import Replicate, Shard

    w = ctx.world
    inner = [d for d in range(2, w) if w % d == 0]
    pp = ctx.rng.choice(inner) if inner else w  # more than one stage, and more than one rank per stage if it can
    per = w // pp
    tp = ctx.rng.choice([d for d in range(1, per + 1) if per % d == 0]) if ctx.rng.random() < 0.5 else 1
    dp = per // tp
    if tp > 1:
        m = mesh((pp, dp, tp), ("pp", "dp", "tp"))
        stage_mesh = m["dp", "tp"]
    else:
        m = mesh((pp, dp), ("pp", "dp"))
        stage_mesh = m["dp"]
    stage, coord = divmod(ctx.rank, per)
    sizes = _stage_sizes(ctx, pp)
    d = ctx.rng.choice([2, 4, 5, 8])
    emb_full = ctx.full((ctx.size(), d))
    emb_pl = placements_for(ctx, emb_full.shape, stage_mesh.ndim)
    fulls, owners = [emb_full], [None]
    for s in range(pp):
        for _ in range(sizes[s]):
            shape = ctx.shape()
            fulls.append(ctx.full(shape))
            owners.append((s, placements_for(ctx, shape, stage_mesh.ndim)))
    entries, copies = [], {}
    if stage in (0, pp - 1):
        entries.append(dt_entry(0, emb_full, stage_mesh, emb_pl))
        copies[0] = [coord, (pp - 1) * per + coord]
    for j in range(1, len(fulls)):
        s, pl = owners[j]
        if s == stage:
            entries.append(dt_entry(j, fulls[j], stage_mesh, pl))
    use_world = ctx.rng.random() < 0.5
    g = dist.group.WORLD if use_world else m["pp"].get_group()  # this rank's pipeline group
    lay = Layout(f"dtensor pp={pp} dp={dp} tp={tp} stages={sizes} emb={emb_pl} pg={'world' if use_world else 'pp'}",
                 fulls, entries, pg=g, copies={i: copies[e.j] for i, e in enumerate(entries) if e.j in copies})
    lay.vec_dims = stage_mesh.ndim
    return lay


def fam_plain_pp(ctx: Ctx) -> Layout:
    """Megatron-style plain stages: pp x tp (x dp) ranks, each its own tensors: tensor-parallel pieces of the
    linear weights (rows or columns, uneven), LayerNorms and rowwise biases replicated over tp, a vocab-parallel
    embedding tied between the first and the last stage, every tensor replicated over dp; all declared with
    Copies, or (no copies declared) each rank's tensors its own."""
    declare = ctx.rng.random() < 0.8
    # undeclared: every rank's tensors its own, so one copy of each (no dp, no tp, no tie)
    dp, pp, tp = ctx.factor(3) if declare else (1, ctx.world, 1)
    dp_rank, rest = divmod(ctx.rank, pp * tp)
    stage, t = divmod(rest, tp)

    def rank_of(d, s, q):
        return d * pp * tp + s * tp + q

    fulls, entries, copies = [], [], {}
    stage_dtype = [ctx.dtype() for _ in range(pp)]
    d = ctx.rng.choice([2, 4, 6, 8])
    vocab = ctx.size()

    def add(full, piece, on_stage, same_on):
        j = len(fulls)
        fulls.append(full)
        if on_stage(stage):
            entries.append(plain_entry(j, full, piece, whole=True))
            if same_on is not None:
                copies[len(entries) - 1] = sorted(same_on)

    def tp_piece(dim):
        return lambda f: f.tensor_split(tp, dim)[t] if f.dim() > dim else f

    all_dp = [rank_of(x, stage, t) for x in range(dp)]
    # the tied embedding: vocab-parallel rows, on stage 0 and stage pp-1 (one tensor when pp == 1)
    emb = ctx.full((vocab, d), stage_dtype[0])
    ends = sorted({0, pp - 1}) if declare else [0]
    add(emb, tp_piece(0), lambda s: s in ends, [rank_of(x, s, t) for x in range(dp) for s in ends])
    for s in range(pp):
        dt = stage_dtype[s]
        for _ in range(ctx.rng.randint(1, 2)):
            h = ctx.size()
            ranks_tp = [rank_of(x, s, q) for x in range(dp) for q in range(tp)]
            add(ctx.full((h, d), dt), tp_piece(0), lambda st, s=s: st == s, all_dp)  # colwise weight
            add(ctx.full((h,), dt), tp_piece(0), lambda st, s=s: st == s, all_dp)  # its bias
            add(ctx.full((d, h), dt), tp_piece(1), lambda st, s=s: st == s, all_dp)  # rowwise weight
            add(ctx.full((d,), dt), lambda f: f, lambda st, s=s: st == s, ranks_tp)  # rowwise bias: on every tp rank
            add(ctx.full((d,), dt), lambda f: f, lambda st, s=s: st == s, ranks_tp)  # LayerNorm weight
    return Layout(f"plain pp dp={dp} pp={pp} tp={tp} declared={declare}", fulls, entries, pg=dist.group.WORLD,
                  counts="plain_stages", copies=copies if declare else {})


def fam_shards(ctx: Ctx) -> Layout:
    """ZeRO-style pieces: every tensor flattened and split over the world (uneven, some ranks empty), small
    ones held whole on every rank and declared copies of each other."""
    fulls, entries, copies = [], [], {}
    w, r = ctx.world, ctx.rank
    for j in range(ctx.rng.randint(2, 7)):
        full = ctx.full(ctx.shape())
        fulls.append(full)
        if ctx.rng.random() < 0.25:
            entries.append(plain_entry(j, full))
            copies[len(entries) - 1] = list(range(w))
        else:
            entries.append(plain_entry(j, full, lambda f: f.reshape(-1).tensor_split(w)[r]))
    return Layout(f"shards n={len(fulls)} copies={sorted(copies)}", fulls, entries,
                  pg=distributed.Shards(dist.group.WORLD), copies=copies)


def fam_empty_rank(ctx: Ctx) -> Layout:
    """DTensors on a mesh over the first ranks only (not a slice of a larger mesh); the other ranks hold nothing
    and still take part, process_group= the world."""
    from torch.distributed.device_mesh import DeviceMesh

    k = ctx.rng.randint(1, ctx.world - 1)
    key = ("sub", k)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh("cpu", list(range(k)))
    m = _MESHES[key]
    fulls, entries = [], []
    for j in range(ctx.rng.randint(1, 5)):
        shape = ctx.shape()
        full = ctx.full(shape)
        fulls.append(full)
        pl = placements_for(ctx, shape, 1)
        if ctx.rank < k:
            entries.append(dt_entry(j, full, m, pl))
    # a rank with nothing has a plain (empty) list: its per-tensor results are its own, one collective
    return Layout(f"empty ranks: mesh over {k} of {ctx.world}", fulls, entries, pg=dist.group.WORLD,
                  counts="combined" if ctx.rank < k else "plain_stages")


FAMILIES = [fam_fsdp2, fam_meshes, fam_plain_pp, fam_tp_fsdp, fam_ep, fam_dtensor_pp, fam_shards, fam_tp,
            fam_empty_rank, fam_plain_pp, fam_meshes, fam_dtensor_pp]


def family(world: int, seed: int):
    """The family of layout ``(world, seed)``: in turn over the suite's layouts, world after world."""
    before = sum(n for w, n in LAYOUTS.items() if w < world)
    return FAMILIES[(before + seed) % len(FAMILIES)]


def build(world: int, seed: int) -> Layout:
    ctx = Ctx(world, seed)
    fam = family(world, seed)
    lay = fam(ctx)
    lay.backend = ctx.rng.choice([None, None, "torch"])
    lay.name = f"[{fam.__name__[4:]}] {lay.name} dtypes={ctx.dtypes} backend={lay.backend}"
    lay.rng = ctx.rng
    return lay


# -------------------------------------------------------------------------------------------- checks
def _bits(t) -> bytes:
    t = t._local_tensor if distributed.is_dtensor(t) else t
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _val(t) -> torch.Tensor:
    if distributed.is_dtensor(t):
        assert all(pl.is_replicate() for pl in t.placements), t.placements
        return t._local_tensor
    return t


def _local(g) -> torch.Tensor:
    return g._local_tensor if distributed.is_dtensor(g) else g


_PREC = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11, torch.float64: 53}


def _ulp(v: float, dtype) -> float:
    if v == 0 or not math.isfinite(v):
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(v))) - _PREC[dtype] + 1)


def _near(v: float, o: float, dtype, torch_value: float) -> bool:
    """The default norm's documented error: within two units in the last place of ``dtype`` of the oracle ``o``
    (docs/api.md), or of torch's own error on the gathered model plus one (docs/contract.md's accuracy rule);
    inf where ``o`` rounds past the dtype's largest value."""
    if o >= torch.finfo(dtype).max * (1 + 2.0 ** -_PREC[dtype]):
        return v == INF
    u = _ulp(o, dtype)
    return abs(v - o) <= max(2 * u, abs(torch_value - o) + u) * (1 + 1e-9)


def _promoted(tensors):
    dt = None
    for t in tensors:
        dt = t.dtype if dt is None else torch.promote_types(dt, t.dtype)
    return dt or torch.float32


class Checker:
    def __init__(self, lay: Layout):
        self.lay = lay
        self.failures: list[str] = []

    def fail(self, what: str) -> None:
        self.failures.append(what)

    def expect(self, cond: bool, what: str) -> None:
        if not cond:
            self.fail(what)


def _copies_arg(lay: Layout, params):
    if not lay.copies:
        return lay.pg
    base = lay.pg if lay.pg is not None else dist.group.WORLD
    return distributed.Copies(base, {params[i]: ranks for i, ranks in lay.copies.items()})


def _make_params(lay: Layout) -> list:
    if lay.params is not None:
        return lay.params
    out = []
    for e in lay.entries:
        g = e.make()
        out.append(torch.nn.Parameter(torch.zeros_like(g)))
    return out


def check_layout(lay: Layout) -> list[str]:
    """Every check of one layout on this rank; returns the failures (the same collectives run on every rank
    whatever fails, so a failure on one rank does not leave the others waiting)."""
    ck = Checker(lay)
    params = _make_params(lay)
    saved = [e.make() for e in lay.entries]  # the gradients, restored before each call
    entries = lay.entries
    pg = _copies_arg(lay, params)
    kw = {} if pg is None else {"process_group": pg}
    be = lay.backend
    fulls = lay.fulls
    counts = counts_of(lay)
    mine = [e.j for e in entries]
    my_dtype = _promoted(saved) if entries else torch.float32
    whole_dtype = _promoted(fulls)
    results = []  # what must be the same bits on every rank

    def restore():
        for p, s in zip(params, saved):
            p.grad = s.clone()

    def grads():
        return [p.grad for p in params]

    def counted(fn, n, what):
        with CollectiveCount() as c:
            out = fn()
        ck.expect(c.n == n, f"{what}: {c.n} collectives {c.kinds}, documented {n}")
        return out

    # --- exact=True: the single-process exact norm of the gathered model, bit for bit
    for p in (2.0, 1.0, INF):
        want = fastgrad.get_total_norm(fulls, p, exact=True)
        if my_dtype != whole_dtype:  # a stage of another dtype: its own dtype, correctly rounded
            want = correctly_rounded([v for f in fulls for v in f.double().reshape(-1).tolist()], p, my_dtype)
        restore()
        call = lambda: fastgrad.get_total_norm(grads(), p, backend=be, exact=True, **kw)  # noqa: E731
        got = counted(call, counts["total"], f"exact get_total_norm p={p}") if p == 2.0 else call()
        ck.expect(_bits(_val(got)) == _bits(want), f"exact norm p={p}: {_val(got).item()!r} != single-process {want.item()!r}")
        results.append(_val(got))
        # the clip: the same total, and each local shard the slice of the single-process exact clip
        max_norm = float(want) * lay.rng.choice([0.5, 0.25, 2.0])
        if max_norm == 0 or not math.isfinite(max_norm):
            max_norm = 1.0
        ref = [f.clone() for f in fulls]
        w_total = fastgrad.clip_grad_norm_([_Holder(r) for r in ref], max_norm, p, exact=True)
        restore()
        got = fastgrad.clip_grad_norm_(params, max_norm, p, backend=be, exact=True, **kw)
        if my_dtype == whole_dtype:
            ck.expect(_bits(_val(got)) == _bits(w_total), f"exact clip p={p}: total {_val(got).item()!r} != {w_total.item()!r}")
        for e, prm in zip(entries, params):
            ok = _bits(_local(prm.grad)) == _bits(e.local_of(ref[e.j]).contiguous())
            ck.expect(ok, f"exact clip p={p}: tensor {e.j}'s local shard is not the slice of the single-process clip")

    # per-tensor exact norms: whole tensors' (DTensors, Shards pieces) or this rank's own (plain stages)
    restore()
    call = lambda: fastgrad.multi_tensor_norm(grads(), 2.0, per_tensor=True, backend=be, exact=True, **kw)  # noqa: E731
    total, per = counted(call, counts["per_tensor"], "exact per-tensor")
    if lay.counts == "plain_stages":
        want_per = [e.local_of(fulls[e.j]) for e in entries]
    else:
        want_per = [fulls[j] for j in mine]
    if entries:
        w = fastgrad.multi_tensor_norm(want_per, 2.0, per_tensor=True, exact=True)[1]
        ck.expect(_bits(_val(per)) == _bits(w), f"exact per-tensor norms {_val(per).tolist()} != {w.tolist()}")

    # --- the default: the documented error (_near) against the float64 oracle, the same bits everywhere
    for p in (2.0, 1.0, INF):
        restore()
        call = lambda: fastgrad.get_total_norm(grads(), p, backend=be, **kw)  # noqa: E731
        got = counted(call, counts["total"], f"get_total_norm p={p}") if p == 2.0 else call()
        v = float(_val(got))
        o = oracle.total_norm(fulls, p)
        t = float(torch.nn.utils.get_total_norm([f for f in fulls if f.numel()], p).to(my_dtype))
        if not _near(v, o, my_dtype, t):
            ck.fail(f"default norm p={p}: {v!r} vs oracle {o!r} ({abs(v - o) / max(_ulp(o, my_dtype), 1e-300):.2f} "
                    f"ulp; torch on the gathered model: {abs(t - o) / max(_ulp(o, my_dtype), 1e-300):.2f} ulp)")
        results.append(_val(got))
    restore()
    max_norm = 0.5 * oracle.total_norm(fulls, 2.0) or 1.0
    t1 = counted(lambda: fastgrad.clip_grad_norm_(params, max_norm, backend=be, **kw), counts["total"], "clip_grad_norm_")
    first = [_local(p.grad).clone() for p in params]
    restore()  # a repeat call (a cached plan; DTensor lists on the CPU take the one-pass route): the same bits
    t2 = fastgrad.clip_grad_norm_(params, max_norm, backend=be, **kw)
    ck.expect(_bits(_val(t1)) == _bits(_val(t2)), "clip_grad_norm_: a repeat call gave other bits")
    ck.expect(all(_bits(a) == _bits(_local(p.grad)) for a, p in zip(first, params)), "clip_grad_norm_: repeat clipped differently")
    results.append(_val(t1))
    coef = min(max_norm / (oracle.total_norm(fulls, 2.0) + 1e-6), 1.0)
    for e, prm in zip(entries, params):
        want_local = e.local_of(fulls[e.j]).double() * coef
        gl = _local(prm.grad).double()
        tol = 4 * 2.0 ** -_PREC[prm.grad.dtype] * want_local.abs() + torch.finfo(prm.grad.dtype).smallest_normal
        ck.expect(bool(((gl - want_local).abs() <= tol).all()), f"clip_grad_norm_: tensor {e.j} clipped off the oracle")

    restore()
    call = lambda: fastgrad.multi_tensor_norm(grads(), 2.0, per_tensor=True, backend=be, **kw)  # noqa: E731
    total, per = counted(call, counts["per_tensor"], "per-tensor")
    if entries:
        pv = _val(per).double().tolist()
        for k, (val, ref) in enumerate(zip(pv, want_per)):
            o = oracle.tensor_norm(ref, 2.0)
            t = float(torch.linalg.vector_norm(ref, 2.0).to(my_dtype))
            ck.expect(_near(val, o, my_dtype, t), f"per-tensor norm {k}: {val!r} vs oracle {o!r}")

    restore()
    st = counted(lambda: fastgrad.grad_stats(params, backend=be, **kw), counts["grad_stats"], "grad_stats")
    o = oracle.total_norm(fulls, 2.0)
    t = float(torch.nn.utils.get_total_norm([f for f in fulls if f.numel()], 2.0).to(my_dtype))
    ck.expect(_near(float(st.total_norm), o, my_dtype, t), f"grad_stats total {float(st.total_norm)!r} vs {o!r}")
    if entries:
        for k, ref in enumerate(want_per):
            ck.expect(int(st.numel[k]) == ref.numel(), f"grad_stats numel {k}: {int(st.numel[k])} != {ref.numel()}")

    _check_nan(ck, lay, params, restore, kw)

    # the same bits on every rank (stages of another dtype: each in its own, so compared among their dtype)
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, (str(my_dtype), [_bits(r) for r in results]))
    same = [g for g in got if g[0] == str(my_dtype)]
    ck.expect(all(g == same[0] for g in same), "ranks disagree on a norm's bits")
    return ck.failures


class _Holder:
    def __init__(self, grad):
        self.grad = grad


def _check_nan(ck: Checker, lay: Layout, params, restore, kw) -> None:
    """A NaN in one element: held by one rank only (the step guard skips on every rank), and in every copy of
    it (NaN on every rank; error_if_nonfinite raises on every rank, nothing written)."""
    from fastgrad.guard import StepGuard

    rng = lay.rng
    sizes = [f.numel() for f in lay.fulls]
    if not any(sizes):
        return
    j = rng.choice([k for k, s in enumerate(sizes) if s])
    e = rng.randrange(sizes[j])
    marker = torch.arange(sizes[j], dtype=torch.float64).reshape(lay.fulls[j].shape)
    where = []  # (entry index, flat local index) of the element on this rank
    for i, ent in enumerate(lay.entries):
        if ent.j == j:
            loc = ent.local_of(marker).reshape(-1)
            hit = (loc == e).nonzero().flatten().tolist()
            where += [(i, h) for h in hit]
    holders = [None] * dist.get_world_size()
    dist.all_gather_object(holders, bool(where))
    ranks = [r for r, h in enumerate(holders) if h]
    if not ranks:
        ck.fail(f"no rank holds element {e} of tensor {j}")
        return
    one = rng.choice(ranks)
    me = dist.get_rank()

    def poison(all_copies: bool):
        restore()
        if all_copies or me == one:
            for i, h in where:
                _local(params[i].grad).view(-1)[h] = math.nan

    # one rank's copy: the guard's verdict on every rank
    poison(False)
    opt = torch.optim.SGD(params or [torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # (a rank with nothing: no grad)
    guard = StepGuard(opt, 1.0, backend=lay.backend, exact=rng.random() < 0.5, **kw)
    try:
        guard.clip_()
        ck.expect(guard.last_step_skipped(), f"NaN at element {e} of tensor {j} on rank {one} only: this rank did not skip")
    finally:
        guard.remove()
    # every copy: NaN everywhere, and error_if_nonfinite raises everywhere before anything is written
    for p in (2.0, INF):
        poison(True)
        t = fastgrad.get_total_norm([q.grad for q in params], p, backend=lay.backend, **kw)
        ck.expect(math.isnan(float(_val(t))), f"NaN in tensor {j}: norm p={p} is {float(_val(t))!r}")
    poison(True)
    before = [_local(q.grad).clone() for q in params]
    try:
        fastgrad.clip_grad_norm_(params, 1e-3, backend=lay.backend, error_if_nonfinite=True, **kw)
        ck.fail(f"NaN in tensor {j}: error_if_nonfinite did not raise")
    except RuntimeError as exc:
        ck.expect("non-finite" in str(exc), f"error_if_nonfinite raised {exc}")
    ck.expect(all(torch.equal(b.nan_to_num(), _local(q.grad).nan_to_num()) for b, q in zip(before, params)),
              "error_if_nonfinite wrote gradients")


# ------------------------------------------------------------------------------------------- the runs
def run_world(rank: int, world: int, seeds: list[int], out_dir: str) -> None:
    """This rank's part of ``world``: join the group (a FileStore in ``out_dir``), run each seed's layout,
    leave ``w{world}-s{seed}.ok`` or ``.fail`` (rank 0, every rank's failures) files."""
    store = dist.FileStore(os.path.join(out_dir, f"store-{world}"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=90))
    _MESHES.clear()
    distributed.clear_cache()
    try:
        for seed in seeds:
            t0 = time.perf_counter()
            name = "?"
            try:
                lay = build(world, seed)
                name = lay.name
                fails = check_layout(lay)
            except Exception:  # noqa: BLE001 - recorded; the peers may now wait in a collective: end this world
                with open(os.path.join(out_dir, f"w{world}-s{seed}.err.{rank}"), "w") as f:
                    f.write(f"{name}\n{traceback.format_exc()}")
                raise
            got = [None] * world
            dist.all_gather_object(got, fails)
            if rank == 0:
                bad = [f"rank {r}: {m}" for r, fs in enumerate(got) for m in fs]
                tag = "fail" if bad else "ok"
                with open(os.path.join(out_dir, f"w{world}-s{seed}.{tag}"), "w") as f:
                    f.write(f"{name}\n{time.perf_counter() - t0:.2f} s\n" + "\n".join(bad))
    finally:
        distributed.clear_cache()
        dist.destroy_process_group()


def _worker(rank: int, plan: dict, out_dir: str) -> None:
    """One process for every world: ranks below a world's size run it, in turn (re-joining a new group each
    time: one launch of the largest world serves them all)."""
    torch.set_num_threads(1)
    for world, seeds in plan.items():
        if rank >= world:
            continue
        go = os.path.join(out_dir, f"go-{world}")
        if rank == 0:  # rank 0 is done with the smaller worlds: the others may join now
            open(go, "w").close()
        else:  # (joining early would time out in the rendezvous while the smaller worlds still run)
            while not os.path.exists(go):
                time.sleep(0.2)
        try:
            run_world(rank, world, seeds, out_dir)
        except Exception:  # noqa: BLE001 - this world's remaining layouts did not run; the next world may
            pass


def launch(plan: dict, out_dir: str, wall_limit_s: float) -> str:
    """Run ``plan`` ({world: [seeds]}) on max(worlds) spawned processes; the launcher's error text or ''."""
    return spawn_ranks(_worker, max(plan), out_dir, wall_limit_s, args=(plan, out_dir))


def outcome(out_dir: str, world: int, seed: int) -> tuple[str, str]:
    """``(state, text)``: "ok", "fail" (the checks' messages), "error" (a traceback) or "not run"."""
    base = os.path.join(out_dir, f"w{world}-s{seed}")
    for tag in ("ok", "fail"):
        if os.path.exists(f"{base}.{tag}"):
            with open(f"{base}.{tag}") as f:
                return tag, f.read()
    errs = sorted(f for f in os.listdir(out_dir) if f.startswith(f"w{world}-s{seed}.err."))
    texts = []
    for name in errs:
        with open(os.path.join(out_dir, name)) as f:
            texts.append((f"rank {name.rsplit('.', 1)[1]}: ", f.read()))
    if texts:  # a rank's own error first, then those that only lost their peer
        texts.sort(key=lambda t: "closed by peer" in t[1] or "Connection reset" in t[1])
        return "error", texts[0][1].split("\n", 1)[0] + "\n" + "".join(r + t.split("\n", 1)[1] for r, t in texts[:1])
    return "not run", ""


def default_plan() -> dict:
    return {w: list(range(LAYOUTS[w])) for w in WORLDS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, action="append", help="world size (repeatable); default: all")
    ap.add_argument("--seed", type=int, action="append", help="seed (repeatable); default: the suite's")
    ap.add_argument("--limit", type=float, default=1200.0, help="wall-clock limit, s")
    a = ap.parse_args(argv)
    worlds = a.world or list(WORLDS)
    plan = {w: (a.seed if a.seed is not None else list(range(LAYOUTS.get(w, 8)))) for w in sorted(worlds)}
    out = tempfile.mkdtemp(prefix="fastgrad-fuzz-")
    t0 = time.perf_counter()
    err = launch(plan, out, a.limit)
    bad = 0
    for w, seeds in plan.items():
        for s in seeds:
            state, text = outcome(out, w, s)
            head = text.splitlines()[0] if text else ""
            print(f"world {w} seed {s}: {state}  {head}")
            if state != "ok":
                bad += 1
                print("   " + "\n   ".join(text.splitlines()[1:]) + f"\n   replay: {replay_line(w, s)}")
    print(f"{sum(len(s) for s in plan.values())} layouts, {bad} not ok, {time.perf_counter() - t0:.1f} s"
          + (f" ({err})" if err else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
