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
from . import _scan
from . import distributed
from . import exact as exact_norm
from . import route
from .backends import BackendError, acc_dtype
from .decide import clip_coef, nonfinite
from .backends.torch_backend import combine_norms
# torch's own functions as captured at import: the fallbacks must not reach a patch_torch() router (recursion)
from ._torch_fns import TORCH as _torch_utils

__all__ = ["clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_", "clip_grad_value_", "multi_tensor_norm"]

_NONFINITE_MSG = (
    "The total norm of order {} for gradients from `parameters` is non-finite, so it cannot be clipped. "
    "To disable this error and scale the gradients by the non-finite norm anyway, set "
    "`error_if_nonfinite=False`"
)


def _torch_fallback_allowed(backend: str | None, fn: str) -> None:
    """Sparse and complex gradients go to torch.nn.utils itself; only an automatic or torch choice may."""
    name = inputs.requested_backend(backend)
    if name not in (None, "torch"):
        raise BackendError(
            f"fastgrad backend {name!r} cannot run {fn}: sparse, complex or non-standard floating gradients "
            "are handled only by torch's own implementation (backend='torch' or automatic choice)"
        )


def _norm(tensors: list[Tensor], norm_type: float, backend: str | None, foreach: bool | None,
          per_tensor: bool = False) -> tuple[Tensor, Tensor | None]:
    """Total norm (accumulation dtype, on the first tensor's device) and optionally per-tensor norms in
    input order. One backend call per device; devices combine through their totals."""
    groups = inputs.split_by_device(tensors)
    if len(groups) == 1:
        b = inputs.pick("norm", tensors, backend, norm_type=norm_type)
        return b.norm(tensors, norm_type, per_tensor=per_tensor, foreach=foreach)
    first = tensors[0].device
    dtype = acc_dtype(tensors)
    totals, pers = [], []
    for group in groups:
        b = inputs.pick("norm", group, backend, norm_type=norm_type)
        total, per = b.norm(group, norm_type, per_tensor=per_tensor, foreach=foreach)
        totals.append(total.to(first, dtype))
        if per_tensor:
            pers.append(per.to(first, dtype))
    total = combine_norms(torch.stack(totals), norm_type)
    per = None
    if per_tensor:
        per = inputs.restore_order(torch.cat(pers), inputs.group_by_device(tensors))
    return total, per


def _sharded_norm(tensors: list[Tensor], norm_type: float, backend: str | None, foreach: bool | None,
                  per_tensor: bool, process_group, sh: distributed.Sharded | None = None
                  ) -> tuple[Tensor, Tensor | None, distributed.Sharded]:
    """Global norm of DTensor or hand-sharded ``tensors``: local norms through the backends, one
    all-reduce (fastgrad.distributed). ``sh``: the list's local view when the caller already prepared it."""
    if sh is None:
        sh = distributed.prepare(tensors, process_group)
    total, per = distributed.reduced_norm(sh, norm_type, per_tensor,
                                lambda ts, per_t: _norm(ts, norm_type, backend, foreach, per_t))
    return total, per, sh


def _sharded_view(tensors: list[Tensor], process_group) -> distributed.Sharded | None:
    """The local view of a sharded list, or None when some tensor needs torch's own implementation (sparse,
    complex, other floating dtypes). The compiled scan of the local tensors validates the usual list in one
    C++ pass; only a list it declines pays the Python check (a DTensor's dtype and layout are its local
    tensor's, and reading them through the DTensor costs about a microsecond each)."""
    sh = distributed.prepare(tensors, process_group)
    if not sh.checked and inputs.check_tensors(tensors):
        _no_sharded_fallback(process_group)
        return None
    return sh


def _sharded_dtype(sh: distributed.Sharded, tensors: list[Tensor]) -> torch.dtype:
    """The promoted dtype of a sharded list, from the scan of its local tensors when there is one."""
    if sh.checked:
        return _scan.promoted_dtype_of(sh.writes)
    return inputs.promoted_dtype(tensors)


def _no_sharded_fallback(process_group) -> None:
    if process_group is not None:
        raise TypeError("process_group= supports dense real floating tensors only (no sparse or complex)")


