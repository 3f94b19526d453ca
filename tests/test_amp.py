"""scaler_unscale_and_clip (docs/contract.md section 4): every observable as scaler.unscale_ + clip_grad_norm_.

The reference is always torch itself: ``scaler.unscale_(opt)`` then ``torch.nn.utils.clip_grad_norm_`` (or
fastgrad's clip, where the contract names it), run on an identical copy of the inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch.amp.grad_scaler import OptState

import fastgrad
from fastgrad import amp as famp
from fastgrad import scaler_state

from . import oracle
from .helpers import assert_no_worse_than, bits, clone_params, grads, make_params
from .helpers import optimizer_state as _opt_state

INF, NAN = float("inf"), float("nan")
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _scaler(device, scale_value=1024.0, **kw):
    s = torch.amp.GradScaler(device, init_scale=scale_value, **kw)
    s._lazy_init_scale_growth_tracker(torch.device(device))
    return s


def _setup(device, seed, scale_value=1024.0, dtype=torch.float32, shapes=((17, 5), (5,), (3, 4, 2))):
    params = make_params(list(shapes), dtype, device, seed=seed, scale=scale_value)
    opt = torch.optim.SGD(params, lr=0.1)
    return params, opt, _scaler(device, scale_value)


def _twin(params, device, scale_value=1024.0):
    p2 = clone_params(params, device)
    return p2, torch.optim.SGD(p2, lr=0.1), _scaler(device, scale_value)


def _ref_device(device, dtypes) -> str:
    """Where the torch reference runs. torch's unscale_ has no bf16 CUDA kernel (its CUDA
    _amp_foreach_non_finite_check_and_unscale_ takes fp16/fp32/fp64 only), so with bf16 grads on CUDA the
    reference runs torch's CPU kernel on copies: the same arithmetic (grad * fp32 reciprocal of the scale,
    rounded once to the grad's dtype), and the float64 oracle judges both anyway."""
    return "cpu" if torch.device(device).type == "cuda" and torch.bfloat16 in dtypes else device


def _flags(scaler, opt):
    return {k: (v.dtype, tuple(v.shape), float(v.sum()))
            for k, v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].items()}


def _assert_same_state(s1, o1, s2, o2):
    st1, st2 = s1._per_optimizer_states[id(o1)], s2._per_optimizer_states[id(o2)]
    assert st1["stage"] is st2["stage"]
    f1, f2 = _flags(s1, o1), _flags(s2, o2)
    if s1._device == s2._device:
        assert f1 == f2
    else:  # a reference on CPU (see _ref_device): one flag per device on both sides, same values
        assert list(f1.values()) == list(f2.values()) and len(f1) == 1
    for v in st1["found_inf_per_device"].values():
        assert v.dtype == torch.float32 and float(v.sum()) in (0.0, 1.0)
    assert not hasattr(o1, "grad_scale") and not hasattr(o1, "found_inf")


# ---------------------------------------------------------------- one call against torch
@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF], ids=["l2", "l1", "linf"])
@pytest.mark.parametrize("overflow", [None, INF, -INF, NAN], ids=["finite", "inf", "-inf", "nan"])
@pytest.mark.parametrize("max_norm", [0.01, 1e6], ids=["clip", "noclip"])
def test_matches_unscale_then_clip(bd, overflow, max_norm, norm_type):
    backend, device = bd
    p1, o1, s1 = _setup(device, 51)
    p2, o2, s2 = _twin(p1, device)
    if overflow is not None:
        p1[0].grad[2, 3] = overflow
        p2[0].grad[2, 3] = overflow
    total = fastgrad.scaler_unscale_and_clip(s1, o1, max_norm, norm_type, backend=backend)
    s2.unscale_(o2)
    total_t = torch.nn.utils.clip_grad_norm_(p2, max_norm, norm_type)
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0, equal_nan=True)
    for g, gt in zip(grads(p1), grads(p2)):
        torch.testing.assert_close(g, gt, rtol=2e-6, atol=0, equal_nan=True)
        if overflow is not None:
            # NaN exactly where torch has NaN, and zeros with torch's signs elsewhere.
            assert torch.equal(torch.isnan(g), torch.isnan(gt))
            fin = ~torch.isnan(gt)
            assert torch.equal(torch.signbit(g[fin]), torch.signbit(gt[fin]))
    _assert_same_state(s1, o1, s2, o2)
    assert s1._per_optimizer_states[id(o1)]["stage"] is OptState.UNSCALED
    s1.step(o1), s2.step(o2)
    s1.update(), s2.update()
    assert float(s1.get_scale()) == float(s2.get_scale())
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("limit", [7, 64, 1 << 18])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, INF], ids=["l2", "l1", "l3", "linf"])
@pytest.mark.parametrize("bad,where", [(None, None), (INF, 0), (NAN, 0), (INF, 4), (NAN, 4)],
                         ids=["finite", "inf-first", "nan-first", "inf-inner", "nan-inner"])
