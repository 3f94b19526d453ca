"""Norms and clipping: drop-ins for ``torch.nn.utils.clip_grad_norm_``, ``get_total_norm``,
``clip_grads_with_norm_`` and ``clip_grad_value_``, plus ``multi_tensor_norm``.

Public entry points only; the kernels are the backends' ``norm``, ``clip_norm_``, ``scale_`` and ``clip_value_``
primitives (``fastgrad/backends/``). Semantics: docs/contract.md section 3. Differences from torch, all deliberate:

* per-tensor norms are accumulated in float32 (float64 for float64) whatever the gradient dtype, and the
  clip coefficient is computed from that fp32 norm on the device (torch rounds both to the grad dtype);
* the fused backends skip the scale pass entirely (no memory traffic) when the coefficient is 1;
* a NaN or negative ``max_norm``/``clip_value`` or a NaN ``norm_type`` raises ValueError (torch silently
  turns the gradients into NaN or flips their sign);
* the infinity norm of a zero-size gradient is 0 (torch raises).

Sharded gradients (``fastgrad.distributed``, docs/distributed.md): DTensor grads on any number of meshes
(FSDP2, TP, HSDP, expert parallel), plain tensors among them, and pipeline stages (``process_group=``) are
reduced from their local shards to one global norm, the same on every rank, with one all-reduce for the usual
layouts, and clipped in place; the result is a ``Replicate()`` DTensor when all grads are DTensors on one
mesh (as torch), else a plain tensor. Plain tensors spread over ranks take ``process_group=`` (each rank its
own tensors, e.g. a pipeline stage) or ``process_group=fastgrad.distributed.Shards(group)`` (pieces of the
same tensors, ZeRO style; per-tensor results then describe the whole tensors). Ranks that disagree raise
``fastgrad.distributed.RankMismatchError`` on every rank. Plain single-process calls pay one type check.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _inputs as inputs
from . import distributed
from . import passes
from . import route
from .backends import acc_dtype
from .decide import clip_coef
# torch's own functions as captured at import: the fallbacks must not reach a patch_torch() router (recursion)
from ._torch_fns import TORCH as _torch_utils

__all__ = ["clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_", "clip_grad_value_", "multi_tensor_norm"]


@torch.no_grad()
def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: bool | None = None, *, backend: str | None = None, process_group=None,
                   exact: bool = False) -> Tensor:
    """Norm of the per-tensor norms of ``tensors``, like ``torch.nn.utils.get_total_norm``.

    Returns a 0-dim tensor on the first tensor's device in the promoted dtype of the tensors
    (``torch.tensor(0.0)`` on the CPU for an empty list, with no kernel launched). DTensor input gives a
    ``Replicate()`` DTensor; ``process_group=`` (or ``fastgrad.distributed.Shards(group)``): ``tensors`` are
    this rank's part and the result is the norm over every rank's (a collective: every rank of the group must
    call). ``exact=True`` (p = 1, 2, inf): the exact norm of all values correctly rounded to that dtype, the
    same bits whatever the backend, order, grouping, ranks or layout (fastgrad.exact).
    """
    tensors = inputs.checked(inputs.as_list(tensors))
    p = inputs.check_norm_type(norm_type)
    ex = inputs.check_exact(exact, p)
    if not tensors and process_group is None:
        return torch.tensor(0.0)
    plan = route.plan_for(tensors, process_group)
    sh = plan.place(tensors, "tensors")
    if plan.route == "torch":
        plan.refuse_fallback("get_total_norm", backend, ex)
        return _torch_utils.get_total_norm(tensors, p, error_if_nonfinite, foreach)
    dtype = inputs.out_dtype(tensors, None if sh is None else sh.writes)
    total, out = route.total_norm(sh, tensors, p, backend, foreach, ex, dtype)
    if error_if_nonfinite:
        inputs.check_finite(out if ex else total, p)  # (exact: the value returned, rounded once)
    return out if sh is None else distributed.wrap_like(out, sh)


@torch.no_grad()
def clip_grads_with_norm_(parameters, max_norm: float, total_norm: Tensor, foreach: bool | None = None,
                          *, backend: str | None = None) -> None:
    """Scale gradients by ``min(max_norm / (total_norm + 1e-6), 1)``, like
    ``torch.nn.utils.clip_grads_with_norm_``. The coefficient is computed on ``total_norm``'s device in
    float32 (float64 with float64 grads or norm); fused backends skip the write when it is 1."""
    params = inputs.as_list(parameters)
    max_norm = inputs.check_max_norm(max_norm)
    grads = passes.grads_of(params)
    if not grads:
        return None
    plan = route.lookup(params, None)
    sh = plan.place(grads, for_norm=False)  # scaling the local shards is the whole job
    if plan.route == "torch":
        plan.refuse_fallback("clip_grads_with_norm_", backend)
        return _torch_utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach)
    if sh is not None:
        grads = sh.writes
    if type(total_norm) is not Tensor:
        total_norm = distributed.to_local_norm(total_norm)  # a DTensor norm becomes its replicated value
    if not isinstance(total_norm, Tensor):
        total_norm = torch.tensor(float(total_norm), device=grads[0].device)
    dtype = torch.float64 if total_norm.dtype == torch.float64 else acc_dtype(grads)
    passes.scale_(grads, clip_coef(total_norm.to(dtype), max_norm), backend, foreach)
    return None


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, *, backend: str | None = None, process_group=None,
                    exact: bool = False) -> Tensor:
    """Clip the gradients' total norm in place, like ``torch.nn.utils.clip_grad_norm_``; returns the total
    norm before clipping (0-dim, first grad's device, promoted grad dtype).

    One read pass for the norm, then a scale pass that fused backends skip on the device when no clipping
    is needed. No host sync unless ``error_if_nonfinite=True`` (which checks before anything is written).
    DTensor grads on any meshes (FSDP2, TP, HSDP, EP), mixed with plain ones: one all-reduce for the usual
    layouts, local shards clipped, a ``Replicate()`` DTensor returned when all are on one mesh.
    ``process_group=``: plain grads are this rank's own (a stage; ``Shards(group)``: pieces of the same
    tensors); with DTensors, the group that connects pipeline stages (or the world). Every rank of the group
    must call (see fastgrad.distributed). ``exact=True`` (p = 1, 2, inf): the correctly rounded norm
    (fastgrad.exact) is returned and the coefficient computed from it (so shards clip as slices of the whole).
    The route a list takes is planned once and cached (``fastgrad.route.plan_of(params)`` shows it).
    """
    # A list is used as given (read only): copying 4,000 entries is a few percent of the whole call.
    params = parameters if type(parameters) is list else inputs.as_list(parameters, warn_empty_generator=True)
    max_norm = inputs.check_max_norm(max_norm)
    p = inputs.check_norm_type(norm_type)
    ex = inputs.check_exact(exact, p) if exact else False
    return route.clip_params(params, max_norm, p, error_if_nonfinite, foreach, backend, ex, process_group)


@torch.no_grad()
def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None, *,
                     backend: str | None = None) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` in place, like
    ``torch.nn.utils.clip_grad_value_``, in one read+write pass (torch makes two). NaN stays NaN."""
    params = inputs.as_list(parameters)
    clip_value = inputs.check_clip_value(clip_value)
    grads = passes.grads_of(params)
    if not grads:
        return None
    plan = route.lookup(params, None)
    sh = plan.place(grads, for_norm=False)
    if plan.route == "torch":
        plan.refuse_fallback("clip_grad_value_", backend)
        return _torch_utils.clip_grad_value_(params, clip_value, foreach)
    if sh is not None:
        if any(pl.is_partial() for g in grads for pl in getattr(g, "placements", ())):
            # clamping is not linear: a Partial term cannot be clamped locally; torch redistributes
            plan.refuse_fallback("clip_grad_value_ on Partial DTensor gradients", backend)
            return _torch_utils.clip_grad_value_(params, clip_value, foreach)
        grads = sh.writes
    for group in inputs.split_by_device(grads):
        b = inputs.pick("clip_value", group, backend)
        b.clip_value_(group, clip_value, foreach=foreach)
    return None


