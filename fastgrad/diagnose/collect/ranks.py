"""What ``python -m fastgrad.check`` records of a multi-process run (every rank runs the script under check, from
``torchrun`` or ``--nproc``) so that rank 0 can judge the norm the script clips with (``norm_miscounted``).

At a recorded clip (those of the steps whose update is measured: the first ``UPDATE_ALWAYS``, then every
``UPDATE_EVERY``-th; at most ``MAX_RECORDS`` clips) each rank keeps, on the device and before the clip writes:
per gradient of the clip's parameters its squared norm in float64, and, for a plain tensor, a fingerprint of
its bytes (two wrapping int64 sums of its bits, plain and position-weighted: equal tensors give equal
fingerprints on any device, and different ones almost never do); for a DTensor, whether its local shard
counts, as ``fastgrad.distributed.prepare`` decides from its placements. After the clip, the norm it
returned or was given. Nothing is read to the host during the run: at the end (when the script destroys its
default process group, or after the script) each rank reads its records once and ONE ``gather_object``
brings them, with the process groups each rank belongs to, to rank 0. A mixin of
:class:`~fastgrad.diagnose.collect.hooks.Checker`, which owns the state."""

from __future__ import annotations

import torch
from torch import Tensor

from ...distributed import declared_partitions, is_dtensor, prepare
from .optimizer_hooks import UPDATE_ALWAYS, UPDATE_EVERY

__all__ = ["RankRecorder", "MAX_RECORDS", "fingerprint", "world"]

