"""An independent oracle of the correctly rounded norm: Python ``fractions`` on the values, the root and the
rounding with integers. Shares nothing with fastgrad.exact."""

from __future__ import annotations

import math
from fractions import Fraction
from math import isqrt

import torch

# (precision, exponent of the smallest subnormal, largest exponent)
GRID = {
    torch.float64: (53, -1074, 1023),
    torch.float32: (24, -149, 127),
    torch.bfloat16: (8, -133, 127),
    torch.float16: (11, -24, 15),
}


def _floor_log2(s: Fraction) -> int:
    e = s.numerator.bit_length() - s.denominator.bit_length()
    if Fraction(2) ** e > s:
        e -= 1
    return e


def _round_half_even_sqrt(r: Fraction) -> int:
    """round(sqrt(r)) to the nearest integer, ties to even."""
    n = isqrt(r.numerator // r.denominator)
    mid = (Fraction(2 * n + 1, 2)) ** 2
    if r > mid or (r == mid and n % 2 == 1):
        return n + 1
    return n


def correctly_rounded(values, p: float, dtype: torch.dtype) -> torch.Tensor:
    """The p-norm (1, 2 or inf) of ``values`` (floats), exact, rounded to nearest even in ``dtype``."""
    vals = [float(v) for v in values]
    if any(math.isnan(v) for v in vals):
        return torch.tensor(math.nan, dtype=dtype)
    if any(math.isinf(v) for v in vals):
        return torch.tensor(math.inf, dtype=dtype)
    if p == math.inf:
        return torch.tensor(max((abs(v) for v in vals), default=0.0), dtype=torch.float64).to(dtype)
    # every float is an integer over 2^1074 at most: sum integers (fast), divide once
    shift = 1074
    total = 0
    for v in vals:
        n, d = abs(v).as_integer_ratio()
        i = n << (shift - (d.bit_length() - 1))
        total += i * i if p == 2 else i
    s = Fraction(total, 1 << (shift * int(p)))
    if s == 0:
        return torch.tensor(0.0, dtype=dtype)
    prec, qmin, emax = GRID[dtype]
    if p == 1:
        e = _floor_log2(s)
        q = max(e - prec + 1, qmin)
        k = round(s / Fraction(2) ** q)  # Fraction rounds half to even
    else:
        e = _floor_log2(s) // 2  # 4^e <= s < 4^(e+1): 2^e <= sqrt(s) < 2^(e+1)
        q = max(e - prec + 1, qmin)
        k = _round_half_even_sqrt(s / Fraction(4) ** q)
    if k * Fraction(2) ** q >= Fraction(2) ** (emax + 1):
        return torch.tensor(math.inf, dtype=dtype)
    return torch.tensor(math.ldexp(k, q), dtype=torch.float64).to(dtype)


def four_squares(n: int) -> list[int]:
    """Four non-negative integers whose squares add to ``n`` (Lagrange), by a short search."""
    a = isqrt(n)
    while a >= 0:
        r = n - a * a
        b = isqrt(r)
        for b2 in range(b, max(-1, b - 64), -1):
            r2 = r - b2 * b2
            c = isqrt(r2)
            for c2 in range(c, -1, -1):
                d2 = r2 - c2 * c2
                if d2 > 2 * c2 * c2 + 2:
                    break
                d = isqrt(d2)
                if d * d == d2:
                    return [a, b2, c2, d]
        a -= 1
    raise AssertionError(n)
