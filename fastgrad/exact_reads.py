"""The readings of the exact norm (``exact=True``): how a list's correctly rounded norms are read, on one process
or over every rank of a sharded list, from the arithmetic of ``fastgrad.exact``.

Each device's part comes from the backend that ``backend=`` selects for its norm (the compiled kernel on the cpu
backend, else the torch reference: the same digits); a sharded list's digits travel in the call's one collective
(``fastgrad.distributed.reduced_exact``). The readings, each rounded once from one exact sum:

* :func:`totals`: a list's total in two dtypes (the accumulation dtype, for a coefficient, and the dtype
  returned), on one process or over every rank;
* :func:`acc_norms`: the total and the per-tensor norms in the accumulation dtype, plain or sharded;
* :func:`grad_stats_total`: ``grad_stats(..., exact=True)``'s total.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _inputs as inputs
from . import distributed
from . import exact
from .backends import acc_dtype

__all__ = ["refuse_fallback", "local_digits", "reduced_digits", "totals", "acc_norms",
           "grad_stats_total"]


def refuse_fallback() -> None:
    """``exact=True`` on a list that only torch's own implementation could serve."""
    raise TypeError("exact=True supports dense real floating tensors (float16, bfloat16, float32, float64) only")


def local_digits(tensors, p: float, backend: str | None, per_tensor: bool = False) -> tuple[Tensor, Tensor]:
    """Digits and flags of a plain list on any devices (rows per tensor in input order when ``per_tensor``,
    else one row), on the first tensor's device."""
    groups, parts, compiled = _parts(tensors, p, backend)
    dg, fl = exact.parts_digits(parts, p, per_tensor, compiled, tensors[0].device)
    if per_tensor and len(groups) > 1:
        return inputs.restore_order(dg, groups), inputs.restore_order(fl, groups)
    return dg, fl


def _parts(tensors, p: float, backend: str | None) -> tuple[dict, list, list[bool]]:
    """A plain list by device: the groups' indices, their tensors, and whether the backend ``backend=`` selects for
    each group's norm is the cpu backend (whose compiled kernel builds the digits; else the torch reference)."""
    groups = inputs.group_by_device(tensors)
    parts = [[tensors[i] for i in idx] for idx in groups.values()] if len(groups) > 1 else [tensors]
    return groups, parts, [inputs.pick("norm", part, backend, norm_type=p).name == "cpu" for part in parts]


def reduced_digits(sh: distributed.Sharded, p: float, backend: str | None, per_tensor: bool = False,
                   poison: Tensor | None = None):
    """The whole list's digits and flags over every rank of a sharded list (``fastgrad.distributed.prepare``),
    the same on every rank: this rank's counted shards' digits travel, as float64 integers below 2^32, in the
    one SUM all-reduce that carries the agreement header (sums of < 2^21 ranks' digits are exact). With
    ``per_tensor``: also ``(digits, flags)`` per tensor in input order (whole tensors where shards combine, one
    more collective, as the default path; a pipeline stage's own tensors otherwise). ``poison``
    (``fastgrad.distributed.nonfinite_poison``): NaN counts as one NaN value in the same payload, so a
    non-finite copy this rank holds but does not count makes the total NaN on every rank."""
    nl = exact.window(p)[1]

    def payload(local):
        dg, fl = local_digits(local, p, backend, per_tensor)
        rows = None
        if per_tensor:
            rows = torch.cat([dg, fl], dim=1)
            dg, fl = exact.total_digits(dg, fl)
        else:
            dg, fl = dg[0], fl[0]
        return torch.cat([dg, fl]), rows

    red, vals = distributed.reduced_exact(sh, p, per_tensor, payload, nl + 2, poison, nl)
    total = (exact.normalize(red[:nl]), red[nl:])
    if vals is None:
        return total, None
    return total, (exact.normalize(vals[:, :nl]), vals[:, nl:])


def totals(sh: distributed.Sharded | None, tensors, p: float, backend: str | None, out: torch.dtype | None = None
           ) -> tuple[Tensor, Tensor]:
    """The whole list's correctly rounded norm in its accumulation dtype (for a coefficient) and in ``out`` (the
    value returned; None: the same tensor): one sum, two roundings. ``sh``: over every rank of that sharded view
    (one all-reduce, :func:`reduced_digits`). A plain list of CPU tensors on the cpu backend: the compiled
    ``exact.compiled_total``, which most often decides without building the digits."""
    if sh is None:
        acc = acc_dtype(tensors)
        _, parts, compiled = _parts(tensors, p, backend)
        if compiled == [True] and exact.compiled_ok(tensors):
            both = exact.compiled_total(tensors, p, acc, out or acc)
            if both is not None:
                return both
        dg, fl = exact.parts_digits(parts, p, False, compiled, tensors[0].device)
        return exact.two_roundings(dg[0], fl[0], p, acc, out)
    (dg, fl), _ = reduced_digits(sh, p, backend)
    return exact.two_roundings(dg, fl, p, distributed.local_device_dtype(sh)[1], out)


def acc_norms(tensors, p: float, backend: str | None, per_tensor: bool, sh: distributed.Sharded | None = None,
              poison: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The exact total and, with ``per_tensor``, per-tensor norms of ``tensors`` (or over every rank of the
    sharded view ``sh``: one all-reduce, ``poison`` as :func:`reduced_digits`), each correctly rounded to the
    accumulation dtype; per-tensor None without ``per_tensor``."""
    if sh is not None:
        (dg, fl), rows = reduced_digits(sh, p, backend, per_tensor, poison)
        dtype = distributed.local_device_dtype(sh)[1]
        return exact.finish(dg, fl, p, dtype), rows and exact.finish(*rows, p, dtype)
    dtype = acc_dtype(tensors)
    if not per_tensor:  # (on the cpu backend, the compiled kernel's bound decides most)
        return totals(None, tensors, p, backend)[0], None
    dg, fl = local_digits(tensors, p, backend, True)
    return exact.finish(*exact.total_digits(dg, fl), p, dtype), exact.finish(dg, fl, p, dtype)


def grad_stats_total(grads, backend: str | None, sh: distributed.Sharded | None, like: Tensor) -> Tensor:
    """``grad_stats(..., exact=True)``'s ``total_norm``: the exact L2 norm of ``grads`` (or over every rank of the
    sharded view ``sh``), in ``like``'s dtype and on its device (the default total it replaces)."""
    if sh is not None:
        (dg, fl), _ = reduced_digits(sh, 2.0, backend)
        return exact.finish(dg, fl, 2.0, like.dtype).to(like.device)
    if not grads:
        return like
    return totals(None, grads, 2.0, backend, like.dtype)[1].to(like.device)
