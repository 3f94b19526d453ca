"""AMP: ``scaler_unscale_and_clip`` replaces ``scaler.unscale_(optimizer)`` + ``clip_grad_norm_``: docs/contract.md section 4.

torch's way moves 5N bytes for N bytes of gradients (unscale reads and writes, the norm reads, the clip reads
and writes). Here, per device, one read pass (the backend's ``amp_norm``) yields both the finiteness of the
scaled gradients and the norm of the unscaled ones; the clip coefficient and ``inv_scale`` are multiplied on
the device into one factor, and one write pass (``scale_``) applies it, skipped on the device when the factor
is 1. On one device (no ShardedGradScaler, no ``error_if_nonfinite``) the three steps are one backend call,
``amp_clip_``, which the fused backends run as kernels with the factor kept on the device. The scaler's
per-optimizer state is left exactly as ``scaler.unscale_`` leaves it, so ``scaler.step``
and ``scaler.update`` need no change.

``zero_write=True`` removes the write pass too, for optimizers that unscale inside their own step (torch's
``fused=True`` Adam/AdamW/SGD/Adagrad, flagged ``_step_supports_amp_scaling``): the factor goes to the
optimizer as ``optimizer.grad_scale`` (its reciprocal; the fused kernels divide the gradients by it while
they read them for the update and store the result back), and ``scaler.step`` hands it over with the
``found_inf`` it already passes. See docs/amp-reference.md for when it applies and why the results are the same.

Overflow (an inf/NaN among the scaled gradients): the unscaled norm is inf or NaN, so the coefficient is 0 or
NaN and the folded factor is too; ``g * factor`` then gives NaN exactly where torch's unscale-then-clip gives
NaN (every element for a NaN norm; the inf/NaN elements for an inf norm, finite ones becoming +-0).
One corner differs: a scale below 1 can make *unscaling* overflow a finite gradient (torch then has an inf
unscaled element that found_inf does not flag); torch turns that element into NaN, the folded multiply into 0.
"""

from __future__ import annotations

import inspect
import sys
from typing import Sequence

import torch
from torch import Tensor

from . import _inputs as inputs
from . import distributed
from . import exact as exact_norm
from .backends import acc_dtype
from .decide import amp_factor, clip_coef, grad_scale, nonfinite
from .backends.torch_backend import combine_norms
from .clip import _check_finite, _exact_totals, _no_sharded_fallback, _torch_fallback_allowed, clip_grad_norm_

try:
    from torch.amp.grad_scaler import GradScaler, OptState
except ImportError:  # pragma: no cover - torch < 2.3 kept the scaler under torch.cuda.amp
    from torch.cuda.amp.grad_scaler import GradScaler, OptState  # type: ignore[no-redef]

__all__ = ["scaler_unscale_and_clip", "zero_write_applies"]

_SHARDED_MODULE = "torch.distributed.fsdp.sharded_grad_scaler"


def optimizer_params(optimizer) -> list[Tensor]:
    groups = optimizer.param_groups
    if len(groups) == 1:  # the common case: the group's own list, no per-parameter Python step
        return groups[0]["params"]
    return [p for group in groups for p in group["params"]]


# ---------------------------------------------------------------- what kind of scaler
def _sharded_scaler_class():
    # Only look the class up if the user's program imported it: a ShardedGradScaler instance implies that,
    # and importing torch.distributed.fsdp just to answer "no" would cost every call.
    mod = sys.modules.get(_SHARDED_MODULE)
    return getattr(mod, "ShardedGradScaler", None) if mod is not None else None


def _is_sharded(scaler) -> bool:
    cls = _sharded_scaler_class()
    return cls is not None and isinstance(scaler, cls)


def _traced_plain(scaler) -> bool:
    """True while dynamo traces a call on a plain ``GradScaler`` (exactly that class): dynamo will not trace
    into torch/amp's methods, so that path reads the scaler's fields instead (what those methods read).
    Eager calls, subclasses and ShardedGradScaler keep calling the methods (those graph-break if compiled)."""
    return torch.compiler.is_compiling() and type(scaler) is GradScaler


def _enabled(scaler, traced: bool) -> bool:
    return scaler._enabled if traced else scaler.is_enabled()