def _check_finite(total: Tensor, norm_type: float) -> None:
    # The one host sync the contract allows (docs/contract.md section 3), and only when the caller asked for it.
    if nonfinite(total):
        raise RuntimeError(_NONFINITE_MSG.format(norm_type))


def _scale(grads: list[Tensor], coef: Tensor, backend: str | None, foreach: bool | None) -> None:
    for group in inputs.split_by_device(grads):
        b = inputs.pick("scale", group, backend)
        b.scale_(group, coef.to(group[0].device), foreach=foreach)


def _clip_one_backend(grads: list[Tensor], max_norm: float, norm_type: float, backend: str | None,
                      foreach: bool | None) -> Tensor | None:
    """Norm, coefficient and scale in one backend call (the ``clip_norm_`` primitive, which fused backends
    run without torch ops between their kernels) when the grads are on one device and the same backend
    serves the norm and the scale; else None (the caller composes the pieces)."""
    groups = inputs.split_by_device(grads)
    if len(groups) != 1:
        return None
    b = inputs.pick("norm", grads, backend, norm_type=norm_type)
    if inputs.pick("scale", grads, backend) is not b:
        return None
    return b.clip_norm_(grads, max_norm, norm_type, foreach=foreach)


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
    ex = exact_norm.applies(exact, p)
    if not tensors and process_group is None:
        return torch.tensor(0.0)
    sh = None
    if process_group is not None or distributed.has_dtensor(tensors):
        sh = _sharded_view(tensors, process_group)
    if sh is None and inputs.check_tensors(tensors, "tensors"):
        _no_sharded_fallback(process_group)
        if ex:
            exact_norm.reject_fallback()
        _torch_fallback_allowed(backend, "get_total_norm")
        return _torch_utils.get_total_norm(tensors, p, error_if_nonfinite, foreach)
    if sh is not None:
        if ex:  # rounded once, straight to the returned dtype
            (dg, fl), _ = exact_norm.reduced_digits(sh, p, backend)
            total = exact_norm.finish(dg, fl, p, _sharded_dtype(sh, tensors) if tensors else torch.float32)
        else:
            total, _, sh = _sharded_norm(tensors, p, backend, foreach, False, process_group, sh)
        if error_if_nonfinite:
            _check_finite(total, p)
        return distributed.wrap_like(total.to(_sharded_dtype(sh, tensors)) if tensors else total, sh)
    if ex:
        total = exact_norm.totals(tensors, p, backend, acc_dtype(tensors), inputs.promoted_dtype(tensors))[1]
    else:
        total, _ = _norm(tensors, p, backend, foreach)
    if error_if_nonfinite:
        _check_finite(total, p)
    return total.to(inputs.promoted_dtype(tensors))


@torch.no_grad()
def clip_grads_with_norm_(parameters, max_norm: float, total_norm: Tensor, foreach: bool | None = None,
                          *, backend: str | None = None) -> None:
    """Scale gradients by ``min(max_norm / (total_norm + 1e-6), 1)``, like
    ``torch.nn.utils.clip_grads_with_norm_``. The coefficient is computed on ``total_norm``'s device in
    float32 (float64 with float64 grads or norm); fused backends skip the write when it is 1."""
    params = inputs.as_list(parameters)
    max_norm = inputs.check_max_norm(max_norm)
    grads = inputs.grads_of(params)
    if not grads:
        return None
    if inputs.check_tensors(grads):
        _torch_fallback_allowed(backend, "clip_grads_with_norm_")
        return _torch_utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach)
    if type(total_norm) is not Tensor:
        total_norm = distributed.to_local_norm(total_norm)  # a DTensor norm becomes its replicated value
    if distributed.has_dtensor(grads):
        grads = distributed.prepare(grads, for_norm=False).writes  # scaling the local shards is the whole job
    if not isinstance(total_norm, Tensor):
        total_norm = torch.tensor(float(total_norm), device=grads[0].device)
    dtype = torch.float64 if total_norm.dtype == torch.float64 else acc_dtype(grads)
    coef = clip_coef(total_norm.to(dtype), max_norm)
    _scale(grads, coef, backend, foreach)
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
    ex = exact_norm.applies(exact, p) if exact else False
    plan = route.lookup(params, process_group)
    if process_group is None and not ex and plan.route in _MAY_BE_CPU:
        # the cpu route: norm, coefficient and scale in one C++ call, which checks every grad itself (before
        # no_grad: that call records nothing for autograd, and entering no_grad costs ~2.5 us, a tenth of the
        # whole call on a 148-tensor model)
        fast = _scan.clip_norm_cpu(params, max_norm, p, error_if_nonfinite, backend)
        if fast is not None:
            plan.route = "cpu"
            if fast[1]:
                raise RuntimeError(_NONFINITE_MSG.format(p))
            return fast[0]
    with torch.no_grad():
        if plan.route == "sharded-cpu" and not ex:
            total = _sharded_cpu_clip(params, plan, max_norm, p, error_if_nonfinite, backend)
            if total is not None:
                return total
        return _clip_general(params, plan, max_norm, p, error_if_nonfinite, foreach, backend, process_group, ex)


