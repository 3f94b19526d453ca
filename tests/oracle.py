"""Oracles written from the formulas of docs/contract.md, independent of every backend (and of torch.nn.utils).

They compute in numpy's long double (80-bit extended precision on x86-64: 64-bit significand), so that
even for float64 inputs the oracle is much more precise than what it checks. Element-wise results are
long double numpy arrays; scalar norms are Python floats."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

INF = float("inf")
LD = np.longdouble


def ld(x) -> np.ndarray:
    """Values of a tensor/array/number as a long double numpy array (exact for every fastgrad dtype)."""
    if isinstance(x, Tensor):
        return x.detach().to("cpu", torch.float64).numpy().astype(LD)
    return np.asarray(x, dtype=LD)


# Old name kept: "the inputs, exactly, in a precision above float64".
f64 = ld


def _norm(x: np.ndarray, p: float) -> LD:
    a = np.abs(x.reshape(-1))
    if a.size == 0:
        return LD(0)
    if np.isnan(a).any() and p != 0:
        return LD(math.nan)
    if p == INF:
        return a.max()
    if p == -INF:
        return a.min()
    if p == 0:
        return LD((a != 0).sum())
    return np.power(np.power(a, LD(p)).sum(), LD(1) / LD(p))


def tensor_norm(t, p: float) -> float:
    return float(_norm(ld(t), p))


def _total(tensors, p: float) -> LD:
    norms = np.array([_norm(ld(t), p) for t in tensors], dtype=LD)
    if p == 0:
        return LD((norms != 0).sum())
    return _norm(norms, p)


def total_norm(tensors, p: float) -> float:
    """Norm of the per-tensor norms (docs/contract.md section 3)."""
    return float(_total(tensors, p))


def clipped(grads, max_norm: float, p: float) -> tuple[float, list[np.ndarray]]:
    total = _total(grads, p)
    coef = min(LD(max_norm) / (total + LD(1e-6)), LD(1)) if not np.isnan(total) else LD(math.nan)
    return float(total), [ld(g) * coef for g in grads]


def unit_norm(x, p: float) -> np.ndarray:
    x = ld(x)
    if x.ndim <= 1:
        return np.array(_norm(x, p), dtype=LD).reshape((1,) * x.ndim)
    rows = x.reshape(x.shape[0], -1)
    n = np.array([_norm(r, p) for r in rows], dtype=LD)
    return n.reshape((x.shape[0],) + (1,) * (x.ndim - 1))


def agc(param, grad, clip_factor: float, eps: float, p: float) -> np.ndarray:
    """timm / NFNets: clip where not (||G|| < clip_factor * max(||W||, eps))."""
    w_norm = unit_norm(param, p)
    g_norm = unit_norm(grad, p)
    max_norm = np.maximum(w_norm, LD(eps)) * LD(clip_factor)
    max_norm = np.where(np.isnan(w_norm), LD(math.nan), max_norm)  # np.maximum would keep NaN anyway
    ratio = max_norm / np.maximum(g_norm, LD(1e-6))
    g = ld(grad)
    with np.errstate(invalid="ignore"):
        keep = g_norm < max_norm
    return np.where(keep, g, g * ratio)


def centralize(grad) -> np.ndarray:
    g = ld(grad)
    if g.size == 0:
        return g
    return g - g.mean(axis=tuple(range(1, g.ndim)), keepdims=True)


def norm_mode_steps(norms, k: float, alpha: float = 0.97, warm: int = 25) -> list[tuple[bool, int, float]]:
    """StepGuard's mode "norm" with ``skip_factor=k`` in plain float64, in the device ops' order: per step,
    (spike, finite norms counted, reference). The reference is the mean of the first ``warm`` finite norms,
    then their EMA (``alpha``), fed ``k`` times itself on a spike; a non-finite norm changes nothing."""
    n, mean, out = 0, 0.0, []
    for g in norms:
        if not math.isfinite(g):
            out.append((False, n, mean))
            continue
        ready = n >= warm
        spike = ready and g > k * mean
        if ready:
            mean = alpha * mean + (1 - alpha) * (k * mean if spike else g)
        else:
            mean = mean + (g - mean) / (n + 1)
        n += 1
        out.append((spike, n, mean))
    return out
