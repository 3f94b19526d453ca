"""Multi-tensor in-place scale (the clip/unscale write) and clip-by-value, one pass each, and the whole
norm clip (``launch_clip_norm_``): the norm partials, one finalize program that also computes the clip
coefficient on the device, then this scale: three launches for a single-dtype list, no torch op between.

The scale factor is read from device memory by every program; when it is exactly 1 (the clip coefficient
clamped to 1: nothing to clip) the program returns before touching gradient memory, so "not clipping"
costs one 4-byte read per program and no host sync. A NaN factor is != 1 and writes NaN, as torch does.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .multi_tensor import to_dt, to_dt_once, Config, block_info, tensor_base, copy_back, device_guard, flat_inputs, get_plan, tl_dtype
from .norm import norm_passes


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["b0"])
def scale_kernel(ptr_tab, blk_tab, factor_ptr, b0, DT: tl.constexpr, C: tl.constexpr,
                  PER_SEG: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """x = T(x * f) with f one factor for the list (clip) or one per segment (AGC's per-row ratios);
    a block whose factor is exactly 1 returns without touching memory. A float64 product (C) is rounded to
    T once (to_dt_once)."""
    bid = b0 + tl.program_id(0)
    t, start, n, seg = block_info(blk_tab, bid, 128 // DT.primitive_bitwidth if ALIGNED else 1)
    if PER_SEG:
        f = tl.load(factor_ptr + seg).to(C)
    else:
        f = tl.load(factor_ptr).to(C)
    if f != 1.0:
        ptr = tensor_base(ptr_tab, t, DT, ALIGNED) + start
        ar = tl.arange(0, BLOCK)
        nfull = n - n % BLOCK
        for i in range(0, nfull, BLOCK):
            x = tl.load(ptr + i + ar)
            tl.store(ptr + i + ar, to_dt_once(x.to(C) * f, DT))
        offs = nfull + ar
        m = offs < n
        x = tl.load(ptr + offs, mask=m, other=0.0)
        tl.store(ptr + offs, to_dt_once(x.to(C) * f, DT), mask=m)


@triton.jit
def _clamp(x, lo, hi):
    # comparisons are false for NaN, so NaN passes through unchanged
    return tl.where(x < lo, lo, tl.where(x > hi, hi, x))


@triton.jit(do_not_specialize=["b0"])
def _clip_value_kernel(ptr_tab, blk_tab, clip_value: tl.float64, b0,
                       DT: tl.constexpr, C: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    bid = b0 + tl.program_id(0)
    t, start, n, seg = block_info(blk_tab, bid, 128 // DT.primitive_bitwidth if ALIGNED else 1)
    ptr = tensor_base(ptr_tab, t, DT, ALIGNED) + start
    # (tl.full, not tl.cast: the interpreter would round a Python float through fp32)
    # torch clamps in the op-math type with the bound rounded to it, then rounds to the tensor's dtype
    hi = tl.full([], clip_value, C)
    lo = -hi
    ar = tl.arange(0, BLOCK)
    nfull = n - n % BLOCK
    for i in range(0, nfull, BLOCK):
        x = tl.load(ptr + i + ar)
        tl.store(ptr + i + ar, to_dt(_clamp(x.to(C), lo, hi), DT))
    offs = nfull + ar
    m = offs < n
    x = tl.load(ptr + offs, mask=m, other=0.0)
    tl.store(ptr + offs, to_dt(_clamp(x.to(C), lo, hi), DT), mask=m)


# ---------------------------------------------------------------------------------------------- launchers
def scale_passes(flat: Sequence[Tensor], plan, factor: Tensor) -> None:
    """The scale launches (one per dtype group) over ``plan``, the table of ``flat``."""
    f64 = factor.dtype == torch.float64
    with device_guard(flat[0].device):
        for g in plan.groups:
            if g.count == 0:
                continue
            dt = g.dtypes[0]
            scale_kernel[(g.count,)](
                plan.ptr_tabs[0], plan.blk, factor, g.b0,
                DT=tl_dtype(dt), C=tl.float64 if (f64 or dt == torch.float64) else tl.float32, PER_SEG=False,
                ALIGNED=g.aligned, BLOCK=Config.BLOCK, num_warps=Config.NUM_WARPS, enable_fp_fusion=False)


def launch_scale_(tensors: Sequence[Tensor], factor: Tensor) -> None:
    flat, copies = flat_inputs(tensors)
    scale_passes(flat, get_plan((flat,)), factor)
    copy_back(copies)


def launch_clip_norm_(tensors: Sequence[Tensor], max_norm: float, norm_type: float) -> Tensor:
    """Clip ``tensors`` in place to total ``norm_type``-norm ``max_norm``; returns the total norm (0-dim,
    accumulation dtype). The coefficient ``min(max_norm / (total + 1e-6), 1)`` is computed by the norm's
    finalize program exactly as torch computes it on the total (norm.clip_coef), so the result is bitwise
    the unfused norm + torch.clamp + scale; a coefficient of 1 writes nothing. One table serves both passes."""
    flat, copies = flat_inputs(tensors)
    plan = get_plan((flat,))
    total, _, _, coef = norm_passes(flat, plan, norm_type, per_tensor=False, max_norm=max_norm)
    scale_passes(flat, plan, coef)
    copy_back(copies)
    return total


def launch_clip_value_(tensors: Sequence[Tensor], clip_value: float) -> None:
    flat, copies = flat_inputs(tensors)
    plan = get_plan((flat,))
    with device_guard(flat[0].device):
        for g in plan.groups:
            if g.count == 0:
                continue
            dt = g.dtypes[0]
            _clip_value_kernel[(g.count,)](
                plan.ptr_tabs[0], plan.blk, float(clip_value), g.b0,
                DT=tl_dtype(dt), C=tl.float64 if dt == torch.float64 else tl.float32,
                ALIGNED=g.aligned, BLOCK=Config.BLOCK, num_warps=Config.NUM_WARPS, enable_fp_fusion=False)
    copy_back(copies)
