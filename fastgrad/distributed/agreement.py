"""A sharded call's ONE collective (``collective``: the payload, the flags to OR and the agreement header in one
buffer) and the header itself: what tells every rank, from the reduced buffer alone, whether all the ranks
made the same call on the same list (see fastgrad.distributed's docstring, "Agreement between ranks"), and
the error raised alike on every rank when they did not."""

from __future__ import annotations

import torch
from torch import Tensor

_INF = float("inf")
PENDING: list = []  # CUDA verdicts not read yet: (event, pinned host copy, whose last flag is the copies')
_SUM, _MAX, _MIN = 0, 1, 2


class RankMismatchError(RuntimeError):
    """The ranks of one sharded call disagree (different calls, lists of different lengths, shapes or
    dtypes where they must be the same). Raised with the same text on every rank taking part, before any
    gradient is written."""


def _op_of(p: float) -> int:
    return _MAX if p == _INF else _MIN if p == -_INF else _SUM


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


def _mismatch_text(bad: list[int], copies_at: int | None = None) -> str:
    """The error text from the reduced header alone, so every rank raises the same one (``copies_at``: the
    position of the declared copies' flag, after the groups)."""
    parts = []
    for g in bad:
        if g == copies_at:
            parts.append("the ranks declared different copies (Copies): every rank of a tensor's ranks must declare "
                         "it, with the same ranks, and hold it (a gradient, of the same shape and dtype)")
        elif g == 0:
            parts.append("the ranks made different calls (a different function, norm_type, per_tensor, or kind of "
                         "process_group/layout); every rank taking part must make the same call")
        elif g == 1:
            parts.append("the ranks' gradient lists differ (length, order, shapes or dtypes) where every rank "
                         "must hold the same list (the same parameters, with a gradient on the same ones)")
        else:
            parts.append(f"the ranks of pipeline stage {g - 2} (in process_group order) hold different lists "
                         "(length, order, shapes or dtypes); every rank of a stage must pass the same parameters")
    return "sharded gradient norm: " + "; ".join(parts) + " (nothing was written)"


def _settle(bad: Tensor, blocking: bool, copies: bool = False) -> None:
    """Raise RankMismatchError when a header group disagrees (``copies``: the last flag of ``bad`` is the declared
    copies' check). On the CPU (gloo) the verdict is read now; on a device it is read now only when ``blocking``
    (a vector collective is about to depend on it), else copied to pinned memory and read, without waiting, by
    the next sharded call."""
    at = len(bad) - 1 if copies else None
    if bad.device.type == "cpu" or blocking:
        idx = bad.nonzero().flatten().tolist() if bool(bad.any()) else []
        if idx:
            raise RankMismatchError(_mismatch_text(idx, at))
        return
    host = torch.empty(bad.shape, dtype=torch.bool, pin_memory=True)
    host.copy_(bad, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    PENDING.append((ev, host, at))


def raise_pending() -> None:
    """Verdicts of earlier device calls whose copy has landed (never waits for one that has not)."""
    done = [item for item in PENDING if item[0].query()]
    for item in done:
        PENDING.remove(item)
    for _, host, at in done:
        idx = host.nonzero().flatten().tolist()
        if idx:
            raise RankMismatchError(_mismatch_text(idx, at) + " [detected by the previous sharded call]")


def _signature(kind: int, p: float, vector: bool, plan) -> int:
    """The call's part of the header: what every rank of one call must agree on (``plan``: its ReducePlan)."""
    return hash((kind, p, vector, plan.staged, plan.pieces, plan.slots)) & 0xFFFF


# the kinds of call (the signature's first field; KIND_EXACT: fastgrad.exact's digits, so a rank calling
# without exact=True mismatches)
KIND_NORM, KIND_AMP, KIND_STATS, KIND_EXACT = 1, 2, 3, 4


def all_reduce_steps(t: Tensor, op, steps: list) -> None:
    import torch.distributed as dist

    for g in steps:
        dist.all_reduce(t, op=op, group=g)


def _reduce_op(op: int):
    import torch.distributed as dist

    return (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)[op]


def collective(sh, kind: int, p: float, vector: bool, payload: Tensor, ors: Tensor | None
             ) -> tuple[Tensor, Tensor | None]:
    """THE collective of a call: ``payload`` (already in its reduction's form: p-th power sums, a max/min with
    its identity where this rank adds nothing), ``ors`` (0/1 flags to OR over the ranks) and the agreement
    header, in one buffer, over the plan's steps. Returns the reduced payload and flags; raises
    RankMismatchError (on every rank alike) when the header disagrees."""
    plan = sh.plan
    op = _op_of(p) if kind != KIND_STATS else _SUM
    wide = payload.dtype
    n = len(sh.reads)
    groups: list = [(_signature(kind, p, vector, plan), 0), None if plan.staged else (n & 0xFFFF, sh.fp)]
    if plan.slots:
        slots: list = [None] * plan.slots
        if plan.slot is not None:
            slots[plan.slot] = (n & 0xFFFF, sh.fp)
        groups += slots
    check = wide == torch.float64
    # SUM calls also carry the declared copies' checksum (0 when every copy's ranks declared it alike: see
    # fastgrad.distributed.plan.narrow_copies); a max cannot add one up, so inf norms go unchecked there
    copies = check and op == _SUM
    head = (torch.tensor(_header(op, groups) + ([float(sh.copies_sum)] if copies else []), dtype=wide) if check
            else payload.new_zeros(0))
    parts = [payload]
    k = 0
    if ors is not None:
        k = ors.numel()
        parts.append(-ors if op == _MIN else ors)
    parts.append(head.to(payload.device, non_blocking=True))
    buf = torch.cat(parts)
    all_reduce_steps(buf, _reduce_op(op), plan.steps)
    m = payload.numel()
    out_ors = None
    if ors is not None:
        r = buf[m:m + k]
        out_ors = ((-r if op == _MIN else r) > 0).to(ors.dtype)
    if check:
        head = buf[m + k:]
        bad = _bad_groups(head[:-1] if copies else head, op)
        if copies:
            bad = torch.cat([bad, head[-1:] != 0])
        _settle(bad, blocking=vector and bool(plan.vec_steps), copies=copies)
    return buf[:m], out_ors
