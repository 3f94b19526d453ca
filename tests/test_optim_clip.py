"""clip_optimizer_grad_norm_ (fastgrad/optim_clip.py): zero-write clipping handed to torch's fused optimizers.

References: the same optimizer stepped after ``fastgrad.clip_grad_norm_`` (write mode), and, for the exact
check, after writing ``g / (1 / coef)`` into the gradients, which is what the fused kernels compute."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import fastgrad
from fastgrad import optim_clip as oc

from .helpers import assert_max_error_within, bits, clone_params, grads, make_params
from .helpers import optimizer_state as _opt_state

INF, NAN = float("inf"), float("nan")
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

SHAPES = [(17, 33), (7,), (1,), (4097,), (3, 4, 5)]
FUSED = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam-amsgrad-wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, amsgrad=True, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, fused=True),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.05, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, fused=True),
}


def _new_grads(params, step: int, scale: float, device) -> list[torch.Tensor]:
    """Fresh non-zero gradients for ``step``, the same for every twin."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for p in params:
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale
        out.append(torch.where(g == 0, torch.full_like(g, 0.5), g).to(device, p.dtype))
    return out


def _set_grads(params, values) -> None:
    for p, g in zip(params, values):
        if g is not None:
            p.grad = g.clone()


def _give_grads(step: int, scale: float, device, *param_sets) -> list[torch.Tensor]:
    """The same fresh gradients on every set of twin parameters (copies); returns them."""
    values = _new_grads(param_sets[0], step, scale, device)
    for ps in param_sets:
        _set_grads(ps, values)
    return values


def _twins(opt_name, dtype, device, n=2, none_every=0):
    base = make_params(SHAPES, dtype, device, seed=3, none_every=none_every)
    sets = [clone_params(base) for _ in range(n)]
    return [(ps, FUSED[opt_name](ps)) for ps in sets]


def _model_clip_(params, max_norm, backend=None) -> torch.Tensor:
    """What the fused kernel computes from our hand-off: g / (1 / coef), written into the gradients."""
    total = fastgrad.get_total_norm(grads(params), backend=backend)
    coef = torch.clamp(max_norm / (total.float() + 1e-6), max=1.0)
    s = coef.reciprocal()
    for g in grads(params):
        g.copy_(g.float() / s)
    return total


def _model_step(opt) -> None:
    """Step the model optimizer through the same branch of torch's fused kernel as the zero-write step: with a
    ``grad_scale``, here 1 (dividing by it is exact). torch's CUDA fused SGD rounds the update differently with
    and without one: in the H100 run of 2026-11-25 its step with a grad_scale matched ``p - fl32(lr * g)``
    (product rounded, then subtracted) and its step without one ``p - lr * g`` rounded once (contracted), so a
    model stepped without one differed by an ulp in a few elements."""
    dev = next(p.device for group in opt.param_groups for p in group["params"])
    opt.grad_scale = torch.ones((), dtype=torch.float32, device=dev)
    try:
        opt.step()
    finally:
        del opt.grad_scale


def _assert_bits_equal(xs, ys, what):
    assert len(xs) == len(ys), what
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert torch.equal(bits(x), bits(y)), f"{what} [{i}]: {(x != y).sum()} elements differ"


def _ulps_apart(x: torch.Tensor, y: torch.Tensor) -> int:
    """Largest distance in units in the last place between two same-dtype finite tensors of one sign each."""
    ix, iy = bits(x).to(torch.int64), bits(y).to(torch.int64)
    return int((ix - iy).abs().max()) if x.numel() else 0


