"""Adaptive gradient clipping (Brock et al. 2021, NFNets), with timm's formula.

Public entry point; the kernels are the backends' ``agc_`` primitive.
"""

from __future__ import annotations

import torch

from . import _inputs as inputs
from .decide import agc_factor, agc_limit

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

    Sparse gradients (``nn.Embedding(sparse=True)``) are clipped with the same rule on the rows they touch:
    the units are the slices along dim 0, as for a dense gradient, so an untouched row (zero gradient) is left
    alone exactly as the dense rule leaves it; only the parameter rows looked up are read. The gradient stays
    sparse and is scaled in place (duplicate COO entries of a row all get that row's factor, so their sum is
    the clipped row). The parameter itself must be dense.

    To exclude the classifier head (as the NFNet paper does), pass only the other parameters, e.g.
    ``adaptive_clip_grad_([p for n, p in model.named_parameters() if not n.startswith("fc.")])``.
    """
    params = inputs.as_list(parameters)
    clip_factor = inputs.check_non_negative("clip_factor", clip_factor)
    eps = inputs.check_non_negative("eps", eps)
    p = inputs.check_norm_type(norm_type)
    fast = inputs.pairs_of(params)
    if fast is not None:
        ws, gs = fast  # shapes and devices matched in one C++ pass; read-only use of ws under no_grad
    else:
        pairs = [(w, w.grad) for w in params if w.grad is not None]
        ws = [w.detach() for w, _ in pairs]
        gs = [g for _, g in pairs]
        for i, (w, g) in enumerate(pairs):
            if w.shape != g.shape:
                raise ValueError(
                    f"a gradient of shape {tuple(g.shape)} on {g.device} does not match its parameter of "
                    f"shape {tuple(w.shape)} on {w.device}"
                )
            if w.device != g.device:
                raise ValueError(inputs.wrong_device_message("adaptive_clip_grad_", "parameter", i, w.device, g.device))
    if not gs:
        return None
    # a Checked list (the compiled scan) holds dense tensors only: no per-tensor Python on the usual path
    sparse = [] if type(gs) is inputs.Checked else [i for i, g in enumerate(gs) if g.layout != torch.strided]
    if sparse:  # validated here, applied after the dense ones: nothing is modified before every check passed
        for i in sparse:
            _check_sparse(ws[i], gs[i])
        keep = [i for i in range(len(gs)) if gs[i].layout == torch.strided]
        sp_pairs = [(ws[i], gs[i]) for i in sparse]
        ws, gs = [ws[i] for i in keep], [gs[i] for i in keep]
        if gs:
            _agc_dense(ws, gs, clip_factor, eps, p, backend)
        for w, g in sp_pairs:
            _agc_sparse_(w, g, clip_factor, eps, p)
        return None
    _agc_dense(ws, gs, clip_factor, eps, p, backend)
    return None


def _agc_dense(ws, gs, clip_factor: float, eps: float, p: float, backend: str | None) -> None:
    inputs.check_tensors(gs, allow_fallback=False)
    inputs.check_tensors(ws, "parameters", allow_fallback=False)
    if type(gs) is inputs.Checked and type(ws) is inputs.Checked:  # one device, every tensor checked
        inputs.pick("agc", inputs.checked(ws + gs), backend, norm_type=p).agc_(ws, gs, clip_factor, eps, p)
        return None
    groups = inputs.group_by_device(gs)
    for idx in groups.values():
        gw, gg = [ws[i] for i in idx], [gs[i] for i in idx]
        b = inputs.pick("agc", gw + gg, backend, norm_type=p)
        b.agc_(gw, gg, clip_factor, eps, p)
    return None


def _check_sparse(w, g) -> None:
    if g.layout not in (torch.sparse_coo,):
        raise TypeError(f"adaptive_clip_grad_ reads sparse gradients in COO layout (nn.Embedding(sparse=True)); "
                        f"got a {g.layout} gradient; the gradients were not modified")
    if w.layout != torch.strided:
        raise TypeError("adaptive_clip_grad_ needs a dense parameter for a sparse gradient; got a "
                        f"{w.layout} parameter; the gradients were not modified")
    if not g.dtype.is_floating_point or g.dtype.is_complex:
        raise TypeError(f"gradients must be real floating point; got a sparse gradient of dtype {g.dtype}")
    if g.sparse_dim() < 1:
        raise TypeError("adaptive_clip_grad_: a sparse gradient with no sparse dimension is not supported; "
                        "the gradients were not modified")


def _agc_sparse_(w, g, clip_factor: float, eps: float, p: float) -> None:
    """AGC of one sparse COO gradient, per row of the rows it touches (see ``adaptive_clip_grad_``)."""
    acc = torch.float64 if g.dtype == torch.float64 or w.dtype == torch.float64 else torch.float32
    gc = g.coalesce()  # duplicates summed: the row norms are those of the dense gradient
    vals = gc.values().to(acc)
    if w.ndim <= 1:  # the unit is the whole tensor
        gn = _pnorm(vals.reshape(-1), p)
        wn = _pnorm(w.detach().reshape(-1).to(acc), p)
        scale = _agc_scale(gn, wn, clip_factor, eps)
        g._values().mul_(scale.to(g.dtype))
        return
    rows = gc.indices()[0]
    uniq, inv = torch.unique(rows, return_inverse=True)
    per = vals.reshape(vals.shape[0], -1).abs()  # one entry of the coalesced tensor: part of one row
    if p == float("inf"):
        part = per.amax(dim=1) if per.shape[1] else torch.zeros(per.shape[0], dtype=acc, device=per.device)
        gn = torch.zeros(len(uniq), dtype=acc, device=vals.device).scatter_reduce(0, inv, part, "amax")
        # amax ignores NaN in some versions: carry it explicitly (NaN propagates, as in the dense rule)
        has_nan = torch.zeros(len(uniq), dtype=torch.bool, device=vals.device).index_put_(
            (inv,), torch.isnan(per).any(dim=1), accumulate=True)
        gn = torch.where(has_nan, torch.nan, gn)
    else:
        part = per.pow(p).sum(dim=1)
        gn = torch.zeros(len(uniq), dtype=acc, device=vals.device).index_add_(0, inv, part).pow(1.0 / p)
    wr = w.detach().index_select(0, uniq).reshape(len(uniq), -1).to(acc)
    wn = wr.abs().amax(dim=1) if p == float("inf") else torch.linalg.vector_norm(wr, p, dim=1)
    scale_rows = _agc_scale(gn, wn, clip_factor, eps)
    # scale the gradient's own values (possibly uncoalesced) in place, each by the factor of its row
    g_rows = g._indices()[0]
    pos = torch.searchsorted(uniq, g_rows)
    factor = scale_rows.index_select(0, pos).to(g.dtype)
    v = g._values()
    v.mul_(factor.reshape((-1,) + (1,) * (v.ndim - 1)))


def _pnorm(x, p: float):
    if x.numel() == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.linalg.vector_norm(x, p)


def _agc_scale(gn, wn, clip_factor: float, eps: float):
    """timm's rule as a factor per row (fastgrad.decide: the dense path's own rule)."""
    return agc_factor(gn, agc_limit(wn, clip_factor, eps))
