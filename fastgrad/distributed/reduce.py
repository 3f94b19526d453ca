"""The reduction protocol: what a sharded norm, AMP's read pass and grad_stats reduce. This rank's local
values go into the call's ONE collective (fastgrad.distributed.agreement: payload, flags and agreement header
in one buffer, over the plan's steps); per-tensor vectors are reduced after it, once the header said the
ranks' lists agree."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .. import _scan
from ..backends import acc_dtype
from ..decide import nonfinite
from .agreement import KIND_AMP, KIND_EXACT, KIND_NORM, KIND_STATS, all_reduce_steps, collective
from .layout import Sharded
from .plan import ReducePlan

_INF = float("inf")


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
            all_reduce_steps(buf, dist.ReduceOp.MAX, steps)
            flag = buf[n:] > 0
        else:
            buf = torch.cat([torch.where(nan, _INF, vals), -nan.to(vals.dtype)])
            all_reduce_steps(buf, dist.ReduceOp.MIN, steps)
            flag = buf[n:] < 0
        return torch.where(flag, float("nan"), buf[:n])
    all_reduce_steps(vals, dist.ReduceOp.SUM, steps)
    return vals


def local_device_dtype(sh: Sharded) -> tuple[torch.device, torch.dtype]:
    """Where this rank's contribution to ``sh``'s collective is built, and the accumulation dtype of the whole
    list (the dtype the returned norm is computed in)."""
    if sh.reads:
        return sh.reads[0].device, acc_dtype(sh.reads)
    return sh.plan.device, torch.float32  # a rank owning no shard still takes part in the collective


def _counted(sh: Sharded, dtype: torch.dtype, dev: torch.device, vec: bool = False) -> tuple[list[int], list[Tensor]]:
    """Indices and local tensors of what this rank counts (a Checked list for the compiled one-pass scan) in the
    total, or with ``vec`` in a per-tensor vector (more than the total where declared copies span pipeline
    stages or per-tensor results are local: ``sh.vsel``)."""
    sel = sh.vsel if vec and sh.vsel is not None else sh.sel
    if sel is None:
        return range(len(sh.reads)), sh.reads
    local = [sh.reads[i] for i in sel]
    if local and dtype == torch.float64 and acc_dtype(local) != dtype:
        # This rank holds no piece of the float64 tensors, but every rank must accumulate as the whole
        # list dictates: an empty float64 tensor makes the backend accumulate in float64 (entry dropped).
        local = local + [torch.empty(0, dtype=torch.float64, device=dev)]
    return sel, _scan.checked(local) if local else local


def _of_total(sh: Sharded, per: Tensor | None) -> Tensor | None:
    """The entries of a per-tensor vector counted by the vector's indices (``sh.vsel``) that the total counts
    too (``sh.tpos``); ``per`` itself when they are the same."""
    if per is None or sh.vsel is None:
        return per
    return per[torch.tensor(sh.tpos, dtype=torch.int64).to(per.device, non_blocking=True)]


def _place(per: Tensor, sel, n: int, identity: float, like: Tensor) -> Tensor:
    """Per-tensor values of the counted tensors (``per``, in ``sel`` order; a value or a row each) at their places
    in ``n`` entries; the others hold ``identity`` (what a rank that adds nothing contributes)."""
    if len(sel) == n:
        return per
    vals = torch.full((n, *per.shape[1:]), identity, dtype=like.dtype, device=like.device)
    if len(sel):
        vals[torch.tensor(list(sel), dtype=torch.int64).to(like.device, non_blocking=True)] = per
    return vals


_UNSET = object()


def reduced_norm(sh: Sharded, norm_type: float, per_tensor: bool,
                 local_norm: Callable[[list[Tensor], bool], tuple[Tensor, Tensor | None]] | None,
                 poison: Tensor | None = None, *, local_total=_UNSET) -> tuple[Tensor, Tensor | None]:
    """Global total norm (and per-tensor norms, in input order, when asked) in the accumulation dtype on
    the first local tensor's device, identical on every rank. ``local_norm(tensors, per_tensor)`` is the
    single-process norm of a list of local tensors (fastgrad.passes.list_norm).

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
    dev, dtype = local_device_dtype(sh)
    wide = _wide(dtype, dev)
    p = norm_type
    vector = per_tensor or p == 0  # p = 0 counts tensors with a nonzero: needs per-tensor counts
    given = local_total is not _UNSET
    if given and vector:
        raise ValueError("reduced_norm: local_total= is for a total norm (per_tensor=False, norm_type != 0)")
    sel, local = ((), ()) if given else _counted(sh, dtype, dev, vec=vector)
    combine = vector and bool(plan.vec_steps)  # per-tensor vectors reduced across ranks (else local)

    per_local = None  # this rank's per-tensor values (norms; counts for p = 0), counted ones in `sel` order
    total_local = local_total if given else None
    if local and vector:
        _, per_local = local_norm(local, True)
        per_local = per_local[: len(sel)]
    elif local:  # a total only: the local total (its p-th power is what adds up; a max/min is exact)
        total_local, _ = local_norm(local, False)
    if poison is not None:
        poison = poison.to(dev, wide).reshape(1)  # (+0 leaves the non-negative values' bits alone)
    per_total = _of_total(sh, per_local)
    k_total = len(sel) if per_total is per_local else len(sh.tpos)
    payload, ors = _norm_payload(p, per_total, total_local, k_total, combine, poison, dev, wide)
    red, ors_out = collective(sh, KIND_NORM, p, vector, payload, ors)
    if p == _INF or p == -_INF:
        total = torch.where(ors_out[0] > 0, float("nan"), red[0])
    else:
        total = red[0].pow(1.0 / p) if p != 0 else red[0]
    n = len(sh.reads)
    per = None
    if combine:
        total, per = _reduced_vector(plan, p, per_tensor, per_local, sel, n, poison, total, dev, wide, sh.vown)
    elif per_tensor:
        identity = _INF if p == -_INF else 0.0
        per = _spread(per_local.to(wide) if per_local is not None else None, sel, n, identity, dev, wide)
    return total.to(dtype), None if per is None else per.to(dtype)


