"""Correctly rounded norms (``exact=True``): the exact p-norm of all gradient values, rounded once.

For p = 1 and p = 2 the result is the exact value of ``sum |x|`` or ``sqrt(sum x^2)`` over every element of every
tensor, rounded to nearest (ties to even) to the dtype asked for. It is a function of the multiset of values
only: the same bits whatever the backend, the order of the list, how values are grouped into tensors, the
dtype mix, the number of ranks or the sharding layout. p = inf is a maximum, exact already.

Why it is exact
---------------
Every float16/bfloat16/float32/float64 value is ``x = +-M * 2^e`` with an integer ``M < 2^53``. For p = 1 the
term ``M * 2^e`` is added; for p = 2 the term ``x^2 = M^2 * 2^(2e)``, split into integer pieces (``M = a 2^36 + b
2^18 + c``: five coefficients of ``M^2`` below 2^37), so no product is ever rounded. The pieces are first
summed per exponent of ``x`` (integer bins), then each bin is added into a fixed-point integer accumulator: int64 limbs holding 32-bit digits, limb ``k`` weighing
``2^(BASE + 32 k)``. BASE lies below the lowest bit any term (or any rounding midpoint, below) can have, and
the limbs reach far above the largest possible sum (float64 squares up to 2^2048 times 2^63 terms), so no bit
is dropped and nothing overflows. A chunk of at most 2^24 elements keeps every bin below 2^61; a bin touches
at most three limbs with less than 2^33 each, and a limb receives a few hundred such additions per chunk, far
from 2^63, before the carries are normalised.
Integer addition is associative: partial accumulators of chunks, threads, tensors, devices and ranks just
add, and the carry normalisation gives the one base-2^32 representation of the value (unique), so every route
reaches the same digits. Across ranks the normalised digits (below 2^32) travel as float64 in the usual SUM
all-reduce: sums of fewer than 2^21 of them are integers below 2^53, exact in any order.

The rounding happens on the device with tensor ops (no host read): the top three digits give a float64
approximation of the sum (relative error below 2^-52), its square root (p = 2) an approximation of the
norm, rounded to the target grid (precision and subnormal floor of the dtype). That candidate is within a
few grid steps of the answer; it is then corrected exactly: the midpoints between the candidate and its
neighbours are integers times a power of two, so their squares (p = 2) or themselves (p = 1) are built in the
same limb format and compared with the sum digit by digit, and the candidate moves one step towards the
true value until it lies between its two midpoints (one step suffices for targets of up to 24 bits, three
for float64). A sum exactly on a midpoint takes the even neighbour. The result is then a float64 holding a
value of the target grid, so converting it to the target dtype is exact; a value past the dtype's largest
finite number rounds to inf (overflow: the exact norm, not an intermediate, decides), subnormal results keep
their exact grid (underflow), a NaN element makes the norm NaN, an inf element (and no NaN) inf, and an empty
list or all-zero values give 0.

The implementation below is the reference, in torch ops (CPU and CUDA tensors). The compiled CPU kernel
(``torch.ops.fastgrad.exact_limbs``, csrc/cpu/exact.cpp) computes the same normalised digits with integer
bins per exponent, in parallel, the partials merged by integer addition; the rounding is this module's in
both cases, so both give the same bytes. For a whole plain list without float64 the CPU backend first tries
``exact_total``: a float64 sum of the (exact) terms with a proven relative error bound; when both ends of the
interval it defines round to the same value, that value is the correctly rounded norm (rounding is
monotonic), and no digits are built. Only sums within about 2^-44 of a rounding midpoint, NaN/inf and float64
lists take the digits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["EXACT_NORM_TYPES", "check_norm_type", "window", "limbs", "limbs_torch", "compiled_ok", "normalize",
           "finish", "total_digits", "rounded_norm", "compiled_total", "two_roundings", "parts_digits"]

#: Norm orders ``exact=True`` supports.
EXACT_NORM_TYPES = (1.0, 2.0, math.inf)

_MASK = (1 << 32) - 1
# (BASE, number of limbs) per order: limb k weighs 2^(BASE + 32 k). p = 2: float64 squares reach down to
# (2^-1074)^2 written as M^2 * 2^(2e) with e >= -1126 (M normalised to 53 bits), midpoints of a float64
# result down to 2^-2150; up to 2^2048 * 2^63 terms. p = 1: terms from 2^-1126, sums below 2^1087.
_WINDOWS = {2.0: (-2304, 142), 1.0: (-1152, 74)}
# Elements per chunk of the reference path: bins of coefficients below 2^37 stay below 2^37 * 2^24 = 2^61.
_CHUNK = 1 << 24

# Target grids: (precision in bits, exponent of the smallest subnormal, largest exponent).
_GRID = {
    torch.float64: (53, -1074, 1023),
    torch.float32: (24, -149, 127),
    torch.bfloat16: (8, -133, 127),
    torch.float16: (11, -24, 15),
}


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` for ``exact=True``: 1, 2 or inf, else ValueError (before any work)."""
    p = float(norm_type)
    if p not in EXACT_NORM_TYPES:
        raise ValueError(f"exact=True supports norm_type 1, 2 and inf, got {norm_type!r}")
    return p