@torch.no_grad()
def multi_tensor_norm(tensors, norm_type: float = 2.0, *, per_tensor: bool = False,
                      backend: str | None = None, process_group=None, exact: bool = False):
    """Total p-norm of a list of tensors in float32 (float64 if any tensor is float64), on the first
    tensor's device; with ``per_tensor=True`` returns ``(total, per_tensor_norms)``, the latter a 1-D tensor
    in input order. Unlike get_total_norm the result keeps the accumulation dtype. Dense real floating
    tensors only.

    DTensor input: both results are ``Replicate()`` DTensors (norms of the whole tensors). Plain tensors
    with ``process_group=G``: each rank holds its own tensors (a pipeline stage): the per-tensor norms are
    this rank's own tensors', the total is over every rank of ``G``. ``process_group=
    fastgrad.distributed.Shards(G)``: tensor i on every rank of ``G`` is a piece of one tensor (ZeRO-style
    hand sharding): the per-tensor norms are the whole tensors', and the ranks' lists must match.
    ``exact=True`` (p = 1, 2, inf): both results correctly rounded from the exact norms (fastgrad.exact)."""
    tensors = inputs.checked(inputs.as_list(tensors))
    p = inputs.check_norm_type(norm_type)
    ex = inputs.check_exact(exact, p)
    if not tensors and process_group is None:
        total = torch.tensor(0.0)
        return (total, torch.zeros(0)) if per_tensor else total
    plan = route.plan_for(tensors, process_group)
    sh = plan.place(tensors, "tensors")
    if plan.route == "torch":  # never torch's implementation: name what it cannot take
        inputs.check_tensors(tensors, "tensors", allow_fallback=False)
        raise TypeError("multi_tensor_norm takes float16, bfloat16, float32 and float64 tensors only")
    total, per = route.norms(sh, tensors, p, backend, ex, per_tensor)
    if sh is not None:
        total = distributed.wrap_like(total, sh)
        per = None if per is None else distributed.wrap_like(per, sh)
    return (total, per) if per_tensor else total
