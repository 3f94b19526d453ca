"""Fused AMP read pass: the norm of the unscaled gradients and the finiteness flag of the stored ones,
from one read of gradient memory.

It reuses the norm kernels (``HAS_SCALE``/``FLAG`` variants: each element is loaded once, checked for
NaN/inf as stored, multiplied by ``inv_scale`` and rounded to its dtype, the value ``scaler.unscale_``
would store, then accumulated). The single write happens afterwards in ``clip.launch_scale_`` with the
factor ``inv_scale * clip_coef`` computed on the device, so unscale + check + clip reads gradient memory
once for the norm and reads/writes it at most once more.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from .norm import launch_norm


def launch_amp_norm(tensors: Sequence[Tensor], inv_scale: Tensor, norm_type: float) -> tuple[Tensor, Tensor]:
    """(total norm of the unscaled values, found_inf as a 0-dim float32 1.0/0.0)."""
    total, _, found = launch_norm(tensors, norm_type, inv_scale=inv_scale)
    return total, found
