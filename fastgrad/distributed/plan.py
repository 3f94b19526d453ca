"""Which ranks reduce together: the plan of a sharded call's collectives, built once per set of meshes and
group and cached (see fastgrad.distributed's docstring, "Which ranks reduce together"), and the bounded
caches every layout decision shares."""

from __future__ import annotations

import zlib

import torch

from .dtensor import replicate_placement


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


class Copies:
    """``process_group=Copies(group, {tensor: ranks, ...})``: ``group`` (a process group, or :class:`Shards`)
    as usual, except that each tensor named is the same tensor on ``ranks`` (a process group, or a list of
    global ranks, this rank among them): a tied embedding held by the first and last pipeline stage, a
    LayerNorm weight every rank of hand-written tensor parallelism holds, a shared expert. Only the lowest of
    ``ranks`` counts it, so it enters the norm once; the collectives are the same as without ``Copies``.

    A key is a parameter (matched to its ``.grad``, so one ``Copies`` serves ``clip_grad_norm_(params)`` step
    after step) or the gradient tensor itself; keys not in a call's list are ignored (a per-group clip).
    Declared on top of what placements decide: a DTensor counts on a rank only if its placements count it
    there too, so for a DTensor sharded over a mesh, ``ranks`` are the ranks holding the same LOCAL shard (one
    per stage). Every rank of ``ranks`` must declare the same ``ranks`` for the tensor (checked in the call's
    collective when its norm_type is finite: RankMismatchError on every rank). Checked here: the
    types, each set holding this rank and no rank beyond the world; in each call, before any work: the sets
    lying within the ranks the call reduces over."""

    __slots__ = ("group", "pieces", "_by_id")

    def __init__(self, process_group, copies):
        import torch.distributed as dist

        if isinstance(process_group, Copies):
            raise TypeError("Copies(group, copies): group is a process group or Shards(group), not another Copies")
        group, pieces, _ = unwrap_group(process_group)
        if group is None:
            raise ValueError("Copies(group, copies) needs a process group (e.g. dist.group.WORLD)")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Copies(group, copies) needs an initialized torch.distributed process group")
        self.group, self.pieces = group, pieces
        me, world = dist.get_rank(), dist.get_world_size()
        items = copies.items() if hasattr(copies, "items") else copies
        by_id: dict = {}
        for item in items:
            try:
                key, where = item
            except (TypeError, ValueError):
                raise TypeError("Copies(group, copies): copies is a dict {tensor: ranks} or (tensor, ranks) pairs, "
                                f"got an item {type(item).__name__}") from None
            if not isinstance(key, torch.Tensor):
                raise TypeError(f"Copies(group, copies): a key is a parameter or gradient tensor, got {type(key).__name__}")
            ranks = _copy_ranks(where, world)
            what = f"the tensor of shape {tuple(key.shape)}"
            if me not in ranks:
                raise ValueError(f"Copies(group, copies): {what} is declared a copy on ranks {sorted(ranks)}, "
                                 f"which do not include this rank ({me}): declare the ranks holding it, this one included")
            if id(key) in by_id:
                raise ValueError(f"Copies(group, copies): {what} is declared twice")
            by_id[id(key)] = (key, ranks)
        self._by_id = by_id

    def found(self, tensors) -> list:
        """``[(i, ranks)]`` for each entry of ``tensors`` that a key names (the key itself or its ``.grad``)."""
        targets = {}
        for key, ranks in self._by_id.values():
            targets[id(key)] = ranks
            if key.is_leaf:  # (.grad of a non-leaf warns; a gradient tensor passed as key is a leaf)
                g = key.grad
                if g is not None:
                    targets[id(g)] = ranks
        get = targets.get
        return [(i, r) for i, r in enumerate(map(get, map(id, tensors))) if r is not None]

    def __repr__(self) -> str:
        inner = Shards(self.group) if self.pieces else self.group
        return f"Copies({inner!r}, {len(self._by_id)} tensors)"


