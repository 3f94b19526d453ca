"""Fused AMP read pass: the norm of the unscaled gradients and the finiteness flag of the stored ones,
from one read of gradient memory.

``launch_amp_clip_`` is the whole fused unscale + clip (``Backend.amp_clip_``): these partials, the norm's
finalize computing the total, found_inf and the factor ``inv_scale * clip_coef`` on the device, then the
conditional scale: three launches for a single-dtype list, no torch op between them.

It reuses the norm kernels (``HAS_SCALE``/``FLAG`` variants: each element is loaded once, checked for
NaN/inf as stored, multiplied by ``inv_scale`` and rounded to its dtype, the value ``scaler.unscale_``
would store, then accumulated). The single write happens afterwards in ``clip.launch_scale_`` with the
factor ``inv_scale * clip_coef`` computed on the device, so unscale + check + clip reads gradient memory
once for the norm and reads/writes it at most once more.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from .clip import scale_passes
from .multi_tensor import copy_back, flat_inputs, get_plan
from .norm import launch_norm, norm_passes


def launch_amp_norm(tensors: Sequence[Tensor], inv_scale: Tensor, norm_type: float) -> tuple[Tensor, Tensor]:
    """(total norm of the unscaled values, found_inf as a 0-dim float32 1.0/0.0)."""
    total, _, found = launch_norm(tensors, norm_type, inv_scale=inv_scale)
    return total, found


def launch_amp_clip_(tensors: Sequence[Tensor], inv_scale: Tensor, max_norm: float, norm_type: float,
                     write: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(total norm of the unscaled values, found_inf, factor): the bits of ``launch_amp_norm``, torch's clip
    coefficient times ``inv_scale`` in the accumulation dtype, and (``write``) ``launch_scale_`` by that
    factor (nothing written where it is 1). One table serves both passes."""
    flat, copies = flat_inputs(tensors)
    plan = get_plan((flat,))
    total, _, found, factor = norm_passes(flat, plan, norm_type, inv_scale, per_tensor=False, max_norm=max_norm)
    if write:
        scale_passes(flat, plan, factor)
        copy_back(copies)
    return total, found, factor