# ---------------------------------------------------------------- the hand-off itself
@pytest.mark.parametrize("opt_name", list(FUSED))
@pytest.mark.parametrize("max_norm", [0.7, 1e6], ids=["clips", "no-clip"])
def test_bit_exact_against_the_kernels_arithmetic(bd, opt_name, max_norm):
    """float32: parameters, optimizer state and the stored grads equal, bit for bit, the same fused
    optimizer stepped after writing g / (1/coef) into the grads (through the kernel's grad_scale branch, with
    grad_scale 1: _model_step); the norm equals clip_grad_norm_'s."""
    backend, device = bd
    (pa, oa), (pb, ob), (pc, _) = _twins(opt_name, torch.float32, device, n=3, none_every=4)
    if not getattr(oa, "_step_supports_amp_scaling", False):
        # torch 2.11's fused Adagrad takes no grad_scale: the clip must (and does) write instead
        assert not oc.zero_write_applies(oa)
        pytest.skip(f"torch {torch.__version__}'s fused {opt_name} does not take a grad_scale")
    for step in range(4):
        g = _new_grads(pa, step, 2.0, device)
        for ps in (pa, pb, pc):
            _set_grads(ps, [x if p.grad is not None else None for x, p in zip(g, ps)])
        before = [x.clone() for x in grads(pa)]
        total = fastgrad.clip_optimizer_grad_norm_(oa, max_norm, backend=backend)
        assert oc.zero_write_applies(oa)
        _assert_bits_equal(grads(pa), before, "grads are only read by the clip")
        assert not hasattr(oa, "grad_scale")  # pending in fastgrad, installed only for the step
        ref_total = _model_clip_(pb, max_norm, backend=backend)
        assert torch.equal(total, fastgrad.clip_grad_norm_(pc, max_norm, backend=backend))
        assert torch.equal(total, ref_total)
        oa.step()
        _model_step(ob)
        assert not hasattr(oa, "grad_scale") and not hasattr(oa, "found_inf")
        _assert_bits_equal(pa, pb, f"params after step {step}")
        _assert_bits_equal(_opt_state(oa), _opt_state(ob), f"state after step {step}")
        _assert_bits_equal(grads(pa), grads(pb), f"grads after step {step}")


