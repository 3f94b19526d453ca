"""Test inputs and comparison rules shared by the test modules."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DTYPE_IDS = ["fp32", "fp16", "bf16", "fp64"]

# Odd sizes, a 0-size tensor and sizes that cross the usual 1K/4K block and 64K chunk boundaries.
SHAPES = [(7,), (3, 5), (1,), (0,), (17, 33), (4, 3, 3, 3), (1025,), (2, 0, 3), (4097,), (257, 3), (65537,)]
SMALL_SHAPES = [(7,), (3, 5), (1,), (0,), (17, 33), (4, 3, 3, 3), (1025,)]


def randn(shape, dtype, device, gen: torch.Generator, scale: float = 1.0, noncontig: bool = False) -> Tensor:
    """Fresh random non-zero values (never zeros); non-contiguous when asked and possible."""
    if noncontig and len(shape) >= 1:
        base = torch.randn(*shape[:-1], shape[-1] * 2, generator=gen, dtype=torch.float64) * scale
        t = base[..., ::2]  # every other element of the last dim: non-contiguous, not dense
    else:
        t = torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale
    t = torch.where(t == 0, torch.full_like(t, 0.5), t)
    if noncontig and len(shape) >= 1:
        out = torch.empty(*shape[:-1], shape[-1] * 2, dtype=dtype, device=device)[..., ::2]
        out.copy_(t)
        return out
    return t.to(device, dtype)


def make_params(shapes: Sequence[tuple], dtypes, device: str, seed: int = 0, scale: float = 1.0,
                noncontig: bool = False, none_every: int = 0) -> list[torch.nn.Parameter]:
    """Parameters with random non-zero values and gradients; ``dtypes`` cycles over the shapes;
    every ``none_every``-th parameter (if > 0) gets no gradient."""
    if isinstance(dtypes, torch.dtype):
        dtypes = [dtypes]
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, shape in enumerate(shapes):
        dt = dtypes[i % len(dtypes)]
        p = torch.nn.Parameter(randn(shape, dt, device, gen))
        if not (none_every and i % none_every == none_every - 1):
            p.grad = randn(shape, dt, device, gen, scale=scale, noncontig=noncontig)
        params.append(p)
    return params


def clone_params(params: Sequence[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Deep copies that keep each gradient's strides (so non-contiguous stays non-contiguous)."""
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        if p.grad is not None:
            g = p.grad
            if g.is_contiguous():
                q.grad = g.clone()
            else:
                storage = torch.empty(g.untyped_storage().nbytes() // g.element_size(), dtype=g.dtype,
                                      device=g.device)
                c = storage.as_strided(g.shape, g.stride(), g.storage_offset())
                c.copy_(g)
                q.grad = c
        out.append(q)
    return out


def grads(params) -> list[Tensor]:
    return [p.grad for p in params if p.grad is not None]


def ulp(x: Tensor, dtype: torch.dtype) -> Tensor:
    """One unit in the last place of |x| in ``dtype`` (float64 tensor); smallest normal's ulp at 0."""
    fi = torch.finfo(dtype)
    a = x.abs().clamp(min=fi.tiny)
    _, e = torch.frexp(a)
    return torch.ldexp(torch.ones_like(a), (e - 1).to(torch.int32)) * fi.eps


def assert_no_worse_than(ours: Tensor, ref: Tensor, oracle: Tensor, dtype: torch.dtype, what: str = "") -> None:
    """SPEC section 3 accuracy rule, elementwise: |ours - oracle| <= |ref - oracle| + 1 ulp of ``dtype``.
    Non-finite values must match exactly (NaN where NaN, the same infinities)."""
    o = ours.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    t = oracle.detach().to("cpu", torch.float64)
    assert o.shape == t.shape, f"{what}: shape {tuple(o.shape)} != {tuple(t.shape)}"
    nonfinite = ~torch.isfinite(t) | ~torch.isfinite(r)
    if nonfinite.any():
        torch.testing.assert_close(o[nonfinite], r[nonfinite], rtol=0, atol=0, equal_nan=True, msg=what)
    f = ~nonfinite
    err = (o[f] - t[f]).abs()
    allowed = (r[f] - t[f]).abs() + ulp(t[f], dtype)
    bad = err > allowed
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {int(f.sum())} elements worse than the reference; worst: ours "
        f"{o[f][bad][:3].tolist()} ref {r[f][bad][:3].tolist()} oracle {t[f][bad][:3].tolist()}"
    )


def rtol_vs_torch(dtype: torch.dtype) -> float | None:
    """SPEC: fp32 results equal torch's within rtol 1e-6, fp64 within 1e-12 (others: oracle rule only)."""
    return {torch.float32: 1e-6, torch.float64: 1e-12}.get(dtype)


def bits(t: Tensor) -> Tensor:
    """Raw bits for bitwise comparisons (NaN payloads included)."""
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def is_nan(x) -> bool:
    return math.isnan(float(x))
