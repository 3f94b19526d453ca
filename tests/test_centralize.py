"""centralize_gradient_ against the official formula (docs/contract.md section 6) on every (backend, device) pair."""

from __future__ import annotations

import pytest
import torch

import fastgrad
from fastgrad import _ext

from . import oracle
from .helpers import (DTYPE_IDS, DTYPES, assert_max_error_within, bits, clone_params, cuda_kernels_run, cuda_row_shapes,
                      assert_repeatable_without_host_sync, assert_zero_and_nan_rows, grads, make_params,
                      params_in_poisoned_buffer, zero_and_nan_rows)

GC_SHAPES = [(7,), (5, 3), (17, 33), (8, 3, 3, 3), (3, 0), (0, 4), (2, 1025), (1, 4097), (4, 2, 5)]


def official_gc_(params, gc_conv_only=False):
    """Gradient-Centralization repository's operation, in the gradient's own dtype."""
    for p in params:
        g = p.grad
        if g is None:
            continue
        if g.dim() > (3 if gc_conv_only else 1):
            g.add_(-g.mean(dim=tuple(range(1, g.dim())), keepdim=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("conv_only", [False, True], ids=["all", "conv_only"])
def test_gc_matches_official_and_oracle(bd, dtype, conv_only):
    backend, device = bd
    params = make_params(GC_SHAPES, dtype, device, seed=31, none_every=5)
    orig = clone_params(params)
    ref = clone_params(params)
    fastgrad.centralize_gradient_(params, gc_conv_only=conv_only, backend=backend)
    official_gc_(ref, conv_only)
    for p, r, o in zip(params, ref, orig):
        if o.grad is None:
            assert p.grad is None
            continue
        if o.grad.ndim <= (3 if conv_only else 1):
            assert torch.equal(bits(p.grad), bits(o.grad)), "grads of excluded ranks must be untouched"
            continue
        assert_max_error_within(p.grad, r.grad, oracle.centralize(o.grad), dtype, f"gc {tuple(o.grad.shape)}")


def test_gc_noncontiguous_and_rows_mean_zero(bd):
    backend, device = bd
    params = make_params([(6, 10), (5, 4, 3)], torch.float32, device, seed=32, noncontig=True)
    strides = [p.grad.stride() for p in params]
    fastgrad.centralize_gradient_(params, backend=backend)
    for p, s in zip(params, strides):
        assert p.grad.stride() == s
        row_means = p.grad.double().mean(dim=tuple(range(1, p.grad.ndim)))
        assert row_means.abs().max() < 1e-6


def test_gc_nan_stays_in_its_row(bd):
    backend, device = bd
    params = make_params([(4, 6)], torch.float32, device, seed=33)
    params[0].grad[2, 3] = float("nan")
    fastgrad.centralize_gradient_(params, backend=backend)
    g = params[0].grad.cpu()
    assert torch.isnan(g[2]).all() and torch.isfinite(g[[0, 1, 3]]).all()


# ------------------------------------------------------------------------------- cuda backend row plan
# Rows that fit a block are centralised in one launch from registers; longer rows are split (partials, a
# finalize, an apply): tests/helpers.py cuda_row_lengths names the classes.
cuda_only = pytest.mark.skipif(not (torch.cuda.is_available() and _ext.has_cuda_kernels()),
                               reason="needs a CUDA GPU and fastgrad's CUDA kernels")


def _check_gc(params, what):
    orig = clone_params(params)
    ref = clone_params(params)
    fastgrad.centralize_gradient_(params, backend="cuda")
    official_gc_(ref)
    for p, r, o in zip(params, ref, orig):
        name = f"{what} {tuple(o.shape)} {o.dtype}"
        if o.grad.dim() <= 1:
            assert torch.equal(bits(p.grad), bits(o.grad)), name
            continue
        assert_max_error_within(p.grad, r.grad, oracle.centralize(o.grad), o.dtype, name)
    return orig


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cuda_gc_every_row_class(dtype):
    params = make_params(cuda_row_shapes(dtype), dtype, "cuda", seed=51)
    _check_gc(params, "row classes")


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_gc_nan_and_zero_rows(dtype):
    params = make_params(cuda_row_shapes(dtype), dtype, "cuda", seed=52)
    picked = zero_and_nan_rows(params)
    orig = _check_gc(params, "nan/zero rows")
    assert_zero_and_nan_rows(params, orig, picked)


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("offset", [1, 3])
def test_cuda_gc_views_in_poisoned_buffer(dtype, offset):
    params, buf, guard = params_in_poisoned_buffer(cuda_row_shapes(dtype), dtype, "cuda", seed=53, offset=offset)
    before = buf.clone()
    _check_gc(params, f"offset {offset}")
    assert torch.equal(bits(buf[guard]), bits(before[guard])), "an element outside the gradients was written"


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("noncontig", [False, True], ids=["contig", "noncontig"])
def test_cuda_gc_mixed_dtypes(noncontig):
    shapes = cuda_row_shapes(torch.float16) + cuda_row_shapes(torch.float64)
    params = make_params(shapes, [torch.float32, torch.bfloat16, torch.float16, torch.float64], "cuda", seed=54,
                         noncontig=noncontig)
    strides = [p.grad.stride() for p in params]
    _check_gc(params, "mixed")
    assert [p.grad.stride() for p in params] == strides


@cuda_only
@pytest.mark.cuda
def test_cuda_gc_deterministic_without_host_sync():
    params = make_params(cuda_row_shapes(torch.float16) + cuda_row_shapes(torch.float32),
                         [torch.float16, torch.float32], "cuda", seed=55)
    assert_repeatable_without_host_sync(params, lambda ps: fastgrad.centralize_gradient_(ps, backend="cuda"))


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("n, launches", [(16384, 1), (16392, 3)], ids=["packed", "split"])
def test_cuda_gc_launches(n, launches):
    # bf16 rows of 16384 elements (32 KB, aligned) fit a block: one kernel; one window more and the row is
    # split: row pass, finalize, apply.
    params = make_params([(3, n), (40, 33), (9, 2)], torch.bfloat16, "cuda", seed=56)
    fastgrad.centralize_gradient_(params, backend="cuda")  # warm-up: the table is cached
    names = cuda_kernels_run(lambda: fastgrad.centralize_gradient_(params, backend="cuda"))
    assert len(names) == launches, names
    assert sum("k_row_pass" in x for x in names) == 1, names


@cuda_only
@pytest.mark.cuda
def test_cuda_gc_table_is_not_the_norm_table():
    # A GC row of a (1, n) gradient and the norm's whole-tensor unit describe the same memory; their device
    # tables (row plan vs chunk plan) must not be served for each other from the table cache.
    params = make_params([(1, 40000), (1, 77)], torch.float32, "cuda", seed=57)
    # references: torch's own norm (torch.nn.utils), fp32 rtol 1e-6 (the accuracy rule)
    total = fastgrad.get_total_norm(grads(params), backend="cuda")
    torch.testing.assert_close(total, torch.nn.utils.get_total_norm(grads(params)), rtol=1e-6, atol=0)
    _check_gc(params, "after a norm")
    after = fastgrad.get_total_norm(grads(params), backend="cuda")
    torch.testing.assert_close(after, torch.nn.utils.get_total_norm(grads(params)), rtol=1e-6, atol=0)
