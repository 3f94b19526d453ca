"""Sharded gradients: DTensor grads on any number of DeviceMeshes (FSDP2 ``fully_shard``, tensor parallel,
HSDP, expert parallel), plain tensors among them, hand-sharded plain grads (ZeRO style) and pipeline stages,
reduced to ONE global norm that every rank agrees on bit for bit.

Counting each element once. Every rank turns its local shards into one contribution, and the contributions
of all ranks add up (max/min for the inf/-inf norms) to the norm of the whole model:

* ``Shard(d)`` (and FSDP2+TP's ``_StridedShard``) on a mesh dimension: the ranks hold disjoint pieces.
* ``Replicate()``: only the ranks at coordinate 0 of every replicated dimension contribute (an exact 0/1
  weight: no division by the replication factor, so no rounding and the same bits everywhere).
* ``Partial(op)``: a rank holds a term, not a piece, and the norm of a sum is not a sum of norms: the norm
  is read from a copy redistributed to ``Replicate()`` (one extra collective per Partial tensor, which FSDP2
  and the usual TP plans never produce for gradients). Clipping scales the local terms in place (exact for
  a coefficient >= 0 with sum/avg/max/min partials).
* A plain tensor in a list with DTensors is taken to be replicated on every rank of those DTensors' meshes
  (a parameter left out of ``fully_shard``): the lowest rank of the meshes contributes it. Likewise a
  DTensor on a mesh that spans only part of the ranks of this rank's meshes (TP + FSDP2: a LayerNorm that
  ``fully_shard`` put on the dp slice is replicated across tp, each tp rank holding its own dp slice) is
  a copy: only the slice holding the lowest of those ranks contributes.
* A plain list with ``process_group=``: every rank holds its own elements (ZeRO shards, a pipeline stage).

Which ranks reduce together (the plan, cached per set of meshes and group):

* DTensors whose meshes together cover the world (FSDP2, TP, HSDP, MoE with dense layers on a 1-D mesh and
  experts on an ep x dp mesh): ONE all-reduce over the world.
* ``process_group=G`` with DTensors says that the ranks of ``G`` hold other parameters (pipeline stages):
  - ``G`` contains this rank's meshes (e.g. ``dist.group.WORLD``): ONE all-reduce over ``G``;
  - ``G`` meets the meshes only in this rank (the pipeline group, one rank per stage): ONE all-reduce over
    the world when ``|G| x |meshes' ranks|`` is the world size (the stages tile it), else the mesh's
    reduction then one over ``G``.
* Meshes on a subset of the ranks: a reduction along the mesh spanning them (one collective for a 1-D mesh,
  one per dimension otherwise). If such a mesh is a slice of a larger mesh (e.g. the dp x tp slice of a
  pp x dp x tp mesh) and no ``process_group=`` says otherwise, the norm would leave out the other slices'
  gradients: that raises (pass the pipeline group, or the mesh's own group to mean "these ranks only").
* Per-tensor results (``per_tensor=True``, ``norm_type=0``, ``grad_stats``) need the same list on every rank
  taking part; across pipeline stages the per-tensor vector is reduced within the stage and the stage
  totals in a second collective over ``process_group`` (2 instead of 1).
* The inf/-inf norm reduces with MAX/MIN, the finite ones with SUM; a NaN travels as a flag packed into the
  same buffer (MAX/MIN collectives do not promise to propagate NaN), so it is still one collective.

A rank with an empty list still takes part: with DTensors elsewhere it knows no mesh, so every rank passes
the same ``process_group=`` (e.g. ``dist.group.WORLD``) and the empty rank contributes zero over it.

Results: a ``Replicate()`` DTensor on the mesh when all gradients are DTensors on ONE mesh (what torch's
``clip_grad_norm_`` returns; torch gives ``Partial(max)`` for the inf norm, whose ``full_tensor()`` is the
same value), else a plain 0-dim tensor; in both cases the same value on every rank, ready to log.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from . import _scan
from .backends import acc_dtype

__all__ = ["is_dtensor", "has_dtensor", "Sharded", "prepare", "reduced_norm", "reduced_amp_norm",
           "reduced_stats", "wrap_like", "to_local_norm", "clear_cache", "nonfinite_poison"]

_INF = float("inf")
_DT: type | None = None
_DT_CHECKED = False


def _dtensor_cls() -> type | None:
    """The DTensor class, or None where torch.distributed (or DTensor) is not built in. Imported on first
    need only, so a plain call never pays for torch.distributed.tensor's import."""
    global _DT, _DT_CHECKED
    if not _DT_CHECKED:
        _DT_CHECKED = True
        try:
            import torch.distributed as dist

            if dist.is_available():
                try:
                    from torch.distributed.tensor import DTensor  # torch >= 2.5
                except ImportError:  # pragma: no cover - torch 2.4
                    from torch.distributed._tensor import DTensor
                _DT = DTensor
        except ImportError:  # pragma: no cover - builds without distributed
            _DT = None
    return _DT


