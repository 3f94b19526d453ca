"""The guard's modes against plain float64 transcriptions of their formulas (ZClip, AutoClip, AdaGC, the
"norm" mode's spike rule), written here from the papers, on recorded norm sequences with warm-up, spikes and
NaNs; the modes under a GradScaler; checkpoint and resume of their device state."""

from __future__ import annotations

import math

import pytest
import torch

from fastgrad import StepGuard

from .guard_cases import INF, NAN, _params, _same, _scaled, _set_grads, _snapshot
from . import oracle
from .helpers import bits


# ---------------------------------------------------------------- adaptive modes vs float64 references
def _drive(guard, param, norms):
    """Feed ``norms`` as the gradient norm of one float64 parameter; return the coefficients applied."""
    direction = torch.randn(param.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    direction /= direction.norm()
    coefs = []
    for n in norms:
        param.grad = direction * n if math.isfinite(n) else direction * 1.0 + n
        g0 = param.grad.clone()
        guard.clip_()
        guard.optimizer.step()
        coefs.append(float(param.grad.norm() / g0.norm()) if math.isfinite(n) else NAN)
    return coefs


def _norm_sequence(seed, n=80):
    gen = torch.Generator().manual_seed(seed)
    base = (1.0 + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)).tolist()
    for i in (5, 31, 37):  # spikes, one inside the warm-up
        base[i] *= 10.0
    for i in (12, 33):
        base[i] = NAN
    base[34] = INF
    return base


def _zclip_ref(norms, alpha=0.97, z=2.5, warm=25, eps=1e-6, max_norm=None, factor=1.0):
    buf, mean, var, out = [], None, None, []
    for g in norms:
        if not math.isfinite(g):
            out.append(NAN)  # skipped: statistics untouched
            continue
        if mean is None:
            limit = max_norm if max_norm is not None else INF
            buf.append(g)
            if len(buf) == warm:
                mean = sum(buf) / warm
                var = sum((x - mean) ** 2 for x in buf) / warm
        else:
            std = math.sqrt(var)
            zs = (g - mean) / (std + eps)
            thr = None
            if zs > z:
                thr = (mean + z * std / (zs / z)) * factor
            limit = thr if thr is not None else g
            if max_norm is not None:
                limit = min(limit, max_norm)
            x = thr if thr is not None else g
            mean = alpha * mean + (1 - alpha) * x
            var = alpha * var + (1 - alpha) * (x - mean) ** 2
        out.append(limit / (g + 1e-6) if g > limit else 1.0)
    return out


@pytest.mark.parametrize("max_norm", [None, 1.5])
def test_zclip_matches_reference(max_norm):
    norms = _norm_sequence(1)
    p = torch.nn.Parameter(torch.zeros(37, dtype=torch.float64))
    guard = StepGuard(torch.optim.SGD([p], lr=0.0), max_norm, mode="zclip")
    got = _drive(guard, p, norms)
    want = _zclip_ref(norms, max_norm=max_norm)
    assert sum(1 for w in want if math.isfinite(w) and w < 1) >= 2  # the sequence does clip
    for i, (a, b) in enumerate(zip(got, want)):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-12), i


def _percentile(xs, q):
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _autoclip_ref(norms, q=10.0, history=None):
    hist, out = [], []
    for g in norms:
        if not math.isfinite(g):
            out.append(NAN)
            continue
        hist.append(g)
        if history is not None:
            hist = hist[-history:]
        thr = _percentile(hist, q)
        out.append(min(thr / (g + 1e-6), 1.0))
    return out


@pytest.mark.parametrize("q,history", [(10.0, 1000), (50.0, 7)])
def test_autoclip_matches_reference(q, history):
    norms = _norm_sequence(2, n=40)
    p = torch.nn.Parameter(torch.zeros(11, dtype=torch.float64))
    guard = StepGuard(torch.optim.SGD([p], lr=0.0), mode="autoclip", percentile=q, history_size=history)
    got = _drive(guard, p, norms)
    want = _autoclip_ref(norms, q, history)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-12), i


