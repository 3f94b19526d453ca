"""adaptive_clip_grad_ against timm's formula (docs/contract.md section 5) on every (backend, device) pair."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

import fastgrad
from fastgrad import _ext

from . import oracle
from .helpers import (DTYPE_IDS, DTYPES, assert_max_error_within, bits, clone_params, cuda_kernels_run, cuda_row_shapes,
                      assert_repeatable_without_host_sync, assert_zero_and_nan_rows, grads, make_params, mix_row_scales,
                      params_in_poisoned_buffer, zero_and_nan_rows)

AGC_SHAPES = [(7,), (1,), (5, 3), (17, 33), (8, 3, 3, 3), (0,), (3, 0), (2, 1025), (1, 4097), ()]


def timm_agc_(parameters, clip_factor=0.01, eps=1e-3, norm_type=2.0):
    """timm.utils.agc.adaptive_clip_grad as published (norms in the parameter's own dtype): the
    same-precision implementation fastgrad's error is measured against."""
    for p in parameters:
        if p.grad is None:
            continue
        dims = tuple(range(1, p.ndim)) if p.ndim > 1 else None
        w_norm = p.detach().norm(norm_type, dim=dims, keepdim=True) if dims else p.detach().norm(norm_type)
        g = p.grad.detach()
        g_norm = g.norm(norm_type, dim=dims, keepdim=True) if dims else g.norm(norm_type)
        max_norm = w_norm.clamp(min=eps).mul_(clip_factor)
        clipped = g * (max_norm / g_norm.clamp(min=1e-6))
        p.grad.detach().copy_(torch.where(g_norm < max_norm, g, clipped))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("clip_factor", [0.01, 0.5, 100.0])
def test_agc_matches_timm_and_oracle(bd, dtype, norm_type, clip_factor):
    backend, device = bd
    shapes = AGC_SHAPES if norm_type != float("inf") else [s for s in AGC_SHAPES if 0 not in s]
    params = make_params(shapes, dtype, device, seed=21, scale=0.3)
    orig = clone_params(params)
    timm = clone_params(params)
    fastgrad.adaptive_clip_grad_(params, clip_factor, 1e-3, norm_type, backend=backend)
    timm_agc_(timm, clip_factor, 1e-3, norm_type)
    for p, t, o in zip(params, timm, orig):
        expect = oracle.agc(o, o.grad, clip_factor, 1e-3, norm_type)
        assert p.grad.dtype == dtype and p.grad.shape == o.grad.shape
        assert_max_error_within(p.grad, t.grad, expect, dtype, f"agc {tuple(o.shape)}")


def test_agc_zero_tiny_and_nan(bd):
    backend, device = bd
    params = make_params([(6, 4), (6, 4), (9,), (3, 5)], torch.float32, device, seed=22)
    params[0].grad.zero_()  # zero gradients stay zero
    with torch.no_grad():
        params[1].mul_(1e-9)  # tiny parameters: eps takes over
    params[3].grad[1, 2] = float("nan")  # NaN spreads over its unit (row 1) only, as in timm
    orig = clone_params(params)
    timm = clone_params(params)
    fastgrad.adaptive_clip_grad_(params, backend=backend)
    timm_agc_(timm)
    assert torch.equal(bits(params[0].grad), bits(orig[0].grad))
    expect = oracle.agc(orig[1], orig[1].grad, 0.01, 1e-3, 2.0)
    assert_max_error_within(params[1].grad, timm[1].grad, expect, torch.float32, "tiny params")
    g = params[3].grad.cpu()
    assert torch.isnan(g[1]).all() and torch.isfinite(g[0]).all() and torch.isfinite(g[2]).all()
    torch.testing.assert_close(g, timm[3].grad.cpu(), equal_nan=True, rtol=1e-6, atol=1e-7)


def test_agc_noncontiguous_and_skips_none(bd):
    backend, device = bd
    params = make_params([(6, 10), (5, 4, 3), (8,)], torch.float32, device, seed=23, noncontig=True, none_every=3)
    timm = clone_params(params)
    orig = clone_params(params)
    fastgrad.adaptive_clip_grad_(p for p in params)
    timm_agc_(timm)
    for p, t, o in zip(params, timm, orig):
        if o.grad is None:
            assert p.grad is None
            continue
        assert p.grad.stride() == o.grad.stride()
        assert_max_error_within(p.grad, t.grad, oracle.agc(o, o.grad, 0.01, 1e-3, 2.0), torch.float32, "noncontig")


def test_agc_deterministic(bd):
    backend, device = bd
    params = make_params([(33, 17), (129,)], torch.bfloat16, device, seed=24)
    outs = []
    for _ in range(5):
        mine = clone_params(params)
        fastgrad.adaptive_clip_grad_(mine, backend=backend)
        outs.append([bits(g) for g in grads(mine)])
    assert all(all(torch.equal(a, b) for a, b in zip(o, outs[0])) for o in outs)


# ------------------------------------------------------------------------------- cuda backend row plan
# The cuda kernels take every unit that fits a block in one launch (held in registers, written from them) and
# split longer ones (partials, a finalize, an apply): tests/helpers.py cuda_row_lengths names the classes.
cuda_only = pytest.mark.skipif(not (torch.cuda.is_available() and _ext.has_cuda_kernels()),
                               reason="needs a CUDA GPU and fastgrad's CUDA kernels")


def _check_agc(params, clip_factor, norm_type, what):
    """fastgrad's cuda AGC against timm on the same device and the float64 oracle; units that keep their
    gradient must not be written (bits unchanged). Returns the gradients before the call."""
    orig = clone_params(params)
    timm = clone_params(params)
    fastgrad.adaptive_clip_grad_(params, clip_factor, 1e-3, norm_type, backend="cuda")
    timm_agc_(timm, clip_factor, 1e-3, norm_type)
    for p, t, o in zip(params, timm, orig):
        expect = oracle.agc(o, o.grad, clip_factor, 1e-3, norm_type)
        name = f"{what} {tuple(o.shape)} {o.dtype}"
        assert_max_error_within(p.grad, t.grad, expect, o.dtype, name)
        kept = torch.as_tensor(expect == oracle.ld(o.grad.cpu())).reshape(o.shape)
        if o.grad.dim() > 1:
            kept_rows = kept.reshape(o.shape[0], -1).all(dim=1)
            assert torch.equal(bits(p.grad[kept_rows.to(p.grad.device)]), bits(o.grad[kept_rows.to(o.grad.device)])), name
    return orig


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
def test_cuda_agc_every_row_class(dtype, norm_type):
    params = make_params(cuda_row_shapes(dtype), dtype, "cuda", seed=41)
    with torch.no_grad():  # timm's fp16 L1 norm of a 98,309-element row of N(0, 1) values would overflow
        for p in params:
            p.mul_(0.1)
            p.grad.mul_(0.1)
    mix_row_scales(params)  # clip factor 0.1: the scaled rows keep, the others clip
    orig = _check_agc(params, 0.1, norm_type, "row classes")
    changed = [not torch.equal(bits(p.grad), bits(o.grad)) for p, o in zip(params, orig)]
    assert all(changed), "every tensor has rows that clip"


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_agc_nan_and_zero_rows(dtype):
    shapes = cuda_row_shapes(dtype)
    params = make_params(shapes, dtype, "cuda", seed=42)
    picked = zero_and_nan_rows(params)
    orig = _check_agc(params, 0.01, 2.0, "nan/zero rows")
    assert_zero_and_nan_rows(params, orig, picked)


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=["fp32", "fp16", "fp64"])
@pytest.mark.parametrize("offset", [1, 3])
def test_cuda_agc_views_in_poisoned_buffer(dtype, offset):
    params, buf, guard = params_in_poisoned_buffer(cuda_row_shapes(dtype), dtype, "cuda", seed=43, offset=offset)
    mix_row_scales(params)
    before = buf.clone()
    _check_agc(params, 0.1, 2.0, f"offset {offset}")
    assert torch.equal(bits(buf[guard]), bits(before[guard])), "an element outside the gradients was written"


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("noncontig", [False, True], ids=["contig", "noncontig"])
def test_cuda_agc_mixed_dtypes(noncontig):
    shapes = cuda_row_shapes(torch.float32) + cuda_row_shapes(torch.bfloat16)
    for dts in ([torch.float32, torch.bfloat16, torch.float16], [torch.float16, torch.float64, torch.bfloat16, torch.float32]):
        params = make_params(shapes, dts, "cuda", seed=44, noncontig=noncontig)
        mix_row_scales(params)
        strides = [p.grad.stride() for p in params]
        _check_agc(params, 0.1, 2.0, f"mixed {dts}")
        assert [p.grad.stride() for p in params] == strides


