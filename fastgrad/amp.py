"""AMP: ``scaler_unscale_and_clip`` replaces ``scaler.unscale_(optimizer)`` + ``clip_grad_norm_``: SPEC section 4.

This version composes the two steps (the torch semantics every backend must reproduce); the fused
one-read/one-write path builds on the backends' ``amp_norm`` and ``scale_`` primitives.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _inputs as I
from .clip import clip_grad_norm_

__all__ = ["scaler_unscale_and_clip"]


def optimizer_params(optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@torch.no_grad()
def scaler_unscale_and_clip(scaler, optimizer, max_norm: float, norm_type: float = 2.0, *,
                            error_if_nonfinite: bool = False, backend: str | None = None) -> Tensor:
    """``scaler.unscale_(optimizer)`` then ``clip_grad_norm_`` over the optimizer's parameters.

    Leaves the scaler's per-optimizer state as ``unscale_`` does, so ``scaler.step(optimizer)`` skips the
    step on overflow and ``scaler.update()`` backs the scale off. Returns the total norm of the unscaled
    gradients (non-finite after an overflow). A disabled scaler only clips.
    """
    max_norm = I.check_max_norm(max_norm)
    p = I.check_norm_type(norm_type)
    if scaler.is_enabled():
        scaler.unscale_(optimizer)
    return clip_grad_norm_(optimizer_params(optimizer), max_norm, p, error_if_nonfinite, backend=backend)