def _placements():
    try:
        from torch.distributed.tensor import Replicate
    except ImportError:  # pragma: no cover - torch 2.4
        from torch.distributed._tensor import Replicate
    return Replicate


def is_dtensor(t) -> bool:
    if type(t) is Tensor:
        return False
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def has_dtensor(tensors: Sequence[Tensor]) -> bool:
    """Whether the list holds a DTensor anywhere. A :class:`fastgrad._scan.Checked` list (every plain
    single-process call with the compiled helpers) is all plain tensors by construction: one ``is``. Any
    other list is looked at whole, so a plain tensor first no longer hides DTensors behind it. ``len``, not
    ``bool``: the Dynamo of torch 2.11 cannot trace ``bool`` of a list."""
    if type(tensors) is _scan.Checked or len(tensors) == 0:
        return False
    for t in tensors:
        if type(t) is not Tensor and is_dtensor(t):
            return True
    return False


# ------------------------------------------------------------------------------- caches (host cost)
# Keyed by object identity; the value keeps the object so that an id reused after garbage collection can
# not alias (the entry is checked with `is`). Small: one entry per (mesh, placements) kind and per plan.
_SPEC_CACHE: dict = {}
_MESH_RANKS: dict = {}
_PLAN_CACHE: dict = {}


def clear_cache() -> None:
    """Forget the cached placement decisions, mesh rank sets and reduction plans (e.g. after destroying
    and re-creating process groups with the same objects' ids)."""
    _SPEC_CACHE.clear()
    _MESH_RANKS.clear()
    _PLAN_CACHE.clear()


def _spec_info(mesh, placements) -> tuple[bool, bool, tuple | None]:
    """``(counted, has_partial, read_placements)`` for a DTensor on ``mesh`` with ``placements`` on this
    rank: whether its local values enter the norm (coordinate 0 of every dimension on which it is
    replicated), and the placements to redistribute to for the norm when some are Partial."""
    key = (id(mesh), placements)
    hit = _SPEC_CACHE.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"this rank is not part of the DeviceMesh {mesh} of some of the gradients")
    partial = any(p.is_partial() for p in placements)
    read_pl = None
    if partial:
        Replicate = _placements()
        read_pl = tuple(Replicate() if p.is_partial() else p for p in placements)
    eff = read_pl if partial else placements
    counted = all(coord[d] == 0 for d, p in enumerate(eff) if p.is_replicate())
    info = (counted, partial, read_pl)
    if len(_SPEC_CACHE) > 4096:  # placements are a handful of kinds; a flood means short-lived meshes
        _SPEC_CACHE.clear()
    _SPEC_CACHE[key] = (mesh, info)
    return info


def _ranks_of_mesh(mesh) -> frozenset:
    hit = _MESH_RANKS.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1]
    ranks = frozenset(int(r) for r in mesh.mesh.flatten().tolist())
    _MESH_RANKS[id(mesh)] = (mesh, ranks)
    return ranks