def test_torch_backend_batched_read_pass(monkeypatch, limit, norm_type, bad, where):
    """The torch backend's amp_norm reduces bounded batches of pieces (tensors cut at ``limit`` elements):
    the total must match the whole-tensor formulation it replaced and the float64 oracle of the values
    unscale_ stores, whatever the cut; the flag must see a bad element in any piece."""
    from fastgrad.backends import torch_backend as tb

    monkeypatch.setattr(tb, "_AMP_BATCH_CPU", limit)
    gen = torch.Generator().manual_seed(7)
    ts = [torch.randn(33, 9, generator=gen), torch.randn(0), torch.randn(5, generator=gen).to(torch.bfloat16),
          torch.randn(3, generator=gen), torch.randn(3, generator=gen), torch.randn(3, generator=gen),
          torch.randn(40, 6, generator=gen).t(), torch.randn(129, generator=gen).to(torch.float16),
          torch.randn(70, generator=gen).double()]
    ts = [t * 4096.0 for t in ts]
    if where == 0:
        ts[0][30, 8] = bad  # the last piece of the first tensor, whatever the limit
    elif where == 4:
        ts[4][1] = bad  # inside a batch of several small tensors, not its first member
    inv = torch.tensor(1.0 / 3000.0)  # not a power of two: the rounding of T(x * inv) matters
    b = tb.TorchBackend()
    total, found = b.amp_norm(ts, inv, norm_type)
    ref_total, ref_found = b._amp_norm_per_tensor(ts, inv, norm_type, torch.float64)
    assert total.dtype == torch.float64 and found.dtype == torch.float32 and found.shape == ()
    assert float(found) == float(ref_found) == (0.0 if bad is None else 1.0)
    if bad is None:
        unscaled = [oracle.f64((t.float() * inv).to(t.dtype) if t.dtype != torch.float64 else t * inv.double())
                    for t in ts]
        exact = oracle.total_norm(unscaled, norm_type)
        torch.testing.assert_close(total, ref_total, rtol=1e-13, atol=0)
        assert abs(float(total) - exact) <= 1e-13 * exact
    else:
        assert not math.isfinite(float(total)) and not math.isfinite(float(ref_total))


@pytest.mark.parametrize("dtypes", [[torch.bfloat16], [torch.float32, torch.bfloat16], [torch.float64]],
                         ids=["bf16", "fp32+bf16", "fp64"])
@pytest.mark.parametrize("max_norm", [0.01, 1e6], ids=["clip", "noclip"])
def test_dtypes_against_oracle(bd, dtypes, max_norm):
    """Low precision: the folded multiply rounds once where torch rounds twice, so the contract's accuracy rule
    (no worse than unscale_ + clip_grad_norm_ against a float64 oracle, + 1 ulp) is the criterion."""
    backend, device = bd
    shapes = [(17, 5), (5,), (3, 4, 2), (300,)]
    scale = 2.0 ** 12
    p1 = make_params(shapes, dtypes, device, seed=61, scale=scale)
    o1, s1 = torch.optim.SGD(p1, lr=0.1), _scaler(device, scale)
    p2, o2, s2 = _twin(p1, _ref_device(device, dtypes), scale)
    unscaled = [oracle.f64(g) / scale for g in grads(p1)]
    total_o, want = oracle.clipped(unscaled, max_norm, 2.0)
    total = fastgrad.scaler_unscale_and_clip(s1, o1, max_norm, backend=backend)
    s2.unscale_(o2)
    total_t = torch.nn.utils.clip_grad_norm_(p2, max_norm)
    assert total.dtype == total_t.dtype and total.device == p1[0].device
    assert_no_worse_than(total.reshape(1), total_t.reshape(1), torch.tensor([total_o]), total.dtype, "total")
    for g, gt, w in zip(grads(p1), grads(p2), want):
        assert_no_worse_than(g, gt, w, g.dtype, f"grad {g.dtype}")
    _assert_same_state(s1, o1, s2, o2)


def test_norm_zero_and_fallback_order():
    """norm_type 0 (torch's count of nonzero tensors) goes through the torch fallback automatically."""
    p1, o1, s1 = _setup("cpu", 54)
    p2, o2, s2 = _twin(p1, "cpu")
    total = fastgrad.scaler_unscale_and_clip(s1, o1, 2.0, 0)
    s2.unscale_(o2)
    total_t = torch.nn.utils.clip_grad_norm_(p2, 2.0, 0)
    assert float(total) == float(total_t) == 3.0
    for g, gt in zip(grads(p1), grads(p2)):
        torch.testing.assert_close(g, gt, rtol=1e-6, atol=0)


def test_no_write_when_factor_is_one(bd):
    """scale 1 and no clipping: the combined factor is 1 and the gradients' bits are untouched."""
    backend, device = bd
    params, opt, scaler = _setup(device, 55, scale_value=1.0)
    params[1].grad[0] = -0.0
    before = [bits(g) for g in grads(params)]
    fastgrad.scaler_unscale_and_clip(scaler, opt, 1e9, backend=backend)
    assert all(torch.equal(bits(g), b) for g, b in zip(grads(params), before))