_MAY_BE_CPU = (None, "cpu", "plain")  # a plain list may have moved to the CPU: the C++ call tells


def _grads_once(params: list) -> list[Tensor]:
    """``inputs.grads_of``'s Python path, reading each ``.grad`` once."""
    out = []
    try:
        for prm in params:
            g = prm.grad
            if g is not None:
                out.append(g)
    except AttributeError:
        inputs.reject_non_tensors(params)  # names the bad item and the fix
        raise
    return out


def _sharded_cpu_clip(params: list, plan: route.ListPlan, max_norm: float, p: float, error_if_nonfinite: bool,
                      backend: str | None) -> Tensor | None:
    """The sharded-cpu route: the sharded clip below for DTensor grads with CPU local shards on the cpu backend,
    its per-tensor part in one C++ pass (fastgrad.distributed.local_cpu_norm: grads, specs, local tensors, local
    norm, checked against the plan's layout) and one more for the scale, the same collective and coefficient in
    between: the same bits. None when the list no longer fits the layout (nothing done)."""
    fast = distributed.local_cpu_norm(params, plan.layout, p, backend)
    if fast is None:
        return None
    sh, local_total, handle = fast
    total, _ = distributed.reduced_norm(sh, p, False, None, local_total=local_total)
    if error_if_nonfinite:
        _check_finite(total, p)  # the same value on every rank: all of them raise, none writes
    distributed.scale_local_cpu(handle, clip_coef(total, max_norm))
    return distributed.wrap_like(total.to(_scan.promoted_dtype_of(sh.writes)), sh)


def _clip_general(params: list, plan: route.ListPlan, max_norm: float, p: float, error_if_nonfinite: bool,
                  foreach: bool | None, backend: str | None, process_group, ex: bool = False) -> Tensor:
    """clip_grad_norm_ after its arguments are checked, by the plain, sharded and torch routes; records in
    ``plan`` the route the list took."""
    grads = _scan.grads_of(params)
    if grads is None:  # not plain tensors: DTensor parameters' grads without torch-function handling, else Python
        grads = distributed.dtensor_grads(params)
        if grads is None:
            grads = _grads_once(params)
    if not grads and process_group is None:
        return torch.tensor(0.0)
    sh = None
    if process_group is not None or distributed.has_dtensor(grads):
        sh = _sharded_view(grads, process_group)
        if sh is not None:
            plan.layout = sh.layout  # (the sharded-cpu route's input; for the repr, the collectives)
            plan.route = "sharded-cpu" if distributed.takes_cpu_pass(sh, process_group) else "sharded"
    if sh is None and inputs.check_tensors(grads):
        _no_sharded_fallback(process_group)
        if ex:
            exact_norm.reject_fallback()
        _torch_fallback_allowed(backend, "clip_grad_norm_")
        plan.route = "torch"
        return _torch_utils.clip_grad_norm_(params, max_norm, p, error_if_nonfinite, foreach)
    if sh is not None:
        return _clip_sharded(sh, grads, max_norm, p, error_if_nonfinite, foreach, backend, process_group, ex)
    plan.route = "plain"
    if ex:
        total, out = _exact_totals(grads, p, backend)
        if error_if_nonfinite:
            _check_finite(total, p)
        _scale(grads, clip_coef(total, max_norm), backend, foreach)
        return out
    total = None if error_if_nonfinite else _clip_one_backend(grads, max_norm, p, backend, foreach)
    if total is None:
        total, _ = _norm(grads, p, backend, foreach)
        if error_if_nonfinite:
            _check_finite(total, p)
        coef = clip_coef(total, max_norm)
        _scale(grads, coef, backend, foreach)
    return total.to(inputs.promoted_dtype(grads))