def _copy_ranks(where, world: int) -> frozenset:
    """The global ranks of a copy's ``ranks``: a process group's, or a list of ints checked against the world."""
    import torch.distributed as dist

    if isinstance(where, dist.ProcessGroup):
        return frozenset(dist.get_process_group_ranks(where))
    try:
        ranks = list(where)
    except TypeError:
        raise TypeError("Copies(group, copies): each tensor's ranks are a process group or a list of global ranks, "
                        f"got {type(where).__name__}") from None
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) and not (
        isinstance(r, torch.Tensor) and r.numel() == 1 and not r.is_floating_point())]
    if bad or not ranks:
        raise TypeError(f"Copies(group, copies): ranks are a non-empty list of ints, got {where!r}")
    ranks = frozenset(int(r) for r in ranks)
    if min(ranks) < 0 or max(ranks) >= world:
        raise ValueError(f"Copies(group, copies): ranks {sorted(ranks)} are not all ranks of the world (0..{world - 1})")
    return ranks


class Partition:
    """``Partition(buffer, [(offset, length, owner, replicated_over), ...])`` declares what a flat buffer holds
    (a ZeRO-style partition of a flattened model: slices of tensor-parallel shards next to slices of tensors
    every tensor-parallel rank keeps whole). Each entry: ``length`` elements of the flattened buffer from
    ``offset`` belong to ``owner`` (the parameter they come from, or its name; what check reports), and
    ``replicated_over`` says whether that tensor is replicated (a process group, or a list of global ranks,
    this rank among them: the same elements sit in the same slice on every one of them, and only the lowest
    counts them) or sharded (None: these elements are this rank's alone).

    The declaration holds from its creation on, for the buffer and its ``.grad``: every sharded clip
    (``fastgrad.clip_grad_norm_(..., process_group=...)`` and the other norms that take one) counts each
    element once, and ``python -m fastgrad.check`` judges the buffer slice by slice. A later declaration for
    the same buffer replaces this one; :meth:`remove` drops it. Checked here, before any work: the types,
    slices inside the buffer that do not overlap, each replicated slice's ranks holding this rank and no rank
    beyond the world. Every rank of a replicated slice must declare it alike (checked in a sharded call's
    collective when its norm_type is finite: RankMismatchError on every rank). A rank that does not count a
    replicated slice reads the slices it counts through one copy of them per call."""

    __slots__ = ("buffer", "slices", "__weakref__")

    def __init__(self, buffer, slices):
        import torch.distributed as dist

        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"Partition(buffer, slices): buffer is a tensor (a flat parameter), got {type(buffer).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Partition(buffer, slices) needs an initialized torch.distributed process group")
        me, world = dist.get_rank(), dist.get_world_size()
        n = buffer.numel()
        out = []
        for item in slices:
            try:
                offset, length, owner, where = item
            except (TypeError, ValueError):
                raise TypeError("Partition(buffer, slices): each slice is (offset, length, owner, replicated_over), "
                                f"got {item!r}") from None
            if isinstance(offset, bool) or isinstance(length, bool) or not isinstance(offset, int) \
                    or not isinstance(length, int):
                raise TypeError(f"Partition: offset and length are ints, got {offset!r} and {length!r}")
            if offset < 0 or length <= 0 or offset + length > n:
                raise ValueError(f"Partition: the slice [{offset}, {offset + length}) is not inside the buffer's "
                                 f"{n} elements")
            if not isinstance(owner, (str, torch.Tensor)):
                raise TypeError(f"Partition: a slice's owner is its parameter or a name, got {type(owner).__name__}")
            ranks = None
            if where is not None:
                ranks = _copy_ranks(where, world)
                if me not in ranks:
                    raise ValueError(f"Partition: the slice [{offset}, {offset + length}) is declared replicated on "
                                     f"ranks {sorted(ranks)}, which do not include this rank ({me})")
            out.append((offset, offset + length, owner, ranks))
        out.sort(key=lambda x: x[0])
        for a, b in zip(out, out[1:]):
            if b[0] < a[1]:
                raise ValueError(f"Partition: the slices [{a[0]}, {a[1]}) and [{b[0]}, {b[1]}) overlap")
        self.buffer, self.slices = buffer, out
        _PARTITIONS[id(buffer)] = self

    def remove(self) -> None:
        """Forget the declaration."""
        if _PARTITIONS.get(id(self.buffer)) is self:
            del _PARTITIONS[id(self.buffer)]

    def pieces(self) -> list[tuple[int, int, object, frozenset | None]]:
        """The whole buffer in order, as ``(start, stop, owner, replicated ranks)``: the declared slices and,
        between them, the undeclared stretches (owner None)."""
        out, at = [], 0
        for a, b, owner, ranks in self.slices:
            if a > at:
                out.append((at, a, None, None))
            out.append((a, b, owner, ranks))
            at = b
        if at < self.buffer.numel():
            out.append((at, self.buffer.numel(), None, None))
        return out

    def __repr__(self) -> str:
        return f"Partition({self.buffer.numel()} elements, {len(self.slices)} slices)"