def _norm_payload(p: float, per_local: Tensor | None, total_local: Tensor | None, k: int, combine: bool,
                  poison: Tensor | None, dev, wide) -> tuple[Tensor, Tensor | None]:
    """This rank's contribution to a norm's collective, in its reduction's form (a p-th power sum; a max/min
    with its NaN flag moved into ``ors``; for p = 0 a count), from its per-tensor values (``k`` of them) or its
    total, and its NaN flag to OR (the max/min; else None)."""
    identity = _INF if p == -_INF else 0.0
    if p == _INF or p == -_INF:
        if per_local is not None:
            total_local = (per_local.amax() if p == _INF else per_local.amin()) if k else None
        if total_local is None:
            t = torch.full((1,), identity, dtype=wide, device=dev)
        else:
            t = total_local.to(dev, wide).reshape(1)
        if poison is not None:
            t = t + poison
        nan = torch.isnan(t)
        return torch.where(nan, identity, t), nan.to(wide)
    if p != 0:
        if per_local is not None:  # in float64: exact squares of fp32 norms
            payload = per_local.to(wide).pow(p).sum().reshape(1)
        elif total_local is not None:
            payload = total_local.to(dev, wide).pow(p).reshape(1)
        else:
            payload = torch.zeros(1, dtype=wide, device=dev)
    else:  # p == 0: the count is the whole story only where per-tensor values are local
        payload = ((per_local != 0).sum().to(wide).reshape(1) if per_local is not None and not combine
                   else torch.zeros(1, dtype=wide, device=dev))
    if poison is not None:
        payload = payload + poison
    return payload, None


