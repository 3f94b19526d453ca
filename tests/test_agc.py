"""adaptive_clip_grad_ against timm's formula (SPEC section 5) on every (backend, device) pair."""

from __future__ import annotations

import pytest
import torch

import fastgrad

from . import oracle
from .helpers import DTYPE_IDS, DTYPES, assert_max_error_within, bits, clone_params, grads, make_params

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