_PARTITIONS: dict = {}  # id(buffer) -> its Partition (which holds the buffer, so the id cannot be reused)


def declared_partitions(tensors) -> list:
    """``[(i, Partition)]`` for each entry of ``tensors`` that is a declared buffer or its ``.grad``."""
    if not _PARTITIONS:
        return []
    targets = {}
    for part in _PARTITIONS.values():
        targets[id(part.buffer)] = part
        if part.buffer.is_leaf and part.buffer.grad is not None:
            targets[id(part.buffer.grad)] = part
    get = targets.get
    return [(i, p) for i, p in enumerate(map(get, map(id, tensors))) if p is not None]


def narrow_partitions(found: list, reads: list, counts: list) -> tuple[list, list, int]:
    """``(reads, counts, checksum)`` once the declared partitions among the tensors count each element once:
    a buffer whose replicated slices this rank does not count (it is not their lowest rank) is read through a
    copy of the elements it does count (not at all when none); ``checksum`` as :func:`narrow_copies`', per
    replicated slice."""
    import torch.distributed as dist

    me = dist.get_rank()
    reads, counts = list(reads), list(counts)
    checksum = 0
    for i, part in found:
        t = reads[i]
        if t.numel() != part.buffer.numel():
            raise ValueError(f"Partition: the declared buffer has {part.buffer.numel()} elements, its gradient at "
                             f"position {i} has {t.numel()}")
        skip = []
        for a, b, _, ranks in part.slices:
            if ranks is None:
                continue
            low = min(ranks)
            h = zlib.crc32(repr((sorted(ranks), a, b, str(t.dtype))).encode()) & 0xFFF
            checksum += (len(ranks) - 1) * h if me == low else -h
            if me != low:
                skip.append((a, b))
        if not skip:
            continue
        flat, keep, at = t.reshape(-1), [], 0
        for a, b in skip:
            if a > at:
                keep.append(flat[at:a])
            at = b
        if at < flat.numel():
            keep.append(flat[at:])
        reads[i] = torch.cat(keep) if keep else flat[:0]
        counts[i] = counts[i] and bool(keep)
    return reads, counts, checksum


def unwrap_group(process_group):
    """``(group, pieces, copies)``: the process group, whether plain lists are pieces of the same tensors, and
    the declared copies (a :class:`Copies`, or None)."""
    if isinstance(process_group, Copies):
        return process_group.group, process_group.pieces, process_group
    if isinstance(process_group, Shards):
        if process_group.group is None:
            raise ValueError("Shards(group) needs a process group (e.g. dist.group.WORLD)")
        return process_group.group, True, None
    return process_group, False, None


# ------------------------------------------------------------------------------- caches (host cost)
# Keyed by object identity; the value keeps the object so that an id reused after garbage collection can
# not alias (the entry is checked with `is`). Small: one entry per (mesh, placements) kind and per plan.
_SPEC_CACHE: dict = {}
_MESH_RANKS: dict = {}
_PLAN_CACHE: dict = {}


def clear_caches() -> None:
    """Forget the cached placement decisions, mesh rank sets and reduction plans."""
    _SPEC_CACHE.clear()
    _MESH_RANKS.clear()
    _PLAN_CACHE.clear()


def bounded_put(cache: dict, key, value, cap: int) -> None:
    """Store ``value`` in a bounded cache, dropping the least recently used entry when full (dicts keep insertion
    order and :func:`mark_used` moves a hit to the end). Clearing the whole cache instead would throw away the layout
    of the list a training loop clips every step whenever another list came and went in between."""
    cache.pop(key, None)
    while len(cache) >= cap:
        del cache[next(iter(cache))]
    cache[key] = value


