"""The decision rules (fastgrad/decide.py and the guard modes' rules built on it), each against a float64
reference written here, on inputs that sit between the rule and its nearest wrong variant: a norm exactly at
the threshold and one ulp above it, a coefficient that the clamp at 1 decides, a norm that overflows only in
the accumulation dtype, a non-finite step that must leave the mode's state alone, a 16-bit mean whose second
rounding would differ. Each rule is checked through every route that uses it (the one-call C++ clip, the
backend primitives, the AMP and zero-write paths, each read path of the step guard)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fastgrad
from fastgrad import decide
from fastgrad.optim_clip import clip_optimizer_grad_norm_

from . import oracle
from .helpers import bits

INF, NAN = math.inf, math.nan
CPU_BACKENDS = [b for b in ("torch", "cpu") if b in fastgrad.available_backends()]


def up(x: float) -> float:
    return math.nextafter(x, INF)


def down(x: float) -> float:
    return math.nextafter(x, -INF)


# ---------------------------------------------------------------- float64 references
def coef_ref(total: float, max_norm: float, eps: float = 1e-6) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient in float64: min(max_norm / (total + eps), 1), the quotient
    of a number by a tensor evaluated as torch does (reciprocal, then multiply)."""
    return min(max_norm * (1.0 / (total + eps)), 1.0)


def agc_ref(g_norm: float, w_norm: float, clip_factor: float, eps: float) -> float:
    """timm's AGC factor in float64: 1 where ||G|| < clip_factor * max(||W||, eps), else limit / max(||G||, 1e-6)."""
    limit = max(w_norm, eps) * clip_factor
    return 1.0 if g_norm < limit else limit / max(g_norm, 1e-6)


# ---------------------------------------------------------------- the functions themselves
@pytest.mark.parametrize("total,max_norm", [(1.0, 1.0), (2.0, 1.0), (down(1.0), 1.0), (1.0 - 2e-6, 1.0),
                                            (0.0, 0.5), (3.0, 0.0), (1e-7, 1e-6)])
def test_clip_coef_is_torch_formula_in_float64(total, max_norm):
    got = decide.clip_coef(torch.tensor(total, dtype=torch.float64), max_norm)
    assert got.item() == coef_ref(total, max_norm)


def test_clip_coef_boundaries():
    one = torch.tensor(1.0, dtype=torch.float64)
    # at the threshold the epsilon still clips a little (a variant without it, or one that compares
    # total > max_norm first, gives exactly 1)
    assert decide.clip_coef(one, 1.0).item() == 1.0 / (1.0 + 1e-6) < 1.0
    # just below the threshold the quotient exceeds 1 and the clamp makes it exactly 1
    below = torch.tensor(1.0 - 2e-6, dtype=torch.float64)
    assert 1.0 / (1.0 - 2e-6 + 1e-6) > 1.0 and decide.clip_coef(below, 1.0).item() == 1.0
    # the epsilon is 1e-6, not 1e-7 or 1e-5: visible in float32 at a norm of 1 (float32 arithmetic in
    # torch's order: the sum, its reciprocal, the product)
    f32 = decide.clip_coef(torch.tensor(1.0), 1.0)
    assert f32.dtype == torch.float32

    def coef32(eps):
        one = np.float32(1.0)
        return float(one * (one / (one + np.float32(eps))))

    assert f32.item() == coef32(1e-6) and coef32(1e-6) not in (coef32(1e-7), coef32(1e-5))
    assert decide.clip_coef(torch.tensor(NAN), 1.0).isnan()
    assert decide.clip_coef(torch.tensor(INF), 1.0).item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clip_coef_above_is_clip_coef_only_above_the_limit(dtype):
    """ZClip's form: clip_coef bit for bit where the norm is above the limit; 1 at the limit, within eps
    below it (where clip_coef already clips a little) and for a NaN norm (clip_coef: NaN)."""
    def t(x):
        return torch.tensor(x, dtype=dtype)

    limit = t(2.0)
    above = torch.nextafter(limit, t(INF)).item()  # one ulp of the dtype above the limit
    for total in (above, 2.5, 1e30, INF):
        got = decide.clip_coef_above(t(total), limit)
        assert torch.equal(bits(got), bits(decide.clip_coef(t(total), limit))) and got.item() < 1.0, total
    for total in (2.0, 2.0 - 5e-7, 0.0, NAN):
        assert decide.clip_coef_above(t(total), limit).item() == 1.0, total
    assert decide.clip_coef(t(2.0), limit).item() < 1.0 and decide.clip_coef(t(NAN), limit).isnan()
    assert decide.clip_coef_above(t(5.0), t(INF)).item() == 1.0  # no threshold: nothing clipped