@cuda_only
@pytest.mark.cuda
def test_cuda_agc_deterministic_without_host_sync():
    params = make_params(cuda_row_shapes(torch.bfloat16) + cuda_row_shapes(torch.float32),
                         [torch.bfloat16, torch.float32], "cuda", seed=45)
    mix_row_scales(params)
    assert_repeatable_without_host_sync(params, lambda ps: fastgrad.adaptive_clip_grad_(ps, 0.1, backend="cuda"))


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("n, launches", [(8192, 1), (8196, 3)], ids=["packed", "split"])
def test_cuda_agc_launches(n, launches):
    # fp32 rows of 8192 elements (32 KB, 16-byte aligned) fit a block: one kernel does everything; one more
    # window and the row is split: row pass, finalize, apply. Short rows ride along in the same launch.
    params = make_params([(3, n), (40, 33), (7,)], torch.float32, "cuda", seed=46)
    fastgrad.adaptive_clip_grad_(params, 0.01, backend="cuda")  # warm-up: the table is cached
    names = cuda_kernels_run(lambda: fastgrad.adaptive_clip_grad_(params, 0.01, backend="cuda"))
    assert len(names) == launches, names
    assert sum("k_row_pass" in x for x in names) == 1, names


# The row plan is host code: tests/cuda/rowplan_check.cpp checks it (class order, register capacity at every
# row's own start address, each row or chunk taken by exactly one block as the kernels map blocks to rows)
# against apply.cu built by nvcc, on any machine with nvcc; it runs without a GPU. PTX only: no ptxas time.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_row_plan_host_check(tmp_path):
    nvcc = shutil.which("nvcc")
    cuda = os.path.join(ROOT, "csrc", "cuda")
    obj, exe = str(tmp_path / "apply.o"), str(tmp_path / "rowplan_check")
    for cmd in ([nvcc, "-std=c++17", "-O1", "--fmad=false", "-gencode", "arch=compute_80,code=compute_80", "-c",
                 os.path.join(cuda, "apply.cu"), "-o", obj],
                [nvcc, "-std=c++17", "-O1", f"-I{cuda}", os.path.join(ROOT, "tests", "cuda", "rowplan_check.cpp"), obj,
                 "-o", exe]):
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr[-4000:]}"
    res = subprocess.run([exe], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-4000:] + res.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- sparse gradients
