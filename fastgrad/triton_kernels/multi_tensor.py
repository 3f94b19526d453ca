"""Multi-tensor machinery shared by every Triton kernel of fastgrad.

A *plan* describes one list of tensors (or K parallel lists of same-shaped tensors, e.g. AGC's params
and grads) as work for a 1-D grid:

* a pointer table per list (int64 data pointers, in input order);
* a block table, one row ``(tensor, start, end, segment)`` per program: each program handles the flat
  element range ``[start, end)`` (at most ``CHUNK`` elements) of one *segment*. A segment is a whole
  tensor (norms, clip, stats) or one dim-0 row (AGC, GC); a segment's blocks are consecutive rows;
* a segment table, one row ``(first block, number of blocks, length)`` per segment, in input order, which
  the finalize kernels use to reduce the per-block partials of a segment in a fixed order.

Row-wise plans (AGC, GC: ``get_plan(..., rows, packed=True)``) shape the blocks by row length instead:
rows of at most ``Config.ROW_MAX`` elements are *packed*, several whole rows of one tensor per block (about
``Config.ROW_PACK`` elements), so one program reduces and writes each of its rows in one launch; longer rows
are *split* into ``CHUNK`` blocks whose partials a finalize reduces, as for norms. Within a dtype group the
packed blocks come first, then the split ones (``Group.nsplit``), and ``Plan.split_segs`` lists the split
segments, so the finalize and the second pass run over the long rows only.

Blocks are ordered by dtype group (the tuple of the K dtypes), so each group is one contiguous range of
the grid and is launched once with its dtypes as compile-time constants: a pass over a list is one launch
per dtype present (usually one), whatever the list's length. Plans are built once on the host with
vectorised torch ops, copied to the device in one transfer and cached by the lists' (data_ptr, numel,
dtype) tuples, so a training loop that reuses its gradient buffers pays for the tables once.
Offsets are int64 throughout; kernels never recompile for a new list (counts are not specialised).

Every launch passes ``enable_fp_fusion=False``: Triton otherwise contracts a * b + c into one FMA where its
LLVM/ptxas see fit (and the default changes in Triton 3.10), so norm bits could change with the compiler
version; without contraction each operation rounds as written, as in the interpreter and the C++ build.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from .. import _scan

INF = tl.constexpr(float("inf"))
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
# The interpreter rounds fp32 -> bf16 by truncation; hardware rounds to nearest even. Under the
# interpreter the kernels round by hand so CPU runs give the bits a GPU gives.
_EMULATE_BF16 = _INTERPRET

_TL_DTYPE = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


class Config:
    """Tile sizes. ``BLOCK`` elements per loop iteration (a compile-time constant), ``CHUNK`` elements per
    program at most (host-side only: it shapes the tables). Tests shrink both to cross boundaries with
    small tensors; environment overrides: FASTGRAD_TRITON_BLOCK, FASTGRAD_TRITON_CHUNK."""

    BLOCK = int(os.environ.get("FASTGRAD_TRITON_BLOCK", "2048"))
    CHUNK = int(os.environ.get("FASTGRAD_TRITON_CHUNK", "32768"))
    NUM_WARPS = 8
    #: segments per finalize tile and partials per segment per finalize iteration
    SEG_BLOCK = 128
    PART_BLOCK = 16
    #: overflow flags per iteration of the AMP finalize: its loop is one program's serial chain of loads,
    #: so a wide tile keeps it short (a 7B model has ~200K blocks: 52 iterations, not 1,600)
    FLAG_BLOCK = 4096
    #: row-wise ops: rows up to ROW_MAX elements are reduced and written by one program, which takes whole
    #: rows, about ROW_PACK elements and at least one tile's worth of rows (BLOCK // ROW_COLS); longer rows
    #: are split into CHUNK blocks (partials + finalize). A tile is BLOCK // ROW_COLS rows x ROW_COLS columns.
    #: Overrides: FASTGRAD_TRITON_ROW_MAX, FASTGRAD_TRITON_ROW_PACK, FASTGRAD_TRITON_ROW_COLS.
    ROW_MAX = int(os.environ.get("FASTGRAD_TRITON_ROW_MAX", "16384"))
    ROW_PACK = int(os.environ.get("FASTGRAD_TRITON_ROW_PACK", "32768"))
    ROW_COLS = int(os.environ.get("FASTGRAD_TRITON_ROW_COLS", "128"))
    CACHE_SIZE = 256


def row_cols() -> int:
    """Columns of the row-wise tiles (at most BLOCK)."""
    return min(Config.ROW_COLS, Config.BLOCK)


def tl_dtype(dtype: torch.dtype):
    return _TL_DTYPE[dtype]


# ---------------------------------------------------------------------------------------------- kernels
# Alignment hints. ALIGNED launches (the host checked that every tensor base of the launch is 16-byte
# aligned and every block start a multiple of VEC = 16 bytes / itemsize) tell Triton so with tl.multiple_of
# on the very loads below, inside the helpers. A hint applied in the kernel to a helper's *result* goes
# wrong both ways: Triton 3.6 drops it at inlining (no 128-bit accesses at all), and Triton 3.9 copies it
# onto every result of the call, including the block length, which makes masked tails 128-bit accesses
# under one predicate: reads and writes past the end of a tensor (tests/test_triton_compile.py checks both).
@triton.jit
def block_info(blk_tab, bid, VEC: tl.constexpr):
    """(tensor index, start, length, segment) of block ``bid``; start and length are int64. ``VEC`` > 1:
    the start is known to be a multiple of VEC elements (ALIGNED launches only)."""
    row = blk_tab + bid.to(tl.int64) * 4
    t = tl.load(row)
    start = tl.load(row + 1)
    if VEC > 1:
        start = tl.multiple_of(start, VEC)
    end = tl.load(row + 2)
    seg = tl.load(row + 3)
    return t, start, end - start, seg


@triton.jit
def tensor_base(ptr_tab, t, DT: tl.constexpr, ALIGNED: tl.constexpr):
    """Typed base pointer of tensor ``t``, known 16-byte aligned in ALIGNED launches."""
    ptr = tl.load(ptr_tab + t).to(tl.pointer_type(DT))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def to_dt(x, DT: tl.constexpr):
    """Round a compute value to the storage dtype DT (round to nearest even)."""
    if DT == tl.bfloat16 and _EMULATE_BF16:
        f = x.to(tl.float32)
        b = f.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(f != f, 0x7FC0, r)
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DT)


@triton.jit
def to_dt_once(x, DT: tl.constexpr):
    """Round a compute value to the storage dtype DT once, to nearest even (``to_dt`` but for an fp64 value
    and a 16-bit DT). From fp64, 16-bit DT goes through the float32
    rounded to odd (the 29 mantissa bits float does not keep are cut and "anything cut" goes into float's
    last bit; float keeps more than 2 bits beyond fp16/bf16, so that float rounds to the correctly rounded
    16-bit value), whatever a compiler makes of a direct fp64 -> 16-bit conversion (one that goes through a
    float rounded to nearest rounds twice: 1 ulp off where a double just past a 16-bit tie becomes the tie).
    The same bit operations as csrc/round_odd.h (the C++ kernels). Below float's normal range the plain
    conversion is used, as there."""
    if x.dtype == tl.float64 and DT.primitive_bitwidth == 16:
        b = x.to(tl.int64, bitcast=True)
        odd = (b & -0x20000000) | tl.where((b & 0x1FFFFFFF) != 0, 0x20000000, 0).to(tl.int64)
        normal = tl.abs(x) >= 1.1754943508222875e-38  # false for NaN: the plain conversion keeps it
        return to_dt(tl.where(normal, odd.to(tl.float64, bitcast=True), x).to(tl.float32), DT)
    else:
        return to_dt(x, DT)


@triton.jit
def sqrt_rn(x):
    # fp32 sqrt must be correctly rounded to match torch; fp64 sqrt always is.
    if x.dtype == tl.float64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def div_rn(a, b):
    # Triton's fp32 '/' is approximate; fp64 division is IEEE.
    if a.dtype == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def _split(x):
    # Veltkamp split: hi holds the top 26 bits, so products of halves are exact (no FMA needed: the
    # interpreter of Triton 3.6 evaluates fma as a multiply and an add)
    c = x * tl.full([], 134217729.0, tl.float64)  # 2^27 + 1 (not exact in fp32: no bare literal)
    hi = c - (c - x)
    return hi, x - hi


@triton.jit
def _two_prod(a, b):
    """(p, e) with p = fl(a * b) and p + e = a * b exactly (Dekker)."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