def test_per_tensor_coef_is_the_clipped_total_over_the_total():
    gen = torch.Generator().manual_seed(4)
    per = torch.rand(7, generator=gen, dtype=torch.float64) * 3 + 0.1
    coefs = torch.rand(7, generator=gen, dtype=torch.float64)
    total = per.norm()
    want = math.sqrt(sum((c * n) ** 2 for c, n in zip(coefs.tolist(), per.tolist()))) / total.item()
    got = decide.per_tensor_coef(total, per, coefs)
    assert got.item() == pytest.approx(want, rel=1e-14)
    # not the mean coefficient, nor the norm of the coefficients alone
    assert abs(coefs.mean().item() - want) > 1e-3 and abs(coefs.norm().item() - want) > 1e-3
    assert decide.per_tensor_coef(total, per, torch.ones(7, dtype=torch.float64)).item() == pytest.approx(1.0)


def test_amp_factor_and_grad_scale():
    total = torch.tensor(4.0)
    inv = torch.tensor(2.0 ** -10)
    f = decide.amp_factor(total, 1.0, inv)
    assert f.item() == 2.0 ** -10 * torch.tensor(1.0 / (4.0 + 1e-6), dtype=torch.float32).item()
    assert decide.grad_scale(f).item() == (1.0 / f).item()


def test_nonfinite_verdict():
    t = torch.tensor([0.0, 1.0, 3.4e38, INF, -INF, NAN], dtype=torch.float32)
    assert decide.nonfinite(t).tolist() == [False, False, False, True, True, True]


@pytest.mark.parametrize("nonfinite,found,spike,want", [
    (False, None, None, 0.0), (True, None, None, 1.0), (False, 0.0, None, 0.0), (False, 1.0, None, 1.0),
    (True, 0.0, None, 1.0), (False, None, False, 0.0), (False, None, True, 1.0), (False, 1.0, True, 1.0),
    (False, 0.0, False, 0.0)])
def test_bad_step_is_the_union(nonfinite, found, spike, want):
    got = decide.bad_step(torch.tensor(nonfinite), None if found is None else torch.tensor(found),
                          None if spike is None else torch.tensor(spike))
    assert got.dtype == torch.float32 and got.shape == () and got.item() == want
    # the same verdict from a fused route's 0/1 float flag
    got = decide.bad_step(torch.tensor(float(nonfinite)), None if found is None else torch.tensor([found]),
                          None if spike is None else torch.tensor(float(spike)))
    assert got.item() == want


def test_spike_is_strict_finite_and_ready():
    ref = torch.tensor(2.0, dtype=torch.float64)
    yes, no = torch.tensor(True), torch.tensor(False)

    def sp(g, finite=yes, ready=None):
        return bool(decide.spike(torch.tensor(g, dtype=torch.float64), 4.0, ref, finite, ready))

    assert not sp(8.0) and sp(up(8.0)) and not sp(down(8.0))
    assert not sp(up(8.0), finite=no) and not sp(up(8.0), ready=no) and sp(up(8.0), ready=yes)
    per = torch.tensor([1.0, up(8.0)], dtype=torch.float64)  # per-tensor: any tensor above its reference
    assert bool(decide.spike(per, 4.0, torch.tensor([2.0, 2.0], dtype=torch.float64), yes))
    assert not bool(decide.spike(per, 4.0, torch.tensor([2.0, up(2.0)], dtype=torch.float64), yes))


# ---------------------------------------------------------------- the clip coefficient on every route
def _one(value: float, dtype=torch.float64):
    p = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
    p.grad = torch.tensor([value], dtype=dtype)
    return p


def _coef_f32(total: float, max_norm: float) -> float:
    return decide.clip_coef(torch.tensor(total, dtype=torch.float32), max_norm).item()