def window(p: float) -> tuple[int, int]:
    """``(BASE, number of limbs)`` of the accumulator for order ``p`` (1 or 2)."""
    return _WINDOWS[p]


# ------------------------------------------------------------------------------------------- digits
def _deposit(m: Tensor, exp: Tensor, base: int) -> tuple[Tensor, Tensor]:
    """The digits of ``m * 2^exp`` (int64 ``m < 2^63``, ``exp >= base``): ``(index, values)``, shape ``(..., 3)``:
    limb indices k, k+1, k+2 and the (unnormalised, < 2^33) amounts to add there."""
    s = exp - base
    k = s >> 5
    r = s & 31
    lo = (m & _MASK) << r
    hi = (m >> 32) << r
    vals = torch.stack([lo & _MASK, (lo >> 32) + (hi & _MASK), hi >> 32], dim=-1)
    idx = torch.stack([k, k + 1, k + 2], dim=-1)
    return idx, vals


def _split(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``|x| = M * 2^e`` (int64 M < 2^53, int64 e in [-1074, 971]) for finite x, M = 0 elsewhere, read from the
    bits of the float64 value (exact for every input dtype); and the finite mask."""
    u = x.to(torch.float64).view(torch.int64)
    be = (u >> 52) & 0x7FF
    fin = be != 0x7FF
    m = torch.where(fin, (u & ((1 << 52) - 1)) | torch.where(be > 0, 1 << 52, 0), 0)
    return m, be.clamp(min=1, max=0x7FE) - 1075, fin  # (inf/NaN: M = 0 at a valid exponent)


# Exponent bins of the reference path: x = M * 2^e with e in [-1074, 971] for every float64.
_EMIN, _NBINS = -1074, 2046
_P18 = (1 << 18) - 1


def _binned(x: Tensor, p: float, base: int) -> tuple[Tensor, Tensor]:
    """The exact terms of ``|x|^p`` summed per exponent: ``M = a 2^36 + b 2^18 + c`` (pieces below 2^18), so
    ``M^2`` is five integer coefficients below 2^37 (``M`` three below 2^18) at offsets ``18 k``; each is added
    into a bin per exponent of ``x`` (``index_add_`` of integers: exact, any order), a chunk of at most 2^24
    elements keeping every bin below 2^61. Returns ``(index, values)`` of the bins' digits (see :func:`_deposit`)."""
    m, e, _ = _split(x)
    a, b, c = m >> 36, (m >> 18) & _P18, m & _P18
    if p == 1.0:
        coefs = torch.stack([c, b, a])
    else:
        coefs = torch.stack([c * c, 2 * b * c, 2 * a * c + b * b, 2 * a * b, a * a])
    k = coefs.shape[0]
    where = (e - _EMIN) + _NBINS * torch.arange(k, device=x.device).unsqueeze(1)
    bins = torch.zeros(k * _NBINS, dtype=torch.int64, device=x.device)
    bins.index_add_(0, where.reshape(-1), coefs.reshape(-1))
    ex = torch.arange(_NBINS, device=x.device) + _EMIN
    ex = (ex if p == 1.0 else 2 * ex) + 18 * torch.arange(k, device=x.device).unsqueeze(1)
    return _deposit(bins.reshape(k, _NBINS), ex, base)


def normalize(d: Tensor) -> Tensor:
    """Carry normalisation of non-negative int64 limbs (each < 2^62) along the last dim: the unique digits
    below 2^32 of the same value (the window leaves the top limbs empty, so no carry leaves it)."""
    def up(c: Tensor) -> Tensor:  # carries into the next limb
        return torch.nn.functional.pad(c[..., :-1], (1, 0))

    d = (d & _MASK) + up(d >> 32)  # < 2^32 + 2^30
    d = (d & _MASK) + up(d >> 32)  # <= 2^32: carries of 0/1 left, which may ripple
    gen = d >> 32  # limb k sends a carry on its own (then its digit is 0)
    d = d & _MASK
    # A carry ripples through digits 2^32 - 1: limb k receives one iff the last limb below k that is not
    # 2^32 - 1 generated one.
    n = d.shape[-1]
    pos = torch.arange(n, device=d.device).expand_as(d)
    stop = torch.where(d != _MASK, pos, -1).cummax(dim=-1).values
    below = torch.nn.functional.pad(stop[..., :-1], (1, 0), value=-1)
    cin = torch.where(below >= 0, gen.gather(-1, below.clamp(min=0)), 0)
    return (d + cin) & _MASK


def limbs_torch(tensors, p: float, per_tensor: bool = False) -> tuple[Tensor, Tensor]:
    """The reference accumulation: ``(digits, flags)``, int64 of shape ``(T, L)`` and ``(T, 2)`` (NaN and inf
    counts) per tensor when ``per_tensor``, else ``(1, L)`` and ``(1, 2)`` for the whole list; on the first
    tensor's device, digits normalised. Torch ops only, no host read."""
    base, nl = _WINDOWS[p]
    dev = tensors[0].device
    rows, flags = [], []
    acc = torch.zeros(nl, dtype=torch.int64, device=dev)
    fl = torch.zeros(2, dtype=torch.int64, device=dev)
    for t in tensors:
        flat = t.detach().reshape(-1).to(dev)
        if per_tensor:
            acc = torch.zeros(nl, dtype=torch.int64, device=dev)
            fl = torch.zeros(2, dtype=torch.int64, device=dev)
        for start in range(0, flat.numel(), _CHUNK):
            x = flat[start:start + _CHUNK]
            idx, vals = _binned(x, p, base)
            acc = normalize(acc.scatter_add(0, idx.reshape(-1), vals.reshape(-1)))
            xd = x.to(torch.float64)
            fl = fl + torch.stack([xd.isnan().sum(), xd.isinf().sum()])
        if per_tensor:
            rows.append(acc)
            flags.append(fl)
    if per_tensor:
        if not rows:
            return (torch.zeros((0, nl), dtype=torch.int64, device=dev),
                    torch.zeros((0, 2), dtype=torch.int64, device=dev))
        return torch.stack(rows), torch.stack(flags)
    return acc.unsqueeze(0), fl.unsqueeze(0)


def compiled_ok(tensors) -> bool:
    """Whether the compiled CPU kernels serve ``tensors`` (a non-empty list of CPU tensors, extension built)."""
    from . import _ext

    return (len(tensors) > 0 and all(t.device.type == "cpu" for t in tensors) and _ext.load() is not None
            and hasattr(torch.ops.fastgrad, "exact_limbs"))


def limbs(tensors, p: float, per_tensor: bool = False, *, compiled: bool = True) -> tuple[Tensor, Tensor]:
    """:func:`limbs_torch`'s result, from the compiled CPU kernel when ``compiled`` and it applies (CPU tensors,
    extension built), else from the reference. Both give the same digits."""
    if compiled and compiled_ok(tensors):
        base, nl = _WINDOWS[p]
        return torch.ops.fastgrad.exact_limbs(list(tensors), int(p), base, nl, per_tensor)
    return limbs_torch(tensors, p, per_tensor)


def parts_digits(parts: list, p: float, per_tensor: bool, compiled: list[bool], device: torch.device
                 ) -> tuple[Tensor, Tensor]:
    """:func:`limbs` of a list given in parts (each on one device, ``compiled[i]``: whether the compiled kernel
    may build part i's digits), on ``device``: the parts' digits added (normalised), or with ``per_tensor`` their
    rows part after part."""
    dgs, fls = [], []
    for part, c in zip(parts, compiled):
        dg, fl = limbs(part, p, per_tensor, compiled=c)
        dgs.append(dg.to(device))
        fls.append(fl.to(device))
    if len(dgs) == 1:
        return dgs[0], fls[0]
    if not per_tensor:
        return normalize(torch.stack(dgs).sum(0)), torch.stack(fls).sum(0)
    return torch.cat(dgs), torch.cat(fls)


# ------------------------------------------------------------------------------------------- rounding
def _pow2(n: Tensor) -> Tensor:
    """``2.0 ** n`` in float64 for int64 ``n`` in [-1022, 1023], built from its bits (exact on every device)."""
    return ((n + 1023) << 52).view(torch.float64)


def _top(d: Tensor) -> Tensor:
    """Index of the highest nonzero digit along the last dim (-1 for zero)."""
    pos = torch.arange(d.shape[-1], device=d.device).expand_as(d)
    return torch.where(d != 0, pos, -1).amax(dim=-1)


def _cmp(d: Tensor, w: Tensor) -> Tensor:
    """Sign of (value of digits ``d``) - (value of digits ``w``), both normalised, along the last dim."""
    diff = d - w
    i = _top(diff.abs())
    return torch.where(i >= 0, diff.gather(-1, i.clamp(min=0).unsqueeze(-1)).squeeze(-1).sign(), 0)


def _digits_of(mid: Tensor, emid: Tensor, p: float, base: int, nl: int) -> Tensor:
    """Normalised digits of ``mid^p * 2^(p emid)`` (int64 ``mid < 2^56``)."""
    if p == 1.0:
        ms, es = mid.unsqueeze(-1), emid.unsqueeze(-1)
    else:
        a, b = mid >> 28, mid & ((1 << 28) - 1)
        ms = torch.stack([a * a, 2 * a * b, b * b], dim=-1)
        es = torch.stack([2 * emid + 56, 2 * emid + 28, 2 * emid], dim=-1)
    es = es.clamp(min=base, max=base + 32 * (nl - 3))  # out-of-window midpoints only for discarded lanes
    idx, vals = _deposit(ms, es, base)
    lead = idx.shape[:-2]
    flat = lead + (idx.shape[-2] * idx.shape[-1],)  # (not -1: ambiguous for no rows, a rank holding no tensor)
    out = torch.zeros(lead + (nl,), dtype=torch.int64, device=mid.device)
    out = out.scatter_add(-1, idx.reshape(flat), vals.reshape(flat))
    return normalize(out)


def finish(digits: Tensor, flags: Tensor, p: float, dtype: torch.dtype) -> Tensor:
    """The correctly rounded norm in ``dtype`` from normalised ``digits`` ``(..., L)`` and ``flags`` ``(..., 2)``
    (NaN, inf counts): shape ``(...)``, on the digits' device, no host read."""
    base, nl = _WINDOWS[p]
    prec, qmin, emax = _GRID[dtype]
    d = digits
    h = _top(d)
    # float64 approximation from the top three digits: value ~ a * 2^x
    hs = torch.stack([h, h - 1, h - 2], dim=-1)
    top = torch.where(hs >= 0, d.gather(-1, hs.clamp(min=0)), 0).to(torch.float64)
    a = (top[..., 0] * 2.0 ** 64 + top[..., 1] * 2.0 ** 32) + top[..., 2]
    x = 32 * (h - 2) + base
    if p == 2.0:
        a, x = a.sqrt(), x // 2  # base and 32 (h - 2) are even
    f, e0 = torch.frexp(torch.where(h >= 0, a, 1.0))
    big = 1 << prec
    half = 1 << (prec - 1)
    ex = e0.to(torch.int64) - 1 + x  # the value lies in [2^ex, 2^(ex + 1))
    q = torch.clamp(ex - prec + 1, min=qmin)
    shift = (e0.to(torch.int64) + x - q).clamp(min=-2)
    k = torch.round(f * _pow2(shift)).to(torch.int64).clamp(min=1)
    wrap = k == big
    k = torch.where(wrap, half, k)
    q = torch.where(wrap, q + 1, q)
    for _ in range(1 if prec <= 24 else 3):
        boundary = (k == half) & (q > qmin)  # the grid below is twice as fine
        lo_m = torch.where(boundary, 2 * big - 1, 2 * k - 1)
        lo_e = torch.where(boundary, q - 2, q - 1)
        c_lo = _cmp(d, _digits_of(lo_m, lo_e, p, base, nl))
        c_hi = _cmp(d, _digits_of(2 * k + 1, q - 1, p, base, nl))
        odd = (k & 1) == 1
        down = (c_lo < 0) | ((c_lo == 0) & odd)
        up = (c_hi > 0) | ((c_hi == 0) & odd)
        k_dn = torch.where(boundary, big - 1, k - 1)
        q_dn = torch.where(boundary, q - 1, q)
        k_up = torch.where(k + 1 == big, half, k + 1)
        q_up = torch.where(k + 1 == big, q + 1, q)
        k, q = torch.where(down, k_dn, torch.where(up, k_up, k)), torch.where(down, q_dn, torch.where(up, q_up, q))
    over = q > emax + 1 - prec
    # k * 2^q is on the target grid, so both products are exact (the second only reaches subnormals)
    q_hi = q.clamp(min=-1000, max=1000)
    val = (k.to(torch.float64) * _pow2(q_hi)) * _pow2((q - q_hi).clamp(min=-74, max=0))
    val = torch.where(over, math.inf, val)
    val = torch.where(h < 0, 0.0, val)
    val = torch.where(flags[..., 1] > 0, math.inf, val)
    val = torch.where(flags[..., 0] > 0, math.nan, val)
    return val.to(dtype)


def total_digits(digits: Tensor, flags: Tensor) -> tuple[Tensor, Tensor]:
    """Per-tensor ``(T, L)`` digits and ``(T, 2)`` flags -> the whole list's ``(L,)`` and ``(2,)``."""
    return normalize(digits.sum(0)), flags.sum(0)


def rounded_norm(tensors, p: float, dtype: torch.dtype, *, per_tensor: bool = False,
                 per_dtype: torch.dtype | None = None, compiled: bool = True, extra_dtype: torch.dtype | None = None):
    """Correctly rounded p-norm (p = 1 or 2) of all values of ``tensors`` (a non-empty list on one device) in
    ``dtype``; with ``per_tensor`` also each tensor's, in ``per_dtype`` (default ``dtype``), as ``(total, per)``.
    ``extra_dtype``: also return the total rounded (from the same sum) to that dtype, as the last item."""
    dg, fl = limbs(tensors, p, per_tensor, compiled=compiled)
    per = None
    if per_tensor:
        per = finish(dg, fl, p, per_dtype or dtype)
        dg, fl = total_digits(dg, fl)
    else:
        dg, fl = dg[0], fl[0]
    total = finish(dg, fl, p, dtype)
    out = (total, per)
    if extra_dtype is not None:
        out = out + (finish(dg, fl, p, extra_dtype),)
    return out


def compiled_total(tensors, p: float, acc_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
    """The correctly rounded norm of a list the compiled kernels serve (:func:`compiled_ok`) in ``acc_dtype`` and
    ``out_dtype`` (one sum, two roundings) from the compiled ``exact_total``, which decides from a float64 sum with
    an error bound when it can (then no digits are built) and otherwise returns the exact digits, rounded here;
    None where that kernel is not built (the caller builds the digits)."""
    if not hasattr(torch.ops.fastgrad, "exact_total"):
        return None
    base, nl = _WINDOWS[p]
    ra, rb, dg, fl = torch.ops.fastgrad.exact_total(list(tensors), int(p), base, nl, acc_dtype, out_dtype)
    if dg.shape[0] == 0:  # decided by the bound (a shape, not a value, is read)
        return ra, rb
    return two_roundings(dg[0], fl[0], p, acc_dtype, out_dtype)


def two_roundings(digits: Tensor, flags: Tensor, p: float, acc_dtype: torch.dtype, out_dtype: torch.dtype | None
                  ) -> tuple[Tensor, Tensor]:
    """:func:`finish` to ``acc_dtype`` and to ``out_dtype`` (the same tensor when that is None or the same dtype)."""
    total = finish(digits, flags, p, acc_dtype)
    if out_dtype is None or out_dtype == acc_dtype:
        return total, total
    return total, finish(digits, flags, p, out_dtype)
