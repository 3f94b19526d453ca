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
* A plain list with ``process_group=G``: every rank holds its own tensors (a pipeline stage, whole tensors
  dealt to ranks): per-tensor results are this rank's own tensors' norms, the total is over ``G``.
  ``process_group=Shards(G)``: tensor i on every rank of ``G`` is a piece of one tensor (ZeRO-style hand
  sharding): per-tensor results are the whole tensors' norms, and the lists must match (length, dtypes).

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
* The inf/-inf norm reduces with MAX/MIN, the finite ones with SUM; a NaN travels as a flag packed into the
  same buffer (MAX/MIN collectives do not promise to propagate NaN), so it is still one collective.

Agreement between ranks. The reduction buffer carries a small header besides the values: a signature of the
call (kind, norm order, per-tensor or not, the plan's kind) and, per group of ranks that must hold the same
list (the whole span, or each pipeline stage in its own slot), the list's length and a fingerprint of its
shapes and dtypes. Encoded so that the reduced header tells whether every contributor sent the same value
(a SUM carries ``(count, v, v^2)``: all equal iff ``sum(v^2) == count * mean^2``; a MAX carries ``(v, -v)``:
all equal iff max == min), it costs no extra collective, and every rank reads the same verdict, so a
mismatch raises :class:`RankMismatchError` with the same text on every rank, before anything is written.
Per-tensor vectors (``per_tensor=True``, ``norm_type=0``, ``grad_stats``) are reduced only after the
header said their lengths agree (a collective of mismatched sizes aborts the process under gloo): one more
collective than the total alone, except where per-tensor results are local (plain pipeline stages).
On CUDA the verdict of a totals-only call is read without waiting (a copy to pinned memory) and raised by
the next sharded call of the process; a per-tensor call reads it before its vector collective (a host sync).

Host cost. A call's layout (which tensors are DTensors, their meshes and placements, what this rank counts,
the plan, the fingerprint) is cached; a repeat call with the same layout checks it with C-level passes over
the list (types, spec objects, then mesh and placements if a spec object changed) and reads the local
tensors the same way. Anything that differs (length, a type, a mesh, a placement, the group) rebuilds it.

A rank with an empty list still takes part: with DTensors elsewhere it knows no mesh, so every rank passes
the same ``process_group=`` (e.g. ``dist.group.WORLD``) and the empty rank contributes zero over it.

Results: a ``Replicate()`` DTensor on the mesh when all gradients are DTensors on ONE mesh (what torch's
``clip_grad_norm_`` returns; torch gives ``Partial(max)`` for the inf norm, whose ``full_tensor()`` is the
same value), else a plain 0-dim tensor; in both cases the same value on every rank, ready to log.