def _reduced_vector(plan: ReducePlan, p: float, per_tensor: bool, per_local: Tensor | None, sel, n: int,
                    poison: Tensor | None, total: Tensor, dev, wide, owned: list[bool] | None = None
                    ) -> tuple[Tensor, Tensor | None]:
    """The per-tensor vector reduced across ranks, after the header said the lists agree: ``(total, per)``, the
    total replaced by the count of tensors with a nonzero for p = 0 (across stages, each stage's count of the
    entries it ``owned``: a tied copy another stage adds is left out), ``per`` when ``per_tensor``."""
    powers = p != 0 and p not in (_INF, -_INF)
    vals = per_local.to(wide) if per_local is not None else None
    if vals is not None and powers:
        vals = vals.pow(p)  # in float64: exact for p = 2 from an fp32 norm
    vals = _spread(vals, sel, n, _INF if p == -_INF else 0.0, dev, wide)
    if poison is not None:
        vals = vals + poison
    vals = _combine(vals, p, plan.vec_steps)
    if p == 0:
        nonzero = vals != 0
        if owned is not None:
            nonzero = nonzero & torch.tensor(owned, dtype=torch.bool).to(dev, non_blocking=True)
        count = nonzero.sum().to(wide).reshape(1)
        if plan.staged:  # each stage counted its own tensors: add the stages' counts
            if not plan.cross_contrib:
                count = torch.zeros_like(count)
            count = _combine(count, 0.0, [plan.cross])
        total = count[0]
    per = None
    if per_tensor:
        per = vals.pow(1.0 / p) if powers else vals
    return total, per


def _spread(vals: Tensor | None, sel, n: int, identity: float, dev, wide) -> Tensor:
    """:func:`_place` of a rank's per-tensor values; all ``identity`` when it has none."""
    if vals is None:
        return torch.full((n,), identity, dtype=wide, device=dev)
    return _place(vals, sel, n, identity, torch.empty(0, dtype=wide, device=dev))


def reduced_stats(sh: Sharded, local_stats: Callable[[list[Tensor]], dict[str, Tensor]]) -> dict[str, Tensor]:
    """grad_stats over shards: the columns of :func:`fastgrad.stats.tensor_stats` for the WHOLE tensors, in
    input order, the same on every rank (``numel`` too: the counted shards' sizes add up to the tensor's).

    The total (a SUM of squared norms, with the agreement header): one collective. Columns that combine shards
    (DTensors, :class:`Shards`): two more, a SUM (squared norms, NaN/Inf/zero counts, numel) and a MAX of
    max|g| with its NaN flags (a max cannot ride a sum). Plain pipeline stages: their own columns, no more."""
    import torch.distributed as dist

    plan = sh.plan
    dev, dtype = local_device_dtype(sh)
    wide = _wide(dtype, dev)
    sel, local = _counted(sh, dtype, dev, vec=True)
    n = len(sh.reads)
    k = len(sel)
    cols = local_stats(local) if local else None
    if cols is not None:
        sq = cols["norm"][:k].to(wide).square()
        payload = _of_total(sh, sq).sum().reshape(1)
    else:
        payload = torch.zeros(1, dtype=wide, device=dev)
    combine = bool(plan.vec_steps)
    red, _ = collective(sh, KIND_STATS, 2.0, True, payload, None)
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
        all_reduce_steps(sums, dist.ReduceOp.SUM, plan.vec_steps)
        sums = sums.reshape(5, n)
        peak = _combine(peak, _INF, plan.vec_steps)
    counts = sums[1:].to(torch.int64)
    return {"norm": sums[0].sqrt().to(dtype), "max_abs": peak.to(dtype), "nan": counts[0], "inf": counts[1],
            "zero": counts[2], "numel": counts[3], "total_norm": total}


