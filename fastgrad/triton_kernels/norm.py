"""Multi-tensor p-norms: per-block partials, then one deterministic finalize program.

Pass 1 (one launch per dtype group): each program reduces its block to one partial in the accumulation
dtype: sum x^2 (p=2), sum |x| (p=1), max |x| with NaN propagating (p=inf) or sum |x|^p (any p > 0), and,
for the AMP path, a "non-finite seen" flag of the stored values from the same read.
Pass 2 (one program): reduces each tensor's partials in a fixed order (per-tensor norms), the per-tensor
sums into the total, and the flags into found_inf. No atomics, so results are bitwise reproducible. For
clipping (``COEF``) the same program also computes the clip coefficient from the total, so a clip is
partials, this finalize and the conditional scale (``clip.launch_clip_norm_``) with no torch op between.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .multi_tensor import (to_dt, INF, Config, acc_of, block_info, tensor_base, device_guard, div_rn, get_plan,
                           nan_sticky, pow_fp64, segment_reduce, sqrt_rn, tl_dtype, flat_inputs)

MODE_L2, MODE_L1, MODE_INF, MODE_P = 0, 1, 2, 3


def mode_of(norm_type: float) -> int:
    if norm_type == 2.0:
        return MODE_L2
    if norm_type == 1.0:
        return MODE_L1
    if norm_type == float("inf"):
        return MODE_INF
    return MODE_P


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def norm_step(x, acc, nanacc, bad, scale, p, C: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr,
               MODE: tl.constexpr, HAS_SCALE: tl.constexpr, FLAG: tl.constexpr):
    xf = x.to(C)
    if FLAG:
        bad = tl.maximum(bad, tl.where(tl.abs(xf) < INF, 0, 1))
    if HAS_SCALE:
        # the value unscale_ would store, rounded to the gradient's dtype
        xf = to_dt(xf * scale, DT).to(C)
    a = tl.abs(xf.to(ACC))
    if MODE == 0:
        acc += a * a
    elif MODE == 1:
        acc += a
    elif MODE == 2:
        acc = tl.maximum(acc, tl.where(a == a, a, 0.0))
        nanacc += nan_sticky(a)
    else:
        acc += pow_fp64(a, p).to(ACC)
    return acc, nanacc, bad


@triton.jit(do_not_specialize=["b0"])
def _norm_partial_kernel(ptr_tab, blk_tab, part, flags, scale_ptr, p: tl.float64, b0,
                         DT: tl.constexpr, C: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                         HAS_SCALE: tl.constexpr, FLAG: tl.constexpr, ALIGNED: tl.constexpr,
                         BLOCK: tl.constexpr):
    p = tl.full([], p, tl.float64)  # exact fp64 in the interpreter too
    bid = b0 + tl.program_id(0)
    t, start, n, seg = block_info(blk_tab, bid, 128 // DT.primitive_bitwidth if ALIGNED else 1)
    ptr = tensor_base(ptr_tab, t, DT, ALIGNED) + start
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(C)
    acc = tl.zeros([BLOCK], ACC)
    nanacc = tl.zeros([BLOCK], ACC)
    bad = tl.zeros([BLOCK], tl.int32)
    ar = tl.arange(0, BLOCK)
    nfull = n - n % BLOCK
    # full tiles without a mask (vectorisable), then one masked tail
    for i in range(0, nfull, BLOCK):
        x = tl.load(ptr + i + ar)
        acc, nanacc, bad = norm_step(x, acc, nanacc, bad, scale, p, C, DT, ACC, MODE, HAS_SCALE, FLAG)
    offs = nfull + ar
    x = tl.load(ptr + offs, mask=offs < n, other=0.0)
    acc, nanacc, bad = norm_step(x, acc, nanacc, bad, scale, p, C, DT, ACC, MODE, HAS_SCALE, FLAG)
    if MODE == 2:
        r = tl.max(acc, 0) + tl.sum(nanacc, 0)
    else:
        r = tl.sum(acc, 0)
    tl.store(part + bid, r)
    if FLAG:
        tl.store(flags + bid, tl.max(bad, 0))


@triton.jit
def norm_root(s, pinv, MODE: tl.constexpr):
    if MODE == 0:
        return sqrt_rn(s)
    elif MODE == 3:
        return pow_fp64(s, pinv).to(s.dtype)
    else:
        return s


@triton.jit
def clip_coef(total, max_norm, eps, OUT: tl.constexpr):
    """``torch.clamp(max_norm / (total + eps), max=1.0)`` as torch evaluates it on a 0-dim ``OUT`` tensor,
    bit for bit: the Python scalars rounded to OUT, ``total + eps``, then ``max_norm / t``, which torch runs
    as ``reciprocal(t) * max_norm`` (Tensor.__rdiv__), each step rounded to OUT; the clamp keeps NaN."""
    d = total + tl.full([], eps, OUT)
    c = div_rn(tl.full([], 1.0, OUT), d) * tl.full([], max_norm, OUT)
    return tl.where(c > 1.0, tl.full([], 1.0, OUT), c)


@triton.jit(do_not_specialize=["nsegs", "nblocks"])
def _norm_finalize_kernel(part, flags, seg_tab, total_out, per_out, found_out, coef_out, inv_ptr, pinv: tl.float64,
                          max_norm: tl.float64, eps: tl.float64, nsegs, nblocks,
                          ACC: tl.constexpr, OUT: tl.constexpr, MODE: tl.constexpr, FLAG: tl.constexpr,
                          PER: tl.constexpr, COEF: tl.constexpr,
                          SEG_BLOCK: tl.constexpr, PART_BLOCK: tl.constexpr, EXACT: tl.constexpr,
                          FLAG_BLOCK: tl.constexpr):
    pinv = tl.full([], pinv, tl.float64)
    tot = tl.zeros([SEG_BLOCK], ACC)
    totc = tl.zeros([SEG_BLOCK], ACC)
    totp = tl.zeros([SEG_BLOCK], ACC)  # plain sum: the answer when anything is inf/NaN
    totnan = tl.zeros([SEG_BLOCK], ACC)
    for s0 in range(0, nsegs, SEG_BLOCK):
        segs = s0 + tl.arange(0, SEG_BLOCK)
        smask = segs < nsegs
        v = segment_reduce(part, seg_tab, segs, smask, ACC, MODE == 2, PART_BLOCK)
        if PER:
            tl.store(per_out + segs, norm_root(v, pinv, MODE).to(OUT), mask=smask)
        # the total is reduced from the per-tensor sums (not roots): same value, one rounding fewer
        if MODE == 2:
            tot = tl.maximum(tot, tl.where(v == v, v, 0.0))
            totnan += nan_sticky(v)
        else:
            totp += v
            if EXACT:
                y = v - totc
                t = tot + y
                totc = (t - tot) - y
                tot = t
    if MODE == 2:
        total = tl.max(tot, 0) + tl.sum(totnan, 0)
    elif EXACT:
        # fp64 results have no wider accumulator: a tree sum of the lanes costs up to ~2 ulp of the sum
        # (1 ulp of the root), so the lanes are added in sequence with Kahan compensation. 128 steps in
        # one program, and only for lists holding fp64 tensors.
        lanes = tl.arange(0, SEG_BLOCK)
        rest = tot - totc
        total = tl.sum(tl.where(lanes == 0, rest, 0.0), 0)
        c = total * 0.0
        for j in range(1, SEG_BLOCK):
            x = tl.sum(tl.where(lanes == j, rest, 0.0), 0)  # exact: one value plus zeros
            y = x - c
            t = total + y
            c = (t - total) - y
            total = t
        plain = tl.sum(totp, 0)
        # compensation turns inf into NaN (inf - inf); a non-finite sum is exact as it is
        total = tl.where((plain == plain) & (tl.abs(plain) < INF), total, plain)
    else:
        total = tl.sum(totp, 0)
    total = norm_root(total, pinv, MODE).to(OUT)
    tl.store(total_out, total)
    if COEF:
        coef = clip_coef(total, max_norm, eps, OUT)
        if FLAG:
            # AMP: the factor inv_scale * coef, inv_scale (fp32) converted to OUT first and the product
            # rounded once, as torch multiplies the two 0-dim tensors
            coef = tl.load(inv_ptr).to(OUT) * coef
        tl.store(coef_out, coef)
    if FLAG:
        anybad = tl.zeros([FLAG_BLOCK], tl.int32)
        for b in range(0, nblocks, FLAG_BLOCK):
            bb = b + tl.arange(0, FLAG_BLOCK)
            anybad = tl.maximum(anybad, tl.load(flags + bb, mask=bb < nblocks, other=0))
        tl.store(found_out, (tl.max(anybad, 0) > 0).to(tl.float32))


# ---------------------------------------------------------------------------------------------- launchers
def norm_passes(flat: Sequence[Tensor], plan, norm_type: float, inv_scale: Tensor | None = None,
                per_tensor: bool = True, max_norm: float | None = None
                ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The partial launches and the finalize over ``plan`` (the table of ``flat``): (total, per-tensor
    norms or None, found_inf or None, clip coefficient or None). ``inv_scale``: the AMP pass (norm of the
    unscaled values and the finiteness flag of the stored ones); ``max_norm``: the finalize also writes
    the clip coefficient (accumulation dtype), times ``inv_scale`` when that is given (the AMP factor)."""
    dev = flat[0].device
    acc = acc_of(flat)
    mode = mode_of(norm_type)
    amp = inv_scale is not None
    clip = max_norm is not None
    nb = max(plan.nblocks, 1)
    # partials and finalize work in fp64 whatever the data: the extra precision is free in a
    # memory-bound pass and keeps us at least as accurate as torch's CPU reductions (double accumulators)
    part = torch.empty(nb, dtype=torch.float64, device=dev)
    flags = torch.empty(nb, dtype=torch.int32, device=dev) if amp else part
    total = torch.empty((), dtype=acc, device=dev)
    per = torch.empty(plan.ntensors, dtype=acc, device=dev) if per_tensor else total
    found = torch.empty((), dtype=torch.float32, device=dev) if amp else total
    coef = torch.empty((), dtype=acc, device=dev) if clip else total
    p = float(norm_type) if mode == MODE_P else 1.0
    with device_guard(dev):
        for g in plan.groups:
            if g.count == 0:
                continue
            dt = g.dtypes[0]
            _norm_partial_kernel[(g.count,)](
                plan.ptr_tabs[0], plan.blk, part, flags, inv_scale if amp else part, p, g.b0,
                DT=tl_dtype(dt), C=tl.float64 if dt == torch.float64 else tl.float32, ACC=tl.float64,
                MODE=mode, HAS_SCALE=amp, FLAG=amp, ALIGNED=g.aligned, BLOCK=Config.BLOCK,
                num_warps=Config.NUM_WARPS, enable_fp_fusion=False)
        _norm_finalize_kernel[(1,)](
            part, flags, plan.seg, total, per, found, coef, inv_scale if amp else part, 1.0 / p, float(max_norm) if clip else 0.0, 1e-6,
            plan.nsegs, plan.nblocks,
            ACC=tl.float64, OUT=tl_dtype(acc), MODE=mode, FLAG=amp, PER=per_tensor, COEF=clip,
            SEG_BLOCK=Config.SEG_BLOCK, PART_BLOCK=Config.PART_BLOCK, EXACT=acc == torch.float64,
            FLAG_BLOCK=Config.FLAG_BLOCK, num_warps=4, enable_fp_fusion=False)
    return total, (per if per_tensor else None), (found if amp else None), (coef if clip else None)


def launch_norm(tensors: Sequence[Tensor], norm_type: float, inv_scale: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(total, per-tensor norms, found_inf or None). ``inv_scale``: the AMP pass (norm of the unscaled
    values and the finiteness flag of the stored ones)."""
    flat, _ = flat_inputs(tensors)
    total, per, found, _ = norm_passes(flat, get_plan((flat,)), norm_type, inv_scale)
    return total, per, found