def mark_used(cache: dict, key) -> None:
    """Mark a hit as the most recently used entry (a no-op when it already is)."""
    if next(reversed(cache)) != key:
        cache[key] = cache.pop(key)


def group_key(group) -> int:
    """A process group's part of a cache key: its id, and 0 for no group (no object has id 0). A constant,
    not ``id(None)``, which Dynamo cannot trace under ``torch.compile(fullgraph=True)``."""
    return 0 if group is None else id(group)


def spec_info(mesh, placements) -> tuple[bool, bool, tuple | None]:
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
        Replicate = replicate_placement()
        read_pl = tuple(Replicate() if p.is_partial() else p for p in placements)
    eff = read_pl if partial else placements
    counted = all(coord[d] == 0 for d, p in enumerate(eff) if p.is_replicate())
    info = (counted, partial, read_pl)
    bounded_put(_SPEC_CACHE, key, (mesh, info), 4096)  # placements are a handful of kinds; a flood: short-lived meshes
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
class ReducePlan:
    """The collectives of one call.

    ``steps``: the groups the fixed-size buffer (totals, flags, header) is all-reduced over in turn, each
    rank's contribution pre-weighted so that the result is the whole model's (``None``: the default group).
    ``vec_steps``: the groups per-tensor vectors are reduced over; ``[]`` when per-tensor results are this
    rank's own (plain pipeline stages, an empty rank). ``staged``: the ranks of the span hold different
    lists (pipeline stages): each stage's agreement travels in its own header ``slot`` of ``slots`` (one per
    rank of the process group, so every rank of the group builds the same buffer); p = 0's stage counts are
    combined over ``cross`` (this rank contributing when ``cross_contrib``). ``plain_counted``: whether
    plain tensors count on this rank; ``mesh_counted``: the same per mesh (False for a copy of a slice, see
    the package's docstring). ``device``: where a rank without local tensors builds its buffer. ``span``:
    the ranks the steps reach (None when this rank cannot tell)."""

    __slots__ = ("steps", "vec_steps", "staged", "slots", "slot", "cross", "cross_contrib", "plain_counted",
                 "mesh_counted", "device", "keep", "span", "pieces", "vec_span")

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
        # the ranks a per-tensor vector is reduced over (this rank alone when per-tensor results are local)
        if not vec_steps:
            import torch.distributed as dist

            self.vec_span = frozenset((dist.get_rank(),))
        else:
            self.vec_span = union if staged else span

    def describe(self) -> str:
        """The collectives in words, e.g. "all-reduce over the world" (for ``fastgrad.route.ListPlan``'s repr)."""
        return "all-reduce over " + ", then ".join(_group_words(s) for s in self.steps)


def _group_words(group) -> str:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return "the world"
    return f"ranks {sorted(_group_ranks(group))}"


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


def _refuse_a_slice(meshes: list, union: frozenset) -> None:
    """Without a group, meshes that are a slice of a larger mesh would leave the other slices out of the norm."""
    for m in meshes:
        root = _root_ranks(m)
        if root is not None and not root <= union:
            raise ValueError(
                f"the gradients' DeviceMesh covers ranks {sorted(union)}, a slice of a mesh over "
                f"{len(root)} ranks: the other slices' gradients (pipeline stages?) would be left out "
                "of the norm. Pass process_group= the group that connects the stages (or "
                "dist.group.WORLD); to reduce over these ranks only, pass the mesh's own group"
            )


