"""exact=True: the correctly rounded norm (fastgrad/exact.py), against the fractions oracle (tests/exact_oracle.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fastgrad import exact as exact_norm

from .exact_oracle import GRID, correctly_rounded, four_squares

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _promoted(ts):
    dt = ts[0].dtype
    for t in ts[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def _values(ts):
    return [v for t in ts for v in t.double().reshape(-1).tolist()]


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _check(ts, p, dtype=None, compiled=False):
    dtype = dtype or _promoted(ts)
    got, _ = exact_norm.rounded_norm(ts, p, dtype, compiled=compiled)
    want = correctly_rounded(_values(ts), p, dtype)
    assert got.dtype == dtype
    assert _bits(got) == _bits(want), (p, dtype, got.item(), want.item())
    return got


def _random_list(rng: random.Random, gen: torch.Generator, dtypes=DTYPES):
    ts = []
    for _ in range(rng.randint(1, 4)):
        dt = rng.choice(dtypes)
        wide = dt in (torch.float32, torch.float64)
        scale = 10.0 ** rng.randint(-30, 30) if wide else 10.0 ** rng.randint(-3, 3)
        ts.append((torch.randn(rng.randint(0, 40), generator=gen, dtype=torch.float64) * scale).to(dt))
    if not any(t.numel() for t in ts):
        ts.append(torch.ones(1, dtype=ts[0].dtype))
    return ts


@pytest.mark.parametrize("p", [1.0, 2.0])
def test_random_lists_match_the_oracle(p):
    rng, gen = random.Random(int(p)), torch.Generator().manual_seed(int(p))
    for _ in range(40):
        _check(_random_list(rng, gen), p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [1.0, 2.0])
def test_single_dtype_lists_round_straight_to_it(dtype, p):
    gen = torch.Generator().manual_seed(3)
    for n in (1, 5, 300):
        ts = [(torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(dtype)]
        got = _check(ts, p)
        if dtype == torch.bfloat16:  # not through float32: the float32 result rounded again may differ
            assert got.dtype == torch.bfloat16


def _midpoint_lists(dtype, p, k, q):
    """Lists whose exact p-norm is the midpoint between k * 2^q and (k + 1) * 2^q (k odd: a tie that rounds up
    to even; k even: down), just above it and just below it."""
    mid_e = q - 1
    tiny = math.ldexp(1.0, mid_e - 30)
    if p == 1.0:
        x = math.ldexp(k, q)
        h = math.ldexp(1.0, mid_e)
        tie = [x, h]
        return tie, tie + [tiny], [x, h - math.ldexp(1.0, mid_e - 20)]
    # ((2k + 1) 2^(q-1))^2 = (k 2^q)^2 + (4k + 1) 2^(2q-2), and 4k + 1 is a sum of four squares
    x = math.ldexp(k, q)
    tie = [x] + [math.ldexp(a, mid_e) for a in four_squares(4 * k + 1)]
    below = [x] + [math.ldexp(a, mid_e) for a in four_squares(4 * k)]
    return tie, tie + [tiny], below + [tiny]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("p", [1.0, 2.0])
def test_sums_built_on_a_rounding_midpoint(dtype, p):
    prec = GRID[dtype][0]
    rng = random.Random(7)
    for _ in range(6):
        k = rng.randrange(1 << (prec - 1), 1 << prec)
        q = rng.randint(-20, 20)
        tie, above, below = _midpoint_lists(dtype, p, k, q)
        lists = {"tie": tie, "above": above, "below": below}
        for name, vals in lists.items():
            t = torch.tensor(vals, dtype=torch.float64)
            assert t.tolist() == vals  # every value representable
            got = _check([t], p, dtype)
            lo, hi = math.ldexp(k, q), math.ldexp(k + 1, q)
            want = {"tie": hi if k % 2 else lo, "above": hi, "below": lo}[name]
            assert got.double().item() == want, (name, k, q)


@pytest.mark.parametrize("p", [1.0, 2.0])
def test_the_binade_boundary(p):
    # just below a power of two the grid is twice as fine: midpoints on both sides of 2^e
    for dtype in (torch.float32, torch.float64):
        prec = GRID[dtype][0]
        top = math.ldexp(1.0, 10)
        step = math.ldexp(1.0, 10 - prec)  # the spacing just below 2^10
        for delta in (-step, -step / 2, -step / 4, 0.0, step / 2, step):
            vals = [top + delta] if p == 1.0 else [top, math.ldexp(1.0, 10 - prec // 2)]
            if p == 2.0 and delta:
                vals = vals + [abs(delta)]
            _check([torch.tensor(vals, dtype=torch.float64)], p, dtype)


def test_subnormals_overflow_and_specials():
    f32 = torch.float32
    tiny = torch.tensor([1e-45, 3e-45, 1e-40, -7e-39], dtype=f32)
    for p in (1.0, 2.0):
        _check([tiny], p)
        _check([tiny.double() * 1e-280], p)
        _check([torch.tensor([4.9e-324, 1e-320], dtype=torch.float64)], p)
        _check([torch.tensor([6e-8, 1e-7], dtype=torch.float16)], p)
    # true norm above the float32 maximum: inf (and only then)
    big = torch.tensor([3e38, 3e38], dtype=f32)
    assert exact_norm.rounded_norm([big], 2.0, f32)[0].item() == math.inf
    _check([big], 2.0)
    _check([torch.tensor([2.4e38], dtype=f32), torch.tensor([1e37], dtype=f32)], 2.0)
    _check([torch.tensor([1.5e308, 1.5e308], dtype=torch.float64)], 2.0)
    # ... where float32 squares would overflow or underflow, the exact norm does not
    got = _check([torch.tensor([1.5e38, 1.5e38], dtype=f32)], 2.0)
    assert math.isfinite(got.item())
    got = _check([torch.tensor([1e-30, 1e-30], dtype=f32)], 2.0)
    assert got.item() > 0
    nan_inf = torch.tensor([1.0, math.inf, math.nan])
    assert math.isnan(exact_norm.rounded_norm([nan_inf], 2.0, f32)[0].item())
    assert exact_norm.rounded_norm([torch.tensor([1.0, -math.inf])], 1.0, f32)[0].item() == math.inf
    assert exact_norm.rounded_norm([torch.zeros(3), torch.zeros(0)], 2.0, f32)[0].item() == 0.0
    for p in (1.0, 2.0):
        _check([torch.tensor([math.inf, math.nan])], p)


@pytest.mark.parametrize("p", [1.0, 2.0])
def test_order_grouping_and_dtype_mix_give_the_same_bytes(p):
    gen = torch.Generator().manual_seed(11)
    vals = torch.randn(5000, generator=gen, dtype=torch.float64) * torch.logspace(-20, 20, 5000, dtype=torch.float64)
    vals = vals.float()
    whole = exact_norm.rounded_norm([vals], p, torch.float32)[0]
    perm = vals[torch.randperm(5000, generator=gen)]
    pieces = list(perm.split([1, 999, 0, 3000, 1000]))
    assert _bits(exact_norm.rounded_norm(pieces, p, torch.float32)[0]) == _bits(whole)
    assert _bits(exact_norm.rounded_norm(pieces[::-1], p, torch.float32)[0]) == _bits(whole)
    # as 2-D and non-contiguous views of the same values
    assert _bits(exact_norm.rounded_norm([vals.reshape(50, 100).t()], p, torch.float32)[0]) == _bits(whole)
    # the same values held partly as float64 (exactly): float64 result, equal to float32 rounding of the same sum
    mixed = [vals[:2500], vals[2500:].double()]
    assert _bits(exact_norm.rounded_norm(mixed, p, torch.float32)[0]) == _bits(whole)
    _check([vals], p)


def test_per_tensor_norms_are_exact_too():
    gen = torch.Generator().manual_seed(5)
    ts = [torch.randn(n, generator=gen) * 10.0 ** i for i, n in enumerate((3, 0, 70, 1))]
    for p in (1.0, 2.0):
        total, per = exact_norm.rounded_norm(ts, p, torch.float32, per_tensor=True)
        assert per.shape == (4,)
        for t, v in zip(ts, per):
            assert _bits(v) == _bits(correctly_rounded(_values([t]), p, torch.float32))
        assert _bits(total) == _bits(correctly_rounded(_values(ts), p, torch.float32))


def test_normalize_ripples_carries_through_full_digits():
    m = (1 << 32) - 1
    d = torch.tensor([[m + 1, m, m, m, 0, 5], [3 << 40, m, 0, m, m, 0]], dtype=torch.int64)
    got = exact_norm.normalize(d)
    for row, out in zip(d.tolist(), got.tolist()):
        assert sum(v << (32 * i) for i, v in enumerate(row)) == sum(v << (32 * i) for i, v in enumerate(out))
        assert all(0 <= v <= m for v in out)


def test_bad_norm_type_is_rejected():
    with pytest.raises(ValueError, match="exact=True supports norm_type 1, 2 and inf"):
        exact_norm.check_norm_type(3.0)


def test_no_host_read_or_host_value_on_the_way():
    # no .item()/bool() of a tensor (a host sync on a GPU) and no Python value lifted into a tensor (a host to
    # device copy): the whole computation, rounding included, stays tensor ops
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.hits = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if name.startswith(("_local_scalar_dense", "lift_fresh", "item")):
                self.hits.append(name)
            return func(*args, **(kwargs or {}))

    ts = [torch.randn(100), torch.randn(7, dtype=torch.bfloat16), torch.zeros(0)]
    with Watch() as w:
        for p in (1.0, 2.0):
            exact_norm.rounded_norm(ts, p, torch.float32, per_tensor=True, compiled=False, extra_dtype=torch.bfloat16)
    assert w.hits == []
