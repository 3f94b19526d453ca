"""Bad input (docs/contract.md section 3): a clear error naming the problem, raised before any gradient is written."""

from __future__ import annotations

import pytest
import torch

import fastgrad

from .helpers import bits, clone_params, grads, make_params

NAN = float("nan")


def _untouched(params, before):
    return all(torch.equal(bits(g), bits(g0)) for g, g0 in zip(grads(params), grads(before)))


CASES = [
    ("clip_grad_norm_ NaN max_norm", lambda ps, b: fastgrad.clip_grad_norm_(ps, NAN, backend=b), ValueError, "max_norm"),
    ("clip_grad_norm_ negative max_norm", lambda ps, b: fastgrad.clip_grad_norm_(ps, -1.0, backend=b), ValueError,
     "max_norm"),
    ("clip_grad_norm_ string norm_type", lambda ps, b: fastgrad.clip_grad_norm_(ps, 1.0, "fro", backend=b),
     ValueError, "norm_type"),
    ("clip_grad_norm_ None norm_type", lambda ps, b: fastgrad.clip_grad_norm_(ps, 1.0, None, backend=b), ValueError,
     "norm_type"),
    ("clip_grad_norm_ NaN norm_type", lambda ps, b: fastgrad.clip_grad_norm_(ps, 1.0, NAN, backend=b), ValueError,
     "norm_type"),
    ("clip_grads_with_norm_ negative max_norm",
     lambda ps, b: fastgrad.clip_grads_with_norm_(ps, -2.0, torch.tensor(1.0), backend=b), ValueError, "max_norm"),
    ("clip_grad_value_ negative", lambda ps, b: fastgrad.clip_grad_value_(ps, -0.1, backend=b), ValueError,
     "clip_value"),
    ("clip_grad_value_ NaN", lambda ps, b: fastgrad.clip_grad_value_(ps, NAN, backend=b), ValueError, "clip_value"),
    ("get_total_norm bad norm_type", lambda ps, b: fastgrad.get_total_norm(grads(ps), "x", backend=b), ValueError,
     "norm_type"),
    ("agc negative clip_factor", lambda ps, b: fastgrad.adaptive_clip_grad_(ps, -0.01, backend=b), ValueError,
     "clip_factor"),
    ("agc NaN eps", lambda ps, b: fastgrad.adaptive_clip_grad_(ps, 0.01, NAN, backend=b), ValueError, "eps"),
    ("agc bad norm_type", lambda ps, b: fastgrad.adaptive_clip_grad_(ps, norm_type="l2", backend=b), ValueError,
     "norm_type"),
    ("unknown backend", lambda ps, b: fastgrad.clip_grad_norm_(ps, 1.0, backend="nope"), ValueError,
     "unknown fastgrad backend 'nope'"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_arguments_raise_and_leave_grads_untouched(bd, case):
    backend, device = bd
    _, fn, exc, match = case
    params = make_params([(5, 3), (7,)], torch.float32, device, seed=1, scale=10.0)
    before = clone_params(params)
    with pytest.raises(exc, match=match):
        fn(params, backend)
    assert _untouched(params, before)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_integer_and_bool_grads_raise_type_error(dtype):
    good = make_params([(4,)], torch.float32, "cpu", seed=2)[0]
    bad = torch.nn.Parameter(torch.randn(3))
    bad.grad_dtype = None  # torch >= 2.9 otherwise refuses a grad of another dtype
    bad.grad = torch.ones(3, dtype=dtype)
    params = [good, bad]
    before = good.grad.clone()
    for fn in (lambda: fastgrad.clip_grad_norm_(params, 0.1),
               lambda: fastgrad.clip_grad_value_(params, 0.1),
               lambda: fastgrad.clip_grads_with_norm_(params, 0.1, torch.tensor(5.0)),
               lambda: fastgrad.get_total_norm([good.grad, bad.grad]),
               lambda: fastgrad.multi_tensor_norm([good.grad, bad.grad]),
               lambda: fastgrad.centralize_gradient_(params),
               lambda: fastgrad.grad_stats(params)):
        with pytest.raises(TypeError, match="floating point"):
            fn()
        assert torch.equal(good.grad, before)


def test_agc_shape_mismatch_is_named():
    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3)
    p.data = torch.randn(3, 4)  # a parameter whose data was swapped under its grad
    with pytest.raises(ValueError, match="does not match its parameter"):
        fastgrad.adaptive_clip_grad_([p])
