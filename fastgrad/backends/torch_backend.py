"""The torch backend: every primitive in plain PyTorch ops. Always available, any device.

It is the reference the other backends are tested against, so it favours the obvious formulation
(fp32 accumulation through ``dtype=``, torch's ``_foreach_*`` where they give the same result) over speed.
It honours ``foreach`` exactly as ``torch.nn.utils`` does.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..decide import agc_factor, agc_limit
from .base import Backend, acc_dtype

try:  # private helpers torch.nn.utils itself uses; present since torch 2.0
    from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support
except ImportError:  # pragma: no cover - very old or very new torch
    def _device_has_foreach_support(device: torch.device) -> bool:
        return device.type in ("cpu", "cuda")

    def _has_foreach_support(tensors, device) -> bool:
        return _device_has_foreach_support(device) and all(t is None or type(t) is Tensor for t in tensors)

_INF = float("inf")


def _use_foreach(tensors: Sequence[Tensor], foreach: bool | None) -> bool:
    """torch.nn.utils' rule, including its error text for foreach=True on unsupported devices."""
    device = tensors[0].device
    if foreach is None:
        return _has_foreach_support(list(tensors), device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return bool(foreach)


def _by_dtype_indexed(tensors: Sequence[Tensor]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _by_dtype(tensors: Sequence[Tensor]) -> dict[torch.dtype, list[Tensor]]:
    return {dt: [tensors[i] for i in idx] for dt, idx in _by_dtype_indexed(tensors).items()}


def per_tensor_norms(tensors: Sequence[Tensor], norm_type: float, dtype: torch.dtype,
                     foreach: bool | None = None) -> list[Tensor]:
    """Each tensor's p-norm accumulated in ``dtype``, in input order.

    A zero-size tensor's norm is 0 for p >= 0 and inf (torch raises for those on empty input, but the
    norm of nothing is 0); for negative p and -inf torch's own answer is kept.
    """
    out: list[Tensor | None] = [None] * len(tensors)
    todo = []
    for i, t in enumerate(tensors):
        if t.numel() == 0 and (norm_type >= 0):
            out[i] = torch.zeros((), dtype=dtype, device=t.device)
        else:
            todo.append(i)
    if todo:
        ts = [tensors[i] for i in todo]
        if _use_foreach(ts, foreach):
            norms = torch._foreach_norm(ts, norm_type, dtype=dtype)
        else:
            norms = [torch.linalg.vector_norm(t, norm_type, dtype=dtype) for t in ts]
        for i, n in zip(todo, norms):
            out[i] = n
    return out  # type: ignore[return-value]


# Elements per batch of the AMP read pass (TorchBackend.amp_norm): 2 MiB of fp32 on the CPU, so a batch is
# unscaled and reduced while it is in cache; on GPUs few large batches (each costs a few launches).
_AMP_BATCH_CPU = 1 << 19
_AMP_BATCH = 1 << 26


def _batches(tensors: Sequence[Tensor], limit: int):
    """Flat pieces of the non-empty ``tensors`` (one dtype) in lists of at most ``limit`` elements, with the
    index in ``tensors`` each piece comes from; tensors longer than ``limit`` are cut into pieces."""
    batch: list[Tensor] = []
    owners: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if n == 0:
            continue
        flat = t.reshape(-1)  # a view when t is contiguous; a (read-only) copy otherwise
        for piece in (flat.split(limit) if n > limit else (flat,)):
            if batch and size + piece.numel() > limit:
                yield batch, owners
                batch, owners, size = [], [], 0
            batch.append(piece)
            owners.append(i)
            size += piece.numel()
    if batch:
        yield batch, owners


def combine_norms(norms: Tensor, norm_type: float) -> Tensor:
    """Total norm from a 1-D tensor of per-part norms.

    For p != 0 this is the p-norm of the norms (what torch computes). The 0-"norm" counts nonzeros, so
    parts combine by summing (torch's norm-of-norms would count *parts* with a nonzero instead)."""
    if norm_type == 0:
        return norms.sum()
    return torch.linalg.vector_norm(norms, norm_type)


class TorchBackend(Backend):
    name = "torch"
    devices = ()  # any device torch runs on

    # ---------------------------------------------------------------- norms
    def norm(self, tensors, norm_type, *, per_tensor=False, foreach=None):
        dtype = acc_dtype(tensors)
        norms = torch.stack(per_tensor_norms(tensors, norm_type, dtype, foreach))
        # The total of one device's list is the norm of its per-tensor norms, as in torch. (For p = 0 that
        # counts tensors with a nonzero element, which is torch's answer for a single device.)
        total = torch.linalg.vector_norm(norms, norm_type)
        return total, (norms if per_tensor else None)

    def amp_norm(self, tensors, inv_scale, norm_type):
        dtype = acc_dtype(tensors)
        if norm_type <= 0:
            return self._amp_norm_per_tensor(tensors, inv_scale, norm_type, dtype)
        # Bounded batches (pieces of at most `limit` elements; small tensors concatenated into a buffer):
        # each batch is read from gradient memory once, by torch.aminmax, whose min and max propagate NaN
        # and so find NaN and +-inf among the stored values exactly as unscale_'s check does. The values
        # unscale_ would store, T(x * inv_scale), are then written into one small buffer and reduced while
        # they are in cache, per tensor as self.norm reduces them. (An unscaled copy of every gradient
        # cost ~5x torch's unscale_ + clip on a CPU, and torch's CPU inf-norm, the obvious flag, runs ~10x
        # slower than aminmax.)
        dev = tensors[0].device
        limit = _AMP_BATCH_CPU if dev.type == "cpu" else _AMP_BATCH
        pieces: list[list[Tensor]] = [[] for _ in tensors]  # per tensor: norms of its pieces
        bad: list[Tensor] = []
        for group in _by_dtype_indexed(tensors).values():
            ts = [tensors[i] for i in group]
            inv = inv_scale.to(dev, torch.float64 if ts[0].dtype == torch.float64 else torch.float32)
            buf = None
            lows, highs = [], []
            for batch, owners in _batches(ts, limit):
                sizes = [t.numel() for t in batch]
                n = sum(sizes)
                if buf is None:
                    buf = torch.empty(min(limit, sum(t.numel() for t in ts)), dtype=ts[0].dtype, device=dev)
                view = buf[:n]
                src = batch[0] if len(batch) == 1 else torch.cat(batch, out=view)
                lo, hi = torch.aminmax(src)
                lows.append(lo)
                highs.append(hi)
                torch.mul(src, inv, out=view)  # rounded to the grad dtype, as unscale_ stores it
                views = list(view.split(sizes)) if len(batch) > 1 else [view]
                for j, nrm in zip(owners, per_tensor_norms(views, norm_type, dtype)):
                    pieces[group[j]].append(nrm)
            if lows:  # judged in the group's own dtype (a huge float64 is finite, not inf)
                bad.append(~(torch.isfinite(torch.stack(lows).min()) & torch.isfinite(torch.stack(highs).max())))
        if not bad:  # every tensor is empty
            return torch.zeros((), dtype=dtype, device=dev), torch.zeros((), dtype=torch.float32, device=dev)
        zero = torch.zeros((), dtype=dtype, device=dev)
        norms = [zero if not ps else ps[0] if len(ps) == 1 else torch.linalg.vector_norm(torch.stack(ps), norm_type)
                 for ps in pieces]
        found_inf = (torch.stack(bad).any() if len(bad) > 1 else bad[0]).to(torch.float32)
        # as self.norm: the norm of the per-tensor norms, in input order
        return torch.linalg.vector_norm(torch.stack(norms), norm_type), found_inf

    def _amp_norm_per_tensor(self, tensors, inv_scale, norm_type, dtype):
        """The plain formulation (unscaled copies of every tensor, then self.norm), kept for p <= 0 whose
        totals do not combine from pieces the way torch combines whole tensors."""
        nonempty = [t for t in tensors if t.numel()]
        if nonempty:
            amax = torch.stack(torch._foreach_norm(nonempty, _INF, dtype=dtype)).max()
            found_inf = (~torch.isfinite(amax)).to(torch.float32)
        else:
            found_inf = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
        unscaled = [(t * inv_scale.to(torch.float64 if t.dtype == torch.float64 else torch.float32)).to(t.dtype)
                    for t in tensors]
        total, _ = self.norm(unscaled, norm_type)
        return total, found_inf

    # ---------------------------------------------------------------- elementwise
    def scale_(self, tensors, factor, *, foreach=None):
        for group in _by_dtype(tensors).values():
            if _use_foreach(group, foreach):
                torch._foreach_mul_(group, factor)
            else:
                for t in group:
                    t.mul_(factor)

    def clip_value_(self, tensors, clip_value, *, foreach=None):
        for group in _by_dtype(tensors).values():
            if _use_foreach(group, foreach):
                torch._foreach_clamp_min_(group, -clip_value)
                torch._foreach_clamp_max_(group, clip_value)
            else:
                for t in group:
                    t.clamp_(min=-clip_value, max=clip_value)

    # ---------------------------------------------------------------- per-parameter ops
    def agc_(self, params, grads, clip_factor, eps, norm_type):
        for p, g in zip(params, grads):
            dtype = acc_dtype((p, g))
            dims = tuple(range(1, g.ndim)) if g.ndim > 1 else None
            p_norm = _unit_norm(p, norm_type, dims, dtype)
            g_norm = _unit_norm(g, norm_type, dims, dtype)
            # multiplying the kept units by exactly 1 leaves their bits unchanged
            g.mul_(agc_factor(g_norm, agc_limit(p_norm, clip_factor, eps)))

    def centralize_(self, grads):
        for g in grads:
            dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
            mean = g.mean(dim=tuple(range(1, g.ndim)), keepdim=True, dtype=dtype)
            g.sub_(mean)  # computed in `dtype`, rounded once to g's dtype

    def grad_stats(self, tensors):
        dtype = acc_dtype(tensors)
        dev = tensors[0].device
        norms = torch.stack(per_tensor_norms(tensors, 2.0, dtype))
        zero = torch.zeros((), dtype=dtype, device=dev)
        max_abs = torch.stack([t.abs().amax().to(dtype) if t.numel() else zero for t in tensors])
        nan = torch.stack([torch.isnan(t).sum() for t in tensors])
        inf = torch.stack([torch.isinf(t).sum() for t in tensors])
        zeros = torch.stack([(t == 0).sum() for t in tensors])
        return {"norm": norms, "max_abs": max_abs, "nan": nan, "inf": inf, "zero": zeros}


def _unit_norm(x: Tensor, norm_type: float, dims, dtype: torch.dtype) -> Tensor:
    """timm's unitwise_norm with fp32 (fp64) accumulation: whole tensor for ndim <= 1, else per dim-0 slice."""
    if x.numel() == 0:
        shape = (x.shape[0],) + (1,) * (x.ndim - 1) if dims is not None else (1,) * x.ndim
        return torch.zeros(shape, dtype=dtype, device=x.device)
    return torch.linalg.vector_norm(x, norm_type, dim=dims, keepdim=True, dtype=dtype)