def _build_plan(meshes: list, group, pieces: bool) -> ReducePlan:
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
            return ReducePlan([group], [group], staged=False, slots=0, slot=None, cross=None, cross_contrib=False,
                         plain_counted=True, device=dev, keep=((), group), span=granks, pieces=True)
        # each rank its own tensors (a stage, or nothing): per-tensor results are local
        return ReducePlan([group], [], staged=True, slots=slots, slot=order.index(me), cross=group,
                     cross_contrib=True, plain_counted=True, device=dev, keep=((), group), span=granks)
    union = frozenset().union(*(_ranks_of_mesh(m) for m in meshes))
    plain_counted = me == min(union)
    keep = (tuple(meshes), group)
    if group is None:
        if len(union) < world:
            _refuse_a_slice(meshes, union)
        steps = _mesh_steps(meshes, union)
        return ReducePlan(steps, steps, staged=False, slots=0, slot=None, cross=None, cross_contrib=False,
                     plain_counted=plain_counted, device=_group_device(steps[0]), keep=keep, span=union)
    if union <= granks:
        # The group contains the meshes: one all-reduce over it. Ranks of the group outside the meshes hold
        # other parameters (stages); per-tensor vectors are reduced within the meshes then.
        if granks == union:
            return ReducePlan([group], [group], staged=False, slots=slots, slot=None, cross=None, cross_contrib=False,
                         plain_counted=plain_counted, device=dev, keep=keep, span=granks)
        stage = _mesh_steps(meshes, union)
        return ReducePlan([group], stage, staged=True, slots=slots, slot=order.index(min(union)), cross=group,
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
    return ReducePlan(steps, stage, staged=True, slots=slots, slot=order.index(me), cross=group, cross_contrib=True,
                 plain_counted=plain_counted, device=dev, keep=keep,
                 span=frozenset(range(world)) if tiled else None)


def reduce_plan_for(meshes: list, group, pieces: bool) -> ReducePlan:
    key = (tuple(id(m) for m in meshes), group_key(group), pieces)
    hit = _PLAN_CACHE.get(key)
    if hit is not None and hit.keep[-1] is group and all(a is b for a, b in zip(hit.keep[0], meshes)):
        mark_used(_PLAN_CACHE, key)
        return hit
    plan = _build_plan(meshes, group, pieces)
    bounded_put(_PLAN_CACHE, key, plan, 256)
    return plan


def narrow_copies(copies: Copies, tensors, counts: list, plan: ReducePlan) -> tuple:
    """What this rank counts once the declared copies among ``tensors`` are counted once (``counts``: what the
    placements decide): ``(counts, vec_counts, owned, checksum)``, ``None`` for the middle two when no entry is a
    declared copy. The total counts a copy on the lowest of its ranks only; a per-tensor vector, reduced over the
    plan's ``vec_span`` (a pipeline stage's ranks, or this rank alone), on the lowest of its ranks there, so each
    stage holding a tied tensor sees its whole norm; ``owned``: whether the copy's lowest rank lies in that
    span (the stage that adds it to a count of tensors across stages).

    ``checksum``: this rank's share of a sum that is 0 over all ranks when every rank of each copy's ranks
    declared it alike: per copy, a 12-bit hash ``h`` of (its ranks, shape, dtype), ``-h`` on each rank but the
    lowest, ``(len(ranks) - 1) * h`` on the lowest. A rank that leaves out its copy, or declares other ranks,
    leaves a remainder; the agreement header carries the sum (integers, exact in float64)."""
    found = copies.found(tensors)
    if not found:
        return counts, None, None, 0
    import torch.distributed as dist

    me = dist.get_rank()
    span, vspan = plan.span, plan.vec_span
    counts, vec, owned = list(counts), list(counts), [True] * len(counts)
    checksum = 0
    for i, ranks in found:
        if span is not None and not ranks <= span:
            raise ValueError(f"Copies: the tensor at position {i} (shape {tuple(tensors[i].shape)}) is declared a copy "
                             f"on ranks {sorted(ranks)}, but this call reduces over ranks {sorted(span)} only: "
                             "its lowest rank might never count it; declare ranks within the call's group")
        low = min(ranks)
        counts[i] = counts[i] and me == low
        vec[i] = vec[i] and me == min(ranks & vspan)
        owned[i] = low in vspan
        t = tensors[i]
        h = zlib.crc32(repr((sorted(ranks), tuple(t.shape), str(t.dtype))).encode()) & 0xFFF
        checksum += (len(ranks) - 1) * h if me == low else -h
    return counts, vec, owned, checksum


def span_ranks(sh: "Sharded") -> frozenset | None:
    """The ranks whose contributions the call's total combines (None when this rank cannot tell, e.g. a
    pipeline whose stages do not tile the world): a caller may fold another reduction over exactly these
    ranks into the norm's (fastgrad.amp does so for a ShardedGradScaler's overflow flags)."""
    return sh.plan.span


def _group_device(group) -> torch.device:
    """Where a rank with no local tensor puts its contribution: the device the group's backend reduces."""
    import torch.distributed as dist

    name = str(dist.get_backend(group)).lower()
    if "nccl" in name and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