@pytest.mark.parametrize("opt_name", ["adam", "adamw", "sgd", "adagrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_against_clip_grad_norm_then_step(opt_name, dtype):
    """Against write mode (fastgrad.clip_grad_norm_ then the same optimizer), with a float64 run of the same
    optimizer on the exactly clipped gradients as the oracle.

    No clip (coef 1, grad_scale 1): g / 1 == g, so everything is bit-identical. A triggered clip: the kernel
    uses g / fl(1/coef) where write mode uses fl(g * coef); in float32 the two differ by at most one ulp
    (fl(1/coef) is within half an ulp of 1/coef), and in bf16/fp16 the kernel keeps the quotient in float32
    for the update where write mode first rounds it to the grad dtype. So the stored grads are at most one
    ulp apart, and the parameters are held to the project's rule for results that go through a chain of
    roundings (helpers.assert_max_error_within): their largest error against the oracle is at most twice
    write mode's plus one ulp. (Adam's m / sqrt(v) amplifies a one-ulp gradient difference where m nearly
    cancels, so a fixed ulp count per step would not be a sound bound.)"""
    if opt_name == "sgd" and dtype != torch.float32:
        pytest.skip("torch 2.13's CPU fused SGD is wrong in bf16/fp16 by itself (no grad_scale involved): after "
                    "one step it is up to 0.2 away from the unfused SGD on the same inputs; nothing to compare to")
    device = "cpu"
    for max_norm, clips in ((1e6, False), (0.5, True)):
        (pa, oa), (pb, ob), (pc, _) = _twins(opt_name, dtype, device, n=3)
        pc = [torch.nn.Parameter(p.detach().double()) for p in pc]
        oc64 = FUSED[opt_name](pc)
        for step in range(4):
            g = _give_grads(step, 2.0, device, pa, pb)
            _set_grads(pc, [x.double() for x in g])
            ta = fastgrad.clip_optimizer_grad_norm_(oa, max_norm)
            tb = fastgrad.clip_grad_norm_(pb, max_norm)
            fastgrad.clip_grad_norm_(pc, max_norm)
            assert torch.equal(ta, tb)
            for o in (oa, ob, oc64):
                o.step()
            for x, y in zip(grads(pa), grads(pb)):
                assert _ulps_apart(x, y) <= (1 if clips else 0), f"grads after step {step}"
            if not clips:
                _assert_bits_equal(pa, pb, f"params without clipping, step {step}")
                continue
            for i, (x, y, z) in enumerate(zip(pa, pb, pc)):
                assert_max_error_within(x.detach(), y.detach(), z.detach(), dtype, f"param {i}, step {step}")
        if not clips:
            _assert_bits_equal(_opt_state(oa), _opt_state(ob), "state without clipping")


def test_how_often_the_quotient_differs_from_the_product():
    """The measurement docs/amp-reference.md quotes: over random coefficients, g / fl(1/coef) != fl(g * coef) for about
    a quarter of float32 elements, never by more than one ulp, and never for power-of-two coefficients."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(200_000, generator=gen)
    differ = 0
    for i in range(50):
        coef = torch.rand((), generator=gen) * 0.999 + 1e-3
        a, b = g * coef, g / coef.reciprocal()
        assert _ulps_apart(a, b) <= 1
        differ += int((a != b).sum())
    share = differ / (50 * g.numel())
    assert 0.15 < share < 0.35, share
    for k in range(1, 20):
        coef = torch.tensor(2.0 ** -k)
        assert torch.equal(g * coef, g / coef.reciprocal())


# ---------------------------------------------------------------- consumed once, replaced, refused when stale
def test_factor_is_consumed_by_one_step():
    (pa, oa), (pb, ob) = _twins("adam", torch.float32, "cpu")
    g0 = _give_grads(0, 2.0, "cpu", pa, pb)
    fastgrad.clip_optimizer_grad_norm_(oa, 0.5)
    _model_clip_(pb, 0.5)
    oa.step()
    ob.step()
    # second step with new gradients and no clip: unclipped on both sides (a stale factor would shrink it)
    g1 = _give_grads(1, 2.0, "cpu", pa, pb)
    oa.step()
    ob.step()
    _assert_bits_equal(pa, pb, "params")
    _assert_bits_equal(grads(pa), g1, "grads of the unclipped step")  # no quotient stored: no grad_scale
    assert len(oa._optimizer_step_pre_hooks) == 1 and len(oa._optimizer_step_post_hooks) == 1


def test_second_clip_before_the_step_replaces_the_first():
    (pa, oa), (pb, ob) = _twins("adamw", torch.float32, "cpu")
    g = _give_grads(0, 2.0, "cpu", pa, pb)
    fastgrad.clip_optimizer_grad_norm_(oa, 0.1)
    total = fastgrad.clip_optimizer_grad_norm_(oa, 0.7)  # replaces: the step applies the 0.7 clip only
    assert torch.equal(total, _model_clip_(pb, 0.7))
    oa.step()
    ob.step()
    _assert_bits_equal(pa, pb, "params")
    for _ in range(3):
        fastgrad.clip_optimizer_grad_norm_(oa, 1.0)
    assert len(oa._optimizer_step_pre_hooks) == 1  # hooks registered once per optimizer


def test_skipped_step_then_new_gradients():
    """clip, no step, zero_grad, a new backward, clip, step: the step uses the second clip only."""
    (pa, oa), (pb, ob) = _twins("adam", torch.float32, "cpu")
    _set_grads(pa, _new_grads(pa, 0, 5.0, "cpu"))
    fastgrad.clip_optimizer_grad_norm_(oa, 0.1)
    oa.zero_grad(set_to_none=True)
    g = _give_grads(1, 2.0, "cpu", pa, pb)
    fastgrad.clip_optimizer_grad_norm_(oa, 0.5)
    _model_clip_(pb, 0.5)
    oa.step()
    ob.step()
    _assert_bits_equal(pa, pb, "params")


@pytest.mark.parametrize("change", ["accumulate", "zero_grad-none", "zero_grad-zeros", "new-grad", "write",
                                    "grad-added"])
def test_stale_factor_is_refused(change):
    """The gradients changed between the clip and the step: the step raises before touching anything, the
    factor is gone, and the next step runs unclipped."""
    (pa, oa), _ = _twins("adam", torch.float32, "cpu", none_every=4)
    _set_grads(pa, [g if p.grad is not None else None for g, p in zip(_new_grads(pa, 0, 2.0, "cpu"), pa)])
    fastgrad.clip_optimizer_grad_norm_(oa, 0.5)
    had = [p.grad is not None for p in pa]
    if change == "accumulate":
        loss = sum((p * p).sum() for p, h in zip(pa, had) if h)
        loss.backward()
    elif change == "zero_grad-none":
        oa.zero_grad(set_to_none=True)
        _set_grads(pa, [g if h else None for g, h in zip(_new_grads(pa, 1, 2.0, "cpu"), had)])
    elif change == "zero_grad-zeros":
        oa.zero_grad(set_to_none=False)
    elif change == "new-grad":
        pa[0].grad = pa[0].grad.clone()
    elif change == "write":
        torch.nn.utils.clip_grad_norm_(pa, 0.01)  # torch's in-place ops bump the version counter
    else:
        missing = next(p for p in pa if p.grad is None)
        missing.grad = torch.ones_like(missing)
    params_before = [p.detach().clone() for p in pa]
    grads_before = [g.clone() for g in grads(pa)]
    with pytest.raises(RuntimeError, match="the gradients changed after the clip"):
        oa.step()
    _assert_bits_equal(pa, params_before, "params after the refused step")
    _assert_bits_equal(grads(pa), grads_before, "grads after the refused step")
    assert not hasattr(oa, "grad_scale")
    oa.step()  # the factor was discarded: an ordinary unclipped step
    _assert_bits_equal(grads(pa), grads_before, "grads after an unclipped step")


def test_step_with_closure():
    """step(closure) after a pending clip is refused (the closure recomputes the grads); a clip inside the
    closure runs in the step and writes the gradients (write mode)."""
    (pa, oa), (pb, ob) = _twins("adam", torch.float32, "cpu")
    g = _new_grads(pa, 0, 2.0, "cpu")
    _set_grads(pa, g)
    fastgrad.clip_optimizer_grad_norm_(oa, 0.5)
    with pytest.raises(RuntimeError, match=r"step\(closure\)"):
        oa.step(lambda: None)

    def closure_a():
        _set_grads(pa, g)
        fastgrad.clip_optimizer_grad_norm_(oa, 0.5)
        assert not oc.zero_write_applies(oa)  # inside the step: too late to hand over
        return torch.zeros(())

    def closure_b():
        _set_grads(pb, g)
        fastgrad.clip_grad_norm_(pb, 0.5)
        return torch.zeros(())

    oa.step(closure_a)
    ob.step(closure_b)
    _assert_bits_equal(pa, pb, "params")
    assert oc.zero_write_applies(oa)  # after the step, again


def _closure_clipping(params, opt, values, max_norm, out, clip=None):
    """A step(closure) closure: new gradients (its 'backward'), then the clip, inside."""
    def closure():
        _set_grads(params, values)
        if clip is None:
            out.append(fastgrad.clip_optimizer_grad_norm_(opt, max_norm))
            out.append(oc.zero_write_applies(opt))
        else:
            out.append(clip(params, max_norm))
        return torch.zeros(())
    return closure


@pytest.mark.parametrize("opt_name", list(FUSED))
@pytest.mark.parametrize("how", ["positional", "keyword", "scheduler"])
def test_clip_inside_the_closure_on_every_step(opt_name, how):
    """A clip inside step(closure) from the optimizer's very first step on (the first clip registers the hooks
    while that step is already running): every closure step runs in write mode, bit for bit fastgrad.
    clip_grad_norm_ inside the same closure; a plain clip + step() in between still hands over exactly
    (the kernel model); nothing is left on the optimizer and no tensor is read on the host. (The first
    closure step used to run unclipped, its coefficient left pending, and the second raised "step(closure)".)"""
    (pa, oa), (pb, ob) = _twins(opt_name, torch.float32, "cpu", none_every=4)
    if how == "scheduler":  # an LR scheduler wraps optimizer.step: the clip must still see it is inside it
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (oa, ob)]
    from .guard_cases import no_host_reads
    for step, kind in enumerate(["closure", "closure", "plain", "closure"]):
        g = [x if p.grad is not None or step == 0 else None for x, p in zip(_new_grads(pa, step, 2.0, "cpu"), pa)]
        if kind == "plain":
            _set_grads(pa, g)
            _set_grads(pb, g)
            total = fastgrad.clip_optimizer_grad_norm_(oa, 0.5)
            assert torch.equal(total, _model_clip_(pb, 0.5))
            with no_host_reads():
                oa.step()
            _model_step(ob)
        else:
            out_a, out_b = [], []
            ca = _closure_clipping(pa, oa, g, 0.5, out_a)
            cb = _closure_clipping(pb, ob, g, 0.5, out_b, clip=fastgrad.clip_grad_norm_)
            with no_host_reads():
                if how == "keyword":
                    oa.step(closure=ca)
                else:
                    oa.step(ca)
            ob.step(cb)
            assert torch.equal(out_a[0], out_b[0]), f"norm at step {step}"
            assert out_a[1] is False, "inside the step the clip writes (too late to hand over)"
        assert not hasattr(oa, "grad_scale")
        _assert_bits_equal(pa, pb, f"params after step {step} ({kind})")
        _assert_bits_equal(_opt_state(oa), _opt_state(ob), f"state after step {step} ({kind})")
        _assert_bits_equal(grads(pa), grads(pb), f"grads after step {step} ({kind})")
        if how == "scheduler":
            for s in scheds:
                s.step()
        assert oc.zero_write_applies(oa)  # outside the step, it hands over again
    assert len(oa._optimizer_step_pre_hooks) == 1 and len(oa._optimizer_step_post_hooks) == 1


def test_clip_of_another_optimizer_inside_a_closure_hands_over():
    """Inside optimizer A's closure, a clip of optimizer B is not inside B's step: B gets the coefficient for
    its own next step, as outside any closure."""
    (pa, oa), (pb, ob), (pc, oc_) = _twins("adamw", torch.float32, "cpu", n=3)
    g = _give_grads(0, 2.0, "cpu", pb, pc)
    seen = []

    def closure():
        seen.append(fastgrad.clip_optimizer_grad_norm_(ob, 0.5))
        seen.append(oc.zero_write_applies(ob))
        return torch.zeros(())

    oa.step(closure)  # no gradients for A: its step changes nothing
    assert seen[1] is True
    _assert_bits_equal(grads(pb), g, "B's gradients are only read")
    assert torch.equal(seen[0], _model_clip_(pc, 0.5))
    ob.step()
    _model_step(oc_)
    _assert_bits_equal(pb, pc, "B's params")


def test_a_closure_that_raises_leaves_the_hand_over_working():
    """A closure that raises after its clip (the step never reaches its post-hook): the next clip outside a
    step still hands over (bit for bit the kernel model), not falling back to write mode for good."""
    (pa, oa), (pb, ob) = _twins("adam", torch.float32, "cpu")
    _give_grads(0, 2.0, "cpu", pa, pb)
    fastgrad.clip_optimizer_grad_norm_(oa, 0.5)  # registers the hooks
    _model_clip_(pb, 0.5)
    oa.step()
    _model_step(ob)

    def closure():
        _set_grads(pa, _new_grads(pa, 1, 2.0, "cpu"))
        fastgrad.clip_optimizer_grad_norm_(oa, 0.5)
        raise ValueError("boom")

    with pytest.raises(ValueError):
        oa.step(closure)
    g = _give_grads(2, 2.0, "cpu", pa, pb)
    assert oc.zero_write_applies(oa)
    fastgrad.clip_optimizer_grad_norm_(oa, 0.5)
    _assert_bits_equal(grads(pa), g, "handed over: the clip only read the gradients")
    _model_clip_(pb, 0.5)
    oa.step()
    _model_step(ob)
    _assert_bits_equal(pa, pb, "params")


def test_a_step_that_raises_leaves_nothing_behind():
    (pa, oa), _ = _twins("adam", torch.float32, "cpu")
    _set_grads(pa, _new_grads(pa, 0, 2.0, "cpu"))
    fastgrad.clip_optimizer_grad_norm_(oa, 0.5)

    def boom(opt, args, kwargs):
        raise ValueError("boom")

    h = oa.register_step_pre_hook(boom)  # runs after ours: grad_scale is installed when it raises
    with pytest.raises(ValueError):
        oa.step()
    h.remove()
    assert hasattr(oa, "grad_scale")  # left by the failed step ...
    params_before = [p.detach().clone() for p in pa]
    g = [x.clone() for x in grads(pa)]
    oa.step()  # ... and removed by the next step's pre-hook before it could apply again
    assert not hasattr(oa, "grad_scale")
    _assert_bits_equal(grads(pa), g, "no quotient stored: the step ran without grad_scale")
    assert any(not torch.equal(a, b) for a, b in zip(pa, params_before))


def test_optimizer_is_not_kept_alive():
    params = make_params([(5,)], torch.float32, "cpu")
    opt = torch.optim.Adam(params, fused=True)
    fastgrad.clip_optimizer_grad_norm_(opt, 0.1)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------- with a GradScaler
def _scalers(scale, n=2):
    out = []
    for _ in range(n):
        s = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1)
        s._lazy_init_scale_growth_tracker(torch.device("cpu"))
        out.append(s)
    return out


@pytest.mark.parametrize("overflow", [None, INF], ids=["finite", "overflow"])
def test_after_scaler_unscale(overflow):
    """scaler.unscale_(opt), this clip, scaler.step/update: bit-identical to unscale_, writing g / (1/coef),
    scaler.step/update (GradScaler.step leaves grad_scale None after unscale_; the pre-hook installs ours in
    its place and the post-hook puts None back for GradScaler to delete). An overflow skips the step."""
    (pa, oa), (pb, ob) = _twins("adam", torch.float32, "cpu")
    sa, sb = _scalers(1024.0)
    for step in range(4):
        g = _new_grads(pa, step, 2048.0, "cpu")
        if overflow is not None and step == 1:
            g[0][0, 0] = overflow
        _set_grads(pa, g)
        _set_grads(pb, g)
        sa.unscale_(oa)
        sb.unscale_(ob)
        ta = fastgrad.clip_optimizer_grad_norm_(oa, 0.5)
        tb = _model_clip_(pb, 0.5)
        torch.testing.assert_close(ta, tb, rtol=0, atol=0, equal_nan=True)
        sa.step(oa)
        sb.step(ob)
        sa.update()
        sb.update()
        assert not hasattr(oa, "grad_scale") and not hasattr(oa, "found_inf")
        assert sa.get_scale() == sb.get_scale()
        _assert_bits_equal(pa, pb, f"params after step {step}")
        _assert_bits_equal(_opt_state(oa), _opt_state(ob), f"state after step {step}")
    if overflow is not None:
        assert sa.get_scale() < 1024.0 * 2 ** 3  # one update backed off


def test_scaler_step_without_unscale_composes():
    """GradScaler.step on a fused optimizer without unscale_ sets grad_scale = scale; the pending clip is
    multiplied into it, so the step sees g / (scale / coef), as scaler.step after writing the clip (with a
    power-of-two scale, bit for bit)."""
    (pa, oa), (pb, ob) = _twins("sgd", torch.float32, "cpu")
    sa, sb = _scalers(4.0)
    for step in range(2):
        g = _give_grads(step, 8.0, "cpu", pa, pb)
        fastgrad.clip_optimizer_grad_norm_(oa, 3.0)
        _model_clip_(pb, 3.0)
        sa.step(oa)
        sb.step(ob)
        sa.update()
        sb.update()
        assert not hasattr(oa, "grad_scale")
        _assert_bits_equal(pa, pb, f"params after step {step}")


def test_amp_zero_write_factor_is_not_clipped_twice():
    """After scaler_unscale_and_clip(zero_write=True) the optimizer has a grad_scale of its own: this clip
    does not apply (it falls back to the in-place clip, as clip_grad_norm_ would)."""
    (pa, oa), _ = _twins("adam", torch.float32, "cpu")
    s = torch.amp.GradScaler("cpu", init_scale=1024.0)
    s._lazy_init_scale_growth_tracker(torch.device("cpu"))
    _set_grads(pa, _new_grads(pa, 0, 1024.0, "cpu"))
    fastgrad.scaler_unscale_and_clip(s, oa, 1.0, zero_write=True)
    assert hasattr(oa, "grad_scale") and not oc.zero_write_applies(oa)


# ---------------------------------------------------------------- where it does not apply: write mode
class _OwnStepAdam(torch.optim.Adam):
    def step(self, closure=None):
        return super().step(closure)


def _not_applicable_cases():
    def fused_adam(dtype=torch.float32):
        return lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True)

    def with_unfused_group(ps):
        opt = torch.optim.Adam(ps[:2], lr=1e-2, fused=True)
        opt.add_param_group({"params": ps[2:], "fused": False})
        return opt

    def with_foreign_grad_scale(ps):
        opt = torch.optim.Adam(ps, lr=1e-2, fused=True)
        opt.grad_scale = torch.tensor(1.0)
        return opt

    return {
        "not-fused": (torch.float32, lambda ps: torch.optim.Adam(ps, lr=1e-2)),
        "foreach-sgd": (torch.float32, lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True)),
        "float64": (torch.float64, fused_adam()),
        "unfused-group": (torch.float32, with_unfused_group),
        "foreign-grad-scale": (torch.float32, with_foreign_grad_scale),
        "own-step": (torch.float32, lambda ps: _OwnStepAdam(ps, lr=1e-2, fused=True)),
        "zero_write=False": (torch.float32, fused_adam()),
    }


@pytest.mark.parametrize("case", list(_not_applicable_cases()))
def test_falls_back_to_the_in_place_clip(bd, case):
    backend, device = bd
    dtype, make = _not_applicable_cases()[case]
    base = make_params(SHAPES, dtype, device, seed=5, scale=3.0, none_every=3)
    pa, pb = clone_params(base), clone_params(base)
    opt = make(pa)
    if case != "zero_write=False":
        assert not oc.zero_write_applies(opt)
    total = fastgrad.clip_optimizer_grad_norm_(opt, 0.5, zero_write=case != "zero_write=False", backend=backend)
    ref = fastgrad.clip_grad_norm_(pb, 0.5, backend=backend)
    assert torch.equal(total, ref)
    _assert_bits_equal(grads(pa), grads(pb), "grads written as clip_grad_norm_ writes them")
    assert oc._RECORDS.get(opt) is None  # nothing pending, no hooks registered


def test_sparse_grads_fall_back():
    """Sparse grads go to torch's clip, whatever it does (this torch cannot take the norm of a sparse CPU
    grad: both calls raise alike, before anything is written)."""
    emb = torch.nn.Embedding(10, 3, sparse=True)
    (emb(torch.tensor([1, 4, 4, 7])) ** 2).sum().backward()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    assert not oc.zero_write_applies(opt)
    outcomes = []
    for clip in (lambda: fastgrad.clip_optimizer_grad_norm_(opt, 0.1),
                 lambda: torch.nn.utils.clip_grad_norm_(emb.parameters(), 0.1)):
        try:
            outcomes.append(("ok", clip()))
        except Exception as e:  # noqa: BLE001 - torch's outcome, whatever it is
            outcomes.append((type(e), None))
    assert outcomes[0][0] == outcomes[1][0]
    if outcomes[0][0] == "ok":
        torch.testing.assert_close(outcomes[0][1], outcomes[1][1])


def test_no_grads_at_all():
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    opt = torch.optim.Adam(params, fused=True)
    total = fastgrad.clip_optimizer_grad_norm_(opt, 1.0)
    assert float(total) == 0.0
    opt.step()  # nothing to do, nothing pending


# ---------------------------------------------------------------- non-finite gradients
@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_nonfinite_grads_match_write_mode(opt_name, bad):
    """As torch's clip: a NaN norm gives a NaN coefficient (grad_scale NaN: every gradient NaN), an inf norm
    a zero coefficient (grad_scale inf: finite gradients become +-0, the inf ones NaN). Parameters,
    state and grads after the step are bit-identical to write mode's (NaN where NaN)."""
    (pa, oa), (pb, ob) = _twins(opt_name, torch.float32, "cpu")
    g = _new_grads(pa, 0, 2.0, "cpu")
    g[3][5] = bad
    _set_grads(pa, g)
    _set_grads(pb, g)
    ta = fastgrad.clip_optimizer_grad_norm_(oa, 0.5)
    tb = fastgrad.clip_grad_norm_(pb, 0.5)
    torch.testing.assert_close(ta, tb, rtol=0, atol=0, equal_nan=True)
    oa.step()
    ob.step()
    for what, xs, ys in (("params", pa, pb), ("grads", grads(pa), grads(pb)),
                         ("state", _opt_state(oa), _opt_state(ob))):
        for x, y in zip(xs, ys):
            torch.testing.assert_close(x.detach(), y.detach(), rtol=0, atol=0, equal_nan=True, msg=what)
    if bad != bad:
        assert all(x.isnan().all() for x in grads(pa))