def reduced_amp_norm(sh: Sharded, norm_type: float,
                     local_amp: Callable[[list[Tensor]], tuple[Tensor, Tensor]],
                     poison: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The fused AMP read pass over shards: ``local_amp(tensors)`` gives this rank's (norm of the unscaled
    values, found_inf 0/1); ONE all-reduce (per step of the plan) carries the p-th power (or max), the
    overflow flag and the agreement header together. Returns ``(global total, local found_inf, global
    found_inf)``, the flags 0-dim float32 exactly 0 or 1. ``poison``: as
    in :func:`reduced_norm` (a NaN only this rank sees is an overflow on every rank). norm_type 0 has no
    sharded AMP form (the read pass yields totals, not per-tensor counts)."""
    p = norm_type
    if p == 0:
        raise ValueError("scaler_unscale_and_clip with norm_type=0 is not supported for sharded gradients")
    dev, dtype = local_device_dtype(sh)
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
    if p == _INF or p == -_INF:
        if poison is not None:
            total = total + poison
        nan = torch.isnan(total)
        ors = torch.cat([nan.to(wide), f])
        red, out = collective(sh, KIND_AMP, p, False, torch.where(nan, identity, total), ors)
        g_total = torch.where(out[0] > 0, float("nan"), red[0])
        g_flag = out[1]
    else:
        pw = total.pow(p) if local else torch.zeros_like(total)  # no shard: adds nothing (also for p < 0)
        if poison is not None:
            pw = pw + poison
        red, out = collective(sh, KIND_AMP, p, False, pw, f)
        g_total = red[0].pow(1.0 / p)
        g_flag = out[0]
    return g_total.to(dtype), flag, g_flag.to(torch.float32)


# ------------------------------------------------------------------------------------- the step guard's flag
def reduced_exact(sh: Sharded, p: float, per_tensor: bool,
                  local_payload: Callable[[list[Tensor]], tuple[Tensor, Tensor | None]], width: int,
                  poison: Tensor | None = None, poison_at: int = 0) -> tuple[Tensor, Tensor | None]:
    """The exact norm's reduction (fastgrad.exact): integers summed exactly over every rank in the call's ONE
    collective (kind "exact" in the header, so a rank calling without exact=True mismatches).

    ``local_payload(local)``, given this rank's counted local tensors (never empty): ``(payload, rows)``, a vector
    of ``width`` integers below 2^32 (the sum over those tensors; float64 carries sums of < 2^21 ranks' exactly)
    and, with ``per_tensor``, one such row per tensor (else None). ``poison``
    (:func:`nonfinite_poison`): a NaN adds one at ``payload[poison_at]``, so a non-finite copy this rank holds
    but does not count still reaches every rank. Returns the reduced payload (int64) and, with ``per_tensor``,
    the ``(n, width)`` rows in input order, combined over the plan's vector steps (else None)."""
    dev, dtype = local_device_dtype(sh)
    sel, local = _counted(sh, dtype, dev)
    n = len(sh.reads)
    rows = None
    if len(local):
        payload, rows = local_payload(local)
        payload = payload.to(dev, torch.float64)
    else:
        payload = torch.zeros(width, dtype=torch.float64, device=dev)
    if per_tensor and sh.vsel is not None:  # the rows count more than the total (declared copies)
        sel, local = _counted(sh, dtype, dev, vec=True)
        rows = local_payload(local)[1] if len(local) else None
    if poison is not None:
        payload[poison_at] += torch.isnan(poison).to(payload.device, payload.dtype)
    red, _ = collective(sh, KIND_EXACT, p, per_tensor, payload, None)
    red = red.to(torch.int64)
    if not per_tensor:
        return red, None
    if rows is None:
        vals = torch.zeros((n, width), dtype=torch.int64, device=dev)
    else:  # (a float64 list's empty stand-in entry, past len(sel), dropped)
        vals = _place(rows[: len(sel)], sel, n, 0, rows)
    if sh.plan.vec_steps:
        vals = _combine(vals.to(torch.float64).reshape(-1), p, sh.plan.vec_steps).reshape(n, width)
        vals = vals.to(torch.int64)
    return red, vals


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
