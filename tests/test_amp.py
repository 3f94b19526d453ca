"""scaler_unscale_and_clip (SPEC section 4): every observable as scaler.unscale_ + clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch
from torch.amp.grad_scaler import OptState

import fastgrad

from .helpers import bits, clone_params, grads, make_params


def _setup(device, seed, scale_value=1024.0, dtype=torch.float32):
    params = make_params([(17, 5), (5,), (3, 4, 2)], dtype, device, seed=seed, scale=1024.0)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=scale_value)
    scaler._lazy_init_scale_growth_tracker(torch.device(device))
    return params, opt, scaler


@pytest.mark.parametrize("overflow", [False, True], ids=["finite", "overflow"])
@pytest.mark.parametrize("max_norm", [0.01, 1e6], ids=["clip", "noclip"])
def test_matches_unscale_then_clip(bd, overflow, max_norm):
    backend, device = bd
    p1, o1, s1 = _setup(device, 51)
    p2 = clone_params(p1)
    o2 = torch.optim.SGD(p2, lr=0.1)
    s2 = torch.amp.GradScaler(device, init_scale=1024.0)
    s2._lazy_init_scale_growth_tracker(torch.device(device))
    if overflow:
        p1[0].grad[2, 3] = float("inf")
        p2[0].grad[2, 3] = float("inf")
    total = fastgrad.scaler_unscale_and_clip(s1, o1, max_norm, backend=backend)
    s2.unscale_(o2)
    total_t = torch.nn.utils.clip_grad_norm_(p2, max_norm)
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0, equal_nan=True)
    for g, gt in zip(grads(p1), grads(p2)):
        torch.testing.assert_close(g, gt, rtol=2e-6, atol=0, equal_nan=True)
    st1, st2 = s1._per_optimizer_states[id(o1)], s2._per_optimizer_states[id(o2)]
    assert st1["stage"] is OptState.UNSCALED
    assert {k: float(v) for k, v in st1["found_inf_per_device"].items()} == \
        {k: float(v) for k, v in st2["found_inf_per_device"].items()}
    for v in st1["found_inf_per_device"].values():
        assert v.dtype == torch.float32 and v.dim() == 0 and float(v) in (0.0, 1.0)
    s1.step(o1), s2.step(o2)
    s1.update(), s2.update()
    assert float(s1.get_scale()) == float(s2.get_scale())
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_errors_match_torch(bd):
    backend, device = bd
    params, opt, scaler = _setup(device, 52)
    fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0, backend=backend)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0, backend=backend)
    before = clone_params(params)
    with pytest.raises(ValueError, match="max_norm"):
        fastgrad.scaler_unscale_and_clip(scaler, opt, -1.0, backend=backend)
    assert all(torch.equal(bits(g), bits(g0)) for g, g0 in zip(grads(params), grads(before)))


def test_disabled_scaler_only_clips(bd):
    backend, device = bd
    params = make_params([(9, 4), (4,)], torch.float32, device, seed=53)
    theirs = clone_params(params)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler(device, enabled=False)
    total = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.1, backend=backend)
    total_t = torch.nn.utils.clip_grad_norm_(theirs, 0.1)
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0)
