"""The passes over a list of gradients that the public ops share: reading the gradients of a parameter list, the
norms of a list on any devices (one backend call per device, devices combined through their totals), AMP's
read pass, ``unscale_``'s own pass, and the writes.

A pass reads or writes; it decides nothing. What the values decide (a coefficient, a factor, a verdict) is
``fastgrad.decide``'s; which passes a list takes (sharded or not, exact or not, one fused call or these) is
``fastgrad.route``'s.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from . import _inputs as inputs
from . import _scan
from . import distributed
from .backends import acc_dtype
from .backends.torch_backend import combine_norms


def grads_of(params: list) -> list[Tensor]:
    """The gradients of ``params`` that exist: a :class:`fastgrad._scan.Checked` list from one C++ pass for plain
    tensors, DTensor parameters' gradients read without torch-function handling, else Python reading each
    ``.grad`` once."""
    grads = _scan.grads_of(params)
    if grads is None:
        grads = distributed.dtensor_grads(params)
    if grads is not None:
        return grads
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


# ------------------------------------------------------------------------------------------------ norms
def list_norm(tensors: list[Tensor], norm_type: float, backend: str | None, foreach: bool | None = None,
              per_tensor: bool = False) -> tuple[Tensor, Tensor | None]:
    """The total norm of ``tensors`` (accumulation dtype, on the first tensor's device) and, with ``per_tensor``,
    each tensor's in input order. One backend call per device; devices combine through their totals."""
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


def sharded_norm(sh: distributed.Sharded, norm_type: float, backend: str | None, foreach: bool | None = None,
                 per_tensor: bool = False, poison: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`list_norm` over every rank of the sharded view ``sh``: the local norms through the backends, one
    collective (``fastgrad.distributed.reduced_norm``, which also takes ``poison``)."""
    return distributed.reduced_norm(
        sh, norm_type, per_tensor, lambda ts, per_t: list_norm(ts, norm_type, backend, foreach, per_t), poison)


def amp_norms(groups: list[list[Tensor]], inv_scale: Tensor, norm_type: float, backend: str | None
              ) -> list[tuple[Tensor, Tensor]]:
    """AMP's read pass: per device group, ``(total of the unscaled values, found_inf)`` on that device. The
    backends of this pass and of the write pass are chosen first, so a backend that cannot serve the call raises
    before anything is read or written."""
    amp = [inputs.pick("amp_norm", g, backend, norm_type=norm_type) for g in groups]
    for g in groups:
        inputs.pick("scale", g, backend)
    return [b.amp_norm(g, inv_scale.to(g[0].device, non_blocking=True), norm_type) for b, g in zip(amp, groups)]


def combine_totals(totals: list[Tensor], norm_type: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The total norm over devices from per-device totals, on ``device`` in ``dtype``."""
    if len(totals) == 1:
        return totals[0].to(device, dtype)
    return combine_norms(torch.stack([t.to(device, dtype) for t in totals]), norm_type)


def amp_total(groups: list[list[Tensor]], inv_scale: Tensor, norm_type: float, backend: str | None, flag_shape,
              dtype: torch.dtype) -> tuple[Tensor, dict]:
    """AMP's read pass over a list grouped by device: the total norm of the unscaled values over every device (on
    the first, in the accumulation ``dtype``) and the overflow flags by device, in ``flag_shape``."""
    parts = amp_norms(groups, inv_scale, norm_type, backend)
    total = combine_totals([t for t, _ in parts], norm_type, groups[0][0].device, dtype)
    return total, {g[0].device: f.reshape(flag_shape) for g, (_, f) in zip(groups, parts)}


def local_amp(inv_scale: Tensor, norm_type: float, backend: str | None
              ) -> Callable[[list[Tensor]], tuple[Tensor, Tensor]]:
    """AMP's read pass over one rank's local tensors, as ``fastgrad.distributed.reduced_amp_norm`` takes it:
    ``tensors -> (their total, found_inf 0/1)``."""
    def read(tensors: list[Tensor]) -> tuple[Tensor, Tensor]:
        dev = tensors[0].device
        parts = amp_norms(inputs.split_by_device(tensors), inv_scale, norm_type, backend)
        total = combine_totals([t for t, _ in parts], norm_type, dev, acc_dtype(tensors))
        return total, torch.stack([f.to(dev).reshape(()) for _, f in parts]).amax()
    return read


# ------------------------------------------------------------------------------------------------ writes
def scale_(tensors: list[Tensor], factor: Tensor, backend: str | None, foreach: bool | None = None) -> None:
    """Multiply every tensor by ``factor`` (a 0-dim tensor) in place, one backend call per device (skipped on
    the device by the fused backends when the factor is 1)."""
    scale_groups(inputs.split_by_device(tensors), factor, backend, foreach)


def scale_groups(groups: list[list[Tensor]], factor: Tensor, backend: str | None, foreach: bool | None = None
                 ) -> None:
    """:func:`scale_` of tensors already grouped by device."""
    for g in groups:
        b = inputs.pick("scale", g, backend)
        b.scale_(g, factor.to(g[0].device, non_blocking=True), foreach=foreach)


def unscale_first(groups: list[list[Tensor]], inv_scale: Tensor, flag_shape=()) -> dict:
    """``unscale_``'s own pass per device group: the overflow flag read from the SCALED values, the gradients
    multiplied by ``inv_scale`` in place. Returns the flags by device."""
    found = {}
    for g in groups:
        dev = g[0].device
        f = torch.zeros(flag_shape, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(g, f, inv_scale.to(dev, non_blocking=True))
        found[dev] = f
    return found
