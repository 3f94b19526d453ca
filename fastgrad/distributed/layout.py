"""The local view of a sharded list: its local shards, what this rank counts and the list's fingerprint,
from a layout cached per list (see fastgrad.distributed's docstring, "Host cost"), and the same view read in
one C++ pass for DTensor gradients with CPU local shards."""

from __future__ import annotations

import operator
from typing import Sequence

import torch
from torch import Tensor

from .. import _scan
from .agreement import PENDING, raise_pending
from .dtensor import dtensor_class
from .plan import (Copies, Shards, ReducePlan, bounded_put, declared_partitions, group_key, mark_used,
                   narrow_copies, narrow_partitions, reduce_plan_for, spec_info, unwrap_group)

_LAYOUTS: dict = {}
_LIST_CAP = 64  # list layouts kept: a model's clip lists, each a few KB


def clear_layouts() -> None:
    """Forget the cached list layouts."""
    _LAYOUTS.clear()


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
    None; ``plan``: the collectives; ``fp``: the list's fingerprint for the agreement header; ``layout``: the
    cached layout it came from (None for ``for_norm=False``). With declared copies (:class:`Copies`) a per-tensor
    vector may count more than the total: ``vsel``, the indices it counts (None: ``sel``), ``tpos``, the positions
    in ``vsel`` that the total counts, and ``vown``, per entry, whether this rank's stage adds it to a count of
    tensors (None: all); ``copies_sum``: this rank's share of the declared copies' checksum, which the agreement
    header adds up."""

    __slots__ = ("reads", "writes", "counts", "sel", "mesh", "plan", "fp", "checked", "layout", "vsel", "tpos",
                 "vown", "copies_sum")

    def __init__(self, reads, writes, counts, sel, mesh, plan, fp=0):
        self.reads: list[Tensor] = reads
        self.writes: list[Tensor] = writes
        self.counts: list[bool] = counts
        self.sel: list[int] | None = sel
        self.mesh = mesh
        self.plan: ReducePlan = plan
        self.fp = fp
        self.checked = type(writes) is _scan.Checked
        self.layout: _Layout | None = None
        self.vsel: list[int] | None = None
        self.tpos: list[int] | None = None
        self.vown: list[bool] | None = None
        self.copies_sum = 0


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
            info = spec_info(m, pl)
            last_mesh, last_pl = spec.mesh, pl
        dt_pos.append(i)
        specs.append(spec)
        where.append(pos)
        info_of.append(info)
    lay.plan = reduce_plan_for(meshes, group, pieces) if (meshes or group is not None) else None
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
    reduction. ``process_group``: a group, :class:`Shards` (plain tensors that are pieces of one another) or
    :class:`Copies` (a group with tensors declared the same on several ranks).
    ``for_norm=False`` gives only the write targets (no plan, no redistribution of Partial tensors).

    Host cost: the layout (see the package's docstring) is cached, so a repeat call costs a few C-level passes
    over the list (its types, its DTensors' spec objects, their local tensors) and the compiled scan of the
    local tensors; no DTensor dispatch."""
    if PENDING:
        raise_pending()
    group, pieces, copies = unwrap_group(process_group)
    cls = dtensor_class()
    if not for_norm:
        writes = [t._local_tensor if cls is not None and isinstance(t, cls) else t for t in tensors]
        return Sharded(writes, _scan.checked(writes) if writes else writes, [], None, None, None)
    n = len(tensors)
    first = getattr(tensors[0], "_spec", None) if n else None
    key = (n, group_key(group), pieces, id(first))
    lay, dts = _cached_layout(tensors, _LAYOUTS.get(key), group)
    if lay is None:
        lay = _build_layout(tensors, list(map(type, tensors)), cls, group, pieces)
        bounded_put(_LAYOUTS, key, lay, _LIST_CAP)
        dts = tensors if lay.dt_pos is None else [tensors[i] for i in lay.dt_pos]
    else:
        mark_used(_LAYOUTS, key)
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

    counts, sel = _counts(lay, reads, n)
    vec = owned = None
    check = 0
    if copies is not None:
        counts, vec, owned, check = narrow_copies(copies, tensors, counts, plan)
        if vec is not None:
            sel = None if all(counts) else [i for i, c in enumerate(counts) if c]
    fp = _list_fingerprint(lay, reads, n, pieces)
    parts = declared_partitions(tensors)
    if parts:  # flat buffers whose replicated slices count on their lowest rank only (after the fingerprint,
        # which compares the buffers' own shapes)
        reads, counts, psum = narrow_partitions(parts, reads, counts)
        reads = _scan.checked(reads)
        sel = None if all(counts) else [i for i, c in enumerate(counts) if c]
        check += psum
    sh = Sharded(reads, writes, counts, sel, lay.mesh, plan, fp)
    sh.layout = lay
    sh.copies_sum = check
    if vec is not None and vec != counts:
        sh.vsel = [i for i, c in enumerate(vec) if c]
        sh.tpos = [j for j, i in enumerate(sh.vsel) if counts[i]]
    if owned is not None and not all(owned):
        sh.vown = owned
    return sh


