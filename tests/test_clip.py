"""clip_grad_norm_, get_total_norm, clip_grads_with_norm_, clip_grad_value_ and multi_tensor_norm on every
(backend, device) pair, against torch.nn.utils (same inputs) and a float64 oracle (docs/contract.md section 3)."""

from __future__ import annotations

import math

import pytest
import torch

import fastgrad
from fastgrad import BackendError

from . import oracle
from .helpers import (DTYPE_IDS, DTYPES, SHAPES, SMALL_SHAPES, assert_close_to_torch, assert_no_worse_than, bits,
                      clone_params, grads, make_params, norm_ulps, rtol_vs_torch)

INF = float("inf")
FAST_NORMS = [2.0, 1.0, INF, 0.5, 3.0]
# torch.nn.utils raises for the inf norm of a zero-size grad; comparisons with it use these shapes.
NONEMPTY_SMALL = [s for s in SMALL_SHAPES if math.prod(s)]


def _both(params):
    return params, clone_params(params)


def _check_clip_result(ours_params, torch_params, orig, total, total_torch, max_norm, p, dtype):
    """Total norm and clipped grads: torch's dtype/device, accuracy rule vs the oracle, rtol vs torch."""
    og = grads(orig)
    o_total, o_grads = oracle.clipped(og, max_norm, p)
    assert total.dtype == total_torch.dtype and total.device == total_torch.device and total.dim() == 0
    assert_no_worse_than(total, total_torch, o_total, total.dtype, "total norm", norm_ulps(p, o_total))
    # For p < 1 the clipped gradients carry the total's slack: each is scaled by a coefficient computed from the
    # total, and the H100 run's triton p = 0.5 fp32 case shows a correctly rounded total giving an element 2.0 ulps
    # off where torch's total (off itself) happened to land exactly.
    g_ulps = norm_ulps(p, o_total) + 1.0 if 0 < p < 1 else 1.0
    for g, gt, go in zip(grads(ours_params), grads(torch_params), o_grads):
        assert g.dtype == gt.dtype and g.shape == gt.shape and g.stride() == gt.stride()
        assert_no_worse_than(g, gt, go, g.dtype, "clipped gradient", g_ulps)
    rtol = rtol_vs_torch(dtype)
    if rtol is not None:
        assert_close_to_torch(total, total_torch, o_total, rtol, "total norm vs torch")
        for g, gt, go in zip(grads(ours_params), grads(torch_params), o_grads):
            assert_close_to_torch(g, gt, go, rtol, "clipped gradient vs torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("norm_type", FAST_NORMS)
@pytest.mark.parametrize("clipping", [True, False], ids=["clip", "noclip"])
def test_clip_grad_norm_matches_torch_and_oracle(bd, dtype, norm_type, clipping):
    backend, device = bd
    shapes = SHAPES if norm_type != INF else [s for s in SHAPES if math.prod(s)]
    seed = 10 * DTYPES.index(dtype) + FAST_NORMS.index(norm_type)
    params = make_params(shapes, dtype, device, seed=seed, none_every=4)
    orig = clone_params(params)
    total_orig = oracle.total_norm(grads(orig), norm_type)
    max_norm = total_orig / 3 if clipping else total_orig * 3
    ours, theirs = _both(params)
    total = fastgrad.clip_grad_norm_(ours, max_norm, norm_type, backend=backend)
    total_t = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    _check_clip_result(ours, theirs, orig, total, total_t, max_norm, norm_type, dtype)
    if not clipping:  # coefficient 1: values unchanged bit for bit
        for g, g0 in zip(grads(ours), grads(orig)):
            assert torch.equal(bits(g), bits(g0))


@pytest.mark.parametrize("noncontig", [False, True], ids=["contig", "noncontig"])
def test_clip_mixed_dtypes_one_call(bd, noncontig):
    backend, device = bd
    params = make_params(SHAPES, [torch.float32, torch.bfloat16, torch.float16], device, seed=3,
                         noncontig=noncontig)
    orig = clone_params(params)
    ours, theirs = _both(params)
    total = fastgrad.clip_grad_norm_(ours, 1.0, backend=backend)
    total_t = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert total.dtype == torch.float32
    _check_clip_result(ours, theirs, orig, total, total_t, 1.0, 2.0, torch.float16)


def test_clip_transposed_and_expanded_views(bd):
    backend, device = bd
    gen = torch.Generator().manual_seed(5)
    p1 = torch.nn.Parameter(torch.randn(6, 9, generator=gen).to(device))
    p1.grad = torch.randn(9, 6, generator=gen).to(device).t()  # dense but transposed
    p2 = torch.nn.Parameter(torch.randn(4, 5, 3, generator=gen).to(device))
    p2.grad = torch.randn(4, 3, 5, generator=gen).to(device).transpose(1, 2)
    params = [p1, p2]
    orig = clone_params(params)
    ours, theirs = _both(params)
    total = fastgrad.clip_grad_norm_(ours, 0.5, backend=backend)
    total_t = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    _check_clip_result(ours, theirs, orig, total, total_t, 0.5, 2.0, torch.float32)


def test_many_small_tensors(bd):
    backend, device = bd
    shapes = [((i * 37) % 200 + 1,) for i in range(300)]
    params = make_params(shapes, [torch.float32, torch.bfloat16], device, seed=11)
    orig = clone_params(params)
    ours, theirs = _both(params)
    total = fastgrad.clip_grad_norm_(ours, 1.0, backend=backend)
    total_t = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    _check_clip_result(ours, theirs, orig, total, total_t, 1.0, 2.0, torch.bfloat16)


def test_single_tensor_and_generator_inputs(bd):
    backend, device = bd
    (p,) = make_params([(13, 7)], torch.float32, device, seed=2)
    q = clone_params([p])[0]
    total = fastgrad.clip_grad_norm_(p, 0.1, backend=backend)
    total_t = torch.nn.utils.clip_grad_norm_(q, 0.1)
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0)
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    params = make_params(SMALL_SHAPES, torch.float32, device, seed=4)
    theirs = clone_params(params)
    total = fastgrad.clip_grad_norm_((x for x in params), 0.1, backend=backend)
    total_t = torch.nn.utils.clip_grad_norm_((x for x in theirs), 0.1)
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0)