def _optimizer_state(scaler, optimizer, traced: bool) -> dict:
    states = scaler._per_optimizer_states
    if not traced:
        return states[id(optimizer)]
    # The defaultdict's factory lives in torch/amp (not traceable): build the same fresh state here.
    key = id(optimizer)
    state = states.get(key)
    if state is None:
        state = {"stage": OptState.READY, "found_inf_per_device": {}}
        states[key] = state
    return state


def _known_unscale(scaler) -> bool:
    """True when ``scaler.unscale_`` is torch's own (plain or sharded), i.e. the behaviour we reproduce. A
    subclass that overrides unscale_ or _unscale_grads_ gets its own code run instead (the composed path)."""
    t = type(scaler)
    impls = [GradScaler]
    sharded = _sharded_scaler_class()
    if sharded is not None:
        impls.append(sharded)
    return any(t.unscale_ is c.unscale_ and t._unscale_grads_ is c._unscale_grads_ for c in impls)


class ScaleNotStartedError(RuntimeError, AssertionError):
    """A GradScaler used before its first ``scale()`` (an AssertionError too, as torch raises there)."""


def _check_ready(scaler, state: dict, traced: bool = False) -> None:
    """torch's checks in unscale_, in torch's order and with its texts."""
    if traced:  # _check_scale_growth_tracker's checks, inlined (its method cannot be traced)
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if scaler._scale is None:
            raise AssertionError("Attempted unscale_ but _scale is None.  " + fix)
        if scaler._growth_tracker is None:
            raise AssertionError("Attempted unscale_ but _growth_tracker is None.  " + fix)
    else:
        scaler._check_scale_growth_tracker("unscale_")
    if state["stage"] is OptState.UNSCALED:
        raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
    if state["stage"] is OptState.STEPPED:
        raise RuntimeError("unscale_() is being called after step().")


def _inv_scale(scaler) -> Tensor:
    # As unscale_: the reciprocal in fp64 then fp32 (fp32 division is imprecise under some compile options);
    # MPS has no fp64.
    s = scaler._scale
    return s.reciprocal() if s.device.type == "mps" else s.double().reciprocal().float()


def _all_reduce_found_inf(scaler, found: dict[torch.device, Tensor]) -> None:
    """ShardedGradScaler.unscale_'s cross-rank reduction of the per-device flags (SUM over its process
    group), including its detour through the scaler's device for flags on the CPU."""
    import torch.distributed as dist

    works, on_cpu, moved = [], [], []
    for f in found.values():
        if scaler._device != "cpu" and f.device.type == "cpu":
            m = f.to(scaler._device)
            on_cpu.append(f)
            moved.append(m)
            works.append(dist.all_reduce(m, async_op=True, group=scaler.process_group))
        else:
            works.append(dist.all_reduce(f, async_op=True, group=scaler.process_group))
    for w in works:
        w.wait()
    if on_cpu:
        torch._foreach_copy_(on_cpu, moved)


# ---------------------------------------------------------------- zero-write mode
_STEP_PROBES: dict = {}


def _step_keeps_grad_scale(step_fn) -> bool:
    """Does this ``GradScaler.step`` hand a ``grad_scale`` set on the optimizer through to a
    ``_step_supports_amp_scaling`` optimizer after unscale_? torch >= 2.5 or so does (it multiplies scales);
    older releases overwrite it with None, which would silently skip our factor. Asked once per step
    function by running it on a dummy CPU optimizer."""
    known = _STEP_PROBES.get(step_fn)
    if known is not None:
        return known
    sentinel = torch.tensor(3.0)

    class _Probe:
        _step_supports_amp_scaling = True
        param_groups: list = []
        seen = None

        def step(self):
            self.seen = getattr(self, "grad_scale", None)

    ok = False
    try:
        probe = _Probe()
        s = GradScaler("cpu", init_scale=2.0)
        s._lazy_init_scale_growth_tracker(torch.device("cpu"))
        s._per_optimizer_states[id(probe)] = {"stage": OptState.UNSCALED,
                                             "found_inf_per_device": {torch.device("cpu"): torch.zeros(())}}
        probe.grad_scale = sentinel
        step_fn(s, probe)
        ok = probe.seen is sentinel and not hasattr(probe, "grad_scale")
    except Exception:  # any incompatibility means: do not rely on it
        ok = False
    _STEP_PROBES[step_fn] = ok
    return ok