def _adagc_ref(seq, lam_abs=1.0, lam_rel=1.05, beta=0.98, warm=100, eps=1e-8):
    """seq: per step, a list of per-tensor norms. Returns per step the per-tensor coefficients."""
    gamma, n, out = None, 0, []
    for per in seq:
        total = math.sqrt(sum(x * x for x in per))
        if not math.isfinite(total):
            out.append(None)
            continue
        if gamma is None:
            gamma = [INF] * len(per)
        if n < warm:
            h = [min(lam_abs / (total + eps), 1.0)] * len(per)
            gamma = [min(gm, hi * x) for gm, hi, x in zip(gamma, h, per)]
        else:
            h = [min(lam_rel * gm / (x + eps), 1.0) for gm, x in zip(gamma, per)]
            gamma = [beta * gm + (1 - beta) * hi * x for gm, hi, x in zip(gamma, h, per)]
        n += 1
        out.append(h)
    return out


def test_adagc_matches_reference():
    gen = torch.Generator().manual_seed(4)
    shapes = [(13,), (4, 5), (1,)]
    ps = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shapes]
    dirs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    dirs = [d / d.norm() for d in dirs]
    steps = 40
    seq = [[float(0.3 * (k + 1) * (1 + 0.1 * torch.randn((), generator=gen, dtype=torch.float64)))
            for k in range(3)] for _ in range(steps)]
    seq[15][1] *= 20  # a one-tensor spike after warm-up
    seq[3][0] *= 20   # one inside the warm-up
    seq[20][2] = NAN
    guard = StepGuard(torch.optim.SGD(ps, lr=0.0), mode="adagc", warmup_steps=8)
    want = _adagc_ref(seq, warm=8)
    for t, per in enumerate(seq):
        for p, d, x in zip(ps, dirs, per):
            p.grad = d * x if math.isfinite(x) else d + x
        g0 = [p.grad.clone() for p in ps]
        guard.clip_()
        guard.optimizer.step()
        if want[t] is None:
            assert guard.last_step_skipped()
            continue
        got = [float(p.grad.norm() / g.norm()) for p, g in zip(ps, g0)]
        assert got == pytest.approx(want[t], rel=1e-9), t
    assert want[15][1] < 0.1  # the spike tensor was clipped hard


def _norm_spike_ref(norms, k, alpha=0.97, warm=25):
    """mode="norm" with skip_factor=k, in plain float64 (tests/oracle.py): per step, was it skipped as a spike?"""
    return [spike for spike, _, _ in oracle.norm_mode_steps(norms, k, alpha, warm)]


@pytest.mark.parametrize("k,warm", [(10.0, 25), (3.0, 4)])
def test_norm_mode_spike_rule_matches_reference(k, warm):
    """The spike reference of mode="norm" is the run's own norm level (warm-up mean, then EMA), not max_norm."""
    norms = _norm_sequence(5, n=70)
    norms[50] *= 40.0  # a spike after every warm-up
    p = torch.nn.Parameter(torch.zeros(29, dtype=torch.float64))
    guard = StepGuard(torch.optim.SGD([p], lr=0.0), 1.0, skip_factor=k, warmup_steps=warm)
    got = []
    direction = torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    direction /= direction.norm()
    for g in norms:
        p.grad = direction * g if math.isfinite(g) else direction + g
        guard.clip_()
        guard.optimizer.step()
        got.append(guard.state()["skipped"] and math.isfinite(g))
    want = _norm_spike_ref(norms, k, warm=warm)
    assert want[50] and sum(want) >= (1 if k >= 10 else 3)  # k=3 also skips the 10x spikes after warm-up
    assert got == want


def test_norm_mode_never_skips_a_healthy_run_above_max_norm():
    """A run whose norms sit far above max_norm (common early in training) is clipped, never skipped: the
    spike reference is the run's own level. A lasting 30x shift of that level is followed after a few skips
    instead of skipping forever."""
    p = torch.nn.Parameter(torch.zeros(16))
    opt = torch.optim.SGD([p], lr=1e-3)
    guard = StepGuard(opt, 1.0, skip_factor=10.0)
    gen = torch.Generator().manual_seed(0)
    for step in range(200):
        level = 12.0 if step < 100 else 360.0
        p.grad = torch.randn(16, generator=gen) / 4.0 * level
        guard.clip_()
        opt.step()
    st = guard.state()
    assert st["nonfinite_steps"] == 0
    assert 1 <= st["skipped_steps"] <= 15, st  # only the first steps of the shift
    assert st["clipped_steps"] == 200 - st["skipped_steps"]
    assert st["consecutive_skipped"] == 0


