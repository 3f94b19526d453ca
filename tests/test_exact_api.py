"""exact=True on the public functions (get_total_norm, clip_grad_norm_, multi_tensor_norm) and the compiled
CPU kernel against the torch reference: the same bytes, equal to the fractions oracle."""

from __future__ import annotations

import math
import random

import pytest
import torch

import fastgrad
from fastgrad import exact as exact_norm
from fastgrad.backends import available_backends

from .exact_oracle import correctly_rounded

CPU_BACKENDS = [b for b in ("torch", "cpu") if b in available_backends()]
needs_kernel = pytest.mark.skipif(not hasattr(torch.ops.fastgrad, "exact_limbs") or "cpu" not in CPU_BACKENDS,
                                  reason="the compiled CPU kernels are not built")


def _bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _vals(ts):
    return [v for t in ts for v in t.double().reshape(-1).tolist()]


class Holder:
    def __init__(self, grad):
        self.grad = grad


def _list(seed, dtypes, sizes=(7, 0, 300, 1, 70000)):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** (i - 2)).to(dtypes[i % len(dtypes)])
            for i, n in enumerate(sizes)]


# ------------------------------------------------------------------------------------------- the kernel
@needs_kernel
@pytest.mark.parametrize("p", [1.0, 2.0])
def test_compiled_kernel_gives_the_reference_digits(p):
    rng = random.Random(int(p))
    gen = torch.Generator().manual_seed(int(p))
    specials = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-45, 3.4e38, 1e-310], dtype=torch.float64)
    for trial in range(12):
        ts = []
        for _ in range(rng.randint(1, 5)):
            dt = rng.choice([torch.float32, torch.float64, torch.bfloat16, torch.float16])
            n = rng.choice([0, 1, 5, 33, 40000, 70001])
            t = torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** rng.randint(-40, 38)
            if trial % 3 == 0 and n:
                t[: min(n, 8)] = specials[: min(n, 8)]
            ts.append(t.to(dt))
        if rng.random() < 0.3 and ts[-1].numel() > 4:
            ts[-1] = ts[-1][::3]  # a non-contiguous view
        for per_tensor in (False, True):
            a = torch.ops.fastgrad.exact_limbs(ts, int(p), *exact_norm.window(p), per_tensor)
            b = exact_norm.limbs_torch(ts, p, per_tensor)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (trial, per_tensor)


@needs_kernel
def test_compiled_kernel_does_not_depend_on_threads():
    ts = _list(3, [torch.float32], sizes=(1 << 20, 5, 1 << 17))
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(torch.ops.fastgrad.exact_limbs(ts, 2, *exact_norm.window(2.0), True)[0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


# ------------------------------------------------------------------------------------------- public functions
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("p", [1.0, 2.0, math.inf])
@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.bfloat16], [torch.float16, torch.bfloat16],
                                    [torch.float32, torch.float64]], ids=["fp32", "bf16", "fp16+bf16", "fp32+fp64"])
def test_get_total_norm_is_the_correctly_rounded_norm(backend, p, dtypes):
    ts = _list(1, dtypes)
    got = fastgrad.get_total_norm(ts, p, backend=backend, exact=True)
    want_dtype = fastgrad.get_total_norm(ts, p, backend=backend).dtype  # the dtype the default returns
    assert got.dtype == want_dtype
    assert _bits(got) == _bits(correctly_rounded(_vals(ts), p, want_dtype))
    # order and grouping: the same bytes
    flat = torch.cat([t.double().reshape(-1) for t in ts])
    if len(dtypes) == 1:
        regrouped = list(flat.to(dtypes[0]).flip(0).split(1000))
        assert _bits(fastgrad.get_total_norm(regrouped, p, backend=backend, exact=True)) == _bits(got)


def test_backends_agree_bit_for_bit():
    ts = _list(4, [torch.float32, torch.bfloat16])
    for p in (1.0, 2.0):
        outs = {b: _bits(fastgrad.get_total_norm(ts, p, backend=b, exact=True)) for b in CPU_BACKENDS}
        assert len(set(outs.values())) == 1, outs