def test_no_grads_returns_cpu_zero_without_kernels(bd):
    backend, device = bd
    params = make_params([(3,), (4,)], torch.float32, device, none_every=1)
    assert all(p.grad is None for p in params)
    for fn in (lambda: fastgrad.clip_grad_norm_(params, 1.0, backend=backend),
               lambda: fastgrad.get_total_norm([], backend=backend)):
        total = fn()
        assert total.device.type == "cpu" and total.dtype == torch.float32 and float(total) == 0.0
    assert fastgrad.clip_grad_value_(params, 1.0, backend=backend) is None
    assert fastgrad.clip_grads_with_norm_(params, 1.0, torch.tensor(3.0), backend=backend) is None


def test_empty_generator_warns_like_torch():
    with pytest.warns(UserWarning, match="empty generator, no gradient clipping will occur"):
        total = fastgrad.clip_grad_norm_((p for p in []), 1.0)
    assert float(total) == 0.0


def test_all_zero_size_grads(bd):
    backend, device = bd
    params = make_params([(0,), (3, 0)], torch.float32, device)
    for p in [2.0, 1.0, INF]:
        total = fastgrad.clip_grad_norm_(params, 1.0, p, backend=backend)
        assert float(total) == 0.0 and total.device.type == device


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("norm_type", [2.0, INF, 1.0])
def test_nonfinite_grads_behave_as_torch(bd, dtype, poison, norm_type):
    backend, device = bd
    params = make_params(NONEMPTY_SMALL, dtype, device, seed=7)
    params[3].grad.view(-1)[100] = float(poison)
    ours, theirs = _both(params)
    total = fastgrad.clip_grad_norm_(ours, 1.0, norm_type, backend=backend)
    total_t = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    torch.testing.assert_close(total, total_t, equal_nan=True, rtol=0, atol=0)
    for g, gt in zip(grads(ours), grads(theirs)):
        # NaN norm: every gradient NaN; inf norm: finite gradients zeroed, infinities become NaN.
        torch.testing.assert_close(g, gt, equal_nan=True, rtol=0, atol=0)


