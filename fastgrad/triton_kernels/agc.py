"""Adaptive gradient clipping (NFNets, timm's formula) over a whole parameter list. A unit is a dim-0
row for ndim > 1 and the whole tensor otherwise; per unit ``max = clip_factor * max(||W||, eps)`` and, where
``not (||G|| < max)`` (so NaN clips), ``G *= max / max(||G||, 1e-6)``, else G is untouched.

The row-wise plan (multi_tensor.get_plan(..., packed=True)) makes this one launch per dtype group for
every unit of at most ``Config.ROW_MAX`` elements: a program takes several whole rows, reduces each row of W
and G (2-D tiles, rows x columns, the column width picked by the row length so short rows do not idle the
lanes), computes the coefficients and rescales the rows that need it, re-reading G from cache. Longer units
are split over programs: the same launch stores their per-block partials, then one launch reduces them in a
fixed order into per-unit coefficients and one launch writes (blocks whose coefficient is 1 return at once).
Norms of 16-bit tensors accumulate in float32 lanes (float32 and float64 tensors in float64 lanes); the
per-row sums, the coefficient and the product are fp64, and each clipped element is rounded once
(``to_dt_once``). fp64 lanes for 16-bit data doubled the registers of the [rows, columns] tiles and put two
more fp64 conversions per element on the GPU's slow fp64 conversion path (the bf16 llama workloads ran at
about half the memory floor).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .clip import scale_kernel
from .multi_tensor import (Config, block_info, tensor_base, copy_back, device_guard, div_rn, flat_inputs,
                           get_plan, row_cols, row_starts, row_tile, rows_of, segment_reduce, tl_dtype, to_dt_once)
from .norm import MODE_P, mode_of, norm_root, norm_step


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
        acc, nanacc, bad = norm_step(x, acc, nanacc, bad, 1.0, p, C, DT, ACC, MODE, False, False)
    offs = nfull + ar
    x = tl.load(ptr + offs, mask=offs < n, other=0.0)
    acc, nanacc, bad = norm_step(x, acc, nanacc, bad, 1.0, p, C, DT, ACC, MODE, False, False)
    if MODE == 2:
        return tl.max(acc, 0) + tl.sum(nanacc, 0)
    else:
        return tl.sum(acc, 0)


@triton.jit
def _agc_ratio(w, g, clip_factor, eps, tiny, OUT: tl.constexpr):
    """The per-unit coefficient from the unit norms ``w`` (param) and ``g`` (grad): exactly 1 where no
    clipping is due."""
    cf = tl.full([], clip_factor, OUT)
    e = tl.full([], eps, OUT)
    # clamp(min=...) keeps NaN, so select with '<' (false for NaN) rather than maximum()
    max_norm = tl.where(w < e, e, w) * cf
    # the 1e-6 floor arrives as an fp64 argument: an fp32 literal would be inexact for fp64 grads
    t = tl.full([], tiny, OUT)
    denom = tl.where(g < t, t, g)
    return tl.where(g < max_norm, 1.0, div_rn(max_norm, denom))


@triton.jit
def _agc_rows(wp, gp, length, nrows, clip_factor, eps, tiny, p, pinv, DTW: tl.constexpr, DTG: tl.constexpr,
              MODE: tl.constexpr, R: tl.constexpr, CB: tl.constexpr):
    """AGC of ``nrows`` whole rows of ``length`` elements from ``wp``/``gp``, R rows at a time in
    [R, CB] tiles."""
    # lane accumulators: float32 for 16-bit data (8 or 11 significant bits, results rounded to that), float64
    # for float32 and float64 (clipped elements held to within 1 ulp of the better of torch and the oracle)
    AW: tl.constexpr = tl.float64 if DTW.primitive_bitwidth > 16 else tl.float32
    AG: tl.constexpr = tl.float64 if DTG.primitive_bitwidth > 16 else tl.float32
    for r0 in range(0, nrows, R):
        base, rmask = row_starts(r0, nrows, length, R)
        aw = tl.zeros([R, CB], AW)
        nw = tl.zeros([R, CB], AW)
        ag = tl.zeros([R, CB], AG)
        ng = tl.zeros([R, CB], AG)
        bad = tl.zeros([R, CB], tl.int32)
        for c0 in range(0, length, CB):
            offs, m = row_tile(base, rmask, c0, length, CB)
            w = tl.load(wp + offs, mask=m, other=0.0)
            g = tl.load(gp + offs, mask=m, other=0.0)
            aw, nw, bad = norm_step(w, aw, nw, bad, 1.0, p, AW, DTW, AW, MODE, False, False)
            ag, ng, bad = norm_step(g, ag, ng, bad, 1.0, p, AG, DTG, AG, MODE, False, False)
        if MODE == 2:
            wn = (tl.max(aw, 1) + tl.sum(nw, 1)).to(tl.float64)
            gn = (tl.max(ag, 1) + tl.sum(ng, 1)).to(tl.float64)
        else:
            wn = tl.sum(aw, 1).to(tl.float64)
            gn = tl.sum(ag, 1).to(tl.float64)
        coef = _agc_ratio(norm_root(wn, pinv, MODE), norm_root(gn, pinv, MODE), clip_factor, eps, tiny, tl.float64)
        need = rmask & (coef != 1.0)
        if tl.max(need.to(tl.int32), 0) > 0:  # rows that keep their gradient are not written
            for c0 in range(0, length, CB):
                offs, m = row_tile(base, need, c0, length, CB)
                g = tl.load(gp + offs, mask=m, other=0.0)
                tl.store(gp + offs, to_dt_once(g.to(tl.float64) * coef[:, None], DTG), mask=m)


@triton.jit(do_not_specialize=["b0", "nb", "row_max"])
def _agc_rows_kernel(wptr_tab, gptr_tab, blk_tab, seg_tab, part, clip_factor: tl.float64, eps: tl.float64,
                     tiny: tl.float64, p: tl.float64, pinv: tl.float64, b0, nb, row_max,
                     DTW: tl.constexpr, DTG: tl.constexpr, MODE: tl.constexpr, ALIGNED: tl.constexpr,
                     BLOCK: tl.constexpr, COLS: tl.constexpr):
    p = tl.full([], p, tl.float64)
    pinv = tl.full([], pinv, tl.float64)
    bid = b0 + tl.program_id(0)
    # the host checked both lists: block starts are whole 16-byte vectors of the narrower dtype too
    NARROW: tl.constexpr = DTW.primitive_bitwidth if DTW.primitive_bitwidth < DTG.primitive_bitwidth \
        else DTG.primitive_bitwidth
    t, start, n, seg = block_info(blk_tab, bid, 128 // NARROW if ALIGNED else 1)
    wp = tensor_base(wptr_tab, t, DTW, ALIGNED) + start
    gp = tensor_base(gptr_tab, t, DTG, ALIGNED) + start
    length = tl.load(seg_tab + seg.to(tl.int64) * 3 + 2)
    if length > row_max:
        # one block of a split unit: its partial norms, for _agc_coef_kernel
        AW: tl.constexpr = tl.float64 if DTW.primitive_bitwidth > 16 else tl.float32  # as in _agc_rows
        AG: tl.constexpr = tl.float64 if DTG.primitive_bitwidth > 16 else tl.float32
        tl.store(part + bid, _unit_partial(wp, n, p, DTW, AW, AW, MODE, BLOCK).to(tl.float64))
        tl.store(part + nb + bid, _unit_partial(gp, n, p, DTG, AG, AG, MODE, BLOCK).to(tl.float64))
    else:
        # whole rows, in [BLOCK // COLS, COLS] tiles. One width: a second one (short rows) doubled the row
        # code, and ptxas took 3-5x longer on it (sm_80, fp16, p=3: 47 s against 9 s)
        _agc_rows(wp, gp, length, n // length, clip_factor, eps, tiny, p, pinv, DTW, DTG, MODE, BLOCK // COLS, COLS)


@triton.jit(do_not_specialize=["nsplit", "nb"])
def _agc_coef_kernel(part, seg_tab, split_tab, coef, clip_factor: tl.float64, eps: tl.float64,
                     tiny: tl.float64, pinv: tl.float64, nsplit, nb, ACC: tl.constexpr, OUT: tl.constexpr,
                     MODE: tl.constexpr, SEG_BLOCK: tl.constexpr, PART_BLOCK: tl.constexpr):
    """Coefficients of the split units (``split_tab``: their segment ids), partials reduced in a fixed
    order."""
    pinv = tl.full([], pinv, tl.float64)
    i = tl.program_id(0) * SEG_BLOCK + tl.arange(0, SEG_BLOCK)
    imask = i < nsplit
    segs = tl.load(split_tab + i, mask=imask, other=0)
    w = norm_root(segment_reduce(part, seg_tab, segs, imask, ACC, MODE == 2, PART_BLOCK), pinv, MODE).to(OUT)
    g = norm_root(segment_reduce(part + nb, seg_tab, segs, imask, ACC, MODE == 2, PART_BLOCK), pinv, MODE).to(OUT)
    tl.store(coef + segs, _agc_ratio(w, g, clip_factor, eps, tiny, OUT), mask=imask)


# ---------------------------------------------------------------------------------------------- launcher
def launch_agc_(params: Sequence[Tensor], grads: Sequence[Tensor], clip_factor: float, eps: float,
                norm_type: float) -> None:
    wflat, _ = flat_inputs(params, rowwise=True)
    gflat, copies = flat_inputs(grads, rowwise=True)
    plan = get_plan((wflat, gflat), rows_of(gflat), packed=True)
    dev = gflat[0].device
    mode = mode_of(norm_type)
    p = float(norm_type) if mode == MODE_P else 1.0
    nb = max(plan.nblocks, 1)
    # fp64 partials of the split units (as in norm.py); the slots of packed blocks stay unwritten
    part = torch.empty(2 * nb if plan.nsplit else 1, dtype=torch.float64, device=dev)
    coef = torch.empty(max(plan.nsegs, 1), dtype=torch.float64, device=dev) if plan.nsplit else None
    scalars = (float(clip_factor), float(eps), 1e-6)
    with device_guard(dev):
        for g in plan.groups:
            if g.count == 0:
                continue
            _agc_rows_kernel[(g.count,)](
                plan.ptr_tabs[0], plan.ptr_tabs[1], plan.blk, plan.seg, part,
                *scalars, p, 1.0 / p, g.b0, nb, Config.ROW_MAX,
                DTW=tl_dtype(g.dtypes[0]), DTG=tl_dtype(g.dtypes[1]), MODE=mode,
                ALIGNED=g.aligned, BLOCK=Config.BLOCK, COLS=row_cols(), num_warps=Config.NUM_WARPS,
                enable_fp_fusion=False)
        if plan.nsplit:
            _agc_coef_kernel[(triton.cdiv(plan.nsplit, Config.SEG_BLOCK),)](
                part, plan.seg, plan.split_segs, coef, *scalars, 1.0 / p, plan.nsplit, nb,
                ACC=tl.float64, OUT=tl.float64, MODE=mode, SEG_BLOCK=Config.SEG_BLOCK,
                PART_BLOCK=Config.PART_BLOCK, num_warps=4, enable_fp_fusion=False)
            for g in plan.groups:
                if g.nsplit == 0:
                    continue
                scale_kernel[(g.nsplit,)](
                    plan.ptr_tabs[1], plan.blk, coef, g.b0 + g.count - g.nsplit, DT=tl_dtype(g.dtypes[1]),
                    C=tl.float64, PER_SEG=True, ALIGNED=g.aligned, BLOCK=Config.BLOCK,
                    num_warps=Config.NUM_WARPS, enable_fp_fusion=False)
    copy_back(copies)