def _root_ranks(mesh) -> frozenset | None:
    """Ranks of the mesh ``mesh`` was sliced from (itself when not a slice); None when torch cannot say."""
    root = None
    getter = getattr(mesh, "_get_root_mesh", None)
    try:
        if getter is not None:
            root = getter()
        else:
            from torch.distributed.device_mesh import _mesh_resources

            root = _mesh_resources.get_root_mesh(mesh)
    except Exception:  # noqa: BLE001 - a private API that moved: skip the check rather than fail the call
        return None
    return None if root is None else _ranks_of_mesh(root)


# ------------------------------------------------------------------------------------ the local view
class Sharded:
    """Local view of a sharded gradient list.

    ``reads[i]``: local tensor whose values enter the norm; ``writes[i]``: local tensor scaled in place;
    ``counts[i]``: whether this rank's ``reads[i]`` contributes; ``mesh``: the one mesh of an all-DTensor
    single-mesh list (the result is a Replicate DTensor on it), else None; ``plan``: the collectives."""

    __slots__ = ("reads", "writes", "counts", "mesh", "plan")

    def __init__(self, reads, writes, counts, mesh, plan):
        self.reads: list[Tensor] = reads
        self.writes: list[Tensor] = writes
        self.counts: list[bool] = counts
        self.mesh = mesh
        self.plan: _Plan = plan


class _Plan:
    """The collectives of one call. ``steps``: groups to all-reduce the (scalar or same-length vector)
    buffer over in turn, each rank's contribution pre-weighted so the sum is the whole model's (``None``
    is the default group). For per-tensor vectors across pipeline stages (lists that differ per stage):
    ``stage_steps`` reduce within the stage, then ``cross`` reduces the stage totals, to which only this
    rank contributes when ``cross_contrib``. ``plain_counted``: whether plain tensors count on this rank;
    ``mesh_counted``: the same per mesh (False for a copy of a slice, see the module's docstring).
    ``device``: where a rank without local tensors builds its buffer."""

    __slots__ = ("steps", "stage_steps", "cross", "cross_contrib", "plain_counted", "device", "keep",
                 "mesh_counted")

    def __init__(self, steps, stage_steps, cross, cross_contrib, plain_counted, device, keep):
        self.steps = steps
        # per mesh of keep[0]: whether its tensors count here (the copy of a slice holding the lowest rank)
        meshes = keep[0]
        union = frozenset().union(*(_ranks_of_mesh(m) for m in meshes)) if meshes else frozenset()
        self.mesh_counted = tuple(min(union) in _ranks_of_mesh(m) for m in meshes)
        self.stage_steps = stage_steps
        self.cross = cross
        self.cross_contrib = cross_contrib
        self.plain_counted = plain_counted
        self.device = device
        self.keep = keep  # the meshes and group the plan was built for (keeps their ids valid)

    @property
    def staged(self) -> bool:
        return self.cross is not None


def _group_ranks(group) -> frozenset:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return frozenset(range(dist.get_world_size()))
    return frozenset(dist.get_process_group_ranks(group))


def _mesh_steps(meshes: list, union: frozenset) -> list:
    """Groups that reduce over exactly ``union``: the one of a 1-D mesh spanning it, or each dimension of
    a multi-dimensional one in turn (SUM/MAX/MIN are associative, so that reaches every rank)."""
    import torch.distributed as dist

    if len(union) == dist.get_world_size():
        return [None]
    best = None
    for m in meshes:
        if _ranks_of_mesh(m) == union and (best is None or m.ndim < best.ndim):
            best = m
    if best is None:
        raise ValueError(
            "the gradients' DeviceMeshes cover different sets of ranks ("
            + ", ".join(str(sorted(_ranks_of_mesh(m))) for m in meshes)
            + ") and none of them spans their union, so no reduction over these meshes counts every element "
            "once; put the parameters on meshes of one root mesh that spans them, or pass process_group= a "
            "group holding all these ranks"
        )
    return [best.get_group(d) for d in range(best.ndim)]


