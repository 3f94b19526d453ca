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
* ``process_group=Copies(G, {tensor: ranks})`` (``G`` a group or ``Shards(G)``): as ``G``, except that each
  tensor named is the same on ``ranks`` (a tied embedding on the first and last stage, a weight replicated by
  hand-written tensor parallelism): only the lowest of ``ranks`` contributes it (on top of what placements
  decide for a DTensor). A per-tensor vector counts it on the lowest of ``ranks`` within the ranks the vector
  is reduced over, so each stage holding a tied tensor gets its whole norm. No extra collective.
* ``Partition(buffer, [(offset, length, owner, replicated_over), ...])`` declares what a flat buffer holds (a
  ZeRO partition of a tensor-parallel model: shards' slices next to slices of replicated tensors): every call
  with a ``process_group`` counts a replicated slice on the lowest of its ranks only, whatever the group.

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

Modules: ``dtensor`` (DTensor adapters), ``plan`` (which ranks reduce together, and the caches), ``layout``
(a list's local view, and its one-pass C++ form for CPU shards), ``agreement`` (a call's one
collective with its header, and :class:`RankMismatchError`), ``reduce`` (what a norm, AMP's read pass and
grad_stats reduce).
"""

from __future__ import annotations

from . import agreement, layout, plan
from .agreement import RankMismatchError
from .dtensor import dtensor_grads, has_dtensor, is_dtensor, to_local_norm, wrap_like
from .layout import Sharded, takes_cpu_pass, local_cpu_norm, prepare, scale_local_cpu
from .plan import Copies, Partition, Shards, declared_partitions, span_ranks
from .reduce import local_device_dtype, nonfinite_poison, reduced_amp_norm, reduced_exact, reduced_norm, reduced_stats

__all__ = ["is_dtensor", "has_dtensor", "dtensor_grads", "Sharded", "Shards", "Copies", "Partition", "declared_partitions",
           "RankMismatchError", "prepare",
           "reduced_norm", "reduced_amp_norm", "reduced_stats", "wrap_like", "to_local_norm", "span_ranks",
           "clear_cache", "nonfinite_poison", "reduced_exact", "local_device_dtype", "takes_cpu_pass", "local_cpu_norm",
           "scale_local_cpu"]


def clear_cache() -> None:
    """Forget the cached placement decisions, mesh rank sets, reduction plans and list layouts (e.g. after
    destroying and re-creating process groups with the same objects' ids)."""
    plan.clear_caches()
    layout.clear_layouts()
    agreement.PENDING.clear()
    for forget in _ON_CLEAR:
        forget()


_ON_CLEAR: list = []  # the layers above that keep layouts (fastgrad.route's plans) register their clear here


def on_clear(forget) -> None:
    """Register ``forget()`` to run at every :func:`clear_cache` (a layer above that keeps layouts: route's
    plans)."""
    _ON_CLEAR.append(forget)
