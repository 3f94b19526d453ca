"""Gradient centralization over a whole list: per dim-0 row, subtract the row mean (accumulated in fp32,
fp64 for fp64). Three launches (per dtype group for the passes over memory): row partial sums, per-row
means reduced in a fixed order, and the subtraction ``x = T(float(x) - mean)``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .multi_tensor import (to_dt, Config, block_info, tensor_base, copy_back, device_guard, div_rn,
                           flat_inputs, get_plan, rows_of, segment_reduce, tl_dtype)


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["b0"])
def _gc_partial_kernel(ptr_tab, blk_tab, part, b0, DT: tl.constexpr, ACC: tl.constexpr,
                       ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    bid = b0 + tl.program_id(0)
    t, start, n, seg = block_info(blk_tab, bid, 128 // DT.primitive_bitwidth if ALIGNED else 1)
    ptr = tensor_base(ptr_tab, t, DT, ALIGNED) + start
    acc = tl.zeros([BLOCK], ACC)
    ar = tl.arange(0, BLOCK)
    nfull = n - n % BLOCK
    for i in range(0, nfull, BLOCK):
        acc += tl.load(ptr + i + ar).to(ACC)
    offs = nfull + ar
    acc += tl.load(ptr + offs, mask=offs < n, other=0.0).to(ACC)
    tl.store(part + bid, tl.sum(acc, 0))


@triton.jit(do_not_specialize=["nsegs"])
def _gc_mean_kernel(part, seg_tab, mean, nsegs, ACC: tl.constexpr, SEG_BLOCK: tl.constexpr,
                    PART_BLOCK: tl.constexpr):
    segs = tl.program_id(0) * SEG_BLOCK + tl.arange(0, SEG_BLOCK)
    smask = segs < nsegs
    s = segment_reduce(part, seg_tab, segs, smask, ACC, False, PART_BLOCK)
    length = tl.load(seg_tab + segs.to(tl.int64) * 3 + 2, mask=smask, other=1).to(ACC)
    tl.store(mean + segs, div_rn(s, length), mask=smask)


@triton.jit(do_not_specialize=["b0"])
def _gc_apply_kernel(ptr_tab, blk_tab, mean, b0, DT: tl.constexpr, C: tl.constexpr,
                     ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    bid = b0 + tl.program_id(0)
    t, start, n, seg = block_info(blk_tab, bid, 128 // DT.primitive_bitwidth if ALIGNED else 1)
    ptr = tensor_base(ptr_tab, t, DT, ALIGNED) + start
    mu = tl.load(mean + seg).to(C)
    ar = tl.arange(0, BLOCK)
    nfull = n - n % BLOCK
    for i in range(0, nfull, BLOCK):
        x = tl.load(ptr + i + ar)
        tl.store(ptr + i + ar, to_dt(x.to(C) - mu, DT))
    offs = nfull + ar
    m = offs < n
    x = tl.load(ptr + offs, mask=m, other=0.0)
    tl.store(ptr + offs, to_dt(x.to(C) - mu, DT), mask=m)


# ---------------------------------------------------------------------------------------------- launcher
def launch_centralize_(grads: Sequence[Tensor]) -> None:
    flat, copies = flat_inputs(grads, rowwise=True)
    plan = get_plan((flat,), rows_of(flat))
    if plan.nblocks == 0:
        return
    dev = flat[0].device
    # fp64 sums, means and subtraction: each element is rounded once, as in norm.py
    part = torch.empty(plan.nblocks, dtype=torch.float64, device=dev)
    mean = torch.empty(plan.nsegs, dtype=torch.float64, device=dev)
    with device_guard(dev):
        for g in plan.groups:
            if g.count:
                _gc_partial_kernel[(g.count,)](
                    plan.ptr_tabs[0], plan.blk, part, g.b0, DT=tl_dtype(g.dtypes[0]), ACC=tl.float64,
                    ALIGNED=g.aligned, BLOCK=Config.BLOCK, num_warps=Config.NUM_WARPS, enable_fp_fusion=False)
        _gc_mean_kernel[(triton.cdiv(plan.nsegs, Config.SEG_BLOCK),)](
            part, plan.seg, mean, plan.nsegs, ACC=tl.float64, SEG_BLOCK=Config.SEG_BLOCK,
            PART_BLOCK=Config.PART_BLOCK, num_warps=4, enable_fp_fusion=False)
        for g in plan.groups:
            if g.count:
                dt = g.dtypes[0]
                _gc_apply_kernel[(g.count,)](
                    plan.ptr_tabs[0], plan.blk, mean, g.b0, DT=tl_dtype(dt),
                    C=tl.float64,  # x - mean in fp64, rounded once
                    ALIGNED=g.aligned, BLOCK=Config.BLOCK, num_warps=Config.NUM_WARPS, enable_fp_fusion=False)
    copy_back(copies)