def _routes():
    """Every public clip that applies clip_grad_norm_'s coefficient: name -> fn(param, max_norm, backend)."""

    def plain(p, m, b):
        fastgrad.clip_grad_norm_([p], m, backend=b)

    def with_norm(p, m, b):
        fastgrad.clip_grads_with_norm_([p], m, fastgrad.get_total_norm([p.grad], backend=b), backend=b)

    def zero_write(p, m, b):
        opt = torch.optim.SGD([p], lr=1.0, fused=True)
        before = p.detach().clone()
        clip_optimizer_grad_norm_(opt, m, backend=b)
        opt.step()
        p.grad = (before - p.detach())  # the step the fused optimizer took is the clipped gradient
        with torch.no_grad():
            p.copy_(before)

    def amp(p, m, b):
        opt = torch.optim.SGD([p], lr=1.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(torch.ones(()))  # as a backward of a scaled loss would: the scale tensor exists
        p.grad.mul_(1024.0)
        fastgrad.scaler_unscale_and_clip(scaler, opt, m, backend=b)

    def guard(p, m, b):
        opt = torch.optim.SGD([p], lr=0.0)
        fastgrad.StepGuard(opt, m, backend=b).clip_()

    return {"clip_grad_norm_": plain, "clip_grads_with_norm_": with_norm, "clip_optimizer_grad_norm_": zero_write,
            "scaler_unscale_and_clip": amp, "StepGuard": guard}


# clip_optimizer_grad_norm_ with float64 gradients takes the write path (the fused kernels take a float32
# scale), which the clip_grad_norm_ cases cover: that pair is not generated.
_ROUTE_DTYPES = [(r, d) for r in _routes() for d in (torch.float32, torch.float64)
                 if not (r == "clip_optimizer_grad_norm_" and d == torch.float64)]


@pytest.mark.parametrize("route,dtype", _ROUTE_DTYPES,
                         ids=[f"{r}-{'fp32' if d == torch.float32 else 'fp64'}" for r, d in _ROUTE_DTYPES])
@pytest.mark.parametrize("backend", [None] + CPU_BACKENDS)
def test_clip_coefficient_on_every_route(route, backend, dtype):
    fn = _routes()[route]
    m = 1.5
    cases = [m, up(m), 2.0 * m, m - 3e-6]  # at, one ulp above, far above, just below (the clamp decides)
    for total in cases:
        t = torch.tensor(total, dtype=dtype).item()
        p = _one(t, dtype)
        fn(p, m, backend)
        coef = torch.tensor(coef_ref(t, m) if dtype == torch.float64 else _coef_f32(t, m), dtype=dtype)
        want = torch.tensor([t], dtype=dtype)
        # the fused optimizer divides by the handed-over scale, the others multiply by the coefficient
        want = want / coef.reciprocal() if route == "clip_optimizer_grad_norm_" else want * coef
        assert torch.equal(bits(p.grad), bits(want)), (route, backend, total, p.grad.item(), want.item())
    # the threshold clips a little and below it nothing moves: checked, not assumed
    assert coef_ref(m, m) < 1.0 and coef_ref(m - 3e-6, m) == 1.0


# ---------------------------------------------------------------- the non-finite verdict on every route
def _overflowing():
    """Finite float32 gradients whose float32 norm overflows."""
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3e38, 3e38])
    return p


@pytest.mark.parametrize("backend", [None] + CPU_BACKENDS)
def test_error_if_nonfinite_judges_the_norm(backend):
    for bad in (NAN, INF, -INF):
        p = _one(bad, torch.float32)
        with pytest.raises(RuntimeError, match="non-finite"):
            fastgrad.clip_grad_norm_([p], 1.0, error_if_nonfinite=True, backend=backend)
    p = _overflowing()
    with pytest.raises(RuntimeError, match="non-finite"):
        fastgrad.clip_grad_norm_([p], 1.0, error_if_nonfinite=True, backend=backend)
    assert p.grad.tolist() == pytest.approx([3e38, 3e38])  # checked before anything is written
    p = _one(1e19, torch.float32)  # a large finite norm is finite
    fastgrad.clip_grad_norm_([p], 1.0, error_if_nonfinite=True, backend=backend)


@pytest.mark.parametrize("route", ["cpu_write", "one_call", "general"])
def test_guard_skips_an_overflowed_norm_on_every_read_path(route, monkeypatch):
    from fastgrad.guard import read

    taken = []
    for name in ("cpu_write", "one_call", "general"):  # record the paths that served (returned a norm)
        def spy(*a, _f=getattr(read, name), _n=name, **k):
            out = _f(*a, **k)
            if out is not None:
                taken.append(_n)
            return out
        monkeypatch.setattr(read, name, spy)
    kw = {"cpu_write": {}, "one_call": {"backend": "torch"}, "general": {"mode": "autoclip"}}[route]
    p = _overflowing()
    opt = torch.optim.SGD([p], lr=1.0)
    guard = fastgrad.StepGuard(opt, 1.0, **kw)
    before = p.detach().clone()
    guard.clip_()
    opt.step()
    assert taken[0] == route, taken
    st = guard.state()
    assert st["skipped"] and st["nonfinite_steps"] == 1, st
    assert torch.equal(p.detach(), before)
    # and a finite norm just under the overflow is a healthy step on the same path
    p.grad = torch.tensor([1e19, 0.0])
    guard.clip_()
    opt.step()
    assert not guard.state()["skipped"]


