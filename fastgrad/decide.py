"""The decisions: what a read of the gradients turns into, written once for every route.

A route (one C++ call, a Triton launch, torch ops, a collective over shards) differs in *how* it reads the
gradients: the total norm, the overflow flag, per-tensor norms. What happens next is decided here, on the
device, with torch ops and no host sync:

* :func:`clip_coef`: the clip coefficient ``min(max_norm / (total + 1e-6), 1)``; :func:`clip_coef_above`:
  ZClip's form of it (only a norm above the limit is clipped); :func:`per_tensor_coef`: what per-tensor
  coefficients amount to on the total norm;
* :func:`amp_factor` and :func:`with_unscale`: unscale and clip folded into one factor;
* :func:`grad_scale`: that factor as the ``grad_scale`` a fused optimizer divides by;
* :func:`nonfinite`: the verdict on a norm (NaN, or inf: an overflowed norm is as bad as a NaN one);
* :func:`spike`: a finite norm above ``k`` times a reference, once the reference is ready;
* :func:`bad_step`: the step verdict, ``nonfinite | found_inf | spike``, as the guard's 0/1 float32 flag;
* :func:`clip_engaged`: whether a clip at a fixed threshold engaged (the guard's ledger counts it);
* :func:`agc_limit` and :func:`agc_factor`: adaptive clipping's per-unit threshold and factor.

The fused kernels (``csrc/``, ``fastgrad/triton_kernels/``) compute the coefficient and the factors on the
device in the same order (reciprocal, multiply, clamp) and are tested bit for bit against these functions;
``tests/test_decide.py`` holds the float64 reference of each rule and the inputs that tell a rule from its
nearest wrong variant.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["CLIP_EPS", "AGC_NORM_FLOOR", "clip_coef", "clip_coef_above", "per_tensor_coef", "with_unscale", "amp_factor", "grad_scale", "nonfinite", "spike",
           "bad_step", "clip_engaged", "agc_limit", "agc_factor"]

#: torch.nn.utils.clip_grad_norm_'s epsilon, added to the total norm before dividing.
CLIP_EPS = 1e-6
#: AGC's floor on a unit's gradient norm (timm): the ratio never divides by less.
AGC_NORM_FLOOR = 1e-6


def clip_coef(total: Tensor, max_norm, eps: float = CLIP_EPS) -> Tensor:
    """``min(max_norm / (total + eps), 1)`` in the total's dtype, exactly as ``torch.nn.utils.clip_grad_norm_``
    evaluates it on the 0-dim total (NaN stays NaN). ``max_norm`` may be a tensor (an adaptive threshold);
    ``eps`` differs only where a mode's paper says so (AdaGC)."""
    return torch.clamp(max_norm / (total + eps), max=1.0)


def clip_coef_above(total: Tensor, limit: Tensor, eps: float = CLIP_EPS) -> Tensor:
    """ZClip's coefficient (Kumar et al. 2025: the clip is applied only to a norm above its threshold):
    :func:`clip_coef` where ``total > limit``, else 1. It differs from :func:`clip_coef` in two places: a norm
    at the limit or less than ``eps`` below it keeps 1 (clip_coef gives ``limit / (total + eps)``, just under
    1), and a NaN norm gives 1 (clip_coef: NaN), so a skipped non-finite step leaves the gradients unclipped."""
    return torch.where(total > limit, clip_coef(total, limit, eps), torch.ones_like(total))


def per_tensor_coef(total: Tensor, per: Tensor, coefs: Tensor) -> Tensor:
    """The coefficient that per-tensor coefficients ``coefs`` (on tensors of 2-norms ``per``) amount to on
    the total 2-norm ``total``: the clipped gradients' norm over the norm before, ``||coefs * per|| / total``
    (the guard's reading of a per-tensor mode's step)."""
    return torch.linalg.vector_norm(coefs * per, 2.0) / total


def with_unscale(coef: Tensor, inv_scale: Tensor) -> Tensor:
    """A clip coefficient (or per-tensor coefficients) and a GradScaler's ``inv_scale`` folded into one factor,
    on the coefficient's device in its dtype (inv_scale converted first, the product rounded once). With
    power-of-two scales the product is exact, so ``g * factor`` equals torch's ``(g * inv_scale) * coef`` bit
    for bit in fp32."""
    return inv_scale.to(coef.device, coef.dtype) * coef


def amp_factor(total: Tensor, max_norm: float, inv_scale: Tensor) -> Tensor:
    """Unscale and clip in one factor: :func:`with_unscale` of ``clip_coef(total, max_norm)``."""
    return with_unscale(clip_coef(total, max_norm), inv_scale)


def grad_scale(factor: Tensor) -> Tensor:
    """The factor as the ``grad_scale`` a fused torch optimizer divides its gradients by inside its step."""
    return factor.reciprocal()


def nonfinite(total: Tensor) -> Tensor:
    """Whether a norm is NaN or infinite (bool, same shape). Finite gradients whose norm overflows the
    accumulation dtype are judged by their norm: clipping them by an infinite norm would zero them."""
    return ~torch.isfinite(total)


def spike(norm: Tensor, k: float, ref: Tensor, finite: Tensor, ready: Tensor | None = None) -> Tensor:
    """A spike: a finite norm strictly above ``k`` times the reference (for per-tensor norms: any tensor's),
    once the reference is ``ready`` (None: always). 0-dim bool."""
    over = norm > k * ref
    if over.dim():
        over = over.any()
    out = finite & over
    return out if ready is None else ready & out


def bad_step(nonfinite_flag: Tensor, found_inf: Tensor | None = None, spike_flag: Tensor | None = None
             ) -> Tensor:
    """The step verdict: bad when the norm is non-finite, or the scaled gradients overflowed (``found_inf``, a
    0/1 float flag), or a spike was declared. Returns the guard's 0-dim float32 0/1 flag. ``nonfinite_flag``
    is :func:`nonfinite` of the norm (bool), or the same verdict as a 0/1 float32 flag where a fused route
    computed it (then it is returned as is when nothing else is folded in)."""
    bad = nonfinite_flag.to(torch.float32)
    if found_inf is not None:
        bad = torch.maximum(bad, found_inf.reshape(()).to(bad.device, torch.float32))
    if spike_flag is not None:
        bad = torch.maximum(bad, spike_flag.to(torch.float32))
    return bad


def clip_engaged(total: Tensor, max_norm: float) -> Tensor:
    """Whether a clip at ``max_norm`` engaged on this norm: finite and strictly above it (bool, same shape). At
    ``max_norm`` exactly clip_grad_norm_'s coefficient is ``max_norm / (max_norm + 1e-6)``, a change of 1e-6
    relative that no one would call clipping; a non-finite norm is a skip, not a clip."""
    return torch.isfinite(total) & (total > max_norm)


def agc_limit(w_norm: Tensor, clip_factor: float, eps: float) -> Tensor:
    """AGC's threshold per unit: ``clip_factor * max(||W||, eps)`` (a new tensor)."""
    return w_norm.clamp(min=eps).mul_(clip_factor)


def agc_factor(g_norm: Tensor, limit: Tensor) -> Tensor:
    """AGC's factor per unit (timm's rule): 1 where ``||G|| < limit``, else ``limit / max(||G||, 1e-6)``, so a
    NaN norm clips (to NaN) and a unit at the limit is rescaled."""
    ratio = limit / g_norm.clamp(min=AGC_NORM_FLOOR)
    return torch.where(g_norm < limit, torch.ones_like(ratio), ratio)
