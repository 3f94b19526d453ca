"""Adaptive gradient clipping (Brock et al. 2021, NFNets), with timm's formula: docs/contract.md section 5.

Public entry point; the kernels are the backends' ``agc_`` primitive.
"""

from __future__ import annotations

import torch

from . import _inputs as I

__all__ = ["adaptive_clip_grad_"]


@torch.no_grad()
def adaptive_clip_grad_(parameters, clip_factor: float = 0.01, eps: float = 1e-3, norm_type: float = 2.0, *,
                        backend: str | None = None) -> None:
    """Clip each gradient unit-wise relative to its parameter's norm, in place.

    A unit is the whole tensor for ``ndim <= 1`` and each slice along dim 0 otherwise (an output
    channel / row). With ``max_i = clip_factor * max(||W_i||, eps)``, a unit whose gradient norm is not below
    ``max_i`` is rescaled to norm ``max_i`` (ratio ``max_i / max(||G_i||, 1e-6)``); others are untouched, so
    zero gradients stay zero and NaN propagates, exactly as ``timm.utils.adaptive_clip_grad``. Norms are
    accumulated in float32 (float64 for float64), which is more accurate than timm's in-dtype norms.

    To exclude the classifier head (as the NFNet paper does), pass only the other parameters, e.g.
    ``adaptive_clip_grad_([p for n, p in model.named_parameters() if not n.startswith("fc.")])``.
    """
    params = I.as_list(parameters)
    clip_factor = I.check_non_negative("clip_factor", clip_factor)
    eps = I.check_non_negative("eps", eps)
    p = I.check_norm_type(norm_type)
    fast = I.pairs_of(params)
    if fast is not None:
        ws, gs = fast  # shapes and devices matched in one C++ pass; read-only use of ws under no_grad
    else:
        pairs = [(w, w.grad) for w in params if w.grad is not None]
        ws = [w.detach() for w, _ in pairs]
        gs = [g for _, g in pairs]
        for w, g in pairs:
            if w.shape != g.shape or w.device != g.device:
                raise ValueError(
                    f"a gradient of shape {tuple(g.shape)} on {g.device} does not match its parameter of "
                    f"shape {tuple(w.shape)} on {w.device}"
                )
    if not gs:
        return None
    I.check_tensors(gs, allow_fallback=False)
    I.check_tensors(ws, "parameters", allow_fallback=False)
    if type(gs) is I.Checked and type(ws) is I.Checked:  # one device, every tensor checked
        I.pick("agc", I.checked(ws + gs), backend, norm_type=p).agc_(ws, gs, clip_factor, eps, p)
        return None
    groups = I.group_by_device(gs)
    for idx in groups.values():
        gw, gg = [ws[i] for i in idx], [gs[i] for i in idx]
        b = I.pick("agc", gw + gg, backend, norm_type=p)
        b.agc_(gw, gg, clip_factor, eps, p)
    return None