def test_default_is_unchanged():
    ts = _list(5, [torch.float32])
    for p in (1.0, 2.0, math.inf, 3.0):
        assert _bits(fastgrad.get_total_norm(ts, p, exact=False)) == _bits(fastgrad.get_total_norm(ts, p))
        assert _bits(fastgrad.multi_tensor_norm(ts, p, exact=False)) == _bits(fastgrad.multi_tensor_norm(ts, p))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.bfloat16], [torch.float32, torch.float64]])
def test_clip_grad_norm_scales_by_the_exact_norms_coefficient(backend, dtypes):
    ts = _list(6, dtypes)
    for p in (2.0, 1.0):
        grads = [t.clone() for t in ts]
        total = fastgrad.clip_grad_norm_([Holder(g) for g in grads], 0.5, p, backend=backend, exact=True)
        assert _bits(total) == _bits(correctly_rounded(_vals(ts), p, total.dtype))
        acc = torch.float64 if torch.float64 in dtypes else torch.float32
        # the default scaling with the exact norm (in the accumulation dtype) as the total
        want = [t.clone() for t in ts]
        fastgrad.clip_grads_with_norm_([Holder(w) for w in want], 0.5, correctly_rounded(_vals(ts), p, acc),
                                       backend=backend)
        for g, w in zip(grads, want):
            assert _bits(g) == _bits(w)