def test_error_if_nonfinite_raises_before_any_write(bd):
    backend, device = bd
    params = make_params(SMALL_SHAPES, torch.float32, device, seed=8)
    params[0].grad[3] = float("nan")
    before = clone_params(params)
    theirs = clone_params(params)
    with pytest.raises(RuntimeError) as ours_err:
        fastgrad.clip_grad_norm_(params, 1.0, error_if_nonfinite=True, backend=backend)
    with pytest.raises(RuntimeError) as torch_err:
        torch.nn.utils.clip_grad_norm_(theirs, 1.0, error_if_nonfinite=True)
    assert str(ours_err.value) == str(torch_err.value)
    for g, g0 in zip(grads(params), grads(before)):
        assert torch.equal(bits(g), bits(g0))
    with pytest.raises(RuntimeError, match="non-finite"):
        fastgrad.get_total_norm(grads(params), error_if_nonfinite=True, backend=backend)


@pytest.mark.parametrize("norm_type", [0.0, -INF, -1.0, -0.5])
def test_other_norm_types_fall_back_to_torch_result(bd, norm_type):
    backend, device = bd
    params = make_params(SMALL_SHAPES[:3] + [(5, 5)], torch.float32, device, seed=9)
    params[1].grad.zero_()  # so the 0-"norm" (count of tensors with a nonzero) is not just len(list)
    ours, theirs = _both(params)
    if backend == "torch":
        total = fastgrad.clip_grad_norm_(ours, 1.0, norm_type, backend=backend)
    else:
        with pytest.raises(BackendError, match=backend):
            fastgrad.clip_grad_norm_(ours, 1.0, norm_type, backend=backend)
        if device == "cpu" and backend == "triton":
            return  # automatic choice never picks the interpreter; the torch-cpu case covers this
        total = fastgrad.clip_grad_norm_(ours, 1.0, norm_type)  # automatic: quiet fallback
    total_t = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0)
    for g, gt in zip(grads(ours), grads(theirs)):
        torch.testing.assert_close(g, gt, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_get_total_norm_and_clip_grads_with_norm(bd, dtype):
    backend, device = bd
    params = make_params(SHAPES, dtype, device, seed=12)
    ts = [g.clone() for g in grads(params)]
    total = fastgrad.get_total_norm(ts, 2.0, backend=backend)
    total_t = torch.nn.utils.get_total_norm(ts, 2.0)
    assert total.dtype == total_t.dtype == dtype
    assert_no_worse_than(total, total_t, oracle.total_norm(ts, 2.0), dtype, "get_total_norm")
    ours, theirs = _both(params)
    orig = clone_params(params)
    fastgrad.clip_grads_with_norm_(ours, 1.0, total, backend=backend)
    torch.nn.utils.clip_grads_with_norm_(theirs, 1.0, total)
    coef = min(1.0 / (float(total) + 1e-6), 1.0)
    for g, gt, g0 in zip(grads(ours), grads(theirs), grads(orig)):
        assert_no_worse_than(g, gt, oracle.f64(g0) * coef, dtype, "clip_grads_with_norm_")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("noncontig", [False, True], ids=["contig", "noncontig"])
def test_clip_grad_value_exactly_torch(bd, dtype, noncontig):
    backend, device = bd
    params = make_params(SHAPES, dtype, device, seed=13, scale=2.0, noncontig=noncontig)
    params[0].grad[1] = float("nan")
    params[1].grad[0, 0] = float("inf")
    params[1].grad[0, 1] = -float("inf")
    ours, theirs = _both(params)
    assert fastgrad.clip_grad_value_(ours, 0.75, backend=backend) is None
    torch.nn.utils.clip_grad_value_(theirs, 0.75)
    for g, gt in zip(grads(ours), grads(theirs)):
        assert torch.equal(bits(g), bits(gt)) or torch.testing.assert_close(g, gt, equal_nan=True, rtol=0,
                                                                            atol=0) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("norm_type", FAST_NORMS)
def test_multi_tensor_norm_per_tensor(bd, dtype, norm_type):
    backend, device = bd
    ts = grads(make_params(SHAPES, dtype, device, seed=14))
    total, per = fastgrad.multi_tensor_norm(ts, norm_type, per_tensor=True, backend=backend)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert total.dtype == acc and per.dtype == acc and per.shape == (len(ts),)
    assert total.device.type == device and per.device.type == device
    ref_total, ref_per = fastgrad.multi_tensor_norm(ts, norm_type, per_tensor=True, backend="torch")
    exp_per = torch.tensor([oracle.tensor_norm(t, norm_type) for t in ts], dtype=torch.float64)
    assert_no_worse_than(per, ref_per, exp_per, acc, "per-tensor norms", norm_ulps(norm_type, exp_per))
    exp_total = oracle.total_norm(ts, norm_type)
    assert_no_worse_than(total, ref_total, exp_total, acc, "total", norm_ulps(norm_type, exp_total))
    rtol = 1e-12 if dtype == torch.float64 else 1e-6  # fp32 accumulation: same rule as fp32 inputs
    assert_close_to_torch(per, ref_per, exp_per, rtol, "per-tensor norms vs torch backend")
    assert_close_to_torch(total, ref_total, exp_total, rtol, "total vs torch backend")
    plain = fastgrad.multi_tensor_norm(ts, norm_type, backend=backend)
    assert torch.equal(bits(plain), bits(total))


def test_multi_tensor_norm_empty():
    total, per = fastgrad.multi_tensor_norm([], per_tensor=True)
    assert float(total) == 0.0 and per.numel() == 0


def test_results_are_bitwise_deterministic(bd):
    backend, device = bd
    params = make_params(SHAPES, [torch.float32, torch.bfloat16], device, seed=15)
    runs = []
    for _ in range(20):
        mine = clone_params(params)
        total = fastgrad.clip_grad_norm_(mine, 0.3, backend=backend)
        runs.append((bits(total), [bits(g) for g in grads(mine)]))
    for total_bits, g_bits in runs[1:]:
        assert torch.equal(total_bits, runs[0][0])
        assert all(torch.equal(a, b) for a, b in zip(g_bits, runs[0][1]))


@pytest.mark.parametrize("foreach", [None, True, False])
def test_torch_backend_honours_foreach(foreach):
    params = make_params(SMALL_SHAPES, torch.float32, "cpu", seed=16)
    ours, theirs = _both(params)
    total = fastgrad.clip_grad_norm_(ours, 0.5, foreach=foreach, backend="torch")
    total_t = torch.nn.utils.clip_grad_norm_(theirs, 0.5, foreach=foreach)
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0)
    fastgrad.clip_grad_value_(ours, 0.01, foreach=foreach, backend="torch")
    torch.nn.utils.clip_grad_value_(theirs, 0.01, foreach=foreach)
    for g, gt in zip(grads(ours), grads(theirs)):
        torch.testing.assert_close(g, gt, rtol=1e-6, atol=0)


