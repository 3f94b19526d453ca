"""The guard's read passes: the norm (per tensor for AdaGC) of the gradients, the mode's rule, and the
write or the zero-write hand-over, each in as few backend calls as the layout allows.

* :func:`cpu_write`: a ``kernel_clip`` mode (its coefficient is clip_grad_norm_'s at max_norm), gradients
  written, plain CPU tensors: clip_grad_norm_'s own one-call C++ clip with its finiteness check.
* :func:`one_call`: a ``kernel_clip`` mode on one device: the read pass, the non-finite flag, the coefficient
  and the write in ONE backend call (the fused AMP primitive).
* :func:`general`: every mode, any layout (sharded, GradScaler, per-tensor norms), through clip.py's
  dispatch and the mode's rule in device ops; with ``exact=True`` the norms from fastgrad.exact instead
  (:func:`exact_norms`).

Each reads in its own way and decides nothing itself, whatever the mode: it hands the mode the step's
``Norms`` (per-tensor ones when the mode's ``per_tensor`` asks for them) and gets ``(coefficient, spike)``
back (``Mode.update``); the verdict comes from ``fastgrad.decide``. Each returns the total norm and hands the
outcome to the guard (``guard._decided``)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _inputs as inputs
from .. import decide
from .. import exact_reads
from .. import _scan
from .. import distributed
from .. import passes
from .. import route
from ..backends import acc_dtype
from ..passes import amp_norms as device_amp_norms, combine_totals as combine_device_totals, unscale_first
from ..passes import list_norm as _norm, scale_ as _scale
from ..scaler_state import record_read_pass as _record_read_pass
from .modes.base import Norms


def cpu_write(guard, params, grads=None) -> Tensor | None:
    """A ``kernel_clip`` mode, gradients written, CPU: clip_grad_norm_'s one-call C++ clip with its finiteness
    check (a non-finite norm writes nothing and says so; CPU memory: no device to wait for). The flag is then
    one of two cached constant tensors. None when that path cannot serve (nothing done)."""
    fast = _scan.clip_norm_cpu(params, guard.max_norm, guard.norm_type, True, guard.backend)
    if fast is None:
        return None
    total, nonfinite = fast
    if grads is None:
        grads = _scan.plain_grads_of(params) or inputs.grads_of(params)  # (validated by the C++ clip)
    guard._ensure_state(total, 0)
    if guard._flags is None:
        guard._flags = (torch.zeros((), dtype=torch.float32), torch.ones((), dtype=torch.float32))
    _, spike = guard._mode.update(Norms(total, clipped=True))  # the coefficient: the C++ clip's
    # the C++ clip judged the norm with the same rule (decide.nonfinite); its answer as a cached 0/1 flag
    bad = decide.bad_step(guard._flags[bool(nonfinite)], spike_flag=spike)
    guard._decided(total, None, None, bad, spike, None, grads)
    return total


def one_call(guard, params, grads, inv_scale, scaler, state, hand_over) -> Tensor | None:
    """A ``kernel_clip`` mode on one device: the read pass, the non-finite flag, the coefficient and the
    write in ONE backend call (the fused AMP primitive, with an unscale factor of exactly 1 when there is no
    scaler: ``grad * 1`` is ``grad``, so the norm is clip_grad_norm_'s bit for bit), and no torch op after it
    unless the mode has more to do (``skip_factor``). None when two backends would serve the read and the
    write."""
    p = guard.norm_type
    if inv_scale is None and not hand_over and grads[0].device.type == "cpu":
        out = cpu_write(guard, params, grads)
        if out is not None:
            return out
    b = route.one_call_backend("amp_norm", grads, guard.backend, p)
    if b is None:
        return None
    dev = grads[0].device
    if guard._one is None or guard._one.device != dev:
        guard._one = torch.ones((), dtype=torch.float32, device=dev)
    inv = guard._one if inv_scale is None else inv_scale.to(dev, non_blocking=True)
    total, found, factor = b.amp_clip_(grads, inv, guard.max_norm, p, not hand_over)
    if state is not None:
        _record_read_pass(scaler, state, False, {dev: found.reshape(())}, total, p, False, [grads], inv_scale,
                          guard.backend)
    guard._ensure_state(total, 0)
    norms = Norms(total, clipped=True)  # the coefficient: the kernel's (in ``factor``)
    _, spike = guard._mode.update(norms)
    bad = decide.bad_step(norms.nonfinite, found, spike)
    guard._decided(total, factor, None if inv_scale is None else inv, bad, spike,
                   decide.grad_scale(factor) if hand_over else None, grads)
    return total.to(inputs.promoted_dtype(grads))


def general(guard, params, grads, inv_scale, scaler, state, hand_over, sh, use_scaler) -> Tensor:
    """Every mode, any layout (``sh``: the sharded view the list's plan placed, None for a plain list): norms
    (per tensor where the mode asks), the mode's rule in device ops, then the write (one coefficient, or one per
    tensor) or the hand-over."""
    p = guard.norm_type
    per_tensor = guard._mode.per_tensor
    if guard._exact:  # the gradients are unscaled by now: the rule below clips them without inv_scale
        total, per, writes = exact_norms(guard, grads, inv_scale, scaler, state, sh, use_scaler)
        inv_scale = None
    elif use_scaler and sh is not None:
        # one all-reduce carries the global norm of the unscaled shards and the global overflow flag, so
        # every rank records the same found_inf and takes the same decision (fastgrad.amp's sharded path)
        total, _, flag = distributed.reduced_amp_norm(sh, p, passes.local_amp(inv_scale, p, guard.backend),
                                                      _poison(guard, sh))
        groups = inputs.split_by_device(sh.writes)
        found = {x[0].device: flag.to(x[0].device).reshape(()) for x in groups}
        _record_read_pass(scaler, state, False, found, total, p, False, groups, inv_scale, guard.backend)
        writes, per = sh.writes, None
    elif use_scaler:
        groups = inputs.split_by_device(grads)
        parts = device_amp_norms(groups, inv_scale, p, guard.backend)
        total = combine_device_totals([t for t, _ in parts], p, grads[0].device, acc_dtype(grads))
        found = {x[0].device: f.reshape(()) for x, (_, f) in zip(groups, parts)}
        per = _unscaled_per_tensor(guard, grads, inv_scale) if per_tensor else None
        _record_read_pass(scaler, state, False, found, total, p, False, groups, inv_scale, guard.backend)
        writes = grads
    elif sh is not None:
        # clip.py's sharded norm, plus the flag of the copies this rank holds but does not count, folded
        # into the same all-reduce: every rank takes the same decision (fastgrad.distributed.nonfinite_poison)
        total, per = passes.sharded_norm(sh, p, guard.backend, None, per_tensor, _poison(guard, sh))
        writes = sh.writes
    else:
        total, per = _norm(grads, p, guard.backend, None, per_tensor)
        writes = grads

    guard._ensure_state(total, len(params))
    norms = Norms(total, per, _param_index(guard, params, grads) if per_tensor else None)
    coef, spike = guard._mode.update(norms)
    factor = coef if inv_scale is None else decide.with_unscale(coef, inv_scale)
    if coef.dim():  # one coefficient per tensor: each written by its own; recorded as what they amount to
        _scale_per_tensor(writes, factor)
        coef = decide.per_tensor_coef(total, norms.per, coef)
    elif not hand_over and writes:
        _scale(writes, factor, guard.backend, None)
    guard._decided(total, coef, None, decide.bad_step(norms.nonfinite, spike_flag=spike), spike,
                   decide.grad_scale(factor) if hand_over else None, grads)
    out = total.to(inputs.promoted_dtype(grads)) if grads else total
    return distributed.wrap_like(out, sh) if sh is not None else out


def exact_norms(guard, grads, inv_scale, scaler, state, sh, use_scaler):
    """exact=True's read: with a scaler, ``unscale_``'s own pass first (the overflow flags from the scaled
    values), then the correctly rounded norms of the unscaled values (per tensor for AdaGC): ``(total, per,
    writes)``. Sharded (``sh``): one all-reduce; every rank's found_inf is then the reduced norm's verdict (an
    overflowed scaled value is non-finite unscaled), the same everywhere."""
    p, per_tensor = guard.norm_type, guard._mode.per_tensor
    writes = sh.writes if sh is not None else grads
    groups = inputs.split_by_device(writes)
    found = unscale_first(groups, inv_scale) if use_scaler else None
    # a non-finite copy this rank holds but does not count reaches every rank's verdict (same payload)
    total, per = exact_reads.acc_norms(grads, p, guard.backend, per_tensor, sh, _poison(guard, sh))
    if sh is not None and use_scaler:
        bad = decide.nonfinite(total).to(torch.float32)
        found = {dev: bad.to(dev) for dev in found}
    if use_scaler:
        _record_read_pass(scaler, state, False, found, total, p, False, groups, None, guard.backend)
    return total, per, writes


def _param_index(guard, params: list, grads: list) -> Tensor | None:
    if len(grads) == len(params):
        return None
    # built on the host, then copied without a wait (a blocking host-to-device copy is a sync on CUDA)
    idx = torch.tensor([i for i, q in enumerate(params) if q.grad is not None], dtype=torch.int64)
    return idx.to(guard._device, non_blocking=True)


def _unscaled_per_tensor(guard, grads, inv_scale) -> Tensor:
    """AdaGC under a GradScaler: the per-tensor norms of the unscaled values (a second read after the AMP
    read pass, whose primitive has no per-tensor output)."""
    _, per = _norm(grads, guard.norm_type, guard.backend, None, True)
    return per * inv_scale.to(per.device, per.dtype)


def _poison(guard, sh) -> Tensor | None:
    """A sharded list's flag of the copies this rank holds but does not count (None for a plain list)."""
    if sh is None:
        return None
    return distributed.nonfinite_poison(sh, lambda ts: _norm(ts, guard.norm_type, guard.backend, None, False)[0])


def _scale_per_tensor(writes: list[Tensor], coefs: Tensor) -> None:
    if not writes:
        return
    if len({x.device for x in writes}) == 1:  # one foreach call (same bits as one mul_ per tensor)
        torch._foreach_mul_(writes, list(coefs.to(writes[0].device).unbind(0)))
        return
    for x, c in zip(writes, coefs.unbind(0)):
        x.mul_(c.to(x.device))