def _build_plan(meshes: list, group, empty: bool) -> _Plan:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sharded gradients need an initialized torch.distributed process group")
    world = dist.get_world_size()
    me = dist.get_rank()
    if group is not None and (group is dist.GroupMember.NON_GROUP_MEMBER or me not in _group_ranks(group)):
        raise ValueError(f"this rank ({me}) is not a member of process_group")
    dev_group = group
    if not meshes:
        if empty:  # a rank with nothing to add: its per-tensor part is empty, it joins the stage totals only
            return _Plan([group], [], group, True, True, _group_device(group), ((), group))
        # plain tensors: disjoint across the group (ZeRO shards, pipeline stages)
        return _Plan([group], None, None, True, True, _group_device(group), ((), group))
    union = frozenset().union(*(_ranks_of_mesh(m) for m in meshes))
    plain_counted = me == min(union)
    if group is None:
        if len(union) < world:
            for m in meshes:
                root = _root_ranks(m)
                if root is not None and not root <= union:
                    raise ValueError(
                        f"the gradients' DeviceMesh covers ranks {sorted(union)}, a slice of a mesh over "
                        f"{len(root)} ranks: the other slices' gradients (pipeline stages?) would be left out "
                        "of the norm. Pass process_group= the group that connects the stages (or "
                        "dist.group.WORLD); to reduce over these ranks only, pass the mesh's own group"
                    )
        steps = _mesh_steps(meshes, union)
        return _Plan(steps, None, None, False, plain_counted, _group_device(steps[0]), (tuple(meshes), group))
    granks = _group_ranks(group)
    if union <= granks:
        # The group contains the meshes: one all-reduce over it. Ranks of the group outside the meshes hold
        # other parameters (stages); per-tensor vectors are reduced within the meshes first then.
        if granks == union:
            return _Plan([group], None, None, False, plain_counted, _group_device(group), (tuple(meshes), group))
        stage = _mesh_steps(meshes, union)
        return _Plan([group], stage, group, plain_counted, plain_counted, _group_device(group), (tuple(meshes), group))
    if granks & union != {me}:
        raise ValueError(
            f"process_group (ranks {sorted(granks)}) shares ranks with the gradients' meshes (ranks "
            f"{sorted(union)}) without containing them: it must either contain the meshes (e.g. "
            "dist.group.WORLD) or connect ranks holding different parameters, one per stage (a pipeline group)"
        )
    stage = _mesh_steps(meshes, union)
    steps = [None] if len(granks) * len(union) == world else stage + [group]
    return _Plan(steps, stage, group, True, plain_counted, _group_device(dev_group), (tuple(meshes), group))


def _plan_for(meshes: list, group, empty: bool) -> _Plan:
    key = (tuple(id(m) for m in meshes), id(group), empty)
    hit = _PLAN_CACHE.get(key)
    if hit is not None and hit.keep[-1] is group and all(a is b for a, b in zip(hit.keep[0], meshes)):
        return hit
    plan = _build_plan(meshes, group, empty)
    if len(_PLAN_CACHE) > 256:
        _PLAN_CACHE.clear()
    _PLAN_CACHE[key] = plan
    return plan