def test_params_without_grads_and_no_grads_at_all(bd):
    backend, device = bd
    params = make_params([(4, 3), (3,), (6,)], torch.float32, device, seed=56, scale=512.0, none_every=2)
    p2 = clone_params(params)
    o1, s1 = torch.optim.SGD(params, lr=0.1), _scaler(device, 512.0)
    o2, s2 = torch.optim.SGD(p2, lr=0.1), _scaler(device, 512.0)
    total = fastgrad.scaler_unscale_and_clip(s1, o1, 0.5, backend=backend)
    s2.unscale_(o2)
    total_t = torch.nn.utils.clip_grad_norm_(p2, 0.5)
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0)
    _assert_same_state(s1, o1, s2, o2)

    empty = [torch.nn.Parameter(torch.ones(3, device=device))]
    o3, s3 = torch.optim.SGD(empty, lr=0.1), _scaler(device)
    o4, s4 = torch.optim.SGD([torch.nn.Parameter(torch.ones(3, device=device))], lr=0.1), _scaler(device)
    total = fastgrad.scaler_unscale_and_clip(s3, o3, 0.5, backend=backend)
    s4.unscale_(o4)
    assert total.device.type == "cpu" and float(total) == 0.0
    assert s3._per_optimizer_states[id(o3)] == {"stage": OptState.UNSCALED, "found_inf_per_device": {}}
    _assert_same_state(s3, o3, s4, o4)
    # torch refuses to step without any inf check recorded; so must we, with the same error.
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        s3.step(o3)


# ---------------------------------------------------------------- errors
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
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step\\(\\)"):
        fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0, backend=backend)
    with pytest.raises(ValueError, match="norm_type"):
        fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0, NAN, backend=backend)


def test_fp16_grads_rejected_by_plain_scaler(bd):
    backend, device = bd
    params = make_params([(4, 3), (3,)], [torch.float32, torch.float16], device, seed=57, scale=64.0)
    opt, scaler = torch.optim.SGD(params, lr=0.1), _scaler(device, 64.0)
    before = [bits(g) for g in grads(params)]
    with pytest.raises(ValueError, match="^Attempting to unscale FP16 gradients.$"):
        fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0, backend=backend)
    assert all(torch.equal(bits(g), b) for g, b in zip(grads(params), before))
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY
    with pytest.raises(ValueError, match="^Attempting to unscale FP16 gradients.$"):
        scaler.unscale_(opt)  # the text is torch's


def test_scale_never_initialised_same_assertion(bd):
    backend, device = bd
    params = make_params([(4, 3)], torch.float32, device, seed=58)
    opt = torch.optim.SGD(params, lr=0.1)
    ours, theirs = torch.amp.GradScaler(device), torch.amp.GradScaler(device)
    with pytest.raises(AssertionError) as e_t:
        theirs.unscale_(opt)
    with pytest.raises(AssertionError, match=r"called before scaler\.scale\(loss\)") as e_o:
        fastgrad.scaler_unscale_and_clip(ours, opt, 1.0, backend=backend)
    assert isinstance(e_o.value, RuntimeError) and "_scale is None" in str(e_t.value)
    assert id(opt) not in ours._per_optimizer_states or \
        ours._per_optimizer_states[id(opt)]["stage"] is OptState.READY


@pytest.mark.parametrize("overflow", [None, INF, NAN], ids=["finite", "inf", "nan"])
def test_error_if_nonfinite(bd, overflow):
    """Observable as unscale_ then clip_grad_norm_(error_if_nonfinite=True): on a non-finite norm the
    gradients are unscaled (not clipped), the scaler state is recorded, and torch's RuntimeError raised."""
    backend, device = bd
    p1, o1, s1 = _setup(device, 59)
    p2, o2, s2 = _twin(p1, device)
    if overflow is not None:
        p1[2].grad[1, 2, 0] = overflow
        p2[2].grad[1, 2, 0] = overflow
    err_t = err_o = None
    s2.unscale_(o2)
    try:
        total_t = torch.nn.utils.clip_grad_norm_(p2, 0.01, error_if_nonfinite=True)
    except RuntimeError as e:
        err_t = str(e)
    try:
        total = fastgrad.scaler_unscale_and_clip(s1, o1, 0.01, error_if_nonfinite=True, backend=backend)
    except RuntimeError as e:
        err_o = str(e)
    assert err_o == err_t
    assert (err_o is None) == (overflow is None)
    if err_o is None:
        torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0)
    for g, gt in zip(grads(p1), grads(p2)):
        torch.testing.assert_close(g, gt, rtol=2e-6, atol=0, equal_nan=True)
    _assert_same_state(s1, o1, s2, o2)


def test_disabled_scaler_only_clips(bd):
    backend, device = bd
    params = make_params([(9, 4), (4,)], torch.float32, device, seed=53)
    theirs = clone_params(params)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler(device, enabled=False)
    total = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.1, backend=backend)
    total_t = torch.nn.utils.clip_grad_norm_(theirs, 0.1)
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0)
    for g, gt in zip(grads(params), grads(theirs)):
        torch.testing.assert_close(g, gt, rtol=2e-6, atol=0)
    assert not getattr(scaler, "_per_optimizer_states", None)


def test_custom_unscale_is_respected():
    """A scaler subclass with its own unscale_ gets its own code run (then fastgrad clips)."""
    calls = []

    class MyScaler(torch.amp.GradScaler):
        def unscale_(self, optimizer):
            calls.append(id(optimizer))
            super().unscale_(optimizer)

    p1, o1, _ = _setup("cpu", 60)
    p2, o2, s2 = _twin(p1, "cpu")
    s1 = MyScaler("cpu", init_scale=1024.0)
    s1._lazy_init_scale_growth_tracker(torch.device("cpu"))
    total = fastgrad.scaler_unscale_and_clip(s1, o1, 0.05)
    s2.unscale_(o2)
    total_t = torch.nn.utils.clip_grad_norm_(p2, 0.05)
    assert calls == [id(o1)]
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0)
    _assert_same_state(s1, o1, s2, o2)