def zero_write_applies(scaler, optimizer, grads: Sequence[Tensor] | None = None) -> bool:
    """Whether ``scaler_unscale_and_clip(..., zero_write=True)`` can hand its factor to ``optimizer``
    instead of writing the gradients: an enabled torch GradScaler (or ShardedGradScaler) whose ``step``
    passes ``optimizer.grad_scale`` through, an optimizer that unscales inside its step
    (``_step_supports_amp_scaling``, e.g. torch's ``fused=True`` Adam/AdamW/SGD) without the legacy
    ``grad_scaler`` keyword and without a ``grad_scale`` of its own already set, and no float64 gradients
    (the fused kernels take a float32 scale)."""
    if not scaler.is_enabled() or not _known_unscale(scaler):
        return False
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if getattr(optimizer, "grad_scale", None) is not None:
        return False
    try:
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            return False
    except (TypeError, ValueError):
        return False
    if grads is None:
        grads = inputs.grads_of(optimizer_params(optimizer))
    if inputs.has_dtype(grads, torch.float64):
        return False
    return _step_keeps_grad_scale(type(scaler).step)


# ---------------------------------------------------------------- per-device passes
def device_amp_norms(groups: list[list[Tensor]], inv_scale: Tensor, norm_type: float, backend: str | None
                     ) -> list[tuple[Tensor, Tensor]]:
    """The read pass: per device group, ``(total of the unscaled values, found_inf)`` on that device.
    Backends for this pass and for the write pass are chosen first, so a backend that cannot serve the call
    raises before anything is read or written."""
    amp = [inputs.pick("amp_norm", g, backend, norm_type=norm_type) for g in groups]
    for g in groups:
        inputs.pick("scale", g, backend)
    return [b.amp_norm(g, inv_scale.to(g[0].device, non_blocking=True), norm_type) for b, g in zip(amp, groups)]


def combine_device_totals(totals: list[Tensor], norm_type: float, device: torch.device, dtype: torch.dtype
                          ) -> Tensor:
    """Total norm over devices from the per-device totals, on ``device`` in ``dtype`` (as clip.py does)."""
    if len(totals) == 1:
        return totals[0].to(device, dtype)
    return combine_norms(torch.stack([t.to(device, dtype) for t in totals]), norm_type)


def _scale_groups(groups: list[list[Tensor]], factor: Tensor, backend: str | None) -> None:
    for g in groups:
        b = inputs.pick("scale", g, backend)
        b.scale_(g, factor.to(g[0].device, non_blocking=True))


def _record_read_pass(scaler, state, sharded, found, total, p, error_if_nonfinite, groups, inv_scale, backend
                      ) -> None:
    """After the read pass: the scaler state unscale_ leaves (flags per device, stage UNSCALED; the flags
    all-reduced for a ShardedGradScaler), then, if asked, the non-finite check, which raises after writing
    the unscaled values, as unscale_ had already done when torch's clip_grad_norm_ raises."""
    state["found_inf_per_device"] = found
    state["stage"] = OptState.UNSCALED
    if sharded:
        _all_reduce_found_inf(scaler, found)
    if error_if_nonfinite:
        try:
            _check_finite(total, p)
        except RuntimeError:
            _scale_groups(groups, inv_scale, backend)
            raise


# ---------------------------------------------------------------- public
def _explain_bad_args(scaler, optimizer, swapped_only: bool = False) -> None:
    """Error path of scaler_unscale_and_clip: ``optimizer`` has no param_groups (or ``scaler`` no unscale_).
    Say the fix."""
    if hasattr(scaler, "param_groups") and hasattr(optimizer, "unscale_"):
        raise TypeError("scaler_unscale_and_clip(scaler, optimizer, max_norm): the scaler and the optimizer are "
                        "swapped; call fastgrad.scaler_unscale_and_clip(scaler, optimizer, max_norm) (the "
                        "gradients were not modified)") from None
    if swapped_only:
        return
    raise TypeError(f"scaler_unscale_and_clip: optimizer must be a torch.optim.Optimizer (with param_groups), "
                    f"got {type(optimizer).__name__}; call fastgrad.scaler_unscale_and_clip(scaler, optimizer, "
                    "max_norm) (the gradients were not modified)") from None