def prepare(tensors: Sequence[Tensor], process_group=None, *, for_norm: bool = True) -> Sharded:
    """Local shards of ``tensors`` (DTensors on any meshes, plain tensors, mixed) and the plan of the
    reduction. ``for_norm=False`` skips the redistribution of Partial tensors and the plan (only the write
    targets are needed). Host cost: a few attribute reads per tensor; the placements' meaning and the plan
    are cached (no DTensor dispatch)."""
    cls = _dtensor_cls()
    reads, writes, counts = [], [], []
    meshes: list = []
    plain: list[int] = []
    last_mesh = last_pl = info = None
    pos = -1
    where: list[int] = []  # per tensor: its mesh's position in `meshes` (-1: plain)
    for t in tensors:
        if type(t) is Tensor or cls is None or not isinstance(t, cls):
            reads.append(t)
            writes.append(t)
            counts.append(True)
            plain.append(len(counts) - 1)
            where.append(-1)
            continue
        spec = t._spec
        m = spec.mesh
        pl = spec.placements
        if m is not last_mesh or pl is not last_pl and pl != last_pl:
            if m is not last_mesh:
                for pos, x in enumerate(meshes):
                    if x is m:
                        break
                else:  # DTensor ops may hand out an equal copy of a mesh: one mesh for the plan
                    for pos, x in enumerate(meshes):
                        if x == m:
                            m = x
                            break
                    else:
                        pos = len(meshes)
                        meshes.append(m)
            info = _spec_info(m, pl)
            last_mesh, last_pl = m, pl
        local = t._local_tensor  # what to_local() returns, without an autograd node
        read = local
        if info[1] and for_norm:
            read = t.redistribute(m, info[2])._local_tensor
        reads.append(read)
        writes.append(local)
        counts.append(info[0] and read.numel() > 0)
        where.append(pos)
    if not for_norm:
        return Sharded(reads, _scan.checked(writes) if writes else writes, counts, None, None)
    plan = _plan_for(meshes, process_group, not counts)
    if plain and not plan.plain_counted:
        for i in plain:
            counts[i] = False
    if not all(plan.mesh_counted):  # tensors on a copy of a slice (replicated outside their mesh)
        skip = plan.mesh_counted
        for i, k in enumerate(where):
            if k >= 0 and not skip[k]:
                counts[i] = False
    for i in plain:
        if counts[i] and reads[i].numel() == 0:
            counts[i] = False
    mesh = meshes[0] if len(meshes) == 1 and not plain else None
    return Sharded(reads, _scan.checked(writes) if writes else writes, counts, mesh, plan)


# ------------------------------------------------------------------------------------- collectives
def _all_reduce(t: Tensor, op, steps: list) -> None:
    import torch.distributed as dist

    for g in steps:
        dist.all_reduce(t, op=op, group=g)