# ---------------------------------------------------------------- training loops
_OPTS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
}


def _model(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(device)


def _train(device, opt_name, steps, overflow_at, *, fused_clip, backend=None, zero_write=False,
           max_norm=0.05, accum=1, checks=None):
    """N steps of a small model with loss scaling; ``overflow_at`` maps a step to the value written into one
    gradient element after backward (as an fp16 overflow would). Returns per-step records."""
    model = _model(device)
    params = list(model.parameters())
    opt = _OPTS[opt_name](params)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=gen).to(device), torch.randn(8, 3, generator=gen).to(device))
            for _ in range(steps * accum)]
    records = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(accum):
            x, y = data[step * accum + micro]
            loss = torch.nn.functional.mse_loss(model(x), y) / accum  # average over the micro-batches
            scaler.scale(loss).backward()
        if step in overflow_at:
            params[0].grad[1, 2] = overflow_at[step]
        scaled = [g.clone() for g in grads(params)]
        if fused_clip:
            total = fastgrad.scaler_unscale_and_clip(scaler, opt, max_norm, backend=backend, zero_write=zero_write)
        else:
            scaler.unscale_(opt)
            total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if checks is not None:
            checks(step, scaler, opt, params, scaled)
        found = sum(float(v) for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
        scaler.step(opt)
        scaler.update()
        records.append({
            "total": total.detach().clone(), "skipped": found > 0,
            "grads": [g.detach().clone() for g in grads(params)], "scaled": scaled,
            "params": [p.detach().clone() for p in params], "state": [t.clone() for t in _opt_state(opt)],
            "scale": float(scaler.get_scale()), "growth": scaler._get_growth_tracker(),
            "leftover": hasattr(opt, "grad_scale") or hasattr(opt, "found_inf"),
        })
    return records


def _compare_runs(ours, theirs, zero_write_used):
    for step, (a, b) in enumerate(zip(ours, theirs)):
        where = f"step {step}"
        assert a["skipped"] == b["skipped"], where
        assert a["scale"] == b["scale"] and a["growth"] == b["growth"], where
        assert not a["leftover"], where
        torch.testing.assert_close(a["total"], b["total"], rtol=1e-6, atol=0, equal_nan=True, msg=where)
        for x, y in zip(a["params"], b["params"]):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=where)
        assert len(a["state"]) == len(b["state"]), where
        for x, y in zip(a["state"], b["state"]):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=where)
        if zero_write_used and a["skipped"]:
            # Skipped step in zero-write mode: nothing was written, the grads still hold the scaled values.
            assert all(torch.equal(bits(g), bits(s)) for g, s in zip(a["grads"], a["scaled"])), where
        else:
            for x, y in zip(a["grads"], b["grads"]):
                torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-9, equal_nan=True, msg=where)


OVERFLOWS = {2: INF, 4: NAN, 5: -INF}


@pytest.mark.parametrize("opt_name,zero_write", [
    ("sgd", False), ("adam", False), ("adam", True), ("sgd-fused", False), ("sgd-fused", True),
    ("adam-fused", False), ("adam-fused", True), ("adamw-fused", True),
])
def test_training_loop_matches_torch(bd, opt_name, zero_write):
    backend, device = bd
    steps = 7
    probe = _OPTS[opt_name]([torch.nn.Parameter(torch.ones(2, device=device))])
    assert famp.zero_write_applies(_scaler(device), probe) == opt_name.endswith("fused")
    theirs = _train(device, opt_name, steps, OVERFLOWS, fused_clip=False)
    applies = zero_write and opt_name.endswith("fused")

    def checks(step, scaler, opt, params, scaled):
        # zero-write: nothing written before the step, and the factor waits on the optimizer; else written.
        if applies:
            assert isinstance(opt.grad_scale, torch.Tensor) and opt.grad_scale.dtype == torch.float32
            assert all(torch.equal(bits(g), bits(s)) for g, s in zip(grads(params), scaled))
        else:
            assert not hasattr(opt, "grad_scale")

    ours = _train(device, opt_name, steps, OVERFLOWS, fused_clip=True, backend=backend, zero_write=zero_write,
                  checks=checks)
    assert [r["skipped"] for r in theirs] == [s in OVERFLOWS for s in range(steps)]
    assert len({r["scale"] for r in theirs}) > 2  # the scale both grew and backed off in this run
    _compare_runs(ours, theirs, applies)


@pytest.mark.parametrize("opt_name,zero_write", [("adam", False), ("adam-fused", True)])
def test_training_loop_accumulation_and_no_clip(bd, opt_name, zero_write):
    """Gradient accumulation (loss / accum, one clip of the accumulated grads per update) and a max_norm
    large enough that no step clips: then only the unscale remains (the factor is inv_scale)."""
    backend, device = bd
    for max_norm in (1e6, 0.05):
        theirs = _train(device, opt_name, 5, {3: INF}, fused_clip=False, max_norm=max_norm, accum=2)
        ours = _train(device, opt_name, 5, {3: INF}, fused_clip=True, backend=backend, zero_write=zero_write,
                      max_norm=max_norm, accum=2)
        _compare_runs(ours, theirs, zero_write)