@torch.no_grad()
def scaler_unscale_and_clip(scaler, optimizer, max_norm: float, norm_type: float = 2.0, *,
                            error_if_nonfinite: bool = False, zero_write: bool = False,
                            backend: str | None = None, process_group=None, exact: bool = False) -> Tensor:
    """``scaler.unscale_(optimizer)`` then ``clip_grad_norm_`` over the optimizer's parameters, fused: one
    read of the gradients for the overflow check and the norm, one write for unscale and clip together
    (none when the combined factor is 1).

    Leaves the scaler's per-optimizer state as ``unscale_`` does, so ``scaler.step(optimizer)`` skips the
    step on overflow and ``scaler.update()`` backs the scale off. Returns the total norm of the unscaled
    gradients (non-finite after an overflow). A disabled scaler only clips. No host sync, except the one
    check ``error_if_nonfinite=True`` asks for (on a non-finite norm the gradients are then left unscaled
    but unclipped, the scaler state set, and RuntimeError raised, as the two torch calls would).

    ``zero_write=True``: where :func:`zero_write_applies` (torch's ``fused=True`` optimizers), nothing is
    written; the factor is given to the optimizer, which applies it inside ``scaler.step(optimizer)`` (call
    that next). Until then the ``.grad`` tensors still hold the scaled values, and after a skipped step they
    keep them. Elsewhere the flag is ignored (the gradients are written as usual).

    Sharded gradients (DTensors on any meshes, plain ones among them, pipeline stages with
    ``process_group=``, or this rank's disjoint shards with ``process_group=``; docs/distributed.md): the
    norm and the overflow flag come from the local shards with ONE all-reduce for the usual layouts, so
    every rank sees the same norm and the same found_inf (a ShardedGradScaler's own reduction of the flags
    rides in that all-reduce too when its process group is the ranks the norm reaches, else it runs as
    torch's, a second collective); the local shards are written; the norm is a Replicate() DTensor when all grads are
    DTensors on one mesh. ``zero_write`` does not
    apply there; norm_type 0 is not supported there.

    ``exact=True`` (p = 1, 2, inf): the returned norm is the exact norm of the UNSCALED gradients correctly
    rounded (fastgrad.exact; ``g * inv_scale`` is itself rounded unless the scale is a power of two and
    nothing underflows, so the gradients are unscaled first, as ``unscale_`` does, then read once more for the
    exact norm, then clipped by the coefficient computed from it). The scaler state is left as ``unscale_``
    leaves it; ``zero_write`` does not apply (the gradients are written). Sharded gradients: the norm and the
    overflow verdict travel in one all-reduce. p = inf takes the default route (a max of the rounded unscaled
    values is exact already).
    """
    if scaler is None or not hasattr(scaler, "unscale_"):
        _explain_bad_args(scaler, optimizer, swapped_only=True)
        # None (a scaler the script only makes under AMP) would fail deep inside with an AttributeError
        raise TypeError(f"scaler_unscale_and_clip(scaler, optimizer, max_norm): scaler must be a "
                        f"torch.amp.GradScaler, got {type(scaler).__name__}; without AMP call "
                        "fastgrad.clip_grad_norm_(params, max_norm) instead (the gradients were not modified)")
    max_norm = inputs.check_max_norm(max_norm)
    p = inputs.check_norm_type(norm_type)
    ex = exact_norm.applies(exact, p)  # inf: a max of correctly rounded unscaled values, exact already
    try:
        params = optimizer_params(optimizer)
    except (AttributeError, TypeError, KeyError, IndexError):
        _explain_bad_args(scaler, optimizer)  # raises the TypeError that says the fix
    traced = _traced_plain(scaler)
    if not _enabled(scaler, traced):
        return clip_grad_norm_(params, max_norm, p, error_if_nonfinite, backend=backend,
                               process_group=process_group, exact=ex)

    if not traced and not _known_unscale(scaler):
        # A scaler with its own unscale_ (and its own rules): run it, then clip.
        scaler.unscale_(optimizer)
        return clip_grad_norm_(params, max_norm, p, error_if_nonfinite, backend=backend,
                               process_group=process_group, exact=ex)

    if not traced and getattr(scaler, "_scale", True) is None:
        # torch's own check says only "_scale is None": say which call is missing
        raise ScaleNotStartedError(
            "scaler_unscale_and_clip was called before scaler.scale(loss): the GradScaler has no scale yet. "
            "Call scaler.scale(loss).backward() first in each iteration; the gradients were not modified")
    state = _optimizer_state(scaler, optimizer, traced)
    _check_ready(scaler, state, traced)
    sharded = not traced and _is_sharded(scaler)
    grads = inputs.grads_of(params)
    if not sharded and inputs.has_dtype(grads, torch.float16):
        raise ValueError("Attempting to unscale FP16 gradients.")
    if inputs.check_tensors(grads):
        # Sparse or complex grads: torch's unscale_ and clip (refused before anything if a fused backend
        # was asked for by name).
        _no_sharded_fallback(process_group)
        if ex:
            exact_norm.reject_fallback()
        _torch_fallback_allowed(backend, "scaler_unscale_and_clip")
        scaler.unscale_(optimizer)
        return clip_grad_norm_(params, max_norm, p, error_if_nonfinite, backend=backend)

    inv_scale = _inv_scale(scaler)
    # torch's flags: 0-dim per device for GradScaler, shape (1,) for ShardedGradScaler.
    flag_shape = (1,) if sharded else ()
    if ex and (grads or process_group is not None):
        return _exact_unscale_and_clip(scaler, state, sharded, grads, inv_scale, max_norm, p, error_if_nonfinite,
                                       backend, process_group, flag_shape)
    if process_group is not None or distributed.has_dtensor(grads):
        return _sharded_unscale_and_clip(scaler, state, sharded, grads, inv_scale, max_norm, p,
                                         error_if_nonfinite, backend, process_group, flag_shape)
    if not grads:
        found = {}
        if sharded:  # it records a flag on the scale's device even with nothing to check
            found[scaler._scale.device] = torch.zeros(flag_shape, dtype=torch.float32, device=scaler._scale.device)
        state["found_inf_per_device"] = found
        state["stage"] = OptState.UNSCALED
        if sharded:
            _all_reduce_found_inf(scaler, found)
        return torch.tensor(0.0)

    groups = inputs.split_by_device(grads)
    if len(groups) == 1 and not sharded and not error_if_nonfinite:
        fused = _amp_clip_one_backend(scaler, optimizer, state, grads, inv_scale, max_norm, p, zero_write, backend)
        if fused is not None:
            return fused
    parts = device_amp_norms(groups, inv_scale, p, backend)
    first = grads[0].device
    dtype = acc_dtype(grads)
    total = combine_device_totals([t for t, _ in parts], p, first, dtype)
    found = {g[0].device: f.reshape(flag_shape) for g, (_, f) in zip(groups, parts)}
    _record_read_pass(scaler, state, sharded, found, total, p, error_if_nonfinite, groups, inv_scale, backend)

    factor = amp_factor(total, max_norm, inv_scale)  # unscale and clip in one multiply
    if zero_write and zero_write_applies(scaler, optimizer, grads):
        # The fused optimizers divide by grad_scale (and store the quotient into .grad) inside their step.
        optimizer.grad_scale = grad_scale(factor)
    else:
        _scale_groups(groups, factor, backend)
    return total.to(inputs.promoted_dtype(grads))