def _exact_totals(grads: list[Tensor], p: float, backend: str | None, sh: distributed.Sharded | None = None
                  ) -> tuple[Tensor, Tensor]:
    """The exact norm (fastgrad.exact) of ``grads``, or over every rank of the sharded view ``sh`` (one
    all-reduce): ``(total in the accumulation dtype, for the coefficient; the value returned, rounded once to the
    grads' dtype)``."""
    if sh is not None:
        return exact_norm.sharded_totals(sh, p, backend, _sharded_dtype(sh, grads) if grads else None)
    return exact_norm.totals(grads, p, backend, acc_dtype(grads), inputs.promoted_dtype(grads))


def _clip_sharded(sh: distributed.Sharded, grads: list[Tensor], max_norm: float, p: float, error_if_nonfinite: bool,
                  foreach: bool | None, backend: str | None, process_group, ex: bool) -> Tensor:
    """The sharded route: the global norm from the local shards (one collective), the coefficient, the scale of
    the local shards."""
    if ex:  # coefficient from the exact norm in the accumulation dtype; returned rounded once to the grads'
        total, out = _exact_totals(grads, p, backend, sh)
    else:
        total, _, sh = _sharded_norm(grads, p, backend, foreach, False, process_group, sh)
        out = total.to(_sharded_dtype(sh, grads)) if grads else total
    if error_if_nonfinite:
        _check_finite(total, p)  # the same value on every rank: all of them raise, none writes
    if sh.writes:
        _scale(sh.writes, clip_coef(total, max_norm), backend, foreach)
    return distributed.wrap_like(out, sh)


@torch.no_grad()
def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None, *,
                     backend: str | None = None) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` in place, like
    ``torch.nn.utils.clip_grad_value_``, in one read+write pass (torch makes two). NaN stays NaN."""
    params = inputs.as_list(parameters)
    clip_value = inputs.check_clip_value(clip_value)
    grads = inputs.grads_of(params)
    if not grads:
        return None
    if inputs.check_tensors(grads):
        _torch_fallback_allowed(backend, "clip_grad_value_")
        return _torch_utils.clip_grad_value_(params, clip_value, foreach)
    if distributed.has_dtensor(grads):
        if any(pl.is_partial() for g in grads for pl in getattr(g, "placements", ())):
            # clamping is not linear: a Partial term cannot be clamped locally; torch redistributes
            _torch_fallback_allowed(backend, "clip_grad_value_ on Partial DTensor gradients")
            return _torch_utils.clip_grad_value_(params, clip_value, foreach)
        grads = distributed.prepare(grads, for_norm=False).writes
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
    ex = exact_norm.applies(exact, p)
    if not tensors and process_group is None:
        total = torch.tensor(0.0)
        return (total, torch.zeros(0)) if per_tensor else total
    if process_group is not None or distributed.has_dtensor(tensors):
        sh = distributed.prepare(tensors, process_group)
        if not sh.checked:
            inputs.check_tensors(tensors, "tensors", allow_fallback=False)
        if ex:
            total, per = exact_norm.acc_norms(tensors, p, backend, per_tensor, sh)
        else:
            total, per, sh = _sharded_norm(tensors, p, backend, None, per_tensor, process_group, sh)
        total = distributed.wrap_like(total, sh)
        return (total, distributed.wrap_like(per, sh)) if per_tensor else total
    inputs.check_tensors(tensors, "tensors", allow_fallback=False)
    if ex:
        total, per = exact_norm.acc_norms(tensors, p, backend, per_tensor)
    else:
        total, per = _norm(tensors, p, backend, None, per_tensor)
    return (total, per) if per_tensor else total