def test_error_if_nonfinite_raises_before_handing_over():
    (pa, oa), _ = _twins("adam", torch.float32, "cpu")
    g = _new_grads(pa, 0, 2.0, "cpu")
    g[0][1, 1] = INF
    _set_grads(pa, g)
    with pytest.raises(RuntimeError, match="non-finite"):
        fastgrad.clip_optimizer_grad_norm_(oa, 0.5, error_if_nonfinite=True)
    rec = oc._RECORDS.get(oa)
    assert rec is None or rec.scale is None
    _assert_bits_equal(grads(pa), g, "grads untouched")


# ---------------------------------------------------------------- refusals
def test_refusals_name_the_fix():
    params = make_params([(4,), (3,)], torch.float32, "cpu")
    before = [g.clone() for g in grads(params)]
    opt = torch.optim.Adam(params, fused=True)
    with pytest.raises(TypeError, match=r"got parameters, not an optimizer.*clip_grad_norm_"):
        fastgrad.clip_optimizer_grad_norm_(params, 1.0)
    with pytest.raises(TypeError, match=r"got parameters, not an optimizer"):
        fastgrad.clip_optimizer_grad_norm_((p for p in params), 1.0)
    with pytest.raises(TypeError, match=r"got parameters, not an optimizer"):
        fastgrad.clip_optimizer_grad_norm_(torch.nn.Linear(2, 2), 1.0)
    with pytest.raises(TypeError, match=r"GradScaler.*scaler_unscale_and_clip"):
        fastgrad.clip_optimizer_grad_norm_(torch.amp.GradScaler("cpu"), 1.0)
    with pytest.raises(TypeError, match=r"must be a torch.optim.Optimizer"):
        fastgrad.clip_optimizer_grad_norm_("adam", 1.0)
    with pytest.raises(TypeError, match=r"zero_write must be True or False"):
        fastgrad.clip_optimizer_grad_norm_(opt, 1.0, zero_write="yes")
    with pytest.raises(ValueError, match="max_norm"):
        fastgrad.clip_optimizer_grad_norm_(opt, -1.0)
    with pytest.raises(ValueError, match="norm_type"):
        fastgrad.clip_optimizer_grad_norm_(opt, 1.0, NAN)
    _assert_bits_equal(grads(params), before, "grads untouched by refused calls")
    assert oc._RECORDS.get(opt) is None