def _sparse_embedding_grad(dtype, coalesced: bool, seed: int = 0, rows: int = 37, dim: int = 5):
    """A parameter of an nn.Embedding(sparse=True)-like shape with a COO gradient touching a few rows, some
    of them twice (uncoalesced duplicates unless ``coalesced``); the dense equivalent is returned too."""
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(rows, dim, generator=g, dtype=torch.float64).to(dtype))
    idx = torch.tensor([[1, 2, 2, 7, 30, 1, 36]])
    vals = (torch.randn(7, dim, generator=g, dtype=torch.float64) * torch.tensor(
        [3.0, 0.001, 0.002, 5.0, 0.0, 2.0, 1e-7], dtype=torch.float64)[:, None]).to(dtype)
    sp = torch.sparse_coo_tensor(idx, vals, (rows, dim))
    w.grad = sp.coalesce() if coalesced else sp
    return w, sp.to_dense().double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")], ids=["l2", "l1", "linf"])
@pytest.mark.parametrize("coalesced", [True, False], ids=["coalesced", "duplicates"])
def test_agc_sparse_matches_dense_float64_reference(dtype, norm_type, coalesced):
    w, dense = _sparse_embedding_grad(dtype, coalesced)
    exp = oracle.agc(w.detach().double(), dense, 0.05, 1e-3, norm_type)
    g_before = w.grad
    fastgrad.adaptive_clip_grad_([w], clip_factor=0.05, norm_type=norm_type)
    assert w.grad is g_before and w.grad.is_sparse  # in place, still sparse
    got = w.grad.to_dense().double().numpy()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert abs(got - exp).max() <= tol * max(1.0, abs(exp).max())
    assert abs(dense.numpy() - exp).max() > 1e-3  # the reference did clip something


def test_agc_sparse_with_dense_params_nan_and_1d():
    w, dense = _sparse_embedding_grad(torch.float32, False, seed=3)
    w.grad._values()[3, 1] = float("nan")  # row 7: NaN propagates over the row, as in the dense rule
    lin = torch.nn.Parameter(torch.randn(4, 3))
    lin.grad = torch.randn(4, 3) * 10
    b = torch.nn.Parameter(torch.randn(6))
    b.grad = torch.sparse_coo_tensor(torch.tensor([[0, 4, 4]]), torch.tensor([9.0, -3.0, 1.0]), (6,))
    ref_lin = oracle.agc(lin.detach().double(), lin.grad.double(), 0.02, 1e-3, 2.0)
    ref_b = oracle.agc(b.detach().double(), b.grad.to_dense().double(), 0.02, 1e-3, 2.0)
    dense[7, 1] = float("nan")
    ref_w = oracle.agc(w.detach().double(), dense, 0.02, 1e-3, 2.0)
    fastgrad.adaptive_clip_grad_([w, lin, b], clip_factor=0.02)
    got_w = w.grad.to_dense().double().numpy()
    assert ((got_w != got_w) == (ref_w != ref_w)).all()  # NaN exactly on row 7
    ok = ref_w == ref_w
    assert abs(got_w[ok] - ref_w[ok]).max() < 1e-6
    assert abs(lin.grad.double().numpy() - ref_lin).max() < 1e-5
    assert abs(b.grad.to_dense().double().numpy() - ref_b).max() < 1e-6


def test_agc_sparse_bad_input_changes_nothing():
    w, _ = _sparse_embedding_grad(torch.float32, True)
    lin = torch.nn.Parameter(torch.randn(4, 3))
    lin.grad = torch.randn(4, 3) * 10
    sp = torch.nn.Parameter(torch.randn(5, 5).to_sparse())  # a sparse PARAMETER: no row norms to read
    sp.grad = torch.randn(5, 5).to_sparse()
    before = lin.grad.clone(), w.grad.to_dense().clone()
    with pytest.raises(TypeError, match="needs a dense parameter"):
        fastgrad.adaptive_clip_grad_([lin, w, sp], clip_factor=0.01)
    assert torch.equal(lin.grad, before[0]) and torch.equal(w.grad.to_dense(), before[1])