#: recorded clips per run (a hand-written loop clips every backward: the records stay bounded)
MAX_RECORDS = 64
#: 16-bit position weights: with 32-bit words the products stay below 2^47
_WEIGHT_MOD = 65521
_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` when there is none."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def fingerprint(t: Tensor) -> Tensor:
    """Two int64 numbers (a device tensor) that equal tensors of the same shape and dtype share, byte for byte:
    the wrapping sums of the tensor's bits read as integers, plain and weighted by position. Integer sums wrap
    the same whatever the order, so every device and reduction order agrees."""
    flat = t.detach().contiguous().reshape(-1)
    bits = flat.view(_INT_OF[flat.element_size()]).to(torch.int64)
    pos = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % _WEIGHT_MOD + 1
    return torch.stack([bits.sum(), (bits * pos).sum()])


class RankRecorder:
    def _rank_init(self) -> None:
        self._rank_rows: list = []   # per recorded clip: (step, meta, names, device values), until the end
        self.rank_calls: list | None = None  # rank 0, after the gather: per clip, every rank's record
        self._rank_gathered = False
        #: rank 0, after the gather: {rank: why} of each rank that sent no records (its records unreadable)
        self.ranks_silent: dict[int, str] = {}

    def _rank_record(self, params) -> tuple | None:
        """Before a clip writes: this rank's record of ``params``' gradients (device values), or None when this
        clip is not recorded (one process, a step not sampled, the records full)."""
        rank, size = world()
        if size < 2 or not self._bw or len(self._rank_rows) >= MAX_RECORDS:
            return None
        step = self.steps_done + 1
        if step > UPDATE_ALWAYS and step % UPDATE_EVERY:
            return None
        if isinstance(params, Tensor):
            params = [params]
        params = [p for p in params if p.grad is not None]
        if self.watcher is not None:
            self._refresh_names()
        names = [self._names.get(p, f"parameter {i}") for i, p in enumerate(params)]
        kinds = self._module_kinds(params)
        grads = [p.grad for p in params]
        dt_pos = [i for i, g in enumerate(grads) if is_dtensor(g)]
        counted: list = [None] * len(grads)
        reads: list = [g.coalesce().values() if g.is_sparse else g for g in grads]
        if dt_pos:
            import torch.distributed as dist

            # the placements' verdict on each local shard, over the whole world (a pipeline's stages included)
            sh = prepare([grads[i] for i in dt_pos], dist.group.WORLD)
            for j, i in enumerate(dt_pos):
                counted[i] = bool(sh.counts[j])
                reads[i] = sh.reads[j]
        flat = [False] * len(reads)
        parts = dict(declared_partitions(grads))
        if parts or any(c is None and r.dim() == 1 and p not in self._names
                        for c, r, p in zip(counted, reads, params)):
            names, counted, reads, kinds, flat = self._rank_pieces(params, names, counted, reads, kinds, parts)
        sq = [torch.sum(torch.square(r.detach().to(torch.float64))).reshape(1) for r in reads]
        keys = [None if c is not None else (tuple(r.shape), str(r.dtype)) for c, r in zip(counted, reads)]
        prints = [fingerprint(r) if c is None else None for c, r in zip(counted, reads)]
        return step, names, counted, [r.numel() for r in reads], keys, sq, prints, kinds, flat

    def _rank_pieces(self, params, names, counted, reads, kinds, parts) -> tuple:
        """The record's entries once flat buffers are looked into: a buffer with a declared layout
        (``fastgrad.distributed.Partition``) becomes one entry per slice, named after the parameter it belongs to,
        so that a replicated slice (the same bytes on the ranks that hold it) counts once; the stretches it
        leaves undeclared, and a plain 1-D gradient that no module of the watched models holds (a flat buffer
        whose layout nobody declared), are marked ``flat``: the rule cannot tell what they hold."""
        out: tuple = ([], [], [], [], [])
        for i, (p, name, c, r, kind) in enumerate(zip(params, names, counted, reads, kinds)):
            part = parts.get(i)
            if p not in self._names and c is None and r.dim() == 1:
                name = self._var_name(p) or name  # a buffer is named after the script's variable
            if part is None:
                undeclared = c is None and r.dim() == 1 and p not in self._names
                for lst, v in zip(out, (name, c, r, kind, undeclared)):
                    lst.append(v)
                continue
            whole = r.reshape(-1)
            for a, b, owner, _ in part.pieces():
                if isinstance(owner, Tensor):
                    label = self._names.get(owner, f"{name}[{a}:{b}]")
                    what = self._module_kinds([owner])[0]
                else:
                    label, what = (owner, None) if owner is not None else (f"{name}[{a}:{b}]", None)
                for lst, v in zip(out, (label, None, whole[a:b], what, owner is None)):
                    lst.append(v)
        return out

    def _module_kinds(self, params) -> list:
        """Per parameter, the type name of the module that holds it directly in the watched models (the
        attribution's "tensors of one module type"), None where none does."""
        want = {id(p): k for k, p in enumerate(params)}
        out: list = [None] * len(params)
        roots = [r() for r in self.watcher._roots] if self.watcher is not None else []
        for root in roots:
            if root is None:
                continue
            for m in root.modules():
                for p in m.parameters(recurse=False):
                    k = want.get(id(p))
                    if k is not None and out[k] is None:
                        out[k] = type(m).__name__
        return out

    def _rank_keep(self, rec: tuple | None, norm, max_norm) -> None:
        """After the clip: keep ``rec`` with the norm the script clipped with (its device value)."""
        if rec is None or not isinstance(norm, Tensor) or norm.numel() != 1:
            return
        self._rank_rows.append((rec, norm.detach().reshape(1), str(norm.dtype), max_norm))

    def _rank_gather(self) -> None:
        """Once, on every rank while the default group lives: the records to the host, then to rank 0."""
        if self._rank_gathered:
            return
        rank, size = world()
        if size < 2:
            return
        self._rank_gathered = True
        import torch.distributed as dist

        mine = []
        failed = None
        try:
            for (step, names, counted, numels, keys, sq, prints, kinds, flat), norm, dtype, max_norm in self._rank_rows:
                sqv = torch.cat(sq).tolist() if sq else []
                fp = [None if p is None else tuple(p.tolist()) for p in prints]
                entries = [(n, c, s, k, None if key is None else key + f, kind, fl)
                           for n, c, s, k, key, f, kind, fl in zip(names, counted, sqv, numels, keys, fp, kinds, flat)]
                mine.append({"step": step, "entries": entries, "norm": float(norm.to(torch.float64)),
                             "dtype": dtype, "max_norm": max_norm})
        except Exception as e:  # noqa: BLE001 - still join the gather, or the other ranks wait forever
            failed = f"could not read its norm records: {e}"
            self.errors.append(f"rank {rank}: {failed}")
            mine = []
        self._rank_rows = []
        out = [None] * size if rank == 0 else None
        dist.gather_object({"calls": mine, "groups": _groups(rank), "failed": failed}, out, dst=0)
        if rank != 0:
            return
        # a rank without records leaves every clip unjudged: flagged, so the report names it under Not checked
        self.ranks_silent = {r: o["failed"] for r, o in enumerate(out) if o.get("failed")}
        n = min(len(o["calls"]) for o in out)
        calls = []
        for k in range(n):
            per = [o["calls"][k] for o in out]
            if len({p["step"] for p in per}) != 1:  # the ranks clipped at different steps: not one clip
                break
            calls.append({"step": per[0]["step"], "ranks": [dict(p, groups=o["groups"]) for p, o in zip(per, out)]})
        self.rank_calls = calls


def _groups(rank: int) -> list[list[int]]:
    """The global ranks of every process group this rank belongs to (the default one included)."""
    import torch.distributed as dist

    out = [list(range(dist.get_world_size()))]
    try:
        from torch.distributed.distributed_c10d import _world

        for ranks in _world.pg_group_ranks.values():
            g = sorted(int(r) for r in ranks)
            if rank in g and g not in out:
                out.append(g)
    except Exception:  # noqa: BLE001 - torch moved its registry: the world alone
        pass
    return out