def unscale_first(groups: list[list[Tensor]], inv_scale: Tensor, flag_shape=()) -> dict:
    """``unscale_``'s own pass per device group: the overflow flag read from the SCALED values, the
    gradients multiplied by ``inv_scale`` in place. Returns the flags by device."""
    found = {}
    for g in groups:
        dev = g[0].device
        f = torch.zeros(flag_shape, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(g, f, inv_scale.to(dev, non_blocking=True))
        found[dev] = f
    return found


def _exact_unscale_and_clip(scaler, state, sharded, grads, inv_scale, max_norm, p, error_if_nonfinite, backend,
                            process_group, flag_shape):
    """exact=True: unscale (the flags as unscale_ records them), the exact norm of the unscaled values (one more
    read), then the clip by the coefficient computed from it (one write, skipped on the device when 1)."""
    for g in inputs.split_by_device(grads):  # the backends that will write, checked before anything is
        inputs.pick("scale", g, backend)
    sh = None
    if process_group is not None or distributed.has_dtensor(grads):
        sh = distributed.prepare(grads, process_group)
    groups = inputs.split_by_device(sh.writes if sh is not None else grads)
    found = unscale_first(groups, inv_scale, flag_shape)
    total, out = _exact_totals(grads, p, backend, sh)  # (of the gradients unscaled just above)
    if sh is not None:
        out = distributed.wrap_like(out, sh)
        # every rank's verdict from the reduced norm (an overflowed scaled value is non-finite unscaled), so
        # the same found_inf everywhere without a second collective
        bad = nonfinite(total).to(torch.float32)
        found = {dev: bad.to(dev).reshape(flag_shape) for dev in found}
        if sharded and not found:
            found[scaler._scale.device] = bad.to(scaler._scale.device).reshape(flag_shape)
        sharded = False
    _record_read_pass(scaler, state, sharded, found, total, p, False, groups, inv_scale, backend)
    if error_if_nonfinite:
        _check_finite(total, p)  # the gradients stay unscaled and unclipped, as the two torch calls leave them
    if groups:
        _scale_groups(groups, clip_coef(total.to(groups[0][0].device), max_norm), backend)
    return out


def _amp_clip_one_backend(scaler, optimizer, state, grads, inv_scale, max_norm, p, zero_write, backend
                          ) -> Tensor | None:
    """One device, a plain GradScaler, no finiteness check: the read pass, the factor and the write
    in ONE backend call (``amp_clip_``), which fused backends run as a few kernels with no torch op between
    them. None (nothing done) when different backends would serve the read and the write; the caller then
    composes the pieces. The scaler state is set as the composed path sets it."""
    b = inputs.pick("amp_norm", grads, backend, norm_type=p)
    if inputs.pick("scale", grads, backend) is not b:
        return None
    # decided before the read pass (host-side checks only), so the primitive knows whether to write
    hand_over = zero_write and zero_write_applies(scaler, optimizer, grads)
    dev = grads[0].device
    total, found, factor = b.amp_clip_(grads, inv_scale.to(dev, non_blocking=True), max_norm, p, not hand_over)
    _record_read_pass(scaler, state, False, {dev: found.reshape(())}, total, p, False, [grads], inv_scale, backend)
    if hand_over:
        # The fused optimizers divide by grad_scale (and store the quotient into .grad) inside their step.
        optimizer.grad_scale = grad_scale(factor)
    return total.to(inputs.promoted_dtype(grads))


def _scaler_group_is_span(scaler, sh) -> bool:
    """Whether a ShardedGradScaler's process group is exactly the ranks the norm's reduction reached."""
    import torch.distributed as dist

    span = distributed.span_ranks(sh)
    if span is None:
        return False
    pg = getattr(scaler, "process_group", None)
    if pg is None or pg is dist.group.WORLD:
        ranks = frozenset(range(dist.get_world_size()))
    else:
        ranks = frozenset(dist.get_process_group_ranks(pg))
    return ranks == span


def _sharded_unscale_and_clip(scaler, state, sharded, grads, inv_scale, max_norm, p, error_if_nonfinite,
                              backend, process_group, flag_shape):
    """scaler_unscale_and_clip over local shards (fastgrad.distributed): the same read pass per rank, one
    all-reduce for the norm and the overflow flag, then the same folded write of the local shards."""
    sh = distributed.prepare(grads, process_group)

    def local_amp(ts):
        groups = inputs.split_by_device(ts)
        parts = device_amp_norms(groups, inv_scale, p, backend)
        total = combine_device_totals([t for t, _ in parts], p, ts[0].device, acc_dtype(ts))
        flag = torch.stack([f.to(ts[0].device).reshape(()) for _, f in parts]).amax()
        return total, flag

    total, local_flag, global_flag = distributed.reduced_amp_norm(sh, p, local_amp)
    # A ShardedGradScaler reduces the ranks' flags over its own process group. When that group is exactly
    # the ranks the norm's all-reduce reached, the global flag that came back with the norm IS that
    # reduction (as 0/1 where torch records the number of ranks that overflowed; step and update read both
    # as "overflow or not"): no second collective. Otherwise the scaler's own reduction of the local flags.
    folded = sharded and _scaler_group_is_span(scaler, sh)
    flag = local_flag if sharded and not folded else global_flag
    groups = inputs.split_by_device(sh.writes)
    found = {g[0].device: flag.to(g[0].device).reshape(flag_shape) for g in groups}
    if sharded and not found:  # it records a flag on the scale's device even with nothing to check
        found[scaler._scale.device] = flag.to(scaler._scale.device).reshape(flag_shape)
    # the total is the same on every rank, so with error_if_nonfinite all ranks raise alike
    _record_read_pass(scaler, state, sharded and not folded, found, total, p, error_if_nonfinite, groups,
                      inv_scale, backend)
    if groups:
        dev = groups[0][0].device
        _scale_groups(groups, amp_factor(total.to(dev), max_norm, inv_scale), backend)
    return distributed.wrap_like(total.to(inputs.promoted_dtype(grads)) if grads else total, sh)