def test_sparse_and_complex_grads_get_torchs_result():
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.complex64))
    p.grad = torch.randn(5, dtype=torch.complex64)
    q = clone_params([p])[0]
    total = fastgrad.clip_grad_norm_([p], 0.5)
    total_t = torch.nn.utils.clip_grad_norm_([q], 0.5)
    torch.testing.assert_close(total, total_t)
    torch.testing.assert_close(p.grad, q.grad)
    s = torch.nn.Parameter(torch.randn(5))
    s.grad = torch.randn(5).to_sparse()
    with pytest.raises(NotImplementedError):  # torch itself cannot take the norm of a sparse COO grad
        torch.nn.utils.clip_grad_norm_([s], 0.5)
    with pytest.raises(NotImplementedError):
        fastgrad.clip_grad_norm_([s], 0.5)
    with pytest.raises(NotImplementedError):
        torch.nn.utils.clip_grad_value_([s], 0.1)
    with pytest.raises(NotImplementedError):
        fastgrad.clip_grad_value_([s], 0.1)
    with pytest.raises(BackendError, match="sparse, complex"):
        fastgrad.clip_grad_norm_([p], 0.5, backend="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grads_on_several_devices():
    cpu = make_params(SMALL_SHAPES, torch.float32, "cpu", seed=17)
    gpu = make_params(SMALL_SHAPES, torch.float32, "cuda", seed=18)
    params = [gpu[0]] + cpu + gpu[1:]
    ours, theirs = _both(params)
    total = fastgrad.clip_grad_norm_(ours, 0.5)
    total_t = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert total.device == total_t.device
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0)
    total, per = fastgrad.multi_tensor_norm(grads(params), per_tensor=True)
    exp = torch.tensor([oracle.tensor_norm(g, 2.0) for g in grads(params)], dtype=torch.float64)
    torch.testing.assert_close(per.double().cpu(), exp, rtol=1e-6, atol=0)
    assert not math.isnan(float(total))


