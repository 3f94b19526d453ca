"""centralize_gradient_ against the official formula (SPEC section 6) on every (backend, device) pair."""

from __future__ import annotations

import pytest
import torch

import fastgrad

from . import oracle
from .helpers import DTYPE_IDS, DTYPES, assert_max_error_within, bits, clone_params, make_params

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