# ---------------------------------------------------------------- other norms, other backends
@pytest.mark.parametrize("norm_type", [1.0, INF, 3.0], ids=["l1", "linf", "l3"])
def test_other_norms(bd, norm_type):
    backend, device = bd
    (pa, oa), (pb, ob) = _twins("adamw", torch.float32, device)
    g = _give_grads(0, 2.0, device, pa, pb)
    ta = fastgrad.clip_optimizer_grad_norm_(oa, 0.3, norm_type, backend=backend)
    total = fastgrad.get_total_norm(grads(pb), norm_type, backend=backend)
    assert torch.equal(ta, total)
    coef = torch.clamp(0.3 / (total + 1e-6), max=1.0)
    for x in grads(pb):
        x.copy_(x / coef.reciprocal())
    oa.step()
    ob.step()
    _assert_bits_equal(pa, pb, "params")


# ---------------------------------------------------------------- GPU
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_the_kernel_model_without_host_sync(dtype):
    """On the GPU (torch's CUDA fused AdamW): no host sync in the clip; float32 bit for bit the kernel model,
    bf16 held to the float64 oracle as in test_against_clip_grad_norm_then_step."""
    (pa, oa), (pb, ob), (pc, _) = _twins("adamw", dtype, "cuda", n=3)
    pc = [torch.nn.Parameter(p.detach().double()) for p in pc]
    oc64 = FUSED["adamw"](pc)
    for step in range(3):
        g = _give_grads(step, 2.0, "cuda", pa, pb)
        _set_grads(pc, [x.double() for x in g])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fastgrad.clip_optimizer_grad_norm_(oa, 0.5)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert oc.zero_write_applies(oa)
        oa.step()  # (torch's own step is not ours to hold to no-sync; the hooks read no tensor values)
        torch.nn.utils.clip_grad_norm_(pc, 0.5)  # the float64 oracle clips with torch, not with fastgrad
        oc64.step()
        if dtype == torch.float32:
            _model_clip_(pb, 0.5)
            _model_step(ob)
            _assert_bits_equal(pa, pb, f"params after step {step}")
        else:
            fastgrad.clip_grad_norm_(pb, 0.5)
            ob.step()
            for i, (x, y, z) in enumerate(zip(pa, pb, pc)):
                assert_max_error_within(x.detach(), y.detach(), z.detach(), dtype, f"param {i}, step {step}")


def test_zero_write_never_hands_over_a_sharded_or_torch_list(one_rank_group):
    """Only a plain list of dense real floating gradients is handed over: DTensor gradients (their clip writes the
    local shards after a collective) and gradients only torch's implementation reads are clipped in place."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    ps = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    for prm in ps:
        prm.grad = torch.randn(5)
    opt = torch.optim.Adam(ps, fused=True)
    assert oc.zero_write_applies(opt)
    mesh = DeviceMesh("cpu", [0])
    assert not oc.zero_write_applies(opt, [distribute_tensor(p.grad, mesh, [Replicate()]) for p in ps])
    assert not oc.zero_write_applies(opt, [ps[0].grad, torch.randn(5, dtype=torch.complex64)])
    assert not oc.zero_write_applies(opt, [ps[0].grad, torch.randn(5).to_sparse()])