def _group_device(group) -> torch.device:
    """Where a rank with no local tensor puts its contribution: the device the group's backend reduces."""
    import torch.distributed as dist

    name = str(dist.get_backend(group)).lower()
    if "nccl" in name and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wide(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    # The tiny combine vector is reduced in float64 (squaring an fp32 norm there is exact), which keeps the
    # result at least as accurate as torch's; MPS has no float64.
    return dtype if device.type == "mps" else torch.float64


def _combine(vals: Tensor, p: float, steps: list) -> Tensor:
    """All-reduce ``vals`` (finite p != 0: p-th powers; 0: counts; inf/-inf: norms) over ``steps`` in ONE
    collective per step: SUM, or MAX/MIN with a NaN flag packed behind the values."""
    import torch.distributed as dist

    if p == _INF or p == -_INF:
        n = vals.numel()
        nan = torch.isnan(vals)
        if p == _INF:
            buf = torch.cat([torch.where(nan, 0.0, vals), nan.to(vals.dtype)])
            _all_reduce(buf, dist.ReduceOp.MAX, steps)
            flag = buf[n:] > 0
        else:
            buf = torch.cat([torch.where(nan, _INF, vals), -nan.to(vals.dtype)])
            _all_reduce(buf, dist.ReduceOp.MIN, steps)
            flag = buf[n:] < 0
        return torch.where(flag, float("nan"), buf[:n])
    _all_reduce(vals, dist.ReduceOp.SUM, steps)
    return vals


def _stage_total(vals: Tensor, p: float) -> Tensor:
    """The total (in the reduction's form: a power sum, a count, a max/min) of reduced per-tensor ``vals``."""
    if p == _INF:
        return vals.amax().reshape(1) if vals.numel() else vals.new_zeros(1)
    if p == -_INF:
        return vals.amin().reshape(1) if vals.numel() else vals.new_full((1,), _INF)
    if p == 0:
        return (vals != 0).sum().to(vals.dtype).reshape(1)
    return vals.sum().reshape(1)


def _finish(total_form: Tensor, p: float) -> Tensor:
    if p == _INF or p == -_INF or p == 0:
        return total_form.reshape(())
    return total_form.reshape(()).pow(1.0 / p)


def _local_dev_dtype(sh: Sharded) -> tuple[torch.device, torch.dtype]:
    if sh.reads:
        return sh.reads[0].device, acc_dtype(sh.reads)
    return sh.plan.device, torch.float32  # a rank owning no shard still takes part in the collective


def _counted(sh: Sharded, dtype: torch.dtype, dev: torch.device) -> tuple[list[int], list[Tensor]]:
    sel = [i for i, c in enumerate(sh.counts) if c]
    local = [sh.reads[i] for i in sel]
    if local and dtype == torch.float64 and acc_dtype(local) != dtype:
        # This rank holds no piece of the float64 tensors, but every rank must accumulate as the whole
        # list dictates: an empty float64 tensor makes the backend accumulate in float64 (entry dropped).
        local = local + [torch.empty(0, dtype=torch.float64, device=dev)]
    return sel, _scan.checked(local) if local else local  # plain local tensors: the compiled one-pass scan


def reduced_norm(sh: Sharded, norm_type: float, per_tensor: bool,
                 local_norm: Callable[[list[Tensor], bool], tuple[Tensor, Tensor | None]],
                 poison: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Global total norm (and per-tensor norms, in input order, when asked) in the accumulation dtype on
    the first local tensor's device, identical on every rank. ``local_norm(tensors, per_tensor)`` is the
    single-process norm of a list of local tensors (fastgrad.clip's backend dispatch).

    One collective per step of the plan (one in all for the usual layouts): a SUM of p-th-power sums for
    finite p (of per-tensor nonzero counts for p = 0), a MAX (MIN for -inf) with the NaN flags packed in.
    Per-tensor results across pipeline stages: the stage's vector, then one more for the stage totals.

    ``poison`` (the step guard's): a 0-dim local tensor, 0 or NaN, added to this rank's contribution, so a
    NaN that only this rank can see reaches every rank's result in the same collective (see
    :func:`nonfinite_poison`)."""
    plan = sh.plan
    dev, dtype = _local_dev_dtype(sh)
    wide = _wide(dtype, dev)
    p = norm_type
    sel, local = _counted(sh, dtype, dev)
    vector = per_tensor or p == 0  # p = 0 counts tensors with a nonzero: needs per-tensor counts
    # Finite p != 0 travels as p-th powers (their sum is what adds up across ranks); 0 counts, inf/-inf
    # as norms (max/min). `identity` is what a rank with nothing to add contributes.
    powers = p != 0 and p not in (_INF, -_INF)
    identity = _INF if p == -_INF else 0.0

    if vector or powers:
        n = len(sh.reads) if vector else 1
        if local:
            _, per = local_norm(local, True)
            per = per[: len(sel)].to(wide)
            if powers:
                per = per.pow(p)  # in float64: exact for p = 2 from an fp32 norm
            if not vector:
                vals = per.sum().reshape(1)
            elif len(sel) != n:  # put the counted ones in place; the rest contribute the identity
                vals = torch.full((n,), identity, dtype=wide, device=dev)
                vals[torch.tensor(sel, dtype=torch.int64).to(dev, non_blocking=True)] = per
            else:
                vals = per
        else:
            vals = torch.full((n,), identity, dtype=wide, device=dev)
    else:  # inf / -inf total: a max/min is exact, the local total will do
        if local:
            total, _ = local_norm(local, False)
            vals = total.to(wide).reshape(1)
        else:
            vals = torch.full((1,), identity, dtype=wide, device=dev)

    if poison is not None:
        vals = vals + poison.to(vals.device, vals.dtype)  # (+0 leaves the non-negative values' bits alone)
    per_out = None
    if vector:
        vals = _combine(vals, p, plan.stage_steps if plan.staged else plan.steps)
        per_out = vals
        form = _stage_total(vals, p)
        if plan.staged:  # the stages' totals: one more collective (their lists differ in length)
            if not plan.cross_contrib:
                form = torch.full_like(form, identity)
            form = _combine(form, p, [plan.cross])
    else:
        form = _combine(vals, p, plan.steps)
    total = _finish(form, p).to(dtype)
    per = None
    if per_tensor:
        per = (per_out.pow(1.0 / p) if powers else per_out).to(dtype)
    return total, per


def reduced_stats(sh: Sharded, local_stats: Callable[[list[Tensor]], dict[str, Tensor]]) -> dict[str, Tensor]:
    """grad_stats over shards: the columns of :func:`fastgrad.stats.tensor_stats` for the WHOLE tensors, in
    input order, the same on every rank (``numel`` too: the counted shards' sizes add up to the tensor's).

    Two collectives (three across pipeline stages): a SUM of the squared norms and the NaN/Inf/zero counts,
    and a MAX of max|g| with its NaN flags (a max cannot ride a sum); then, across stages, the stage totals."""
    import torch.distributed as dist

    plan = sh.plan
    dev, dtype = _local_dev_dtype(sh)
    wide = _wide(dtype, dev)
    sel, local = _counted(sh, dtype, dev)
    n = len(sh.reads)
    sums = torch.zeros((5, n), dtype=wide, device=dev)
    peak = torch.zeros((n,), dtype=wide, device=dev)
    if local:
        cols = local_stats(local)
        k = len(sel)
        loc = torch.stack([cols["norm"][:k].to(wide).square(), cols["nan"][:k].to(wide), cols["inf"][:k].to(wide),
                           cols["zero"][:k].to(wide), cols["numel"][:k].to(dev, wide)])
        mx = cols["max_abs"][:k].to(wide)
        if k == n:
            sums, peak = loc, mx
        else:
            idx = torch.tensor(sel, dtype=torch.int64).to(dev, non_blocking=True)
            sums[:, idx] = loc
            peak[idx] = mx
    steps = plan.stage_steps if plan.staged else plan.steps
    sums = sums.reshape(-1)
    _all_reduce(sums, dist.ReduceOp.SUM, steps)
    sums = sums.reshape(5, n)
    peak = _combine(peak, _INF, steps)
    sq = sums[0]
    form = sq.sum().reshape(1)
    if plan.staged:
        if not plan.cross_contrib:
            form = torch.zeros_like(form)
        _all_reduce(form, dist.ReduceOp.SUM, [plan.cross])
    counts = sums[1:].to(torch.int64)
    return {"norm": sq.sqrt().to(dtype), "max_abs": peak.to(dtype), "nan": counts[0], "inf": counts[1],
            "zero": counts[2], "numel": counts[3], "total_norm": form.reshape(()).sqrt().to(dtype)}


def wrap_like(value: Tensor, sh: Sharded):
    """A result for the caller: a Replicate() DTensor on the grads' mesh when all of them are DTensors on
    one mesh (what torch's clip_grad_norm_ returns), else the plain tensor (the same on every rank)."""
    if sh.mesh is None:
        return value
    Replicate = _placements()
    return _dtensor_cls().from_local(value, sh.mesh, [Replicate()] * sh.mesh.ndim, run_check=False)


def to_local_norm(total_norm):
    """A total norm given to clip_grads_with_norm_ as a DTensor (ours: Replicate; torch's inf norm:
    Partial(max)) becomes the plain replicated value (a collective only for a Partial one)."""
    if is_dtensor(total_norm):
        if all(p.is_replicate() for p in total_norm.placements):
            return total_norm._local_tensor
        return total_norm.full_tensor()
    return total_norm


def reduced_amp_norm(sh: Sharded, norm_type: float,
                     local_amp: Callable[[list[Tensor]], tuple[Tensor, Tensor]],
                     poison: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The fused AMP read pass over shards: ``local_amp(tensors)`` gives this rank's (norm of the unscaled
    values, found_inf 0/1); ONE all-reduce (per step of the plan) carries the p-th power (or max) and the
    overflow flag together. Returns ``(global total, local found_inf, global found_inf)``, the flags 0-dim
    float32 exactly 0 or 1. norm_type 0 has no sharded AMP form (the read pass yields totals, not
    per-tensor counts)."""
    import torch.distributed as dist

    p = norm_type
    if p == 0:
        raise ValueError("scaler_unscale_and_clip with norm_type=0 is not supported for sharded gradients")
    steps = sh.plan.steps
    dev, dtype = _local_dev_dtype(sh)
    wide = _wide(dtype, dev)
    _, local = _counted(sh, dtype, dev)
    if local:
        total, flag = local_amp(local)
        total, flag = total.to(dev, wide).reshape(1), flag.to(dev, torch.float32).reshape(())
    else:
        total = torch.full((1,), _INF if p == -_INF else 0.0, dtype=wide, device=dev)
        flag = torch.zeros((), dtype=torch.float32, device=dev)
    f = flag.to(wide).reshape(1)
    if poison is not None:  # (as in reduced_norm) a NaN only this rank sees: an overflow on every rank
        poison = poison.to(dev, wide)
        f = torch.where(torch.isnan(poison), 1.0, f)
    if p == _INF or p == -_INF:
        if poison is not None:
            total = total + poison
        nan = torch.isnan(total).to(wide)
        if p == _INF:
            buf = torch.cat([torch.where(nan > 0, 0.0, total), nan, f])
            _all_reduce(buf, dist.ReduceOp.MAX, steps)
        else:  # MIN for the value; flags ride negated
            buf = torch.cat([torch.where(nan > 0, _INF, total), -nan, -f])
            _all_reduce(buf, dist.ReduceOp.MIN, steps)
            buf = torch.cat([buf[:1], -buf[1:]])
        g_total = torch.where(buf[1] > 0, float("nan"), buf[0])
        g_flag = buf[2]
    else:
        pw = total.pow(p) if local else torch.zeros_like(total)  # no shard: adds nothing (also for p < 0)
        if poison is not None:
            pw = pw + poison
        buf = torch.cat([pw, f])
        _all_reduce(buf, dist.ReduceOp.SUM, steps)
        g_total = buf[0].pow(1.0 / p)
        g_flag = buf[1]
    g_flag = (g_flag > 0).to(torch.float32)
    return g_total.to(dtype), flag, g_flag


# ------------------------------------------------------------------------------------- the step guard's flag
def nonfinite_poison(sh: Sharded, local_norm: Callable[[list[Tensor]], Tensor]) -> Tensor | None:
    """For the step guard, whose decision must be the same on every rank: the local tensors this rank holds
    but does not count (copies of ``Replicate()`` pieces, plain tensors beside DTensors, a replicated mesh
    slice) are counted on another rank only, so a NaN/Inf in this rank's copy alone would reach no norm.
    Returns NaN when ``local_norm`` of those copies is non-finite, else 0 (a 0-dim tensor in the wide dtype),
    for ``reduced_norm(poison=)``; None when this rank holds no such copy (then nothing is added). One more
    read of the copies, no collective."""
    spare = [r for r, c in zip(sh.reads, sh.counts) if not c and r.numel()]
    if not spare:
        return None
    n = local_norm(_scan.checked(spare)).reshape(())
    return torch.where(torch.isfinite(n), 0.0, float("nan")).to(_wide(n.dtype, n.device))
