"""Sharded gradients: DTensor grads (FSDP2 ``fully_shard``, tensor parallel) and hand-sharded grads with a
``process_group=`` (ZeRO style, each rank holding a disjoint shard).

The norm is computed from the local shards by the usual backends, then ONE collective of torch.distributed
combines the ranks: an all-reduce SUM of the p-th-power sums (finite p), MAX for inf, MIN for -inf. Clipping
then scales the local shards in place with the (replicated) coefficient; no other communication.

Placements of a DTensor, per mesh dimension:

* ``Shard(d)`` (and FSDP2+TP's ``_StridedShard``): ranks hold disjoint pieces, which the reduction adds up.
* ``Replicate()``: every rank of that mesh dimension holds the same values; only the ranks at coordinate 0
  of every replicated dimension contribute, so nothing is counted twice.
* ``Partial(op)``: a rank holds a term of the tensor, not a piece of it, and the norm of a sum is not a sum
  of norms: the norm is read from a copy redistributed to ``Replicate()`` (one extra collective per
  Partial tensor, which FSDP2 and usual TP plans never produce for grads). Scaling the local terms by the
  coefficient (>= 0) is exact for sum/avg/max/min partials, so clipping writes the local tensor in place.

Results for DTensor input are ``Replicate()`` DTensors on the grads' mesh (torch returns ``Replicate()``,
or ``Partial(max)`` for the inf norm, whose ``full_tensor()`` is the same value); with ``process_group=``
they are plain tensors, identical on every rank. All ranks must make the same call with the same list of
parameters (grads None on the same parameters), as for any collective.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from .backends import acc_dtype

__all__ = ["is_dtensor", "has_dtensor", "Sharded", "prepare", "reduced_norm", "wrap_like", "to_local_norm"]

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
    """The check every public call pays: the type of the first tensor only (a plain tensor costs one
    ``is``). A list that mixes plain tensors and DTensors is an error in torch as well; when the DTensor is
    not first, the backend's op raises DTensor's own error instead of :func:`prepare`'s. ``len``, not
    ``bool``: the Dynamo of torch 2.11 cannot trace ``bool`` of a list (every compiled call broke on it)."""
    return len(tensors) > 0 and type(tensors[0]) is not Tensor and is_dtensor(tensors[0])


class Sharded:
    """Local view of a sharded gradient list.

    ``reads[i]``: local tensor whose values enter the norm; ``writes[i]``: local tensor scaled in place;
    ``counts[i]``: whether this rank's ``reads[i]`` contributes (False for replicated copies off
    coordinate 0 and for empty shards); ``mesh`` (DTensor input) or ``group`` (process_group=) says where
    the all-reduce goes."""

    __slots__ = ("reads", "writes", "counts", "mesh", "group")

    def __init__(self, reads, writes, counts, mesh, group):
        self.reads: list[Tensor] = reads
        self.writes: list[Tensor] = writes
        self.counts: list[bool] = counts
        self.mesh = mesh
        self.group = group


def prepare(tensors: Sequence[Tensor], process_group=None, *, for_norm: bool = True) -> Sharded:
    """Local shards of DTensor ``tensors`` (all on one DeviceMesh), or of plain tensors that are disjoint
    shards across ``process_group``. ``for_norm=False`` skips the redistribution of Partial tensors (only
    the write targets are needed)."""
    cls = _dtensor_cls()
    if process_group is not None:
        if cls is not None and any(isinstance(t, cls) for t in tensors):
            raise ValueError(
                "process_group= is for plain tensors holding disjoint shards; DTensor gradients carry their "
                "own DeviceMesh, so pass them without process_group="
            )
        ts = list(tensors)
        return Sharded(ts, ts, [t.numel() > 0 for t in ts], None, process_group)

    mesh = None
    coord = None
    reads, writes, counts = [], [], []
    for t in tensors:
        if cls is None or not isinstance(t, cls):
            raise TypeError(
                "got a mix of DTensor and plain torch.Tensor gradients; convert all of them to DTensor (as "
                "torch requires), or pass plain local shards with process_group="
            )
        m = t.device_mesh
        if mesh is None:
            mesh = m
            coord = m.get_coordinate()
            if coord is None:
                raise ValueError("this rank is not part of the gradients' DeviceMesh")
        elif m is not mesh and m != mesh:
            raise ValueError(
                "all DTensor gradients must live on one DeviceMesh; clip each mesh's parameters separately "
                f"or combine their norms (got {mesh} and {m})"
            )
        local = t._local_tensor  # what to_local() returns, without an autograd node
        placements = t.placements
        read = local
        if for_norm and any(p.is_partial() for p in placements):
            Replicate = _placements()
            placements = tuple(Replicate() if p.is_partial() else p for p in placements)
            read = t.redistribute(mesh, placements)._local_tensor
        counted = read.numel() > 0 and all(
            coord[d] == 0 for d, p in enumerate(placements) if p.is_replicate()
        )
        reads.append(read)
        writes.append(local)
        counts.append(counted)
    return Sharded(reads, writes, counts, mesh, None)


def _all_reduce(t: Tensor, op, sh: Sharded) -> None:
    import torch.distributed as dist

    if sh.mesh is None:
        dist.all_reduce(t, op=op, group=sh.group)
        return
    mesh = sh.mesh
    if mesh.ndim == 1:
        dist.all_reduce(t, op=op, group=mesh.get_group(0))
    elif mesh.size() == dist.get_world_size():
        dist.all_reduce(t, op=op)  # the mesh is every rank: one all-reduce over WORLD
    else:
        # A multi-dimensional mesh on a subset of the ranks has no single group; SUM/MAX/MIN are
        # associative, so reducing along each mesh dimension in turn reaches every rank of the mesh.
        for d in range(mesh.ndim):
            dist.all_reduce(t, op=op, group=mesh.get_group(d))


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


def reduced_norm(sh: Sharded, norm_type: float, per_tensor: bool,
                 local_norm: Callable[[list[Tensor], bool], tuple[Tensor, Tensor | None]]
                 ) -> tuple[Tensor, Tensor | None]:
    """Global total norm (and per-tensor norms, in input order, when asked) in the accumulation dtype on
    the first local tensor's device, identical on every rank. ``local_norm(tensors, per_tensor)`` is the
    single-process norm of a list of local tensors (fastgrad.clip's backend dispatch).

    Exactly one collective: a SUM all-reduce of p-th-power sums for finite p (of per-tensor nonzero counts
    for p = 0), a MAX (MIN for -inf) all-reduce otherwise; NaN travels as a separate flag because MAX/MIN
    collectives do not promise to propagate NaN."""
    import torch.distributed as dist

    reads = sh.reads
    if reads:
        dev = reads[0].device
        dtype = acc_dtype(reads)
    else:  # a rank owning no shard still takes part in the collective
        dev, dtype = _group_device(sh.group), torch.float32
    wide = _wide(dtype, dev)
    p = norm_type
    sel = [i for i, c in enumerate(sh.counts) if c]
    local = [reads[i] for i in sel]
    vector = per_tensor or p == 0  # p = 0 counts tensors with a nonzero: needs per-tensor counts
    if local and dtype == torch.float64 and acc_dtype(local) != dtype:
        # This rank holds no piece of the float64 tensors, but every rank must accumulate as the whole
        # list dictates: an empty float64 tensor makes the backend accumulate in float64 (entry dropped).
        local = local + [torch.empty(0, dtype=torch.float64, device=dev)]
    # Finite p != 0 travels as p-th powers (their sum is what adds up across ranks); 0 counts, inf/-inf
    # as norms (max/min). `identity` is what a rank with nothing to add contributes.
    powers = p != 0 and p not in (_INF, -_INF)
    identity = _INF if p == -_INF else 0.0

    if vector or powers:
        n = len(reads) if vector else 1
        if local:
            _, per = local_norm(local, True)
            per = per[: len(sel)].to(wide)
            if powers:
                per = per.pow(p)  # in float64: exact for p = 2 from an fp32 norm
            if not vector:
                vals = per.sum().reshape(1)
            elif len(sel) != n:  # put the counted ones in place; the rest contribute the identity
                ident = torch.full((), identity, dtype=wide, device=dev)
                slots = [ident] * n
                for k, v in zip(sel, per.unbind(0)):
                    slots[k] = v
                vals = torch.stack(slots)
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

    if p == _INF or p == -_INF:
        nan = torch.isnan(vals)
        if p == _INF:
            buf = torch.cat([torch.where(nan, 0.0, vals), nan.to(wide)])
            _all_reduce(buf, dist.ReduceOp.MAX, sh)
            flag = buf[vals.numel():] > 0
        else:
            buf = torch.cat([torch.where(nan, _INF, vals), -nan.to(wide)])
            _all_reduce(buf, dist.ReduceOp.MIN, sh)
            flag = buf[vals.numel():] < 0
        vals = torch.where(flag, float("nan"), buf[: vals.numel()])
        per_out = vals if vector else None
        total = torch.linalg.vector_norm(vals, p)
    elif p == 0:
        _all_reduce(vals, dist.ReduceOp.SUM, sh)  # per-tensor nonzero counts of the whole tensors
        per_out = vals
        total = (vals != 0).sum().to(wide)
    else:
        # The per-tensor norms enter in float64 (not a local total rounded to fp32), so the only fp32
        # roundings are the per-tensor ones torch's DTensor path has too.
        _all_reduce(vals, dist.ReduceOp.SUM, sh)
        inv = 1.0 / p
        per_out = vals.pow(inv) if vector else None
        total = vals.sum().pow(inv)
    total = total.to(dtype)
    per = per_out.to(dtype) if per_tensor else None
    return total, per


def wrap_like(value: Tensor, sh: Sharded):
    """A result for the caller: a Replicate() DTensor on the grads' mesh for DTensor input (what torch's
    clip_grad_norm_ returns), the plain tensor with process_group=."""
    if sh.mesh is None:
        return value
    Replicate = _placements()
    return _dtensor_cls().from_local(value, sh.mesh, [Replicate()] * sh.mesh.ndim, run_check=False)


def to_local_norm(total_norm):
    """A total norm given to clip_grads_with_norm_ as a DTensor (ours: Replicate; torch's inf norm:
    Partial(max)) becomes the plain replicated value (a collective only for a Partial one)."""
    if is_dtensor(total_norm):
        return total_norm.full_tensor()
    return total_norm


def reduced_amp_norm(sh: Sharded, norm_type: float,
                     local_amp: Callable[[list[Tensor]], tuple[Tensor, Tensor]]
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """The fused AMP read pass over shards: ``local_amp(tensors)`` gives this rank's (norm of the unscaled
    values, found_inf 0/1); ONE all-reduce carries the p-th power (or max) and the overflow flag together.
    Returns ``(global total, local found_inf, global found_inf)``, the flags 0-dim float32 exactly 0 or 1.
    norm_type 0 has no sharded AMP form (the read pass yields totals, not per-tensor counts)."""
    import torch.distributed as dist

    p = norm_type
    if p == 0:
        raise ValueError("scaler_unscale_and_clip with norm_type=0 is not supported for sharded gradients")
    reads = sh.reads
    if reads:
        dev, dtype = reads[0].device, acc_dtype(reads)
    else:
        dev, dtype = _group_device(sh.group), torch.float32
    wide = _wide(dtype, dev)
    local = [reads[i] for i, c in enumerate(sh.counts) if c]
    if local and dtype == torch.float64 and acc_dtype(local) != dtype:
        local = local + [torch.empty(0, dtype=torch.float64, device=dev)]  # as in reduced_norm
    if local:
        total, flag = local_amp(local)
        total, flag = total.to(dev, wide).reshape(1), flag.to(dev, torch.float32).reshape(())
    else:
        total = torch.full((1,), _INF if p == -_INF else 0.0, dtype=wide, device=dev)
        flag = torch.zeros((), dtype=torch.float32, device=dev)
    f = flag.to(wide).reshape(1)
    if p == _INF or p == -_INF:
        nan = torch.isnan(total).to(wide)
        if p == _INF:
            buf = torch.cat([torch.where(nan > 0, 0.0, total), nan, f])
            _all_reduce(buf, dist.ReduceOp.MAX, sh)
        else:  # MIN for the value; flags ride negated
            buf = torch.cat([torch.where(nan > 0, _INF, total), -nan, -f])
            _all_reduce(buf, dist.ReduceOp.MIN, sh)
            buf = torch.cat([buf[:1], -buf[1:]])
        g_total = torch.where(buf[1] > 0, float("nan"), buf[0])
        g_flag = buf[2]
    else:
        pw = total.pow(p) if local else torch.zeros_like(total)  # no shard: adds nothing (also for p < 0)
        buf = torch.cat([pw, f])
        _all_reduce(buf, dist.ReduceOp.SUM, sh)
        g_total = buf[0].pow(1.0 / p)
        g_flag = buf[1]
    g_flag = (g_flag > 0).to(torch.float32)
    return g_total.to(dtype), flag, g_flag