@pytest.mark.parametrize("dtypes,acc", [((torch.bfloat16, torch.float32), torch.float32),
                                        ((torch.float32, torch.float64), torch.float64)], ids=["fp32-acc", "fp64-acc"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_multi_tensor_norm_per_tensor_exact(backend, dtypes, acc):
    # both results in the accumulation dtype: float64 with a float64 tensor in the list
    ts = _list(7, list(dtypes))
    for p in (1.0, 2.0):
        total, per = fastgrad.multi_tensor_norm(ts, p, per_tensor=True, backend=backend, exact=True)
        assert total.dtype == per.dtype == acc
        assert _bits(total) == _bits(correctly_rounded(_vals(ts), p, acc))
        for t, v in zip(ts, per):
            assert _bits(v) == _bits(correctly_rounded(_vals([t]), p, acc))
        assert _bits(fastgrad.multi_tensor_norm(ts, p, backend=backend, exact=True)) == _bits(total)


def test_bad_input_is_rejected_before_any_work():
    g = torch.randn(10)
    keep = g.clone()
    with pytest.raises(ValueError, match="exact=True supports norm_type 1, 2 and inf"):
        fastgrad.clip_grad_norm_([Holder(g)], 0.1, 3.0, exact=True)
    assert torch.equal(g, keep)
    with pytest.raises(ValueError, match="exact=True"):
        fastgrad.get_total_norm([g], 0.0, exact=True)
    with pytest.raises(TypeError, match="exact=True supports dense real floating"):
        fastgrad.get_total_norm([torch.randn(3, dtype=torch.complex64)], 2.0, exact=True)


def test_nonfinite_and_empty():
    assert fastgrad.get_total_norm([], exact=True).item() == 0.0
    assert math.isnan(fastgrad.get_total_norm([torch.tensor([1.0, math.nan, math.inf])], exact=True).item())
    with pytest.raises(RuntimeError, match="non-finite"):
        fastgrad.clip_grad_norm_([Holder(torch.tensor([math.inf]))], 1.0, error_if_nonfinite=True, exact=True)
    # a true norm above the float32 maximum is inf; one just below is not (float32 squares would overflow)
    big = [torch.tensor([3e38, 3e38])]
    assert fastgrad.get_total_norm(big, exact=True).item() == math.inf
    ok = [torch.tensor([1.5e38, 1.5e38])]
    assert _bits(fastgrad.get_total_norm(ok, exact=True)) == _bits(correctly_rounded(_vals(ok), 2.0, torch.float32))
    # error_if_nonfinite judges the value get_total_norm returns: float16 values whose exact norm is past float16's
    # largest (finite in float32) round to inf there, as torch's float16 norm overflows
    over = [torch.full((3,), 60000.0, dtype=torch.float16)]
    assert fastgrad.get_total_norm(over, exact=True).item() == math.inf
    with pytest.raises(RuntimeError, match="non-finite"):
        fastgrad.get_total_norm(over, error_if_nonfinite=True, exact=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.get_total_norm(over, error_if_nonfinite=True)


@needs_kernel
@pytest.mark.parametrize("p", [1.0, 2.0])
def test_compiled_total_decides_by_its_bound_or_leaves_it_to_the_digits(p):
    from .test_exact import _midpoint_lists

    op = torch.ops.fastgrad.exact_total
    f32, bf16 = torch.float32, torch.bfloat16
    # random lists: decided from the float64 sum, no digits built
    for seed in range(6):
        ts = _list(seed, [f32, bf16, torch.float16], sizes=(5, 40000, 1, 300))
        a, b, dg, fl = op(ts, int(p), *exact_norm.window(p), f32, bf16)
        assert dg.shape[0] == 0
        assert _bits(a) == _bits(correctly_rounded(_vals(ts), p, f32))
        assert _bits(b) == _bits(correctly_rounded(_vals(ts), p, bf16))
    # sums on (or a hair off) a float32 rounding midpoint: the bound cannot decide, the digits do
    rng = random.Random(9)
    for _ in range(4):
        k, q = rng.randrange(1 << 23, 1 << 24), rng.randint(-30, 30)
        for vals in _midpoint_lists(f32, p, k, q):
            t = torch.tensor(vals, dtype=f32)
            assert t.double().tolist() == vals
            a, b, dg, fl = op([t], int(p), *exact_norm.window(p), f32, f32)
            assert dg.shape[0] == 1
            got = fastgrad.get_total_norm([t], p, backend="cpu", exact=True)
            assert _bits(got) == _bits(correctly_rounded(vals, p, f32))
    # NaN/inf and float64 lists go to the digits too
    assert op([torch.tensor([1.0, math.nan])], int(p), *exact_norm.window(p), f32, f32)[2].shape[0] == 1
    assert op([torch.ones(3, dtype=torch.float64)], int(p), *exact_norm.window(p), torch.float64, torch.float64)[2].shape[0] == 1


@pytest.mark.parametrize("zero_write", [True, False])
def test_clip_optimizer_grad_norm_exact(zero_write):
    from fastgrad.optim_clip import zero_write_applies

    ts = _list(8, [torch.float32], sizes=(300, 7, 5000))
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in ts]
    for prm, t in zip(params, ts):
        prm.grad = t.clone()
    opt = torch.optim.Adam(params, lr=0.1, fused=True)
    total = fastgrad.clip_optimizer_grad_norm_(opt, 0.5, zero_write=zero_write, exact=True)
    assert _bits(total) == _bits(correctly_rounded(_vals(ts), 2.0, torch.float32))
    if zero_write and zero_write_applies(opt, [prm.grad for prm in params]):
        assert all(torch.equal(prm.grad, t) for prm, t in zip(params, ts))  # handed to the step, not written
        opt.step()
    else:  # clipped in place: clip_grad_norm_(exact=True)'s gradients
        want = [Holder(t.clone()) for t in ts]
        fastgrad.clip_grad_norm_(want, 0.5, exact=True)
        assert all(_bits(prm.grad) == _bits(w.grad) for prm, w in zip(params, want))


@needs_kernel
def test_opcheck_exact_limbs():
    ts = [torch.randn(5, 3), torch.randn(40, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.float64)]
    for per_tensor in (False, True):
        torch.library.opcheck(torch.ops.fastgrad.exact_limbs.default, (ts, 2, *exact_norm.window(2.0), per_tensor))


def test_grad_stats_exact_total():
    model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 5))
    model(torch.randn(3, 30)).square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    default = fastgrad.grad_stats(model)
    st = fastgrad.grad_stats(model, exact=True)
    assert _bits(st.total_norm) == _bits(correctly_rounded(_vals(grads), 2.0, torch.float32))
    assert torch.equal(st.norm, default.norm)  # the columns are the default's
    assert _bits(fastgrad.grad_stats(model).total_norm) == _bits(default.total_norm)
