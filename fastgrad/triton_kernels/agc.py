"""Adaptive gradient clipping (NFNets, timm's formula) over a whole parameter list in three launches
(per dtype group for the two passes over memory):

1. unit-wise partial norms of params and grads, one program per (tensor, unit, chunk) block, reading
   each parameter and gradient once; a unit is a dim-0 row for ndim > 1 and the whole tensor otherwise;
2. per unit, in a fixed order: ``max = clip_factor * max(||W||, eps)`` and the coefficient
   ``max / max(||G||, 1e-6)`` where ``not (||G|| < max)`` (so NaN clips), else exactly 1;
3. the scaled write: programs whose unit's coefficient is 1 return without touching memory.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .clip import _scale_kernel
from .multi_tensor import (Config, block_info, tensor_base, copy_back, device_guard, div_rn, flat_inputs,
                           get_plan, rows_of, segment_reduce, tl_dtype)
from .norm import MODE_P, _norm_step, _root, mode_of


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _unit_partial(ptr, n, p, DT: tl.constexpr, C: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                  BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], ACC)
    nanacc = tl.zeros([BLOCK], ACC)
    bad = tl.zeros([BLOCK], tl.int32)
    ar = tl.arange(0, BLOCK)
    nfull = n - n % BLOCK
    for i in range(0, nfull, BLOCK):
        x = tl.load(ptr + i + ar)
        acc, nanacc, bad = _norm_step(x, acc, nanacc, bad, 1.0, p, C, DT, ACC, MODE, False, False)
    offs = nfull + ar
    x = tl.load(ptr + offs, mask=offs < n, other=0.0)
    acc, nanacc, bad = _norm_step(x, acc, nanacc, bad, 1.0, p, C, DT, ACC, MODE, False, False)
    if MODE == 2:
        return tl.max(acc, 0) + tl.sum(nanacc, 0)
    else:
        return tl.sum(acc, 0)


@triton.jit(do_not_specialize=["b0", "nb"])
def _agc_partial_kernel(wptr_tab, gptr_tab, blk_tab, part, p: tl.float64, b0, nb,
                        DTW: tl.constexpr, DTG: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                        ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.full([], p, tl.float64)
    bid = b0 + tl.program_id(0)
    # the host checked both lists: block starts are whole 16-byte vectors of the narrower dtype too
    NARROW: tl.constexpr = DTW.primitive_bitwidth if DTW.primitive_bitwidth < DTG.primitive_bitwidth \
        else DTG.primitive_bitwidth
    t, start, n, seg = block_info(blk_tab, bid, 128 // NARROW if ALIGNED else 1)
    wp = tensor_base(wptr_tab, t, DTW, ALIGNED) + start
    gp = tensor_base(gptr_tab, t, DTG, ALIGNED) + start
    CW: tl.constexpr = tl.float64 if DTW == tl.float64 else tl.float32
    CG: tl.constexpr = tl.float64 if DTG == tl.float64 else tl.float32
    tl.store(part + bid, _unit_partial(wp, n, p, DTW, CW, ACC, MODE, BLOCK))
    tl.store(part + nb + bid, _unit_partial(gp, n, p, DTG, CG, ACC, MODE, BLOCK))


@triton.jit(do_not_specialize=["nsegs", "nb"])
def _agc_coef_kernel(part, seg_tab, coef, clip_factor: tl.float64, eps: tl.float64, tiny: tl.float64,
                     pinv: tl.float64, nsegs, nb, ACC: tl.constexpr, OUT: tl.constexpr, MODE: tl.constexpr,
                     SEG_BLOCK: tl.constexpr, PART_BLOCK: tl.constexpr):
    pinv = tl.full([], pinv, tl.float64)
    segs = tl.program_id(0) * SEG_BLOCK + tl.arange(0, SEG_BLOCK)
    smask = segs < nsegs
    # Norms, coefficient and the product are all fp64, so each clipped element is rounded once: never
    # less accurate than the reference, which rounds norms, ratio and product separately in fp32.
    w = _root(segment_reduce(part, seg_tab, segs, smask, ACC, MODE == 2, PART_BLOCK), pinv, MODE).to(OUT)
    g = _root(segment_reduce(part + nb, seg_tab, segs, smask, ACC, MODE == 2, PART_BLOCK), pinv, MODE).to(OUT)
    cf = tl.full([], clip_factor, OUT)
    e = tl.full([], eps, OUT)
    # clamp(min=...) keeps NaN, so select with '<' (false for NaN) rather than maximum()
    max_norm = tl.where(w < e, e, w) * cf
    # the 1e-6 floor arrives as an fp64 argument: an fp32 literal would be inexact for fp64 grads
    t = tl.full([], tiny, OUT)
    denom = tl.where(g < t, t, g)
    ratio = div_rn(max_norm, denom)
    tl.store(coef + segs, tl.where(g < max_norm, 1.0, ratio), mask=smask)


# ---------------------------------------------------------------------------------------------- launcher
def launch_agc_(params: Sequence[Tensor], grads: Sequence[Tensor], clip_factor: float, eps: float,
                norm_type: float) -> None:
    wflat, _ = flat_inputs(params, rowwise=True)
    gflat, copies = flat_inputs(grads, rowwise=True)
    plan = get_plan((wflat, gflat), rows_of(gflat))
    dev = gflat[0].device
    mode = mode_of(norm_type)
    p = float(norm_type) if mode == MODE_P else 1.0
    nb = max(plan.nblocks, 1)
    part = torch.empty(2 * nb, dtype=torch.float64, device=dev)  # fp64 partials, as in norm.py
    coef = torch.empty(max(plan.nsegs, 1), dtype=torch.float64, device=dev)
    with device_guard(dev):
        for g in plan.groups:
            if g.count == 0:
                continue
            _agc_partial_kernel[(g.count,)](
                plan.ptr_tabs[0], plan.ptr_tabs[1], plan.blk, part, p, g.b0, nb,
                DTW=tl_dtype(g.dtypes[0]), DTG=tl_dtype(g.dtypes[1]), ACC=tl.float64, MODE=mode,
                ALIGNED=g.aligned, BLOCK=Config.BLOCK, num_warps=Config.NUM_WARPS, enable_fp_fusion=False)
        if plan.nsegs:
            _agc_coef_kernel[(triton.cdiv(plan.nsegs, Config.SEG_BLOCK),)](
                part, plan.seg, coef, float(clip_factor), float(eps), 1e-6, 1.0 / p, plan.nsegs, nb,
                ACC=tl.float64, OUT=tl.float64, MODE=mode, SEG_BLOCK=Config.SEG_BLOCK, PART_BLOCK=Config.PART_BLOCK,
                num_warps=4, enable_fp_fusion=False)
        for g in plan.groups:
            if g.count == 0:
                continue
            dt = g.dtypes[1]
            _scale_kernel[(g.count,)](
                plan.ptr_tabs[1], plan.blk, coef, g.b0, DT=tl_dtype(dt), C=tl.float64, PER_SEG=True,
                ALIGNED=g.aligned, BLOCK=Config.BLOCK, num_warps=Config.NUM_WARPS, enable_fp_fusion=False)
    copy_back(copies)
