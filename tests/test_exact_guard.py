"""exact=True on scaler_unscale_and_clip and StepGuard: the returned norm is the correctly rounded norm of the
unscaled gradients (the fractions oracle's; get_total_norm(exact=True)'s bits), the clip and every decision come
from it, and the scaler's state is what unscale_ leaves. The controls are lists whose default norm is 1 ulp off
the exact one, so the returned bits tell the two routes apart."""

from __future__ import annotations

import math

import pytest
import torch

import fastgrad
from fastgrad.guard import StepGuard, guard_for

from .exact_oracle import correctly_rounded

try:
    from torch.amp.grad_scaler import GradScaler, OptState
except ImportError:  # pragma: no cover
    from torch.cuda.amp.grad_scaler import GradScaler, OptState  # type: ignore[no-redef]

# built as tests/test_exact.py builds midpoint cases (k = 9447364, q = -2, "above"): the exact 2-norm lies a
# hair above the midpoint between two float32 neighbours, the default rounds it down by 1 ulp
MIDPOINT = [2361841.0, 768.375, 7.75, 0.25, 0.0, 1.1641532182693481e-10]


class Holder:
    def __init__(self, grad):
        self.grad = grad


def _bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _vals(ts):
    return [v for t in ts for v in t.double().reshape(-1).tolist()]


def _control():
    return [torch.tensor(MIDPOINT[:2]), torch.tensor(MIDPOINT[2:])]


def _grads(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * 10.0 ** (i - 1) for i, n in enumerate((300, 7, 5000))]


def _scaler(scale):
    s = GradScaler("cpu", init_scale=scale)
    s._lazy_init_scale_growth_tracker(torch.device("cpu"))
    return s


def _setup(grads, scale):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for prm, g in zip(params, grads):
        prm.grad = g * scale
    return params, torch.optim.SGD(params, lr=0.1)


def _unscaled(grads, scaler, scale):
    inv = scaler._scale.double().reciprocal().float()
    return [(g * scale) * inv for g in grads]  # what unscale_ writes


def test_the_control_list_tells_the_routes_apart():
    t = _control()
    want = correctly_rounded(MIDPOINT, 2.0, torch.float32)
    assert _bits(fastgrad.get_total_norm(t, exact=True)) == _bits(want)
    assert _bits(fastgrad.get_total_norm(t)) != _bits(want)


# ------------------------------------------------------------------------------------------- the AMP clip
@pytest.mark.parametrize("exact", [True, False])
def test_scaler_unscale_and_clip_exact_is_the_oracle(exact):
    grads = _control()
    scale = 2.0 ** 10  # a power of two: the unscaled values are the grads themselves
    params, opt = _setup(grads, scale)
    scaler = _scaler(scale)
    got = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, exact=exact)
    want = correctly_rounded(_vals(grads), 2.0, torch.float32)
    assert (_bits(got) == _bits(want)) is exact  # the default's norm is 1 ulp off on this list
    state = scaler._per_optimizer_states[id(opt)]
    assert state["stage"] is OptState.UNSCALED
    assert [f.item() for f in state["found_inf_per_device"].values()] == [0.0]
    if exact:  # clipped as clip_grad_norm_(exact=True) clips the unscaled grads
        ref = [Holder(g.clone()) for g in grads]
        fastgrad.clip_grad_norm_(ref, 0.5, exact=True)
        assert all(_bits(prm.grad) == _bits(r.grad) for prm, r in zip(params, ref))
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf])
def test_scaler_unscale_and_clip_exact_any_scale(p):
    grads = _grads(1)
    scale = 3.0  # 1/3 is not a power of two: g * inv_scale is rounded, the norm is that of what unscale_ wrote
    params, opt = _setup(grads, scale)
    scaler = _scaler(scale)
    got = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, p, exact=True)
    un = _unscaled(grads, scaler, scale)
    assert _bits(got) == _bits(fastgrad.get_total_norm(un, p, exact=True))
    if p == math.inf:  # a max of rounded products is exact already: the default route, its folded write
        return
    ref = [Holder(u) for u in un]
    fastgrad.clip_grad_norm_(ref, 0.5, p, exact=True)
    assert all(_bits(prm.grad) == _bits(r.grad) for prm, r in zip(params, ref))


def test_scaler_unscale_and_clip_exact_overflow_skips_the_step():
    grads = _grads(2)
    grads[2][3] = math.inf
    params, opt = _setup(grads, 4.0)
    scaler = _scaler(4.0)
    got = fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, exact=True)
    assert not math.isfinite(got.item())
    state = scaler._per_optimizer_states[id(opt)]
    assert [f.item() for f in state["found_inf_per_device"].values()] == [1.0]
    scaler.step(opt)  # skipped
    assert all(torch.equal(prm, torch.zeros_like(prm)) for prm in params)
    scaler.update()
    assert scaler.get_scale() == 2.0