def test_adagc_spike_skip_and_zclip_skip_factor():
    p = torch.nn.Parameter(torch.zeros(9, dtype=torch.float64))
    guard = StepGuard(torch.optim.SGD([p], lr=0.0), mode="zclip", skip_factor=5.0, warmup_steps=5)
    norms = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 8.0, 1.0]
    _drive(guard, p, norms)
    st = guard.state()
    assert st["spike_steps"] == 1 and st["skipped_steps"] == 1


@pytest.mark.parametrize("mode", ["norm", "zclip", "autoclip", "adagc"])
def test_modes_under_a_gradscaler_see_the_unscaled_norms(mode):
    """With a GradScaler (power-of-two scale), every mode clips the unscaled gradients as it would without
    one, and an overflow is skipped and backs the scale off."""
    kw = dict(max_norm=1.0) if mode in ("norm", "adagc") else {}
    if mode in ("zclip", "adagc"):
        kw["warmup_steps"] = 3
    a, b = _params(), _params()
    ga = StepGuard(torch.optim.SGD(a, lr=0.1), mode=mode, **kw)
    gb = StepGuard(torch.optim.SGD(b, lr=0.1), mode=mode, **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    for step in range(8):
        _set_grads(a, step, scale=1.0 + step % 3)
        _scaled(b, scaler, step, scale=1.0 + step % 3)
        ta = ga.clip_()
        tb = gb.clip_(scaler)
        assert float(tb) == pytest.approx(float(ta), rel=1e-6)
        for x, y in zip(a, b):
            torch.testing.assert_close(y.grad, x.grad, rtol=1e-6, atol=0)
        ga.optimizer.step()
        scaler.step(gb.optimizer)
        scaler.update()
    _scaled(b, scaler, 9, poison=INF)
    before = _snapshot(b, gb.optimizer)
    gb.clip_(scaler)
    scaler.step(gb.optimizer)
    scaler.update()
    assert _same(_snapshot(b, gb.optimizer), before) and scaler.get_scale() == 512.0
    assert gb.state()["nonfinite_steps"] == 1


@pytest.mark.parametrize("mode", ["zclip", "autoclip", "adagc"])
def test_state_dict_resumes_the_statistics(mode):
    """A guard rebuilt from state_dict() continues exactly as the original (checkpoint / resume)."""
    kw = {"warmup_steps": 3} if mode in ("zclip", "adagc") else {"history_size": 5}
    a, b = _params(), _params()
    ga = StepGuard(torch.optim.SGD(a, lr=0.1), mode=mode, **kw)
    for step in range(6):
        _set_grads(a, step, scale=1.0 + step % 3)
        ga.clip_()
        ga.optimizer.step()
    gb = StepGuard(torch.optim.SGD(b, lr=0.1), mode=mode, **kw)
    gb.optimizer.load_state_dict(ga.optimizer.state_dict())
    for x, y in zip(a, b):
        y.data.copy_(x.data)
    gb.load_state_dict(ga.state_dict())
    for step in range(6, 10):
        _set_grads(a, step, scale=1.0 + 3 * (step == 8))
        _set_grads(b, step, scale=1.0 + 3 * (step == 8))
        assert torch.equal(bits(ga.clip_()), bits(gb.clip_()))
        for x, y in zip(a, b):
            assert torch.equal(bits(x.grad), bits(y.grad))
        ga.optimizer.step()
        gb.optimizer.step()
    assert ga.state() == gb.state()
    with pytest.raises(ValueError, match="mode"):
        StepGuard(torch.optim.SGD(_params(), lr=0.1), 1.0).load_state_dict(ga.state_dict())
