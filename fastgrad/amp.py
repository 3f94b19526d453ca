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

import functools
import inspect
from typing import Sequence

import torch
from torch import Tensor

from . import _inputs as inputs
from . import exact_reads
from . import passes
from . import route
from . import scaler_state
from .clip import clip_grad_norm_
from .scaler_state import GradScaler, OptState

__all__ = ["scaler_unscale_and_clip", "zero_write_applies"]


class ScaleNotStartedError(RuntimeError, AssertionError):
    """A GradScaler used before its first ``scale()`` (an AssertionError too, as torch raises there)."""


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
    if not scaler.is_enabled() or not scaler_state.known_unscale(scaler):
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
        grads = inputs.grads_of(inputs.optimizer_params(optimizer))
    if inputs.has_dtype(grads, torch.float64):
        return False
    return _step_keeps_grad_scale(type(scaler).step)


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
    ex = exact_reads.applies(exact, p) if exact else False  # inf: a max of rounded unscaled values, exact already
    try:
        params = inputs.optimizer_params(optimizer)
    except (AttributeError, TypeError, KeyError, IndexError):
        _explain_bad_args(scaler, optimizer)  # raises the TypeError that says the fix
    traced = scaler_state.traced_plain(scaler)
    enabled = scaler_state.enabled(scaler, traced)
    if enabled and (traced or scaler_state.known_unscale(scaler)):  # unscale_'s work is done here
        if not traced and getattr(scaler, "_scale", True) is None:
            # torch's own check says only "_scale is None": say which call is missing
            raise ScaleNotStartedError(
                "scaler_unscale_and_clip was called before scaler.scale(loss): the GradScaler has no scale yet. "
                "Call scaler.scale(loss).backward() first in each iteration; the gradients were not modified")
        state = scaler_state.optimizer_state(scaler, optimizer, traced)
        scaler_state.check_ready(scaler, state, traced)
        sharded = not traced and scaler_state.is_sharded(scaler)
        grads = passes.grads_of(params)
        if not sharded and inputs.has_dtype(grads, torch.float16):
            raise ValueError("Attempting to unscale FP16 gradients.")
        plan = route.lookup(params, process_group)
        sh = plan.place(grads)
        if plan.route != "torch":
            unscale = scaler_state.Unscale(scaler, state, sharded)
            if sh is None and not grads:
                scaler_state.record_unscaled(scaler, state, {}, sharded, unscale.flag_shape)
                return torch.tensor(0.0)
            hand_over = None
            if zero_write and sh is None and not ex and zero_write_applies(scaler, optimizer, grads):
                # the fused optimizers divide by grad_scale (and store the quotient into .grad) inside their step
                hand_over = functools.partial(setattr, optimizer, "grad_scale")
            return route.clip_(sh, grads, max_norm, p, error_if_nonfinite, None, backend, ex, unscale, hand_over)
        # Sparse or complex grads: torch's unscale_ and clip (refused before anything if a fused backend was asked
        # for by name)
        plan.refuse_fallback("scaler_unscale_and_clip", backend, ex)
    if enabled:  # a scaler with its own unscale_ (and its own rules), or gradients only torch's reads: run it
        scaler.unscale_(optimizer)
    # (a disabled scaler only clips)
    return clip_grad_norm_(params, max_norm, p, error_if_nonfinite, backend=backend, process_group=process_group,
                           exact=ex)
