"""One-pass gradient health statistics: per tensor L2 norm, max |g| (NaN-propagating), and NaN, Inf and
exact-zero counts, from a single read of each gradient (per-block partials, then a per-tensor finalize).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .multi_tensor import (INF, Config, acc_of, block_info, tensor_base, device_guard, flat_inputs, get_plan,
                           nan_sticky, segment_reduce, sqrt_rn, tl_dtype)


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _stats_step(x, sq, mx, nanacc, cnan, cinf, czero, C: tl.constexpr, ACC: tl.constexpr):
    # Only the sum of squares needs the fp64 accumulator. max |x| and the three tests are exact in the
    # compute dtype C (fp32, fp64 for fp64 data), which keeps the per-element fp64 work (half-rate or less
    # on GPUs) to a convert and a multiply-add, and the max/NaN accumulators at half the registers.
    a = tl.abs(x.to(C))
    isnan = a != a
    a64 = a.to(ACC)
    sq += a64 * a64
    mx = tl.maximum(mx, tl.where(isnan, 0.0, a))
    nanacc += nan_sticky(a)
    cnan += isnan.to(tl.int32)
    cinf += (a == INF).to(tl.int32)
    czero += (a == 0.0).to(tl.int32)
    return sq, mx, nanacc, cnan, cinf, czero


@triton.jit(do_not_specialize=["b0", "nb"])
def _stats_partial_kernel(ptr_tab, blk_tab, fpart, ipart, b0, nb,
                          DT: tl.constexpr, C: tl.constexpr, ACC: tl.constexpr, ALIGNED: tl.constexpr,
                          BLOCK: tl.constexpr):
    bid = b0 + tl.program_id(0)
    t, start, n, seg = block_info(blk_tab, bid, 128 // DT.primitive_bitwidth if ALIGNED else 1)
    ptr = tensor_base(ptr_tab, t, DT, ALIGNED) + start
    sq = tl.zeros([BLOCK], ACC)
    mx = tl.zeros([BLOCK], C)
    nanacc = tl.zeros([BLOCK], C)
    cnan = tl.zeros([BLOCK], tl.int32)
    cinf = tl.zeros([BLOCK], tl.int32)
    czero = tl.zeros([BLOCK], tl.int32)
    ar = tl.arange(0, BLOCK)
    nfull = n - n % BLOCK
    for i in range(0, nfull, BLOCK):
        x = tl.load(ptr + i + ar)
        sq, mx, nanacc, cnan, cinf, czero = _stats_step(x, sq, mx, nanacc, cnan, cinf, czero, C, ACC)
    offs = nfull + ar
    m = offs < n
    x = tl.load(ptr + offs, mask=m, other=0.0)
    sq, mx, nanacc, cnan, cinf, czero = _stats_step(x, sq, mx, nanacc, cnan, cinf, czero, C, ACC)
    # masked lanes loaded 0.0: they must not count as zeros
    czero -= tl.where(m, 0, 1)
    # layout: fpart[0:nb] sums of squares, fpart[nb:2nb] maxima; ipart likewise for the three counts
    tl.store(fpart + bid, tl.sum(sq, 0))
    tl.store(fpart + nb + bid, (tl.max(mx, 0) + tl.sum(nanacc, 0)).to(ACC))
    tl.store(ipart + bid, tl.sum(cnan, 0))
    tl.store(ipart + nb + bid, tl.sum(cinf, 0))
    tl.store(ipart + 2 * nb + bid, tl.sum(czero, 0))


@triton.jit(do_not_specialize=["nsegs", "nb"])
def _stats_finalize_kernel(fpart, ipart, seg_tab, norm_out, max_out, nan_out, inf_out, zero_out, nsegs, nb,
                           ACC: tl.constexpr, OUT: tl.constexpr, SEG_BLOCK: tl.constexpr, PART_BLOCK: tl.constexpr):
    segs = tl.program_id(0) * SEG_BLOCK + tl.arange(0, SEG_BLOCK)
    smask = segs < nsegs
    sq = segment_reduce(fpart, seg_tab, segs, smask, ACC, False, PART_BLOCK)
    mx = segment_reduce(fpart + nb, seg_tab, segs, smask, ACC, True, PART_BLOCK)
    cnan = segment_reduce(ipart, seg_tab, segs, smask, tl.int64, False, PART_BLOCK)
    cinf = segment_reduce(ipart + nb, seg_tab, segs, smask, tl.int64, False, PART_BLOCK)
    czero = segment_reduce(ipart + 2 * nb, seg_tab, segs, smask, tl.int64, False, PART_BLOCK)
    tl.store(norm_out + segs, sqrt_rn(sq).to(OUT), mask=smask)
    tl.store(max_out + segs, mx.to(OUT), mask=smask)
    tl.store(nan_out + segs, cnan, mask=smask)
    tl.store(inf_out + segs, cinf, mask=smask)
    tl.store(zero_out + segs, czero, mask=smask)


# ---------------------------------------------------------------------------------------------- launcher
def launch_grad_stats(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(norm, max_abs, nan, inf, zero), each 1-D of len(tensors)."""
    flat, _ = flat_inputs(tensors)
    plan = get_plan((flat,))
    dev = flat[0].device
    acc = acc_of(flat)
    nb = max(plan.nblocks, 1)
    fpart = torch.empty(2 * nb, dtype=torch.float64, device=dev)  # fp64 partials, as in norm.py
    ipart = torch.empty(3 * nb, dtype=torch.int32, device=dev)
    n = plan.ntensors
    # separate buffers: custom ops may not return outputs that alias each other
    norm, max_abs = (torch.empty(n, dtype=acc, device=dev) for _ in range(2))
    nan, inf, zero = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(3))
    with device_guard(dev):
        for g in plan.groups:
            if g.count == 0:
                continue
            _stats_partial_kernel[(g.count,)](
                plan.ptr_tabs[0], plan.blk, fpart, ipart, g.b0, nb,
                DT=tl_dtype(g.dtypes[0]), C=tl.float64 if g.dtypes[0] == torch.float64 else tl.float32,
                ACC=tl.float64, ALIGNED=g.aligned, BLOCK=Config.BLOCK,
                num_warps=Config.NUM_WARPS, enable_fp_fusion=False)
        _stats_finalize_kernel[(triton.cdiv(n, Config.SEG_BLOCK),)](
            fpart, ipart, plan.seg, norm, max_abs, nan, inf, zero, plan.nsegs, nb,
            ACC=tl.float64, OUT=tl_dtype(acc), SEG_BLOCK=Config.SEG_BLOCK, PART_BLOCK=Config.PART_BLOCK,
            num_warps=4, enable_fp_fusion=False)
    return norm, max_abs, nan, inf, zero