# ---------------------------------------------------------------------- the clip_norm_ primitive (issue 13)
@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.bfloat16, torch.float16], [torch.float32, torch.float64]],
                         ids=["fp32", "16bit", "mixed64"])
@pytest.mark.parametrize("norm_type", [2.0, INF, 0.5])
@pytest.mark.parametrize("clipping", [True, False], ids=["clip", "noclip"])
def test_clip_norm_primitive_same_bits_as_its_composition(bd, dtypes, norm_type, clipping):
    """The primitive's contract on every backend: exactly what Backend.clip_norm_ (the backend's own norm,
    torch's coefficient expression, the backend's scale_) gives, total and gradients."""
    from fastgrad.backends import Backend, get

    backend, device = bd
    b = get(backend)
    params = make_params(SHAPES, dtypes, device, seed=40 + FAST_NORMS.index(norm_type), noncontig=True)
    ours, ref = grads(params), grads(clone_params(params))
    exact = oracle.total_norm(ours, norm_type)
    max_norm = exact / 3 if clipping else exact * 3
    total = b.clip_norm_(ours, max_norm, norm_type)
    ref_total = Backend.clip_norm_(b, ref, max_norm, norm_type)
    assert total.dtype == ref_total.dtype == (torch.float64 if torch.float64 in dtypes else torch.float32)
    assert total.dim() == 0 and total.device == ours[0].device
    assert torch.equal(bits(total), bits(ref_total))
    for g, r in zip(ours, ref):
        assert torch.equal(bits(g), bits(r))


@pytest.mark.parametrize("error_if_nonfinite", [False, True])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_clip_grad_norm_is_one_primitive_call(monkeypatch, backend, error_if_nonfinite):
    from fastgrad.backends import get

    b = get(backend)
    if b.unavailable_reason() is not None:
        pytest.skip(b.unavailable_reason())
    calls = []
    for name in ("clip_norm_", "norm", "scale_"):
        def spy(self, *args, _name=name, _orig=getattr(type(b), name), **kwargs):
            calls.append(_name)
            return _orig(self, *args, **kwargs)
        monkeypatch.setattr(type(b), name, spy)
    # non-contiguous grads: the cpu backend's one-call C++ path (_scan.clip_norm_cpu) declines them
    params = make_params(SMALL_SHAPES, torch.float32, "cpu", seed=44, noncontig=True)
    fastgrad.clip_grad_norm_(params, 0.1, error_if_nonfinite=error_if_nonfinite, backend=backend)
    if error_if_nonfinite:  # checks the norm on the host before anything is written: the separate steps
        assert calls == ["norm", "scale_"]
    else:  # one call; the torch backend's is the default composition
        assert calls == (["clip_norm_"] if backend == "cpu" else ["clip_norm_", "norm", "scale_"])


def test_fused_and_checked_clip_paths_agree(bd):
    # error_if_nonfinite=True keeps the step-by-step path (it must check before writing); on finite
    # gradients both paths give the same bits.
    backend, device = bd
    params = make_params(SHAPES, [torch.float32, torch.bfloat16, torch.float16], device, seed=45, noncontig=True)
    a, b = clone_params(params), clone_params(params)
    ta = fastgrad.clip_grad_norm_(a, 0.2, backend=backend)
    tb = fastgrad.clip_grad_norm_(b, 0.2, error_if_nonfinite=True, backend=backend)
    assert torch.equal(bits(ta), bits(tb))
    for x, y in zip(grads(a), grads(b)):
        assert torch.equal(bits(x), bits(y))
