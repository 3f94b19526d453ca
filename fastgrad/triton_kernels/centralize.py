"""Gradient centralization over a whole list: per dim-0 row, subtract the row mean: ``x = T(x - mean)``.
16-bit rows sum in float32 lanes and subtract in float32 (``T(float(x) - float(mean))``, as torch's
``g.sub_(g.mean(...))`` computes it); float32 and float64 rows sum and subtract in fp64, each element rounded
once. The lanes are added and divided in fp64. (fp64 lanes and subtraction for 16-bit rows doubled the
tiles' registers and put three fp64 conversions per element on the GPU's slow fp64 conversion path: the
bf16 llama workloads ran at about 40% of the memory floor.)

With the row-wise plan (multi_tensor.get_plan(..., packed=True)), rows of at most ``Config.ROW_MAX``
elements take one launch per dtype group: a program sums several whole rows in [rows, columns] tiles and
subtracts each row's mean, re-reading the rows from cache. Longer rows are split over programs: the same
launch stores their partial sums, one launch reduces them in a fixed order into means, one launch subtracts.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .multi_tensor import (to_dt, Config, block_info, tensor_base, copy_back, device_guard, div_rn,
                           flat_inputs, get_plan, row_cols, row_starts, row_tile, rows_of, segment_reduce, tl_dtype)


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _gc_rows(ptr, length, nrows, DT: tl.constexpr, R: tl.constexpr, CB: tl.constexpr):
    """Centralize ``nrows`` whole rows of ``length`` elements from ``ptr``, R rows at a time."""
    C: tl.constexpr = tl.float64 if DT.primitive_bitwidth > 16 else tl.float32  # module docstring
    for r0 in range(0, nrows, R):
        base, rmask = row_starts(r0, nrows, length, R)
        acc = tl.zeros([R, CB], C)
        for c0 in range(0, length, CB):
            offs, m = row_tile(base, rmask, c0, length, CB)
            acc += tl.load(ptr + offs, mask=m, other=0.0).to(C)
        mu = div_rn(tl.sum(acc, 1).to(tl.float64), length.to(tl.float64)).to(C)
        for c0 in range(0, length, CB):
            offs, m = row_tile(base, rmask, c0, length, CB)
            x = tl.load(ptr + offs, mask=m, other=0.0)
            tl.store(ptr + offs, to_dt(x.to(C) - mu[:, None], DT), mask=m)


@triton.jit(do_not_specialize=["b0", "row_max"])
def _gc_rows_kernel(ptr_tab, blk_tab, seg_tab, part, b0, row_max, DT: tl.constexpr, ALIGNED: tl.constexpr,
                    BLOCK: tl.constexpr, COLS: tl.constexpr):
    bid = b0 + tl.program_id(0)
    t, start, n, seg = block_info(blk_tab, bid, 128 // DT.primitive_bitwidth if ALIGNED else 1)
    ptr = tensor_base(ptr_tab, t, DT, ALIGNED) + start
    length = tl.load(seg_tab + seg.to(tl.int64) * 3 + 2)
    if length > row_max:
        # one block of a split row: its partial sum, for _gc_mean_kernel
        C: tl.constexpr = tl.float64 if DT.primitive_bitwidth > 16 else tl.float32  # as in _gc_rows
        acc = tl.zeros([BLOCK], C)
        ar = tl.arange(0, BLOCK)
        nfull = n - n % BLOCK
        for i in range(0, nfull, BLOCK):
            acc += tl.load(ptr + i + ar).to(C)
        offs = nfull + ar
        acc += tl.load(ptr + offs, mask=offs < n, other=0.0).to(C)
        tl.store(part + bid, tl.sum(acc, 0).to(tl.float64))
    else:
        # whole rows, in [BLOCK // COLS, COLS] tiles. One width: a second one (short rows) doubled the row
        # code, and ptxas took 3-5x longer on it (sm_80, fp16, p=3: 47 s against 9 s)
        _gc_rows(ptr, length, n // length, DT, BLOCK // COLS, COLS)


@triton.jit(do_not_specialize=["nsplit"])
def _gc_mean_kernel(part, seg_tab, split_tab, mean, nsplit, ACC: tl.constexpr, SEG_BLOCK: tl.constexpr,
                    PART_BLOCK: tl.constexpr):
    """Means of the split rows (``split_tab``: their segment ids), partials reduced in a fixed order."""
    i = tl.program_id(0) * SEG_BLOCK + tl.arange(0, SEG_BLOCK)
    imask = i < nsplit
    segs = tl.load(split_tab + i, mask=imask, other=0)
    s = segment_reduce(part, seg_tab, segs, imask, ACC, False, PART_BLOCK)
    length = tl.load(seg_tab + segs.to(tl.int64) * 3 + 2, mask=imask, other=1).to(ACC)
    tl.store(mean + segs, div_rn(s, length), mask=imask)


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
    plan = get_plan((flat,), rows_of(flat), packed=True)
    if plan.nblocks == 0:
        return
    dev = flat[0].device
    # fp64 partial sums of the split rows; the slots of packed blocks stay unwritten
    part = torch.empty(plan.nblocks if plan.nsplit else 1, dtype=torch.float64, device=dev)
    with device_guard(dev):
        for g in plan.groups:
            if g.count:
                _gc_rows_kernel[(g.count,)](
                    plan.ptr_tabs[0], plan.blk, plan.seg, part, g.b0, Config.ROW_MAX, DT=tl_dtype(g.dtypes[0]),
                    ALIGNED=g.aligned, BLOCK=Config.BLOCK, COLS=row_cols(), num_warps=Config.NUM_WARPS,
                enable_fp_fusion=False)
        if plan.nsplit:
            mean = torch.empty(plan.nsegs, dtype=torch.float64, device=dev)
            _gc_mean_kernel[(triton.cdiv(plan.nsplit, Config.SEG_BLOCK),)](
                part, plan.seg, plan.split_segs, mean, plan.nsplit, ACC=tl.float64, SEG_BLOCK=Config.SEG_BLOCK,
                PART_BLOCK=Config.PART_BLOCK, num_warps=4, enable_fp_fusion=False)
            for g in plan.groups:
                if g.nsplit:
                    _gc_apply_kernel[(g.nsplit,)](
                        plan.ptr_tabs[0], plan.blk, mean, g.b0 + g.count - g.nsplit, DT=tl_dtype(g.dtypes[0]),
                        C=tl.float64 if g.dtypes[0].itemsize > 2 else tl.float32,  # as in _gc_rows
                        ALIGNED=g.aligned, BLOCK=Config.BLOCK, num_warps=Config.NUM_WARPS, enable_fp_fusion=False)
    copy_back(copies)