# ---------------------------------------------------------------- zero-write specifics
def test_zero_write_falls_back_where_it_cannot_apply(bd):
    backend, device = bd
    # fp64 grads: the fused kernels take a float32 grad_scale, so the factor is written instead.
    params = make_params([(4, 3), (3,)], torch.float64, device, seed=62, scale=256.0)
    opt = torch.optim.Adam(params, lr=0.1, fused=True)
    scaler = _scaler(device, 256.0)
    p2, o2, s2 = _twin(params, device, 256.0)
    assert not famp.zero_write_applies(scaler, opt)
    fastgrad.scaler_unscale_and_clip(scaler, opt, 0.01, zero_write=True, backend=backend)
    s2.unscale_(o2)
    torch.nn.utils.clip_grad_norm_(p2, 0.01)
    assert not hasattr(opt, "grad_scale")
    for g, gt in zip(grads(params), grads(p2)):
        torch.testing.assert_close(g, gt, rtol=1e-12, atol=0)
    # A user-set grad_scale is the user's: not overwritten, zero-write declines.
    params = make_params([(4, 3)], torch.float32, device, seed=63, scale=256.0)
    opt = torch.optim.Adam(params, lr=0.1, fused=True)
    opt.grad_scale = torch.tensor(1.0, device=device)
    assert not famp.zero_write_applies(_scaler(device), opt)
    # Disabled scaler: nothing to unscale, zero-write does not apply.
    assert not famp.zero_write_applies(torch.amp.GradScaler(device, enabled=False),
                                       torch.optim.Adam(params, lr=0.1, fused=True))


def test_zero_write_requires_a_step_that_passes_grad_scale(monkeypatch):
    """Older torch (before grad_scale was passed through after unscale_) overwrote optimizer.grad_scale
    with None in step(); the probe must see that and zero-write must then write the gradients."""
    def old_step(self, optimizer, *args, **kwargs):
        optimizer.grad_scale = None  # what those releases did in the UNSCALED stage
        optimizer.found_inf = torch.zeros(())
        optimizer.step()
        del optimizer.grad_scale
        del optimizer.found_inf

    assert scaler_state._step_keeps_grad_scale(torch.amp.GradScaler.step) is True
    assert scaler_state._step_keeps_grad_scale(old_step) is False

    class OldScaler(torch.amp.GradScaler):
        step = old_step

    params = make_params([(4, 3)], torch.float32, "cpu", seed=64, scale=256.0)
    before = [g.clone() for g in grads(params)]
    opt = torch.optim.Adam(params, lr=0.1, fused=True)
    s = OldScaler("cpu", init_scale=256.0)
    s._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert not famp.zero_write_applies(s, opt)
    fastgrad.scaler_unscale_and_clip(s, opt, 1e6, zero_write=True)
    assert not hasattr(opt, "grad_scale")
    torch.testing.assert_close(grads(params)[0], before[0] / 256.0, rtol=0, atol=0)


# ---------------------------------------------------------------- ShardedGradScaler (FSDP)
@pytest.fixture
def flag_reductions(one_rank_group, monkeypatch) -> list:
    """The all-reduces that run, as (shape, group): a ShardedGradScaler's flags must be reduced as torch does."""
    import torch.distributed as dist

    reduced = []
    real_all_reduce = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        reduced.append((tuple(tensor.shape), kwargs.get("group")))
        return real_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    return reduced


@pytest.mark.parametrize("dtypes", [[torch.float16], [torch.float32, torch.bfloat16]], ids=["fp16", "fp32+bf16"])
@pytest.mark.parametrize("overflow", [None, INF], ids=["finite", "inf"])
def test_sharded_scaler(bd, one_rank_group, dtypes, overflow):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    backend, device = bd
    scale = 2.0 ** 8

    def make(params, dev):
        s = ShardedGradScaler(device=dev, init_scale=scale)
        s._lazy_init_scale_growth_tracker(torch.device(dev))
        return torch.optim.SGD(params, lr=0.1), s

    p1 = make_params([(17, 5), (5,), (40,)], dtypes, device, seed=65, scale=scale)
    if overflow is not None:
        p1[0].grad[3, 1] = overflow
    ref_dev = _ref_device(device, dtypes)
    p2 = clone_params(p1, ref_dev)
    (o1, s1), (o2, s2) = make(p1, device), make(p2, ref_dev)
    unscaled = [oracle.f64(g) / scale for g in grads(p1)]
    total_o, want = oracle.clipped(unscaled, 0.05, 2.0)
    total = fastgrad.scaler_unscale_and_clip(s1, o1, 0.05, backend=backend)
    s2.unscale_(o2)  # fp16 is allowed here (FSDP's mixed precision)
    # a CPU reference clips with the torch backend (Triton serves CPU tensors only in the interpreter)
    total_t = fastgrad.clip_grad_norm_(p2, 0.05, backend=backend if ref_dev == device else "torch")
    _assert_same_state(s1, o1, s2, o2)
    for v in s1._per_optimizer_states[id(o1)]["found_inf_per_device"].values():
        assert v.shape == (1,)  # ShardedGradScaler's flag shape
    if overflow is None:
        assert_no_worse_than(total.reshape(1), total_t.reshape(1), torch.tensor([total_o]), total.dtype)
        for g, gt, w in zip(grads(p1), grads(p2), want):
            assert_no_worse_than(g, gt, w, g.dtype, f"grad {g.dtype}")
    else:
        assert math.isinf(float(total)) and math.isinf(float(total_t))
        for g, gt in zip(grads(p1), grads(p2)):
            # the reference may sit on the CPU (_ref_device: bf16 on CUDA): compare its NaN mask on our device
            assert torch.equal(torch.isnan(g), torch.isnan(gt).to(g.device)) and not (g[~torch.isnan(g)] != 0).any()
    s1.step(o1), s2.step(o2)
    s1.update(), s2.update()
    assert float(s1.get_scale()) == float(s2.get_scale())