@triton.jit
def _exp2_int(k):
    """2^k for integral fp64 k, clamped to the normal exponents [-1022, 1023]."""
    k = tl.minimum(tl.maximum(k, -1022.0), 1023.0).to(tl.int64)
    return ((k + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def pow_reduced(a, p):
    """``a ** p`` for finite a > 0 and finite p > 0 from fp64 log2/exp2, about 1 ulp whatever the size of
    p * log2(a): a = 2^e * m with m in [0.75, 1.5), and p * (e + log2 m) kept as two doubles, so only the
    rounding of log2(m) (|log2 m| < 0.6) is scaled by p. The naive exp2(p * log2 a) rounds the product
    itself, an error that exp2 multiplies by ln 2 * |p log2 a|: ~10 ulp for fp64 data and p = 0.5."""
    bits = a.to(tl.int64, bitcast=True)
    sub = ((bits >> 52) & 0x7FF) == 0
    # subnormals: scale by 2^54 (exact) to make them normal; e takes the 54 back
    a = tl.where(sub, a * 18014398509481984.0, a)
    bits = a.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF) - 1023 - tl.where(sub, 54, 0)
    m = ((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000).to(tl.float64, bitcast=True)
    big = m >= 1.5
    m = tl.where(big, m * 0.5, m)
    e = e + tl.where(big, 1, 0)
    ph, pl = _two_prod(p, e.to(tl.float64))
    qh, ql = _two_prod(p, tl.log2(m))
    s = ph + qh
    bv = s - ph
    serr = (ph - (s - bv)) + (qh - bv)  # two-sum: s + serr = ph + qh exactly
    n = tl.floor(s + 0.5)
    f = (s - n) + (serr + pl + ql)  # s - n is exact (Sterbenz); |f| <= ~0.5
    # 2^n as two factors, so that the result over/underflows only when a ** p does
    n = tl.minimum(tl.maximum(n, -2200.0), 2200.0)
    n1 = tl.floor(n * 0.5)
    return tl.exp2(f) * _exp2_int(n1) * _exp2_int(n - n1)


@triton.jit
def pow_fp64(a, p):
    """``a ** p`` for a >= 0 (or NaN) and p > 0, in fp64 so the power stays accurate for fp32 data too.
    Compiled: libdevice's pow (CUDA's double pow, within 2 ulp). The interpreter has no libdevice, so
    there pow_reduced builds it from exp2/log2 with the same accuracy."""
    a64 = a.to(tl.float64)
    if _INTERPRET:
        pos = (a64 > 0) & (a64 < INF)
        r = pow_reduced(tl.where(pos, a64, 1.0), p)
        # 0 -> 0, inf -> inf, NaN -> NaN (NaN > 0 is false, so keep the input itself)
        return tl.where(pos, r, tl.where(a64 == 0, 0.0, a64))
    else:
        # pow(0, p > 0) = 0, pow(inf, p > 0) = inf, pow(NaN, p) = NaN: no special cases needed
        return libdevice.pow(a64, p)


@triton.jit
def nan_sticky(x):
    """0 where x is a number, NaN where it is NaN: adding it to an accumulator makes NaN sticky without
    relying on how max() treats NaN."""
    return tl.where(x == x, 0.0, x)


@triton.jit
def segment_reduce(part, seg_tab, segs, smask, ACC: tl.constexpr, IS_MAX: tl.constexpr,
                   PART_BLOCK: tl.constexpr):
    """Reduce the per-block partials of the segments ``segs`` (a vector) in a fixed order.

    For IS_MAX the partials are >= 0 or NaN, and NaN propagates."""
    row = seg_tab + segs.to(tl.int64) * 3
    first = tl.load(row, mask=smask, other=0)
    nb = tl.load(row + 1, mask=smask, other=0)
    m = tl.max(nb, 0)
    acc = tl.zeros([segs.shape[0], PART_BLOCK], ACC)
    nanacc = tl.zeros([segs.shape[0], PART_BLOCK], ACC)
    for j in range(0, m, PART_BLOCK):
        jj = j + tl.arange(0, PART_BLOCK)
        msk = jj[None, :] < nb[:, None]
        x = tl.load(part + first[:, None] + jj[None, :], mask=msk, other=0).to(ACC)
        if IS_MAX:
            acc = tl.maximum(acc, tl.where(x == x, x, 0.0))
            nanacc += nan_sticky(x)
        else:
            acc += x
    if IS_MAX:
        return tl.max(acc, 1) + tl.sum(nanacc, 1)
    else:
        return tl.sum(acc, 1)


@triton.jit
def row_starts(r0, nrows, length, R: tl.constexpr):
    """Row-wise kernels' [R, columns] tiles: the start offsets of rows r0..r0+R-1 of a packed block and
    which of them exist."""
    rows = r0 + tl.arange(0, R)
    return rows.to(tl.int64) * length, rows < nrows


@triton.jit
def row_tile(base, rmask, c0, length, CB: tl.constexpr):
    """Offsets and mask of columns [c0, c0 + CB) of the rows starting at ``base`` (see row_starts)."""
    cols = c0 + tl.arange(0, CB)
    return base[:, None] + cols[None, :], rmask[:, None] & (cols[None, :] < length)


# ---------------------------------------------------------------------------------------------- plans
class Group:
    """One dtype group's blocks: ``[b0, b0 + count)``, of which the last ``nsplit`` belong to split rows
    (row-wise plans; 0 otherwise)."""

    __slots__ = ("dtypes", "b0", "count", "aligned", "nsplit")

    def __init__(self, dtypes, b0, count, aligned, nsplit=0):
        self.dtypes = dtypes
        self.b0 = b0
        self.count = count
        self.aligned = aligned
        self.nsplit = nsplit


class Plan:
    """Device tables for one list (or K parallel lists); see the module docstring."""

    __slots__ = ("ptr_tabs", "blk", "seg", "split_segs", "nsplit", "groups", "nblocks", "nsegs", "ntensors",
                 "_keep")


def _pad2(x: Tensor) -> Tensor:
    # Sections start on 16-byte boundaries, so every table view gets the same pointer specialisation.
    return torch.cat([x, x.new_zeros(1)]) if x.numel() % 2 else x


def _packed_blocks(r: Tensor, length: Tensor, gid: Tensor, chunk: int, row_max: int, pack: int, tile_rows: int):
    """Blocks of a row-wise plan (see the module docstring), per tensor ``r`` rows of ``length`` elements:
    (block tensor, start, end, first segment, the segment table's first-block and block-count columns,
    split flag per block)."""
    n = r.numel()
    split = length > row_max
    k = (pack // length.clamp(min=1)).clamp(min=tile_rows)  # rows per packed block: fill the tiles' rows
    cpr = (length + chunk - 1) // chunk  # blocks per split row
    nbt = torch.where(split, r * cpr, torch.where(length > 0, (r + k - 1) // k, torch.zeros_like(r)))
    order = torch.sort(gid * 2 + split.long(), stable=True).indices  # group, then packed before split
    nb_ord = nbt[order]
    nblocks = int(nb_ord.sum())
    t_first = torch.zeros(n, dtype=torch.int64)
    t_first[order] = torch.cumsum(nb_ord, 0) - nb_ord
    b_tensor = torch.repeat_interleave(order, nb_ord)
    j = torch.arange(nblocks) - t_first[b_tensor]  # block index within its tensor
    sp = split[b_tensor]
    lb, kb, cb = length[b_tensor], k[b_tensor], cpr[b_tensor].clamp(min=1)
    row0 = torch.where(sp, j // cb, j * kb)
    c = torch.where(sp, j % cb, torch.zeros_like(j))
    b_start = row0 * lb + c * chunk
    b_end = torch.where(sp, torch.minimum(b_start + chunk, (row0 + 1) * lb),
                        torch.minimum((j + 1) * kb, r[b_tensor]) * lb)
    first_seg = torch.cumsum(r, 0) - r
    block_seg = first_seg[b_tensor] + row0
    # segment table: first block and count of each split row (what the finalize reads); packed rows
    # are reduced in place and get 0 blocks there
    seg_tensor = torch.repeat_interleave(torch.arange(n), r)
    seg_row = torch.arange(int(r.sum())) - first_seg[seg_tensor]
    seg_split = split[seg_tensor]
    seg_first = torch.where(seg_split, t_first[seg_tensor] + seg_row * cpr[seg_tensor], torch.zeros_like(seg_row))
    seg_nb = torch.where(seg_split, cpr[seg_tensor], torch.zeros_like(seg_row))
    return b_tensor, b_start, b_end, block_seg, seg_first, seg_nb, sp, seg_split


def _build(lists: Sequence[Sequence[Tensor]], rows: Sequence[int] | None, chunk: int,
           device: torch.device, packed: tuple[int, int] | None = None) -> Plan:
    n = len(lists[0])
    numel = torch.tensor([t.numel() for t in lists[0]], dtype=torch.int64)
    r = torch.ones(n, dtype=torch.int64) if rows is None else torch.tensor(rows, dtype=torch.int64)
    seg_len_t = torch.where(r > 0, numel // r.clamp(min=1), torch.zeros_like(numel))

    # dtype groups, in order of first appearance
    gkeys = [tuple(lst[i].dtype for lst in lists) for i in range(n)]
    gid_of: dict = {}
    gid = torch.tensor([gid_of.setdefault(k, len(gid_of)) for k in gkeys], dtype=torch.int64)

    nsegs = int(r.sum())
    seg_tensor = torch.repeat_interleave(torch.arange(n), r)
    seg_len = seg_len_t[seg_tensor]
    split_segs = torch.zeros(0, dtype=torch.int64)
    if packed is not None:
        b_tensor, b_start, b_end, block_seg, seg_first, seg_nb, b_split, seg_split = _packed_blocks(
            r, seg_len_t, gid, chunk, *packed)
        nblocks = b_tensor.numel()
        split_segs = torch.nonzero(seg_split).reshape(-1)
    else:
        first_seg = torch.cumsum(r, 0) - r
        seg_base = (torch.arange(nsegs) - first_seg[seg_tensor]) * seg_len
        seg_nb = (seg_len + chunk - 1) // chunk

        seg_order = torch.sort(gid[seg_tensor], stable=True).indices
        nb_ord = seg_nb[seg_order]
        nblocks = int(nb_ord.sum())
        seg_first = torch.zeros(nsegs, dtype=torch.int64)
        seg_first[seg_order] = torch.cumsum(nb_ord, 0) - nb_ord
        block_seg = torch.repeat_interleave(seg_order, nb_ord)
        k = torch.arange(nblocks) - seg_first[block_seg]
        b_start = seg_base[block_seg] + k * chunk
        b_end = torch.minimum(b_start + chunk, seg_base[block_seg] + seg_len[block_seg])
        b_tensor = seg_tensor[block_seg]

    blk = torch.stack([b_tensor, b_start, b_end, block_seg], 1).reshape(-1)
    seg = torch.stack([seg_first, seg_nb, seg_len], 1).reshape(-1)
    ptrs = [torch.tensor([t.data_ptr() for t in lst], dtype=torch.int64) for lst in lists]

    # per-group block ranges and alignment (checked here, hinted in the kernels)
    counts = torch.bincount(gid[b_tensor], minlength=len(gid_of)).tolist() if nblocks else [0] * len(gid_of)
    nsplit = [0] * len(gid_of)
    if packed is not None and nblocks:
        nsplit = torch.bincount(gid[b_tensor][b_split], minlength=len(gid_of)).tolist()
    groups = []
    b0 = 0
    rows_l = [1] * n if rows is None else list(rows)
    lens = seg_len_t.tolist()
    for key, g in gid_of.items():
        aligned = True
        for lst, dt in zip(lists, key):
            es = torch.empty((), dtype=dt).element_size()
            if (chunk * es) % 16:
                aligned = False
            for i in range(n):
                if gkeys[i] != key:
                    continue
                if lst[i].data_ptr() % 16 or (rows_l[i] > 1 and (lens[i] * es) % 16):
                    aligned = False
                    break
        groups.append(Group(key, b0, counts[g], aligned, nsplit[g]))
        b0 += counts[g]

    sections = [_pad2(p) for p in ptrs] + [_pad2(blk), _pad2(seg), _pad2(split_segs)]
    host = torch.cat(sections)
    if device.type == "cuda":
        host = host.pin_memory()
        buf = host.to(device, non_blocking=True)
    else:
        buf = host.to(device)
    views = []
    off = 0
    for s in sections:
        views.append(buf[off:off + s.numel()])
        off += s.numel()
    plan = Plan()
    plan.ptr_tabs = views[:len(lists)]
    plan.blk = views[len(lists)]
    plan.seg = views[len(lists) + 1]
    plan.split_segs = views[len(lists) + 2]
    plan.nsplit = split_segs.numel()
    plan.groups = groups
    plan.nblocks = nblocks
    plan.nsegs = nsegs
    plan.ntensors = n
    plan._keep = host  # the pinned source must outlive the asynchronous copy
    return plan


_CACHE: "OrderedDict[tuple, Plan]" = OrderedDict()
_CAPTURED: "dict[tuple, Plan]" = {}  # plans a CUDA graph captured: never evicted
_DTYPE_GET = Tensor.dtype.__get__
_stats = {"hits": 0, "builds": 0}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def get_plan(lists: Sequence[Sequence[Tensor]], rows: Sequence[int] | None = None, packed: bool = False) -> Plan:
    """The cached plan for ``lists`` (K lists of same-shaped, flat-addressable tensors); ``packed``: a
    row-wise plan with short rows packed and long rows split (module docstring)."""
    chunk = (Config.CHUNK, Config.ROW_MAX, Config.ROW_PACK, Config.BLOCK // row_cols()) if packed else Config.CHUNK
    device = lists[0][0].device
    # The key is the per-call host cost: (data_ptr, numel, dtype) of every tensor, from one C++ loop per
    # list when the compiled helpers are there (fastgrad/_scan.py), else map() over unbound methods, the
    # cheapest per-tensor reads in Python. The two spellings never collide (bytes vs tuples).
    keys = [_scan.plan_key(lst) for lst in lists]
    if all(k is not None for k in keys):
        key = (device, chunk, None if rows is None else tuple(rows), *keys)
    else:
        key = (device, chunk, None if rows is None else tuple(rows),
               tuple(map(Tensor.numel, lists[0])),
               *(tuple(map(Tensor.data_ptr, lst)) for lst in lists),
               *(tuple(map(_DTYPE_GET, lst)) for lst in lists))
    capturing = _capturing(device)
    plan = _CAPTURED.get(key) or _CACHE.get(key)
    if plan is not None:
        if capturing:
            # A captured graph bakes in this plan's device tables: they must outlive every replay, so the
            # plan leaves the LRU cache (which could free them) for a table nothing evicts.
            _CAPTURED[key] = plan
            _CACHE.pop(key, None)
        elif key in _CACHE:
            _CACHE.move_to_end(key)
        _stats["hits"] += 1
        return plan
    if capturing:
        raise RuntimeError(
            "fastgrad (Triton backend): no cached kernel table for this tensor list during CUDA graph capture. "
            "Call the same fastgrad function once on the same tensors before capturing (a warm-up, which "
            "also compiles the kernels): building a table copies it from pinned host memory, which a "
            "captured graph would re-read at every replay.")
    plan = _build(lists, rows, Config.CHUNK, device, chunk[1:] if packed else None)
    _stats["builds"] += 1
    _CACHE[key] = plan
    if len(_CACHE) > Config.CACHE_SIZE:
        _CACHE.popitem(last=False)
    return plan


def clear_cache() -> None:
    """Drop the evictable plans. Plans used by a captured CUDA graph stay (the graph holds their device
    pointers); release_captured() drops those once no such graph will be replayed."""
    _CACHE.clear()


def release_captured() -> None:
    _CAPTURED.clear()


def cache_stats() -> dict:
    return dict(_stats, size=len(_CACHE), captured=len(_CAPTURED))


# ---------------------------------------------------------------------------------------------- inputs
def _dense(t: Tensor) -> bool:
    """Non-overlapping and dense: its elements fill [data_ptr, data_ptr + numel * itemsize) exactly."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1),
                               key=lambda x: x[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _rows_dense(t: Tensor) -> bool:
    """Dense with dim 0 outermost: row r fills [r * row_len, (r + 1) * row_len) elements from data_ptr, in
    some order within the row (e.g. channels_last conv weights). AGC and GC only reduce a row and scale
    or shift its elements, which no order within the row changes beyond summation order."""
    if t.dim() <= 1 or t.shape[0] <= 1:
        return _dense(t)
    return _dense(t) and t.stride(0) == t.numel() // t.shape[0]


def flat_inputs(tensors: Sequence[Tensor], rowwise: bool = False) -> tuple[list[Tensor], list]:
    """Tensors the kernels can address as one flat buffer (``rowwise``: with dim-0 rows as consecutive
    ranges), and the (original, contiguous copy) pairs an in-place op must copy back. Only overlapping or
    gapped layouts (slices, expanded views) are copied: a fresh copy per call, so such lists rebuild
    their kernel table every call and cannot be captured in a CUDA graph."""
    if type(tensors) is _scan.Checked and tensors.contiguous:  # checked in one pass already
        return tensors, []
    if all(map(Tensor.is_contiguous, tensors)):  # the common case, without a Python loop
        return tensors, []
    out = list(tensors)
    copies = []
    dense = _rows_dense if rowwise else _dense
    for i, t in enumerate(out):
        if t.is_contiguous() or dense(t):
            continue
        c = t.contiguous()
        out[i] = c
        copies.append((t, c))
    return out, copies


def copy_back(copies) -> None:
    for t, c in copies:
        t.copy_(c)


def rows_of(tensors: Sequence[Tensor]) -> list[int]:
    """Units of AGC/GC: dim-0 slices for ndim > 1, the whole tensor otherwise."""
    return [t.shape[0] if t.dim() > 1 else 1 for t in tensors]


def acc_of(tensors: Sequence[Tensor]) -> torch.dtype:
    if type(tensors) is _scan.Checked:
        return _scan.acc_dtype_of(tensors)
    for t in tensors:
        if t.dtype == torch.float64:
            return torch.float64
    return torch.float32


class device_guard:
    """Launch on the tensors' GPU even when another one is current (no-op on CPU). Triton launches on the
    current device's current stream, so the switch is needed; CUDA's current device is per host thread,
    so it changes nothing for other threads, and it costs one query when the device is already current
    (the usual case)."""

    __slots__ = ("dev", "prev")

    def __init__(self, device: torch.device):
        self.dev = device
        self.prev = None

    def __enter__(self):
        if self.dev.type == "cuda" and self.dev.index is not None:
            cur = torch.cuda.current_device()
            if cur != self.dev.index:
                self.prev = cur
                torch.cuda.set_device(self.dev.index)
        return self

    def __exit__(self, *exc):
        if self.prev is not None:
            torch.cuda.set_device(self.prev)
            self.prev = None
        return False
