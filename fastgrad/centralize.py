"""Gradient centralization (Yong et al. 2020): docs/contract.md section 6.

Public entry point; the kernels are the backends' ``centralize_`` primitive.
"""

from __future__ import annotations

import torch

from . import _inputs as inputs

__all__ = ["centralize_gradient_"]


@torch.no_grad()
def centralize_gradient_(parameters, *, gc_conv_only: bool = False, backend: str | None = None) -> None:
    """Subtract from every gradient with ``ndim > 1`` (``ndim > 3`` when ``gc_conv_only``) its mean over
    dims 1..n-1, in place: ``G -= G.mean(dim=(1, ..., n-1), keepdim=True)``. The mean is accumulated in
    at least float32 (float64 for float64) and subtracted in at least float32: fp16/bf16 gradients as torch's
    ``g.sub_(mean)`` computes it (float32 mean, float32 subtraction) on every backend; float32 gradients so
    on the C++ backends, in float64 and rounded once on the Triton backend. 1-D (bias, norm) gradients are
    untouched, as in the official implementation.

    Call it after ``backward()`` (and after unscaling under AMP) and before clipping/``optimizer.step()``.
    """
    params = inputs.as_list(parameters)
    min_ndim = 3 if gc_conv_only else 1
    all_grads = inputs.grads_of(params)
    inputs.check_tensors(all_grads, allow_fallback=False)
    grads = inputs.checked([g for g in all_grads if g.ndim > min_ndim])
    if not grads:
        return None
    for group in inputs.split_by_device(grads):
        inputs.pick("centralize", group, backend).centralize_(group)
    return None
