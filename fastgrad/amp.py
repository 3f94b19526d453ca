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

import torch
from torch import Tensor

from . import _inputs as inputs
from . import passes
from . import route
from . import scaler_state
from .scaler_state import zero_write_applies  # (public here: docs/amp.md)

__all__ = ["scaler_unscale_and_clip", "zero_write_applies"]


class ScaleNotStartedError(RuntimeError, AssertionError):
    """A GradScaler used before its first ``scale()`` (an AssertionError too, as torch raises there)."""


# ---------------------------------------------------------------- public
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
    inputs.check_scaler(scaler, optimizer)
    max_norm = inputs.check_max_norm(max_norm)
    p = inputs.check_norm_type(norm_type)
    ex = inputs.check_exact(exact, p) if exact else False  # inf: a max of rounded unscaled values, exact already
    try:
        params = inputs.optimizer_params(optimizer)
    except (AttributeError, TypeError, KeyError, IndexError):
        inputs.explain_amp_args(scaler, optimizer)  # raises the TypeError that says the fix
    traced = scaler_state.traced_plain(scaler)
    enabled = scaler_state.enabled(scaler, traced)
    if enabled and (traced or scaler_state.known_unscale(scaler)):  # unscale_'s work is done here
        if not traced and getattr(scaler, "_scale", True) is None:
            # torch's own check says only "_scale is None": say which call is missing
            raise ScaleNotStartedError(
                "scaler_unscale_and_clip was called before scaler.scale(loss): the GradScaler has no scale yet. "
                "Call scaler.scale(loss).backward() first in each iteration; the gradients were not modified")
        grads = passes.grads_of(params)
        plan = route.lookup(params, process_group)
        sh = plan.place(grads)  # (reads and checks only: a refusal below still leaves everything untouched)
        state = scaler_state.optimizer_state(scaler, optimizer, traced)
        scaler_state.check_ready(scaler, state, traced)
        sharded = not traced and scaler_state.is_sharded(scaler)
        unscale = scaler_state.Unscale(scaler, state, sharded, optimizer if zero_write else None)
        may_hand_over = zero_write and plan.route != "torch" and sh is None and not ex
        hand_over = unscale.hand_over(grads) if may_hand_over else None  # zero_write, where it applies
        if not sharded and inputs.has_dtype(grads, torch.float16):
            raise ValueError("Attempting to unscale FP16 gradients.")
        if plan.route != "torch":
            if sh is None and not grads:
                scaler_state.record_unscaled(scaler, state, {}, sharded, unscale.flag_shape)
                return torch.tensor(0.0)
            return route.clip_(sh, grads, max_norm, p, error_if_nonfinite, None, backend, ex, unscale, hand_over)
        # Sparse or complex grads: torch's unscale_ and clip (refused before anything if a fused backend was asked
        # for by name)
        plan.refuse_fallback("scaler_unscale_and_clip", backend, ex)
    if enabled:  # a scaler with its own unscale_ (and its own rules), or gradients only torch's reads: run it
        scaler.unscale_(optimizer)
    # (a disabled scaler only clips)
    return route.clip_params(params, max_norm, p, error_if_nonfinite, None, backend, ex, process_group)