def _cached_layout(tensors, lay: _Layout | None, group) -> tuple[_Layout | None, list | None]:
    """``(layout, its DTensors)`` when the cached ``lay`` still describes ``tensors`` (the same types, the same
    spec objects, or new ones on the same meshes and placements), else ``(None, None)``."""
    if lay is None or lay.group is not group:
        return None, None
    if lay.dt_pos is None:  # all DTensors: reading the specs is the type check too
        dts = tensors
        try:
            specs = list(map(_SPEC, tensors))
        except AttributeError:
            return None, None
    elif list(map(type, tensors)) == lay.types:
        dts = [tensors[i] for i in lay.dt_pos]
        specs = list(map(_SPEC, dts))
    else:
        return None, None
    if not all(map(operator.is_, specs, lay.specs)):
        # new spec objects: the same layout when every (mesh, placements) is the same objects or equal
        if list(map(_MESH_PL, specs)) != lay.mesh_pl:
            return None, None
        lay = _refresh(lay, tensors, dts, specs)
    return lay, dts


def _counts(lay: _Layout, reads, n: int) -> tuple[list[bool], list[int] | None]:
    """What this rank counts, ``(counts, sel)``: the layout's decision per DTensor, plain tensors on the plan's
    say; empty local tensors never (they add nothing, and an empty one would only make the local pass
    special-case it)."""
    if lay.counts is not None:
        return lay.counts, lay.sel
    counts = [True] * n
    for i, c in zip(lay.dt_pos, lay.counted_eff):
        counts[i] = c
    keep_plain = lay.plan is None or lay.plan.plain_counted
    for i in lay.plain_pos:
        counts[i] = keep_plain and reads[i].numel() > 0
    return counts, None if all(counts) else [i for i, c in enumerate(counts) if c]


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


def takes_cpu_pass(sh: Sharded, process_group) -> bool:
    """Whether :func:`local_cpu_norm` can serve the later calls of a list the general path just prepared as
    ``sh``, from its layout ``sh.layout`` (all DTensors, no Partial, local shards on the CPU in one compiled scan;
    not ``Shards`` or ``Copies``). A caller keeps that layout (fastgrad.route's plan) and hands it back."""
    lay = sh.layout
    return not (lay is None or lay.dt_pos is not None or lay.partial or lay.plan is None or lay.fp is None
                or isinstance(process_group, (Shards, Copies)) or not sh.checked or not sh.writes
                or sh.writes.device.type != "cpu" or sh.reads is not sh.writes)


def local_cpu_norm(params: Sequence[Tensor], lay, norm_type: float, backend: str | None
                   ) -> tuple[Sharded, Tensor | None, object] | None:
    """The local part of a sharded clip in one C++ call, for the grads of ``params`` laid out as ``lay`` (the
    ``sh.layout`` of a list :func:`takes_cpu_pass` accepted on an earlier call): ``(sh, local_total, handle)``
    (``local_total``: this rank's norm of what it counts, for ``reduced_norm(local_total=)``; ``handle``: for
    :func:`scale_local_cpu`), else None (nothing done; the general path runs). ``lay`` holds when every grad is a DTensor with the very spec object
    it recorded at its position (same mesh, placements, global shape and dtype), as many grads as it has; the C++
    pass checks that on every call, so a changed list never reuses it."""
    c = _scan.helpers()
    if not params or c is None or not hasattr(c, "dtensor_local_norm") or lay is None or lay.empties is None:
        return None
    selects_builtin = _scan.builtin_selector()
    if not (selects_builtin("cpu", "norm", backend, norm_type) and selects_builtin("cpu", "scale", backend, norm_type)):
        return None
    if PENDING:
        raise_pending()
    cls = dtensor_class()
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