def test_scaler_unscale_and_clip_exact_error_if_nonfinite():
    """A non-finite exact norm raises as unscale_ + clip_grad_norm_(error_if_nonfinite=True): the gradients
    unscaled but not clipped, the scaler state recorded."""
    grads = _grads(6)
    grads[1][0] = math.nan
    params, opt = _setup(grads, 4.0)
    scaler = _scaler(4.0)
    with pytest.raises(RuntimeError, match="non-finite"):
        fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, exact=True, error_if_nonfinite=True)
    un = _unscaled(grads, scaler, 4.0)
    assert all(_bits(prm.grad) == _bits(u) for prm, u in zip(params, un))
    state = scaler._per_optimizer_states[id(opt)]
    assert state["stage"] is OptState.UNSCALED
    assert [f.item() for f in state["found_inf_per_device"].values()] == [1.0]


def test_scaler_unscale_and_clip_exact_rejects_before_any_work():
    grads = _grads(3)
    params, opt = _setup(grads, 2.0)
    scaler = _scaler(2.0)
    before = [prm.grad.clone() for prm in params]
    with pytest.raises(ValueError, match="exact=True supports norm_type 1, 2 and inf"):
        fastgrad.scaler_unscale_and_clip(scaler, opt, 0.5, 3.0, exact=True)
    assert all(_bits(prm.grad) == _bits(b) for prm, b in zip(params, before))
    assert id(opt) not in scaler._per_optimizer_states or \
        scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY


# ------------------------------------------------------------------------------------------- the step guard
@pytest.mark.parametrize("use_scaler", [False, True])
@pytest.mark.parametrize("exact", [True, False])
def test_guard_exact_is_the_oracle(exact, use_scaler):
    grads = _control()
    scale = 2.0 ** 6 if use_scaler else 1.0
    params, opt = _setup(grads, scale)
    guard = StepGuard(opt, 0.5, exact=exact)
    got = guard.clip_(_scaler(scale) if use_scaler else None)
    want = correctly_rounded(_vals(grads), 2.0, torch.float32)
    assert (_bits(got) == _bits(want)) is exact  # the control: the default route is 1 ulp off
    if exact:
        ref = [Holder(g.clone()) for g in grads]
        fastgrad.clip_grad_norm_(ref, 0.5, exact=True)
        assert all(_bits(prm.grad) == _bits(r.grad) for prm, r in zip(params, ref))


def test_guard_exact_zero_write_without_a_scaler():
    """A fused optimizer and no scaler: the exact norm's coefficient is handed to the step (nothing written),
    the same bits whatever the order of the optimizer's list."""
    grads = _control()
    out = []
    for order in (1, -1):
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for prm, g in zip(params, grads):
            prm.grad = g.clone()
        opt = torch.optim.Adam(params[::order], lr=0.1, fused=True)
        got = StepGuard(opt, 0.5, exact=True).clip_()
        assert _bits(got) == _bits(correctly_rounded(_vals(grads), 2.0, torch.float32))
        assert all(_bits(prm.grad) == _bits(g) for prm, g in zip(params, grads))  # handed over, not written
        opt.step()
        out.append(b"".join(_bits(prm) for prm in params))
    assert out[0] == out[1]


@pytest.mark.parametrize("mode", ["norm", "zclip", "autoclip", "adagc"])
def test_guard_exact_decisions_do_not_depend_on_the_layout(mode):
    """Twin runs over the same values, laid out in a different order and split differently: the same norms,
    the same spike skip, the same parameters, bit for bit; each norm the oracle's."""
    base = _grads(5)
    kw = dict(skip_factor=2.0, warmup_steps=2) if mode in ("norm", "zclip") else {}
    if mode == "adagc":
        kw = dict(warmup_steps=2)
    runs = []
    for layout in ("as_is", "reversed"):
        w = [torch.nn.Parameter(torch.zeros_like(g)) for g in base]
        opt = torch.optim.SGD(w, lr=0.01)
        guard = StepGuard(opt, 5.0 if mode != "autoclip" else None, mode=mode, exact=True, **kw)
        norms, steps = [], []
        for step in range(6):
            k = 50.0 if step == 4 else 1.0 + 0.01 * step  # a spike at step 4
            gs = [g * k for g in base]
            for prm, g in zip(w, gs):
                prm.grad = g.clone()
            if layout == "reversed":  # the same values, another order of the optimizer's list
                opt.param_groups[0]["params"] = list(reversed(w))
            norms.append(guard.clip_())
            assert _bits(norms[-1]) == _bits(correctly_rounded(_vals(gs), 2.0, torch.float32))
            before = [prm.detach().clone() for prm in w]
            opt.step()
            steps.append(all(torch.equal(b, prm) for b, prm in zip(before, w)))
            opt.param_groups[0]["params"] = w
        runs.append((b"".join(_bits(n) for n in norms), steps, b"".join(_bits(prm) for prm in w)))
    assert runs[0] == runs[1]
    if mode in ("norm", "zclip"):
        assert runs[0][1][4] and not any(runs[0][1][:4])  # the spike was skipped, the others taken


def test_guard_exact_options_are_checked_before_anything():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="norm_type 1, 2 and inf"):
        StepGuard(opt, 1.0, norm_type=3.0, exact=True)
    with pytest.raises(TypeError, match="exact must be True or False"):
        StepGuard(opt, 1.0, exact="yes")
    assert guard_for(opt) is None
    StepGuard(opt, 1.0, norm_type=math.inf, exact=True)  # inf is a max, exact already