Seam for callers that decide more than the norm (e.g. a step guard's bad-step flag): ``reduced_norm`` and
``reduced_amp_norm`` take ``flags=``, a 1-D tensor of 0/1 values that travels in the same buffer and comes
back OR-ed over every rank in ``sh.flags`` (no extra collective).
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch
from torch import Tensor

from . import _scan
from .backends import acc_dtype
from .decide import nonfinite

__all__ = ["is_dtensor", "has_dtensor", "dtensor_grads", "Sharded", "Shards", "RankMismatchError", "prepare",
           "reduced_norm", "reduced_amp_norm", "reduced_stats", "wrap_like", "to_local_norm", "span_ranks",
           "clear_cache", "nonfinite_poison"]

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


class Shards:
    """``process_group=Shards(group)``: the plain tensors at position i of every rank's list are pieces of
    ONE tensor (ZeRO-style hand sharding), so per-tensor results (``per_tensor=True``, ``norm_type=0``,
    ``grad_stats``) are the whole tensors' and every rank of ``group`` must pass a list of the same length
    and dtypes (checked in the collective). A bare ``group`` means each rank holds its own tensors (pipeline
    stages); totals are the same either way."""

    __slots__ = ("group",)

    def __init__(self, group):
        if isinstance(group, Shards):
            group = group.group
        self.group = group

    def __repr__(self) -> str:
        return f"Shards({self.group!r})"


class RankMismatchError(RuntimeError):
    """The ranks of one sharded call disagree (different calls, lists of different lengths, shapes or
    dtypes where they must be the same). Raised with the same text on every rank taking part, before any
    gradient is written."""


def _unwrap(process_group):
    """``(group, pieces)``: the process group, and whether plain lists are pieces of the same tensors."""
    if isinstance(process_group, Shards):
        if process_group.group is None:
            raise ValueError("Shards(group) needs a process group (e.g. dist.group.WORLD)")
        return process_group.group, True
    return process_group, False


_GRAD = operator.attrgetter("grad")


def dtensor_grads(params: Sequence[Tensor]) -> list[Tensor] | None:
    """``[p.grad for p in params if p.grad is not None]`` when every parameter is a DTensor whose
    ``__torch_function__`` is DTensor's own (disabled) one, read with torch-function handling switched off:
    the same objects, at half the cost (the handling alone is about a microsecond per parameter). None
    otherwise (the caller reads them the usual way)."""
    cls = _dtensor_cls()
    if cls is None or not params or torch.compiler.is_compiling():
        return None
    own = cls.__torch_function__
    for t in set(map(type, params)):
        if not issubclass(t, cls) or t.__torch_function__ is not own:
            return None
    with torch._C.DisableTorchFunctionSubclass():
        return [g for g in map(_GRAD, params) if g is not None]


# ------------------------------------------------------------------------------- caches (host cost)
# Keyed by object identity; the value keeps the object so that an id reused after garbage collection can
# not alias (the entry is checked with `is`). Small: one entry per (mesh, placements) kind, per plan and per
# list layout.
_SPEC_CACHE: dict = {}
_MESH_RANKS: dict = {}
_PLAN_CACHE: dict = {}
_LAYOUTS: dict = {}
_LIST_CAP = 64  # list layouts kept (_LAYOUTS, _CPU_CLIP): a model's clip lists, each a few KB
_CPU_CLIP: dict = {}  # (number of params, id(group), id(first param)) -> their grads' _Layout (local_cpu_norm)
_PENDING: list = []  # CUDA verdicts not read yet: (event, pinned host copy, what)


def _keep(cache: dict, key, value, cap: int) -> None:
    """Store ``value`` in a bounded cache, dropping the least recently used entry when full (dicts keep insertion
    order and :func:`_used` moves a hit to the end). Clearing the whole cache instead would throw away the layout
    of the list a training loop clips every step whenever another list came and went in between."""
    cache.pop(key, None)
    while len(cache) >= cap:
        del cache[next(iter(cache))]
    cache[key] = value


def _used(cache: dict, key) -> None:
    """Mark a hit as the most recently used entry (a no-op when it already is)."""
    if next(reversed(cache)) != key:
        cache[key] = cache.pop(key)


def clear_cache() -> None:
    """Forget the cached placement decisions, mesh rank sets, reduction plans and list layouts (e.g. after
    destroying and re-creating process groups with the same objects' ids)."""
    _SPEC_CACHE.clear()
    _MESH_RANKS.clear()
    _PLAN_CACHE.clear()
    _LAYOUTS.clear()
    _CPU_CLIP.clear()
    _PENDING.clear()


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
    _keep(_SPEC_CACHE, key, (mesh, info), 4096)  # placements are a handful of kinds; a flood: short-lived meshes
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


# ------------------------------------------------------------------------------------------ the plan
class _Plan:
    """The collectives of one call.

    ``steps``: the groups the fixed-size buffer (totals, flags, header) is all-reduced over in turn, each
    rank's contribution pre-weighted so that the result is the whole model's (``None``: the default group).
    ``vec_steps``: the groups per-tensor vectors are reduced over; ``[]`` when per-tensor results are this
    rank's own (plain pipeline stages, an empty rank). ``staged``: the ranks of the span hold different
    lists (pipeline stages): each stage's agreement travels in its own header ``slot`` of ``slots`` (one per
    rank of the process group, so every rank of the group builds the same buffer); p = 0's stage counts are
    combined over ``cross`` (this rank contributing when ``cross_contrib``). ``plain_counted``: whether
    plain tensors count on this rank; ``mesh_counted``: the same per mesh (False for a copy of a slice, see
    the module's docstring). ``device``: where a rank without local tensors builds its buffer. ``span``:
    the ranks the steps reach (None when this rank cannot tell)."""

    __slots__ = ("steps", "vec_steps", "staged", "slots", "slot", "cross", "cross_contrib", "plain_counted",
                 "mesh_counted", "device", "keep", "span", "pieces")

    def __init__(self, steps, vec_steps, *, staged, slots, slot, cross, cross_contrib, plain_counted, device,
                 keep, span, pieces=False):
        self.steps = steps
        self.vec_steps = vec_steps
        self.staged = staged
        self.slots = slots
        self.slot = slot
        self.cross = cross
        self.cross_contrib = cross_contrib
        self.plain_counted = plain_counted
        self.device = device
        self.keep = keep  # the meshes and group the plan was built for (keeps their ids valid)
        self.span = span
        self.pieces = pieces
        # per mesh of keep[0]: whether its tensors count here (the copy of a slice holding the lowest rank)
        meshes = keep[0]
        union = frozenset().union(*(_ranks_of_mesh(m) for m in meshes)) if meshes else frozenset()
        self.mesh_counted = tuple(min(union) in _ranks_of_mesh(m) for m in meshes)


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


def _build_plan(meshes: list, group, pieces: bool) -> _Plan:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sharded gradients need an initialized torch.distributed process group")
    world = dist.get_world_size()
    me = dist.get_rank()
    if group is not None and (group is dist.GroupMember.NON_GROUP_MEMBER or me not in _group_ranks(group)):
        raise ValueError(f"this rank ({me}) is not a member of process_group")
    if pieces and meshes:
        raise ValueError("process_group=Shards(group) is for plain tensors that are pieces of one another; "
                         "DTensors carry their own placements: pass the group itself")
    granks = _group_ranks(group)
    order = sorted(granks)
    slots = 0 if (group is None or pieces) else len(granks)
    dev = _group_device(group)
    if not meshes:
        if group is None:  # plain tensors without a group never get here (single-process path)
            raise ValueError("plain tensors need process_group= to be reduced across ranks")
        if pieces:  # ZeRO pieces: tensor i on every rank is one tensor; one reduction over the group
            return _Plan([group], [group], staged=False, slots=0, slot=None, cross=None, cross_contrib=False,
                         plain_counted=True, device=dev, keep=((), group), span=granks, pieces=True)
        # each rank its own tensors (a stage, or nothing): per-tensor results are local
        return _Plan([group], [], staged=True, slots=slots, slot=order.index(me), cross=group,
                     cross_contrib=True, plain_counted=True, device=dev, keep=((), group), span=granks)
    union = frozenset().union(*(_ranks_of_mesh(m) for m in meshes))
    plain_counted = me == min(union)
    keep = (tuple(meshes), group)
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
        return _Plan(steps, steps, staged=False, slots=0, slot=None, cross=None, cross_contrib=False,
                     plain_counted=plain_counted, device=_group_device(steps[0]), keep=keep, span=union)
    if union <= granks:
        # The group contains the meshes: one all-reduce over it. Ranks of the group outside the meshes hold
        # other parameters (stages); per-tensor vectors are reduced within the meshes then.
        if granks == union:
            return _Plan([group], [group], staged=False, slots=slots, slot=None, cross=None, cross_contrib=False,
                         plain_counted=plain_counted, device=dev, keep=keep, span=granks)
        stage = _mesh_steps(meshes, union)
        return _Plan([group], stage, staged=True, slots=slots, slot=order.index(min(union)), cross=group,
                     cross_contrib=plain_counted, plain_counted=plain_counted, device=dev, keep=keep, span=granks)
    if granks & union != {me}:
        raise ValueError(
            f"process_group (ranks {sorted(granks)}) shares ranks with the gradients' meshes (ranks "
            f"{sorted(union)}) without containing them: it must either contain the meshes (e.g. "
            "dist.group.WORLD) or connect ranks holding different parameters, one per stage (a pipeline group)"
        )
    stage = _mesh_steps(meshes, union)
    tiled = len(granks) * len(union) == world
    steps = [None] if tiled else stage + [group]
    return _Plan(steps, stage, staged=True, slots=slots, slot=order.index(me), cross=group, cross_contrib=True,
                 plain_counted=plain_counted, device=dev, keep=keep,
                 span=frozenset(range(world)) if tiled else None)


def _plan_for(meshes: list, group, pieces: bool) -> _Plan:
    key = (tuple(id(m) for m in meshes), id(group), pieces)
    hit = _PLAN_CACHE.get(key)
    if hit is not None and hit.keep[-1] is group and all(a is b for a, b in zip(hit.keep[0], meshes)):
        _used(_PLAN_CACHE, key)
        return hit
    plan = _build_plan(meshes, group, pieces)
    _keep(_PLAN_CACHE, key, plan, 256)
    return plan


def span_ranks(sh: "Sharded") -> frozenset | None:
    """The ranks whose contributions the call's total combines (None when this rank cannot tell, e.g. a
    pipeline whose stages do not tile the world): a caller may fold another reduction over exactly these
    ranks into the norm's (fastgrad.amp does so for a ShardedGradScaler's overflow flags)."""
    return sh.plan.span


# ------------------------------------------------------------------------------------ the local view
_SPEC = operator.attrgetter("_spec")
_LOCAL = operator.attrgetter("_local_tensor")
_MESH_PL = operator.attrgetter("mesh", "placements")
_NUMEL = torch.Tensor.numel
_DCODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def _dcode(dtype) -> int:
    code = _DCODE.get(dtype)
    if code is None:  # (not str's hash: that one differs between processes)
        import zlib

        code = 16 + zlib.crc32(str(dtype).encode()) % 1000
    return code


def _fingerprint(n: int, tokens) -> int:
    """16 bits that every rank computes alike for the same list: the hash of a tuple of ints (Python's
    int and tuple hashes do not depend on the process, unlike str's)."""
    return hash((n, tuple(tokens))) & 0xFFFF


class Sharded:
    """Local view of a sharded gradient list.

    ``reads[i]``: local tensor whose values enter the norm; ``writes[i]``: local tensor scaled in place
    (a :class:`fastgrad._scan.Checked` list when the compiled scan accepted them: ``checked``);
    ``counts[i]``: whether this rank's ``reads[i]`` contributes (``sel``: their indices, None when all do);
    ``mesh``: the one mesh of an all-DTensor single-mesh list (the result is a Replicate DTensor on it), else
    None; ``plan``: the collectives; ``fp``: the list's fingerprint for the agreement header; ``flags``: after
    a reduction given ``flags=``, their OR over every rank; ``layout``: the cached layout it came from (None
    for ``for_norm=False``)."""

    __slots__ = ("reads", "writes", "counts", "sel", "mesh", "plan", "fp", "checked", "flags", "layout")

    def __init__(self, reads, writes, counts, sel, mesh, plan, fp=0):
        self.reads: list[Tensor] = reads
        self.writes: list[Tensor] = writes
        self.counts: list[bool] = counts
        self.sel: list[int] | None = sel
        self.mesh = mesh
        self.plan: _Plan = plan
        self.fp = fp
        self.checked = type(writes) is _scan.Checked
        self.flags: Tensor | None = None
        self.layout: _Layout | None = None


class _Layout:
    """What a list's structure decides, cached between calls: the DTensor positions, their spec objects and
    (mesh, placements), which of them count on this rank, the Partial ones, the plan, the result mesh and
    the DTensor part of the fingerprint."""

    __slots__ = ("types", "dt_pos", "plain_pos", "specs", "mesh_pl", "counted", "partial", "plan", "mesh",
                 "group", "tokens", "fp", "empties", "counts", "sel", "counted_eff")


def _build_layout(tensors, types, cls, group, pieces) -> _Layout:
    lay = _Layout()
    lay.types = types
    lay.group = group
    dt_pos, plain_pos, specs, where = [], [], [], []
    meshes: list = []
    info_of: list = []
    last_mesh = last_pl = info = None
    pos = -1
    for i, t in enumerate(tensors):
        if cls is None or not isinstance(t, cls):
            plain_pos.append(i)
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
            last_mesh, last_pl = spec.mesh, pl
        dt_pos.append(i)
        specs.append(spec)
        where.append(pos)
        info_of.append(info)
    lay.plan = _plan_for(meshes, group, pieces) if (meshes or group is not None) else None
    mesh_counted = lay.plan.mesh_counted if lay.plan is not None else ()
    lay.dt_pos = None if len(dt_pos) == len(tensors) else dt_pos
    lay.plain_pos = plain_pos
    lay.specs = specs
    lay.mesh_pl = list(map(_MESH_PL, specs))
    lay.counted = [inf[0] and mesh_counted[k] for inf, k in zip(info_of, where)]
    lay.partial = [(j, meshes[where[j]], inf[2]) for j, inf in enumerate(info_of) if inf[1]]
    lay.mesh = meshes[0] if len(meshes) == 1 and not plain_pos else None
    lay.tokens = _dt_tokens(tensors, dt_pos, specs)
    lay.fp = None if plain_pos else _fingerprint(len(tensors), lay.tokens)
    lay.empties = lay.counts = lay.sel = lay.counted_eff = None  # set from the local tensors (prepare)
    return lay


def _dt_tokens(tensors, dt_pos, specs) -> list:
    """The DTensors' part of the fingerprint: global shape and dtype, from the spec (no DTensor dispatch)."""
    out = []
    for i, spec in zip(dt_pos, specs):
        meta = spec.tensor_meta
        if meta is None:
            t = tensors[i]
            out.append((i, tuple(t.shape), _dcode(t.dtype)))
        else:
            out.append((i, tuple(meta.shape), _dcode(meta.dtype)))
    return out


def prepare(tensors: Sequence[Tensor], process_group=None, *, for_norm: bool = True) -> Sharded:
    """Local shards of ``tensors`` (DTensors on any meshes, plain tensors, mixed) and the plan of the
    reduction. ``process_group``: a group, or :class:`Shards` (plain tensors that are pieces of one another).
    ``for_norm=False`` gives only the write targets (no plan, no redistribution of Partial tensors).

    Host cost: the layout (see the module's docstring) is cached, so a repeat call costs a few C-level passes
    over the list (its types, its DTensors' spec objects, their local tensors) and the compiled scan of the
    local tensors; no DTensor dispatch."""
    if _PENDING:
        _raise_pending()
    group, pieces = _unwrap(process_group)
    cls = _dtensor_cls()
    if not for_norm:
        writes = [t._local_tensor if cls is not None and isinstance(t, cls) else t for t in tensors]
        return Sharded(writes, _scan.checked(writes) if writes else writes, [], None, None, None)
    n = len(tensors)
    first = getattr(tensors[0], "_spec", None) if n else None
    key = (n, id(group), pieces, id(first))
    lay = _LAYOUTS.get(key)
    if lay is not None and lay.group is group:
        specs = None
        if lay.dt_pos is None:  # all DTensors: reading the specs is the type check too
            dts = tensors
            try:
                specs = list(map(_SPEC, tensors))
            except AttributeError:
                lay = None
        elif list(map(type, tensors)) == lay.types:
            dts = [tensors[i] for i in lay.dt_pos]
            specs = list(map(_SPEC, dts))
        else:
            lay = None
        if lay is not None and not all(map(operator.is_, specs, lay.specs)):
            # new spec objects: the same layout when every (mesh, placements) is the same objects or equal
            lay = _refresh(lay, tensors, dts, specs) if list(map(_MESH_PL, specs)) == lay.mesh_pl else None
    else:
        lay = None
    if lay is None:
        lay = _build_layout(tensors, list(map(type, tensors)), cls, group, pieces)
        _keep(_LAYOUTS, key, lay, _LIST_CAP)
        dts = tensors if lay.dt_pos is None else [tensors[i] for i in lay.dt_pos]
    else:
        _used(_LAYOUTS, key)
    plan = lay.plan
    locs = list(map(_LOCAL, dts))
    if lay.empties is None:  # local shapes follow from the specs: which local shards are empty is cached
        lay.empties = frozenset(j for j, loc in enumerate(locs) if loc.numel() == 0)
        counted = [c and j not in lay.empties for j, c in enumerate(lay.counted)]
        lay.counts = counted if lay.dt_pos is None else None
        lay.sel = None if all(counted) else [j for j, c in enumerate(counted) if c]
        lay.counted_eff = counted
    if lay.dt_pos is None:
        writes = locs
    else:
        writes = list(tensors)
        for i, loc in zip(lay.dt_pos, locs):
            writes[i] = loc
    writes = _scan.checked(writes) if writes else writes
    reads = writes
    if lay.partial:  # the norm of a Partial tensor is read from its Replicate copy (a collective each)
        reads = list(writes)
        pos = lay.dt_pos if lay.dt_pos is not None else range(n)
        for j, m, pl in lay.partial:
            reads[pos[j]] = dts[j].redistribute(m, pl)._local_tensor

    # What this rank counts: the layout's decision per DTensor, plain tensors on the plan's say; empty local
    # tensors never (they add nothing, and an empty one would only make the local pass special-case it).
    if lay.counts is not None:
        counts, sel = lay.counts, lay.sel
    else:
        counts = [True] * n
        for i, c in zip(lay.dt_pos, lay.counted_eff):
            counts[i] = c
        keep_plain = plan is None or plan.plain_counted
        for i in lay.plain_pos:
            counts[i] = keep_plain and reads[i].numel() > 0
        sel = None if all(counts) else [i for i, c in enumerate(counts) if c]
    fp = _list_fingerprint(lay, reads, n, pieces)
    sh = Sharded(reads, writes, counts, sel, lay.mesh, plan, fp)
    sh.layout = lay
    return sh


# ------------------------------------------------------------------ the local pass in one C++ call (CPU)
# A sharded clip's per-tensor host work is reading each parameter's .grad, its spec and local tensor, then two
# backend calls over the local tensors (the norm, then the scale), each converting the whole list for the
# dispatcher: about 4 us per DTensor gradient. For DTensor grads whose local shards are plain CPU tensors on
# the cpu backend, fastgrad._C.dtensor_local_norm does all of the per-tensor part of that in one pass, checked
# against the layout the general path cached for the same grads (csrc/host.cpp); the collective and the
# coefficient stay here, unchanged.
_DESCS: list = []


def _slot_descs(cls) -> tuple:
    """DTensor's ``_spec`` and ``_local_tensor`` slot descriptors (what ``_SPEC`` and ``_LOCAL`` read)."""
    if not _DESCS or _DESCS[0] is not cls:
        _DESCS[:] = [cls, cls.__dict__["_spec"], cls.__dict__["_local_tensor"]]
    return _DESCS[1], _DESCS[2]


def remember_cpu_clip(params: Sequence[Tensor], process_group, sh: Sharded) -> None:
    """After the general path prepared the grads of ``params``: keep their layout for :func:`local_cpu_norm`
    when its pass can serve them (all DTensors, no Partial, local shards on the CPU in one compiled scan)."""
    lay = sh.layout
    if (lay is None or lay.dt_pos is not None or lay.partial or lay.plan is None or lay.fp is None
            or isinstance(process_group, Shards) or not sh.checked or not sh.writes
            or sh.writes.device.type != "cpu" or sh.reads is not sh.writes):
        return
    _keep(_CPU_CLIP, (len(params), id(process_group), id(params[0])), lay, _LIST_CAP)


def local_cpu_norm(params: Sequence[Tensor], process_group, norm_type: float, backend: str | None
                   ) -> tuple[Sharded, Tensor | None, object] | None:
    """The local part of a sharded clip in one C++ call, for the grads of ``params`` when their layout was
    remembered (:func:`remember_cpu_clip`) and still holds: ``(sh, local_total, handle)`` (``local_total``: this
    rank's norm of what it counts, for ``reduced_norm(local_total=)``; ``handle``: for :func:`scale_local_cpu`),
    else None (nothing done; the general path runs). The layout holds when every grad is a DTensor with the
    very spec object the layout recorded at its position (same mesh, placements, global shape and dtype), as
    many grads as it has; the C++ pass checks that on every call, so a changed list never reuses it."""
    # helpers() first: None while torch.compile traces, so the compiled path never reaches the id() key
    # below (Dynamo 2.11 cannot trace id(None), the default group); eager calls make the same checks.
    c = _scan.helpers()
    if not params or c is None or not hasattr(c, "dtensor_local_norm"):
        return None
    # (the key only finds a candidate: whether it holds is checked below, grad by grad)
    key = (len(params), id(process_group), id(params[0]))
    lay = _CPU_CLIP.get(key)
    if lay is None or lay.group is not process_group or lay.empties is None:
        return None
    _used(_CPU_CLIP, key)
    selects_builtin = _scan._selects_builtin()
    if not (selects_builtin("cpu", "norm", backend, norm_type) and selects_builtin("cpu", "scale", backend, norm_type)):
        return None
    if _PENDING:
        _raise_pending()
    cls = _dtensor_cls()
    spec_desc, local_desc = _slot_descs(cls)
    out = c.dtensor_local_norm(params, cls, spec_desc, local_desc, lay.specs, lay.counted, norm_type)
    if out is None:
        return None
    locs, mask, contiguous, total, handle = out
    writes = _scan.Checked(locs)
    writes.device, writes.dtype_mask, writes.contiguous = _CPU, mask, contiguous
    sh = Sharded(writes, writes, lay.counts, lay.sel, lay.mesh, lay.plan, lay.fp)
    sh.layout = lay
    return sh, total, (c, handle)


def scale_local_cpu(handle, factor: Tensor) -> None:
    """Scale the local tensors of a :func:`local_cpu_norm` call by ``factor`` (a one-element CPU tensor), as the
    cpu backend's scale_ does (nothing written when it is 1); once per handle."""
    c, capsule = handle
    c.dtensor_local_scale(capsule, factor)


_CPU = torch.device("cpu")


def _refresh(lay: _Layout, tensors, dts, specs) -> _Layout:
    """A layout whose DTensors came with new spec objects on the same meshes and placements: the decisions
    stand; the fingerprint (global shapes) and the empty local shards are read again."""
    lay.specs = specs
    lay.tokens = _dt_tokens(tensors, lay.dt_pos if lay.dt_pos is not None else range(len(tensors)), specs)
    lay.fp = None if lay.plain_pos else _fingerprint(len(tensors), lay.tokens)
    lay.empties = None
    return lay


def _list_fingerprint(lay: _Layout, reads, n: int, pieces: bool) -> int:
    """What the ranks that must hold the same list compare: its length, and the global shapes and dtypes of
    its DTensors and plain tensors (only the dtypes for ZeRO pieces, whose local shapes differ)."""
    if pieces:
        return _fingerprint(n, map(_dcode, map(operator.attrgetter("dtype"), reads)))
    if lay.fp is not None:  # DTensors only: the layout's (their shapes and dtypes are the specs')
        return lay.fp
    if lay.plan is not None and lay.plan.staged and not lay.specs:
        return _fingerprint(n, ())  # a plain stage: nobody else holds this list
    plain = [(i, tuple(reads[i].shape), _dcode(reads[i].dtype)) for i in lay.plain_pos]
    return _fingerprint(n, lay.tokens + plain)


# ------------------------------------------------------------------------------------- collectives
_SUM, _MAX, _MIN = 0, 1, 2
_OPS = ("SUM", "MAX", "MIN")


def _op_of(p: float) -> int:
    return _MAX if p == _INF else _MIN if p == -_INF else _SUM


def _all_reduce(t: Tensor, op, steps: list) -> None:
    import torch.distributed as dist

    for g in steps:
        dist.all_reduce(t, op=op, group=g)


def _reduce_op(op: int):
    import torch.distributed as dist

    return (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)[op]


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


# --- the agreement header. Groups of two 16-bit fields each: 0 = the call's signature (every rank), 1 = the
# list (ranks that all hold the same list: the span of an unstaged plan), 2 + s = pipeline stage s's list.
# SUM encodes a group as (count, v1, v1^2, v2, v2^2), MAX as (v1, -v1, v2, -v2) with -inf when absent; MIN
# stores the MAX encoding negated (min(-x) = -max(x)). Integers below 2^16 on at most 2^20 ranks stay exact
# in float64 whatever the order of the additions.
_WIDTH = {_SUM: 5, _MAX: 4, _MIN: 4}


def _header(op: int, groups: list) -> list[float]:
    """``groups``: per group, its two values, or None where this rank does not contribute."""
    out: list[float] = []
    for vals in groups:
        if op == _SUM:
            if vals is None:
                out += (0.0, 0.0, 0.0, 0.0, 0.0)
            else:
                a, b = vals
                out += (1.0, float(a), float(a * a), float(b), float(b * b))
        elif vals is None:
            out += (-_INF, -_INF, -_INF, -_INF)
        else:
            a, b = vals
            out += (float(a), float(-a), float(b), float(-b))
    if op == _MIN:
        out = [-x for x in out]
    return out


def _bad_groups(head: Tensor, op: int) -> Tensor:
    """Per header group: True where its contributors did not all send the same values."""
    if op == _MIN:
        head = -head
    h = head.reshape(-1, _WIDTH[op])
    if op == _SUM:
        c = h[:, 0:1]
        s1 = h[:, 1::2]
        s2 = h[:, 2::2]
        mean = s1 / c.clamp_min(1)
        ok = (mean == mean.round()) & (s2 == c * mean * mean)
        return ~(ok.all(1) | (h[:, 0] == 0))
    hi = h[:, 0::2]
    lo = -h[:, 1::2]
    present = h[:, 0] > -_INF
    return present & ~(hi == lo).all(1)


def _mismatch_text(bad: list[int]) -> str:
    """The error text from the reduced header alone, so every rank raises the same one."""
    parts = []
    for g in bad:
        if g == 0:
            parts.append("the ranks made different calls (a different function, norm_type, per_tensor, or kind of "
                         "process_group/layout); every rank taking part must make the same call")
        elif g == 1:
            parts.append("the ranks' gradient lists differ (length, order, shapes or dtypes) where every rank "
                         "must hold the same list (the same parameters, with a gradient on the same ones)")
        else:
            parts.append(f"the ranks of pipeline stage {g - 2} (in process_group order) hold different lists "
                         "(length, order, shapes or dtypes); every rank of a stage must pass the same parameters")
    return "sharded gradient norm: " + "; ".join(parts) + " (nothing was written)"


def _settle(bad: Tensor, blocking: bool) -> None:
    """Raise RankMismatchError when a header group disagrees. On the CPU (gloo) the verdict is read now;
    on a device it is read now only when ``blocking`` (a vector collective is about to depend on it), else
    copied to pinned memory and read, without waiting, by the next sharded call."""
    if bad.device.type == "cpu" or blocking:
        idx = bad.nonzero().flatten().tolist() if bool(bad.any()) else []
        if idx:
            raise RankMismatchError(_mismatch_text(idx))
        return
    host = torch.empty(bad.shape, dtype=torch.bool, pin_memory=True)
    host.copy_(bad, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    _PENDING.append((ev, host))


def _raise_pending() -> None:
    """Verdicts of earlier device calls whose copy has landed (never waits for one that has not)."""
    done = [(ev, host) for ev, host in _PENDING if ev.query()]
    for item in done:
        _PENDING.remove(item)
    for _, host in done:
        idx = host.nonzero().flatten().tolist()
        if idx:
            raise RankMismatchError(_mismatch_text(idx) + " [detected by the previous sharded call]")


def _signature(kind: int, p: float, vector: bool, plan: _Plan) -> int:
    return hash((kind, p, vector, plan.staged, plan.pieces, plan.slots)) & 0xFFFF


def _phase_a(sh: Sharded, kind: int, p: float, vector: bool, payload: Tensor, ors: Tensor | None
             ) -> tuple[Tensor, Tensor | None]:
    """THE collective of a call: ``payload`` (already in its reduction's form: p-th power sums, a max/min with
    its identity where this rank adds nothing), ``ors`` (0/1 flags to OR over the ranks) and the agreement
    header, in one buffer, over the plan's steps. Returns the reduced payload and flags; raises
    RankMismatchError (on every rank alike) when the header disagrees."""
    plan = sh.plan
    op = _op_of(p) if kind != _STATS else _SUM
    wide = payload.dtype
    n = len(sh.reads)
    groups: list = [(_signature(kind, p, vector, plan), 0), None if plan.staged else (n & 0xFFFF, sh.fp)]
    if plan.slots:
        slots: list = [None] * plan.slots
        if plan.slot is not None:
            slots[plan.slot] = (n & 0xFFFF, sh.fp)
        groups += slots
    check = wide == torch.float64
    head = torch.tensor(_header(op, groups), dtype=wide) if check else payload.new_zeros(0)
    parts = [payload]
    k = 0
    if ors is not None:
        k = ors.numel()
        parts.append(-ors if op == _MIN else ors)
    parts.append(head.to(payload.device, non_blocking=True))
    buf = torch.cat(parts)
    _all_reduce(buf, _reduce_op(op), plan.steps)
    m = payload.numel()
    out_ors = None
    if ors is not None:
        r = buf[m:m + k]
        out_ors = ((-r if op == _MIN else r) > 0).to(ors.dtype)
    if check:
        _settle(_bad_groups(buf[m + k:], op), blocking=vector and bool(plan.vec_steps))
    return buf[:m], out_ors


_NORM, _AMP, _STATS = 1, 2, 3


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


def _local_dev_dtype(sh: Sharded) -> tuple[torch.device, torch.dtype]:
    if sh.reads:
        return sh.reads[0].device, acc_dtype(sh.reads)
    return sh.plan.device, torch.float32  # a rank owning no shard still takes part in the collective


def _counted(sh: Sharded, dtype: torch.dtype, dev: torch.device) -> tuple[list[int], list[Tensor]]:
    """Indices and local tensors of what this rank counts (a Checked list for the compiled one-pass scan)."""
    if sh.sel is None:
        return range(len(sh.reads)), sh.reads
    sel = sh.sel
    local = [sh.reads[i] for i in sel]
    if local and dtype == torch.float64 and acc_dtype(local) != dtype:
        # This rank holds no piece of the float64 tensors, but every rank must accumulate as the whole
        # list dictates: an empty float64 tensor makes the backend accumulate in float64 (entry dropped).
        local = local + [torch.empty(0, dtype=torch.float64, device=dev)]
    return sel, _scan.checked(local) if local else local


def _place(per: Tensor, sel, n: int, identity: float, like: Tensor) -> Tensor:
    """Per-tensor values of the counted tensors (``per``, in ``sel`` order) at their places in a vector of
    ``n``; the others hold ``identity`` (what a rank that adds nothing contributes)."""
    if len(sel) == n:
        return per
    vals = torch.full((n,), identity, dtype=like.dtype, device=like.device)
    if len(sel):
        vals[torch.tensor(list(sel), dtype=torch.int64).to(like.device, non_blocking=True)] = per
    return vals


def _flags_in(flags: Tensor | None, dev, wide) -> Tensor | None:
    return None if flags is None else flags.reshape(-1).to(dev, wide)


_UNSET = object()


def reduced_norm(sh: Sharded, norm_type: float, per_tensor: bool,
                 local_norm: Callable[[list[Tensor], bool], tuple[Tensor, Tensor | None]] | None,
                 poison: Tensor | None = None, *, flags: Tensor | None = None,
                 local_total=_UNSET) -> tuple[Tensor, Tensor | None]:
    """Global total norm (and per-tensor norms, in input order, when asked) in the accumulation dtype on
    the first local tensor's device, identical on every rank. ``local_norm(tensors, per_tensor)`` is the
    single-process norm of a list of local tensors (fastgrad.clip's backend dispatch). ``flags``: see the
    module's docstring (the OR over ranks lands in ``sh.flags``).

    The total: ONE collective per step of the plan (one for the usual layouts) carrying the p-th-power sum
    (SUM) or the max/min with a NaN flag (MAX/MIN), and the agreement header. Per-tensor results that combine
    shards (DTensors, :class:`Shards`) take one more, a vector reduced after the header said the lists agree;
    plain pipeline stages keep their own per-tensor norms (nothing more to reduce). ``norm_type=0`` (tensors
    with a nonzero) counts from the reduced per-tensor vector, plus the stages' counts across stages.

    ``poison`` (the step guard's): a 0-dim local tensor, 0 or NaN, added to this rank's contribution (and to
    its per-tensor vector), so a NaN that only this rank can see reaches every rank's result in the same
    collective (see :func:`nonfinite_poison`).

    ``local_total``: this rank's total over what it counts, already computed by the caller (the compiled local
    pass, :func:`local_cpu_norm`; None when it counts nothing), for a total only: ``local_norm`` is not called."""
    plan = sh.plan
    dev, dtype = _local_dev_dtype(sh)
    wide = _wide(dtype, dev)
    p = norm_type
    n = len(sh.reads)
    vector = per_tensor or p == 0  # p = 0 counts tensors with a nonzero: needs per-tensor counts
    given = local_total is not _UNSET
    if given and vector:
        raise ValueError("reduced_norm: local_total= is for a total norm (per_tensor=False, norm_type != 0)")
    sel, local = ((), ()) if given else _counted(sh, dtype, dev)
    combine = vector and bool(plan.vec_steps)  # per-tensor vectors reduced across ranks (else local)
    powers = p != 0 and p not in (_INF, -_INF)
    identity = _INF if p == -_INF else 0.0

    per_local = None  # this rank's per-tensor values (norms; counts for p = 0), counted ones in `sel` order
    total_local = local_total if given else None
    if local and vector:
        _, per_local = local_norm(local, True)
        per_local = per_local[: len(sel)]
    elif local:  # a total only: the local total (its p-th power is what adds up; a max/min is exact)
        total_local, _ = local_norm(local, False)
    ors = _flags_in(flags, dev, wide)
    if poison is not None:
        poison = poison.to(dev, wide).reshape(1)  # (+0 leaves the non-negative values' bits alone)
    if p == _INF or p == -_INF:
        if per_local is not None:
            total_local = (per_local.amax() if p == _INF else per_local.amin()) if len(sel) else None
        if total_local is None:
            t = torch.full((1,), identity, dtype=wide, device=dev)
        else:
            t = total_local.to(dev, wide).reshape(1)
        if poison is not None:
            t = t + poison
        nan = torch.isnan(t)
        payload = torch.where(nan, identity, t)
        ors = nan.to(wide) if ors is None else torch.cat([nan.to(wide), ors])
    elif powers:
        if per_local is not None:  # in float64: exact squares of fp32 norms
            payload = per_local.to(wide).pow(p).sum().reshape(1)
        elif total_local is not None:
            payload = total_local.to(dev, wide).pow(p).reshape(1)
        else:
            payload = torch.zeros(1, dtype=wide, device=dev)
    else:  # p == 0: the count is the whole story only where per-tensor values are local
        payload = ((per_local != 0).sum().to(wide).reshape(1) if per_local is not None and not combine
                   else torch.zeros(1, dtype=wide, device=dev))
    if poison is not None and p not in (_INF, -_INF):
        payload = payload + poison
    red, ors_out = _phase_a(sh, _NORM, p, vector, payload, ors)
    if p == _INF or p == -_INF:
        total = torch.where(ors_out[0] > 0, float("nan"), red[0])
        sh.flags = ors_out[1:] if flags is not None else None
    else:
        total = red[0].pow(1.0 / p) if powers else red[0]
        sh.flags = ors_out
    per = None
    if combine:
        vals = per_local.to(wide) if per_local is not None else None
        if vals is not None and powers:
            vals = vals.pow(p)  # in float64: exact for p = 2 from an fp32 norm
        like = torch.empty(0, dtype=wide, device=dev)
        vals = _place(vals, sel, n, identity, like) if vals is not None else torch.full(
            (n,), identity, dtype=wide, device=dev)
        if poison is not None:
            vals = vals + poison
        vals = _combine(vals, p, plan.vec_steps)
        if p == 0:
            count = (vals != 0).sum().to(wide).reshape(1)
            if plan.staged:  # each stage counted its own tensors: add the stages' counts
                if not plan.cross_contrib:
                    count = torch.zeros_like(count)
                count = _combine(count, 0.0, [plan.cross])
            total = count[0]
        if per_tensor:
            per = vals.pow(1.0 / p) if powers else vals
    elif per_tensor:
        like = torch.empty(0, dtype=wide, device=dev)
        per = _place(per_local.to(wide), sel, n, identity, like) if per_local is not None else torch.full(
            (n,), identity, dtype=wide, device=dev)
    return total.to(dtype), None if per is None else per.to(dtype)


def reduced_stats(sh: Sharded, local_stats: Callable[[list[Tensor]], dict[str, Tensor]]) -> dict[str, Tensor]:
    """grad_stats over shards: the columns of :func:`fastgrad.stats.tensor_stats` for the WHOLE tensors, in
    input order, the same on every rank (``numel`` too: the counted shards' sizes add up to the tensor's).

    The total (a SUM of squared norms, with the agreement header): one collective. Columns that combine shards
    (DTensors, :class:`Shards`): two more, a SUM (squared norms, NaN/Inf/zero counts, numel) and a MAX of
    max|g| with its NaN flags (a max cannot ride a sum). Plain pipeline stages: their own columns, no more."""
    import torch.distributed as dist

    plan = sh.plan
    dev, dtype = _local_dev_dtype(sh)
    wide = _wide(dtype, dev)
    sel, local = _counted(sh, dtype, dev)
    n = len(sh.reads)
    k = len(sel)
    cols = local_stats(local) if local else None
    if cols is not None:
        sq = cols["norm"][:k].to(wide).square()
        payload = sq.sum().reshape(1)
    else:
        payload = torch.zeros(1, dtype=wide, device=dev)
    combine = bool(plan.vec_steps)
    red, _ = _phase_a(sh, _STATS, 2.0, True, payload, None)
    total = red[0].sqrt().to(dtype)
    sums = torch.zeros((5, n), dtype=wide, device=dev)
    peak = torch.zeros((n,), dtype=wide, device=dev)
    if cols is not None:
        loc = torch.stack([sq, cols["nan"][:k].to(wide), cols["inf"][:k].to(wide), cols["zero"][:k].to(wide),
                           cols["numel"][:k].to(dev, wide)])
        mx = cols["max_abs"][:k].to(wide)
        if k == n:
            sums, peak = loc, mx
        else:
            idx = torch.tensor(list(sel), dtype=torch.int64).to(dev, non_blocking=True)
            sums[:, idx] = loc
            peak[idx] = mx
    if combine:
        sums = sums.reshape(-1)
        _all_reduce(sums, dist.ReduceOp.SUM, plan.vec_steps)
        sums = sums.reshape(5, n)
        peak = _combine(peak, _INF, plan.vec_steps)
    counts = sums[1:].to(torch.int64)
    return {"norm": sums[0].sqrt().to(dtype), "max_abs": peak.to(dtype), "nan": counts[0], "inf": counts[1],
            "zero": counts[2], "numel": counts[3], "total_norm": total}


def reduced_amp_norm(sh: Sharded, norm_type: float,
                     local_amp: Callable[[list[Tensor]], tuple[Tensor, Tensor]],
                     poison: Tensor | None = None, *, flags: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The fused AMP read pass over shards: ``local_amp(tensors)`` gives this rank's (norm of the unscaled
    values, found_inf 0/1); ONE all-reduce (per step of the plan) carries the p-th power (or max), the
    overflow flag and the agreement header together. Returns ``(global total, local found_inf, global
    found_inf)``, the flags 0-dim float32 exactly 0 or 1. ``flags``: see the module's docstring; ``poison``: as
    in :func:`reduced_norm` (a NaN only this rank sees is an overflow on every rank). norm_type 0 has no
    sharded AMP form (the read pass yields totals, not per-tensor counts)."""
    p = norm_type
    if p == 0:
        raise ValueError("scaler_unscale_and_clip with norm_type=0 is not supported for sharded gradients")
    dev, dtype = _local_dev_dtype(sh)
    wide = _wide(dtype, dev)
    _, local = _counted(sh, dtype, dev)
    identity = _INF if p == -_INF else 0.0
    if local:
        total, flag = local_amp(local)
        total, flag = total.to(dev, wide).reshape(1), flag.to(dev, torch.float32).reshape(())
    else:
        total = torch.full((1,), identity, dtype=wide, device=dev)
        flag = torch.zeros((), dtype=torch.float32, device=dev)
    f = flag.to(wide).reshape(1)
    if poison is not None:  # (as in reduced_norm) a NaN only this rank sees: an overflow on every rank
        poison = poison.to(dev, wide).reshape(1)
        f = torch.where(torch.isnan(poison), 1.0, f)
    extra = _flags_in(flags, dev, wide)
    if p == _INF or p == -_INF:
        if poison is not None:
            total = total + poison
        nan = torch.isnan(total)
        ors = torch.cat([nan.to(wide), f] + ([extra] if extra is not None else []))
        red, out = _phase_a(sh, _AMP, p, False, torch.where(nan, identity, total), ors)
        g_total = torch.where(out[0] > 0, float("nan"), red[0])
        g_flag, rest = out[1], out[2:]
    else:
        pw = total.pow(p) if local else torch.zeros_like(total)  # no shard: adds nothing (also for p < 0)
        if poison is not None:
            pw = pw + poison
        ors = f if extra is None else torch.cat([f, extra])
        red, out = _phase_a(sh, _AMP, p, False, pw, ors)
        g_total = red[0].pow(1.0 / p)
        g_flag, rest = out[0], out[1:]
    sh.flags = rest if flags is not None else None
    return g_total.to(dtype), flag, g_flag.to(torch.float32)


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


# ------------------------------------------------------------------------------------- the step guard's flag
def nonfinite_poison(sh: Sharded, local_norm: Callable[[list[Tensor]], Tensor]) -> Tensor | None:
    """For the step guard, whose decision must be the same on every rank: the local tensors this rank holds
    but does not count (copies of ``Replicate()`` pieces, plain tensors beside DTensors, a replicated mesh
    slice) are counted on another rank only, so a NaN/Inf in this rank's copy alone would reach no norm.
    Returns NaN when ``local_norm`` of those copies is non-finite, else 0 (a 0-dim tensor in the wide dtype),
    for ``reduced_norm(poison=)``; None when this rank holds no such copy (then nothing is added). One more
    read of the copies, no collective."""
    if sh.sel is None:  # this rank counts everything it holds
        return None
    spare = [r for r, c in zip(sh.reads, sh.counts) if not c and r.numel()]
    if not spare:
        return None
    n = local_norm(_scan.checked(spare)).reshape(())
    return torch.where(nonfinite(n), float("nan"), 0.0).to(_wide(n.dtype, n.device))