def test_sharded_scaler_without_grads(flag_reductions):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    reduced = flag_reductions

    def make():
        s = ShardedGradScaler(device="cpu", init_scale=8.0)
        s._lazy_init_scale_growth_tracker(torch.device("cpu"))
        return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), s

    (o1, s1), (o2, s2) = make(), make()
    fastgrad.scaler_unscale_and_clip(s1, o1, 1.0)
    ours = list(reduced)
    s2.unscale_(o2)
    assert ours and ours == reduced[len(ours):]
    _assert_same_state(s1, o1, s2, o2)
    assert list(s1._per_optimizer_states[id(o1)]["found_inf_per_device"]) == [torch.device("cpu")]


@pytest.mark.parametrize("exact", [False, True])
def test_sharded_scaler_reduces_the_flags_of_plain_grads(flag_reductions, exact):
    """Plain gradients (each rank its own) under a ShardedGradScaler: the per-device flags go through the
    scaler's own all-reduce over its process group, as its unscale_ does, with or without exact=True."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    reduced = flag_reductions

    def make():
        s = ShardedGradScaler(device="cpu", init_scale=8.0)
        s._lazy_init_scale_growth_tracker(torch.device("cpu"))
        params = make_params([(7, 3), (5,)], [torch.float32], "cpu", seed=66, scale=8.0)
        return torch.optim.SGD(params, lr=0.1), s

    (o1, s1), (o2, s2) = make(), make()
    fastgrad.scaler_unscale_and_clip(s1, o1, 1e9, exact=exact)
    ours = list(reduced)
    s2.unscale_(o2)
    assert ours and ours == reduced[len(ours):]
    _assert_same_state(s1, o1, s2, o2)


# ---------------------------------------------------------------- the amp_clip_ primitive (issue 13)
def _old_amp(b, gs, inv, max_norm, p, write=True):
    """What scaler_unscale_and_clip ran per device before amp_clip_ existed: the backend's amp_norm, torch's
    clip coefficient on the 0-dim total, inv_scale * coef as a torch multiply, the backend's scale_ (the
    reference the primitive must equal bit for bit on every backend)."""
    total, found = b.amp_norm(gs, inv, p)
    factor = inv.to(total.dtype) * torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if write:
        b.scale_(gs, factor)
    return total, found, factor


def _inv(scale, device):
    return torch.tensor(scale, device=device).double().reciprocal().float()  # as GradScaler.unscale_


AMP_DTYPES = {"fp32": [torch.float32], "bf16+fp32": [torch.bfloat16, torch.float32],
              "fp64": [torch.float64], "mixed64": [torch.float32, torch.float64, torch.bfloat16]}
AMP_SHAPES = [(7,), (3, 5), (1,), (0,), (17, 33), (4, 3, 3, 3), (1025,), (2, 0, 3), (257, 3)]


@pytest.mark.parametrize("kind", list(AMP_DTYPES))
@pytest.mark.parametrize("scale", [1024.0, 3000.0, 1.0], ids=["pow2", "non-pow2", "one"])
@pytest.mark.parametrize("overflow,clipping", [(None, True), (None, False), (INF, True), (NAN, True)],
                         ids=["clip", "noclip", "inf", "nan"])  # an overflow's factor is 0 or NaN whatever max_norm
def test_amp_clip_primitive_same_bits_as_the_composition(bd, kind, scale, overflow, clipping):
    """Backend.amp_clip_ on every backend: total, found_inf, factor and the written grads exactly as the
    composition it replaced; with write=False the same three results and not one bit of a grad changed.
    Half the cases have non-contiguous grads (alternating over dtype sets, scales and overflows, so each of
    those meets both layouts)."""
    from fastgrad.backends import get

    backend, device = bd
    b = get(backend)
    seed = 300 + list(AMP_DTYPES).index(kind)
    noncontig = (seed + [1024.0, 3000.0, 1.0].index(scale) + (overflow is None) + clipping) % 2 == 1
    params = make_params(AMP_SHAPES, AMP_DTYPES[kind], device, seed=seed, scale=scale, noncontig=noncontig)
    if overflow is not None:
        params[4].grad[16, 32] = overflow  # the last element of a multi-block grad
    unscaled = oracle.total_norm([oracle.f64(g) / scale for g in grads(params)], 2.0)
    max_norm = unscaled / 3 if clipping else unscaled * 3
    inv = _inv(scale, device)
    acc = torch.float64 if torch.float64 in AMP_DTYPES[kind] else torch.float32
    for write in (True, False):
        ours, ref = grads(clone_params(params)), grads(clone_params(params))
        before = [g.clone() for g in ours]
        out = b.amp_clip_(ours, inv, max_norm, 2.0, write)
        want = _old_amp(b, ref, inv, max_norm, 2.0, write)
        for x, y, name in zip(out, want, ("total", "found_inf", "factor")):
            assert x.dim() == 0 and x.device == ours[0].device and x.dtype == y.dtype, name
            assert torch.equal(bits(x), bits(y)), f"{name}: {x} vs {y} (write={write})"
        assert out[0].dtype == out[2].dtype == acc and out[1].dtype == torch.float32
        assert float(out[1]) == (0.0 if overflow is None else 1.0)
        for i, (g, r, g0) in enumerate(zip(ours, ref, before)):
            assert g.stride() == r.stride()
            assert torch.equal(bits(g), bits(r)), f"grad {i} (write={write})"
            if not write:
                assert torch.equal(bits(g), bits(g0)), f"grad {i} written with write=False"
        if write and overflow is None:  # the test sees a write that did not happen (or should not have)
            assert torch.equal(bits(ours[0]), bits(before[0])) == (scale == 1.0 and not clipping)


def test_amp_clip_primitive_empty_tensors_only(bd):
    from fastgrad.backends import get

    backend, device = bd
    b = get(backend)
    ts = [torch.empty(0, device=device), torch.empty(3, 0, device=device, dtype=torch.bfloat16)]
    inv = _inv(3000.0, device)
    for max_norm in (1.0, 1e-9):
        out = b.amp_clip_(ts, inv, max_norm, 2.0)
        want = _old_amp(b, [t.clone() for t in ts], inv, max_norm, 2.0)
        assert float(out[0]) == 0.0 and float(out[1]) == 0.0
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(out, want))


@pytest.mark.parametrize("mode", ["write", "zero_write", "error_if_nonfinite"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_public_call_is_one_primitive_call(monkeypatch, backend, mode):
    """One device, a plain GradScaler: scaler_unscale_and_clip is ONE amp_clip_ call (the torch backend's is
    the default composition); error_if_nonfinite checks the norm on the host before writing: separate steps."""
    from fastgrad.backends import get

    b = get(backend)
    if b.unavailable_reason() is not None:
        pytest.skip(b.unavailable_reason())
    calls = []
    for name in ("amp_clip_", "amp_norm", "scale_"):
        def spy(self, *args, _name=name, _orig=getattr(type(b), name), **kwargs):
            calls.append(_name)
            return _orig(self, *args, **kwargs)
        monkeypatch.setattr(type(b), name, spy)
    params = make_params([(17, 5), (5,), (3, 4, 2)], torch.float32, "cpu", seed=70, scale=1024.0, noncontig=True)
    opt = torch.optim.Adam(params, lr=0.1, fused=True)
    scaler = _scaler("cpu")
    fastgrad.scaler_unscale_and_clip(scaler, opt, 0.01, error_if_nonfinite=mode == "error_if_nonfinite",
                                     zero_write=mode == "zero_write", backend=backend)
    if mode == "error_if_nonfinite":
        assert calls == ["amp_norm", "scale_"]
    elif backend == "cpu":
        assert calls == ["amp_clip_"]
    else:
        assert calls == ["amp_clip_", "amp_norm"] + (["scale_"] if mode == "write" else [])
    assert hasattr(opt, "grad_scale") == (mode == "zero_write")


@pytest.mark.parametrize("overflow", [None, INF, NAN], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("max_norm", [0.01, 1e6], ids=["clip", "noclip"])
@pytest.mark.parametrize("zero_write", [False, True], ids=["write", "zero_write"])
def test_public_call_same_bits_and_state_as_the_composition(bd, overflow, max_norm, zero_write):
    """The fused path of scaler_unscale_and_clip against the per-device composition it replaced, run by hand
    on a twin: returned total, gradients (or the factor handed to a fused optimizer) and scaler state."""
    from fastgrad.backends import get

    backend, device = bd
    b = get(backend)
    scale = 3000.0  # not a power of two: inv_scale * coef is rounded
    p1 = make_params([(17, 5), (5,), (3, 4, 2), (300,)], [torch.float32, torch.bfloat16], device, seed=71,
                     scale=scale)
    p2 = clone_params(p1)
    if overflow is not None:
        p1[0].grad[2, 3] = p2[0].grad[2, 3] = overflow
    o1 = torch.optim.Adam(p1, lr=0.1, fused=True) if zero_write else torch.optim.SGD(p1, lr=0.1)
    s1 = _scaler(device, scale)
    applies = zero_write and famp.zero_write_applies(s1, o1)
    total = fastgrad.scaler_unscale_and_clip(s1, o1, max_norm, zero_write=zero_write, backend=backend)
    want, found, factor = _old_amp(b, grads(p2), _inv(scale, device), max_norm, 2.0, write=not applies)
    assert torch.equal(bits(total), bits(want))
    for g, r in zip(grads(p1), grads(p2)):
        assert torch.equal(bits(g), bits(r))
    state = s1._per_optimizer_states[id(o1)]
    assert state["stage"] is OptState.UNSCALED
    flags = state["found_inf_per_device"]
    assert list(flags) == [p1[0].device] and flags[p1[0].device].shape == ()
    assert torch.equal(bits(flags[p1[0].device]), bits(found))
    if applies:
        assert torch.equal(bits(o1.grad_scale), bits(factor.reciprocal()))
    else:
        assert not hasattr(o1, "grad_scale")


# ---------------------------------------------------------------- GPU only
@needs_cuda
def test_no_host_sync_on_cuda():
    params = make_params([(256, 33), (33,), (4, 4, 4)], [torch.float32, torch.bfloat16], "cuda", seed=66,
                         scale=1024.0)
    params[0].grad[0, 0] = INF
    opt = torch.optim.Adam(params, lr=0.1, fused=True)
    scaler = _scaler("cuda")
    fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0)  # warm-up: lazy imports, kernel compilation
    scaler.update()
    for zero_write in (False, True):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0, zero_write=zero_write)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        scaler.update()
        if hasattr(opt, "grad_scale"):
            del opt.grad_scale


@needs_cuda
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_amp_clip_primitive_no_host_sync_on_cuda(backend):
    """The fused primitive (issue 13) on CUDA tensors: no sync, writing or not, clipping or not, strided grads
    (a copy each call) included, and the same bits as the composition it replaced."""
    from fastgrad.backends import get

    b = get(backend)
    if b.unavailable_reason() is not None or b.supports("amp_norm", [torch.ones(1, device="cuda")], norm_type=2.0):
        pytest.skip(f"the {backend} backend does not serve CUDA tensors here")
    lists = [grads(make_params([(256, 33), (33,), (4, 4, 4)], [torch.float32, torch.bfloat16], "cuda", seed=s,
                               scale=3000.0, noncontig=s == 2)) for s in (1, 2)]
    inv = _inv(3000.0, "cuda")
    for gs in lists:
        b.amp_clip_(gs, inv, 1.0, 2.0)  # warm-up: kernel compilation, table upload
    torch.cuda.synchronize()
    for gs in lists:
        for write in (True, False):
            for max_norm in (1e-3, 1e9):
                ref = [g.clone() for g in gs]
                torch.cuda.set_sync_debug_mode("error")
                try:
                    out = b.amp_clip_(gs, inv, max_norm, 2.0, write)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                want = _old_amp(b, ref, inv, max_norm, 2.0, write)
                assert all(torch.equal(bits(x), bits(y)) for x, y in zip(out, want))
                assert all(torch.equal(bits(x), bits(y)) for x, y in zip(gs, ref))


@needs_cuda
def test_grads_on_cpu_and_cuda():
    params = make_params([(17, 5), (5,)], torch.float32, "cuda", seed=67, scale=1024.0) + \
        make_params([(3, 4, 2), (9,)], torch.float32, "cpu", seed=68, scale=1024.0)
    p2 = clone_params(params)
    o1, s1 = torch.optim.SGD(params, lr=0.1), _scaler("cuda")
    o2, s2 = torch.optim.SGD(p2, lr=0.1), _scaler("cuda")
    params[3].grad[2] = INF
    p2[3].grad[2] = INF
    total = fastgrad.scaler_unscale_and_clip(s1, o1, 0.05)
    s2.unscale_(o2)
    total_t = torch.nn.utils.clip_grad_norm_(p2, 0.05)
    assert total.device.type == "cuda"
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0, equal_nan=True)
    for g, gt in zip(grads(params), grads(p2)):
        torch.testing.assert_close(g, gt, rtol=2e-6, atol=0, equal_nan=True)
    _assert_same_state(s1, o1, s2, o2)
    assert set(s1._per_optimizer_states[id(o1)]["found_inf_per_device"]) == {torch.device("cuda", 0),
                                                                              torch.device("cpu")}


def test_sparse_grads_go_through_torch():
    """Sparse gradients: torch's own unscale_ (which coalesces them) then torch's clip, so the outcome is
    torch's, whatever it is (this torch cannot take the norm of a sparse CPU grad: both raise alike)."""
    emb1 = torch.nn.Embedding(10, 3, sparse=True)
    emb2 = torch.nn.Embedding(10, 3, sparse=True)
    emb2.load_state_dict(emb1.state_dict())
    outs = []
    for emb in (emb1, emb2):
        opt, s = torch.optim.SGD(emb.parameters(), lr=0.1), _scaler("cpu", 64.0)
        s.scale(emb(torch.tensor([1, 2, 2, 7])).sum()).backward()
        outs.append((emb, opt, s))
    (e1, o1, s1), (e2, o2, s2) = outs
    # A fused backend asked for by name refuses before anything happens.
    with pytest.raises(fastgrad.BackendError):
        fastgrad.scaler_unscale_and_clip(s1, o1, 0.5, backend="triton")
    assert s1._per_optimizer_states[id(o1)]["stage"] is OptState.READY
    try:
        ours = fastgrad.scaler_unscale_and_clip(s1, o1, 0.5)
    except Exception as e:  # noqa: BLE001 - compared with torch's outcome below
        ours = type(e)
    s2.unscale_(o2)
    try:
        theirs = torch.nn.utils.clip_grad_norm_(e2.parameters(), 0.5)
    except Exception as e:  # noqa: BLE001
        theirs = type(e)
    if isinstance(theirs, type):
        assert ours is theirs
    else:
        torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(e1.weight.grad.to_dense(), e2.weight.grad.to_dense())
    _assert_same_state(s1, o1, s2, o2)


def test_bad_arguments_say_the_fix_and_leave_the_gradients():
    """The scaler and the optimizer swapped, no scaler, an optimizer without param_groups: each a TypeError that says
    the fix, raised before anything is read or written."""
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    before = p.grad.clone()
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    with pytest.raises(TypeError, match="the scaler and the optimizer are swapped"):
        fastgrad.scaler_unscale_and_clip(opt, scaler, 1.0)
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler, got NoneType"):
        fastgrad.scaler_unscale_and_clip(None, opt, 1.0)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer .with param_groups., got list"):
        fastgrad.scaler_unscale_and_clip(scaler, [p], 1.0)
    assert torch.equal(p.grad, before)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY
