"""Float64 oracles written from the SPEC formulas, independent of every backend (and of torch.nn.utils)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

INF = float("inf")


def f64(t: Tensor) -> Tensor:
    return t.detach().to("cpu", torch.float64)


def tensor_norm(t: Tensor, p: float) -> float:
    x = f64(t).abs().flatten()
    if x.numel() == 0:
        return 0.0
    if p == INF:
        return float(x.max()) if not torch.isnan(x).any() else math.nan
    if p == -INF:
        return float(x.min())
    if p == 0:
        return float((x != 0).sum())
    return float(x.pow(p).sum().pow(1.0 / p))


def total_norm(tensors: list[Tensor], p: float) -> float:
    """Norm of the per-tensor norms (SPEC section 3)."""
    norms = torch.tensor([tensor_norm(t, p) for t in tensors], dtype=torch.float64)
    if p == 0:
        return float((norms != 0).sum())
    if p == INF:
        return float(norms.max()) if not torch.isnan(norms).any() else math.nan
    if p == -INF:
        return float(norms.min())
    return float(norms.pow(p).sum().pow(1.0 / p))


def clipped(grads: list[Tensor], max_norm: float, p: float) -> tuple[float, list[Tensor]]:
    total = total_norm(grads, p)
    coef = min(max_norm / (total + 1e-6), 1.0) if not math.isnan(total) else math.nan
    return total, [f64(g) * coef for g in grads]


def unit_norm(x: Tensor, p: float) -> Tensor:
    x = f64(x)
    if x.ndim <= 1:
        return torch.tensor(tensor_norm(x, p), dtype=torch.float64).reshape((1,) * x.ndim)
    flat = x.reshape(x.shape[0], -1).abs()
    if flat.shape[1] == 0:
        n = torch.zeros(x.shape[0], dtype=torch.float64)
    elif p == INF:
        n = flat.amax(dim=1)
    else:
        n = flat.pow(p).sum(dim=1).pow(1.0 / p)
    return n.reshape((x.shape[0],) + (1,) * (x.ndim - 1))


def agc(param: Tensor, grad: Tensor, clip_factor: float, eps: float, p: float) -> Tensor:
    """timm / NFNets: clip where not (||G|| < clip_factor * max(||W||, eps))."""
    w_norm = unit_norm(param, p)
    g_norm = unit_norm(grad, p)
    max_norm = w_norm.clamp(min=eps) * clip_factor
    ratio = max_norm / g_norm.clamp(min=1e-6)
    g = f64(grad)
    return torch.where(g_norm < max_norm, g, g * ratio)


def centralize(grad: Tensor) -> Tensor:
    g = f64(grad)
    return g - g.mean(dim=tuple(range(1, g.ndim)), keepdim=True)