def test_guard_counts_found_inf_under_a_scaler():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    guard = fastgrad.StepGuard(opt, 1.0)
    p.grad = torch.tensor([1.0, INF, 0.0])
    guard.clip_(scaler)
    scaler.step(opt)
    scaler.update()
    st = guard.state()
    assert st["skipped"] and st["nonfinite_steps"] == 1
    assert torch.equal(p.detach(), torch.zeros(3))


# ---------------------------------------------------------------- the guard modes' rules
def _guard_run(norms, backend=None, **kw):
    """Feed each norm as a one-element float64 gradient (its norm is exact); per step: (skipped, stats)."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.0)
    guard = fastgrad.StepGuard(opt, backend=backend, **kw)
    out = []
    for g in norms:
        p.grad = torch.tensor([g], dtype=torch.float64)
        guard.clip_()
        opt.step()
        st = guard.state()
        out.append((bool(st["skipped"]), st["coef"], {k: v.tolist() for k, v in guard.state_dict()["stats"].items()}))
    return out


@pytest.mark.parametrize("backend", [None] + CPU_BACKENDS)
def test_norm_mode_spike_rule_and_reference_update(backend):
    k, alpha, warm = 4.0, 0.5, 3
    # warm-up 1, 2, (NaN: not counted), 3 -> mean 2; then: 100 (a spike the moment the reference is ready),
    # 20 = k * 5 exactly (not a spike), one ulp above k * 12.5 (a spike), 1e6 (a spike whose own value must
    # not reach the reference), inf (non-finite: the state does not move)
    norms = [1.0, 2.0, NAN, 3.0, 100.0, 20.0, up(50.0), 1e6, INF, 0.5]
    want = oracle.norm_mode_steps(norms, k, alpha, warm)
    assert [w[0] for w in want] == [False] * 4 + [True, False, True, True, False, False]
    got = _guard_run(norms, backend, max_norm=1.0, skip_factor=k, alpha=alpha, warmup_steps=warm)
    for i, ((skipped, _, stats), (spike, n, mean), g) in enumerate(zip(got, want, norms)):
        assert skipped == (spike or not math.isfinite(g)), i
        assert stats["n"] == n and stats["mean"] == mean, (i, stats, n, mean)


def test_zclip_rules_at_their_thresholds():
    warm = [0.5, 1.5, 0.5, 1.5]  # mean 1, std 0.5 after the warm-up: z = (g - 1) / (0.5 + eps)
    # a spike (skip_factor) is strictly above k times the EMA mean
    for g, spike in ((4.0, False), (up(4.0), True)):
        out = _guard_run(warm + [g], mode="zclip", warmup_steps=4, skip_factor=4.0)
        assert out[-1][0] is spike, g
    # the z-score: just above z_thresh clips to the paper's threshold, just below does not; the first step
    # after the warm-up already uses the statistics
    std = 0.5
    edge = 1.0 + 2.5 * (std + 1e-6)  # z == z_thresh (eps=1e-6 included)
    g_hi, g_lo = edge * (1 + 1e-9), edge * (1 - 1e-9)
    z = (g_hi - 1.0) / (std + 1e-6)
    thr = 1.0 + 2.5 * std / (z / 2.5)
    out = _guard_run(warm + [g_hi], mode="zclip", warmup_steps=4)
    assert out[4][1] == pytest.approx(thr / (g_hi + 1e-6), rel=1e-12) and out[4][1] < 1.0
    assert _guard_run(warm + [g_lo], mode="zclip", warmup_steps=4)[4][1] == 1.0
    # the hard cap: a norm exactly at max_norm is not clipped, one ulp above is
    out = _guard_run([2.0, up(2.0)], mode="zclip", max_norm=2.0, warmup_steps=4)
    assert out[0][1] == 1.0
    assert out[1][1] == pytest.approx(2.0 / (up(2.0) + 1e-6), rel=1e-12) and out[1][1] < 1.0


def test_autoclip_rules_at_their_thresholds():
    ones = [1.0] * 9  # the 10th percentile of nine 1s and the new norm is 1
    for g, spike in ((4.0, False), (up(4.0), True)):
        out = _guard_run(ones + [g], mode="autoclip", skip_factor=4.0)
        assert out[-1][0] is spike, g
    # at the threshold the coefficient is clip_grad_norm_'s, epsilon included
    out = _guard_run(ones, mode="autoclip")
    assert out[-1][1] == pytest.approx(coef_ref(1.0, 1.0), rel=1e-12) and out[-1][1] < 1.0
    # a non-finite norm enters neither the history nor the spike count
    out = _guard_run([1.0, NAN, 1.0], mode="autoclip", history_size=4)
    assert out[1][0] and out[2][2]["n"] == 2


def test_adagc_rules_at_their_thresholds():
    warm = [0.5, 0.5, 0.5]  # gamma = 0.5 after the warm-up (coefficients 1: total + eps far below max_norm)
    for g, spike in ((2.0, False), (up(2.0), True)):
        out = _guard_run(warm + [g], mode="adagc", warmup_steps=3, skip_factor=4.0)
        assert out[-1][0] is spike, g
        assert out[2][2]["gamma"] == [0.5]
    # per tensor after the warm-up: min(lambda_rel * gamma / (||g|| + 1e-8), 1) (the reported coefficient is
    # the clipped total over the total: h to within an ulp)
    g = 1.05 * 0.5
    out = _guard_run(warm + [g], mode="adagc", warmup_steps=3)
    assert out[-1][1] == pytest.approx(1.05 * 0.5 / (g + 1e-8), rel=1e-13) and out[-1][1] < 1.0
    # in the warm-up: the global coefficient with the same epsilon
    out = _guard_run([1.0], mode="adagc", max_norm=1.0, warmup_steps=3)
    assert out[0][1] == pytest.approx(1.0 / (1.0 + 1e-8), rel=1e-13) and out[0][1] < 1.0


# ---------------------------------------------------------------- AGC and GC
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("g_norm,why", [
    (5e-7, "the 1e-6 floor: the ratio divides by 1e-6, not by the norm"),
    (1e-10, "a norm exactly at the limit clips"),
    (down(1e-10), "a norm just below the limit is untouched"),
    (3e-6, "above the floor the ratio divides by the norm")])
def test_agc_floor_and_threshold(backend, g_norm, why):
    clip_factor, eps = 0.01, 1e-8  # limit = 0.01 * max(0, 1e-8) = 1e-10 for an all-zero weight
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    p.grad = torch.tensor([g_norm], dtype=torch.float64)
    fastgrad.adaptive_clip_grad_([p], clip_factor, eps, backend=backend)
    want = g_norm * agc_ref(g_norm, 0.0, clip_factor, eps)
    assert p.grad.item() == pytest.approx(want, rel=1e-15, abs=0), why
    if g_norm == down(1e-10):
        assert p.grad.item() == g_norm


def test_agc_sparse_uses_the_same_floor():
    w = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    w.grad = torch.sparse_coo_tensor([[1]], torch.tensor([[5e-7, 0.0]], dtype=torch.float64), (3, 2))
    fastgrad.adaptive_clip_grad_([w], 0.01, 1e-8)
    assert w.grad.to_dense()[1, 0].item() == pytest.approx(5e-7 * agc_ref(5e-7, 0.0, 0.01, 1e-8), rel=1e-15)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gc_16bit_mean_is_rounded_once(backend, dtype):
    rows = torch.tensor([[1.0, 2.0, 2.0], [3.0, 5.0, 5.0], [0.1, 0.7, 1.3]], dtype=torch.float64).to(dtype)
    p = torch.nn.Parameter(torch.zeros(3, 3, dtype=dtype))
    p.grad = rows.clone()
    fastgrad.centralize_gradient_([p], backend=backend)
    # float64 reference: the float32 mean (the row sums are exact), x - mean (exact here), rounded once
    x = rows.to(torch.float64)
    mean32 = x.mean(dim=1, keepdim=True).to(torch.float32).to(torch.float64)
    want = (x - mean32).to(dtype)
    twice = (x - mean32.to(dtype).to(torch.float64)).to(dtype)  # the mean rounded to 16 bits first
    assert not torch.equal(bits(want), bits(twice))  # the inputs tell the two apart
    assert torch.equal(bits(p.grad), bits(want))
