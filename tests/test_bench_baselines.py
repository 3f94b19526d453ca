"""The benchmark's torch baselines compute what they claim: timm's AGC as transcribed, the GC authors' formula and
the foreach statistics against float64 oracles, and every baseline of an op against fastgrad's result for it
(a baseline that computed something else would make its speedup meaningless)."""

from __future__ import annotations

import pytest
import torch

import fastgrad
from fastgrad.benchmark import ops as benchmark_ops
from fastgrad.benchmark import workloads as benchmark_workloads

SHAPES = [(7, 5), (13,), (6, 3, 3, 3), (1, 9), (5, 1), (4, 2, 3)]


def _params(dtype=torch.float32, seed=0, grad_scale=None):
    """Random parameters with random gradients of mixed shapes; ``grad_scale`` per tensor makes some AGC units
    clip and others not."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, s in enumerate(SHAPES):
        p = torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).to(dtype))
        g = torch.randn(s, generator=gen) * (grad_scale[i] if grad_scale else 1e-3)
        if len(s) > 1:
            g[0] *= 100.0  # the first unit of every matrix is far over its limit
        p.grad = g.to(dtype)
        params.append(p)
    return params


def _unit_norm64(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    if x.ndim <= 1:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)


def agc_oracle(params, clip_factor, eps):
    """AGC in float64: per unit, the gradient scaled to clip_factor * max(|W|, eps) where its norm is above it."""
    out = []
    for p in params:
        g = p.grad.double()
        limit = _unit_norm64(p.detach()).clamp(min=eps) * clip_factor
        gn = _unit_norm64(g)
        out.append(torch.where(gn < limit, g, g * (limit / gn.clamp(min=1e-6))))
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_timm_agc_transcription_matches_a_float64_oracle(dtype, tol):
    params = _params(dtype)
    ref = agc_oracle(params, benchmark_ops.AGC_CLIP_FACTOR, benchmark_ops.AGC_EPS)
    orig = [p.grad.clone() for p in params]
    benchmark_ops.timm_adaptive_clip_grad(params, benchmark_ops.AGC_CLIP_FACTOR, benchmark_ops.AGC_EPS)
    clipped_units = 0
    for p, r, o in zip(params, ref, orig):
        assert p.grad.dtype == dtype
        torch.testing.assert_close(p.grad.double(), r, rtol=tol, atol=0)
        clipped_units += int((p.grad != o).flatten(1).any(1).sum()) if p.grad.ndim > 1 else int((p.grad != o).any())
    # the case is not vacuous: units clipped, and units left untouched bit for bit
    assert clipped_units >= 4
    assert any(torch.equal(p.grad[1:], o[1:]) for p, o in zip(params, orig) if p.grad.ndim > 1)


def test_timm_agc_transcription_keeps_timms_interface():
    """timm's signature and behaviour at the edges: one tensor accepted, a parameter without grad skipped."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3)
    q = torch.nn.Parameter(torch.randn(3))
    ref = agc_oracle([p], 0.01, 1e-3)[0]
    benchmark_ops.timm_adaptive_clip_grad(p)  # a single tensor, timm's defaults (clip_factor 0.01, eps 1e-3)
    torch.testing.assert_close(p.grad.double(), ref, rtol=2e-6, atol=0)
    benchmark_ops.timm_adaptive_clip_grad([q, p])  # q has no grad
    assert q.grad is None


def test_own_agc_loop_equals_the_timm_transcription_bit_for_bit():
    a, b = _params(seed=3), _params(seed=3)
    benchmark_ops.timm_adaptive_clip_grad(a, benchmark_ops.AGC_CLIP_FACTOR, benchmark_ops.AGC_EPS)
    benchmark_ops.agc_loop(b)
    assert all(torch.equal(x.grad, y.grad) for x, y in zip(a, b))


def test_official_gc_matches_a_float64_oracle():
    params = _params(seed=5, grad_scale=[1.0] * len(SHAPES))
    with torch.no_grad():
        for p in params:
            p.grad.add_(0.3)  # a mean far from zero, so centralizing changes every element of a matrix
    orig = [p.grad.clone() for p in params]
    benchmark_ops.official_gc(params)
    for p, o in zip(params, orig):
        if o.ndim <= 1:
            assert torch.equal(p.grad, o)  # vectors untouched
            continue
        g = o.double()
        ref = g - g.mean(dim=tuple(range(1, g.ndim)), keepdim=True)
        # fp32 rounding of the mean and the subtraction: a few ulps of the row's largest value
        atol = 4 * torch.finfo(torch.float32).eps * float(g.abs().max())
        torch.testing.assert_close(p.grad.double(), ref, rtol=0, atol=atol)
        assert not torch.equal(p.grad, o)


def test_foreach_stats_match_float64_norms_and_max():
    params = _params(seed=7, grad_scale=[1.0] * len(SHAPES))
    st = benchmark_ops.foreach_stats(params)
    for p, n, m in zip(params, st["norm"], st["max_abs"]):
        g = p.grad.double()
        assert float(n) == pytest.approx(float(torch.linalg.vector_norm(g)), rel=1e-6)
        assert float(m) == float(g.abs().max())
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in params]))
    assert float(st["total_norm"]) == pytest.approx(float(total), rel=1e-6)


@pytest.mark.parametrize("op", ["agc", "gc", "grad_stats", "clip_trig", "clip_value"])
def test_every_baseline_of_an_op_agrees_with_fastgrad(op):
    """On a real model's shapes (scaled down), each torch baseline and fastgrad's call give the same result."""
    w = benchmark_workloads.prepare("resnet50", 1 << 20)
    st = benchmark_ops.OpState(benchmark_workloads.materialize(w, "cpu", seed=2))
    st.save()
    out = {}
    for b in benchmark_ops.OPS[op].baselines:
        st.restore()
        res = b.make(st)()
        out[b.impl] = (res, [g.clone() for g in st.grads])
    st.restore()
    mine = benchmark_ops.fastgrad_fn(op, st, None)()
    mine_grads = [g.clone() for g in st.grads]
    st.restore()
    for impl, (res, grads) in out.items():
        if benchmark_ops.OPS[op].mutates:
            for a, b in zip(grads, mine_grads):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"{op}: {impl}")
        else:  # grad_stats: the fields both compute
            for key, col in (("norm", "norm"), ("max_abs", "max_abs")):
                theirs = torch.stack([t.float() for t in res[key]]) if isinstance(res[key], (list, tuple)) \
                    else res[key].float()
                torch.testing.assert_close(theirs, getattr(mine, col).float().cpu(), rtol=1e-5, atol=0,
                                           msg=f"{op}: {impl} {key}")
            torch.testing.assert_close(res["total_norm"].float(), mine.total_norm.float().cpu(), rtol=1e-5,
                                       atol=0)


def test_every_op_names_its_baselines():
    for name, spec in benchmark_ops.OPS.items():
        assert spec.baselines and spec.baselines[0].impl == "torch eager", name
        assert len({b.impl for b in spec.baselines}) == len(spec.baselines), name
    assert "timm" in benchmark_ops.OPS["agc"].baseline and "1.0.28" in benchmark_ops.OPS["agc"].baseline
    assert "Gradient-Centralization" in benchmark_ops.OPS["gc"].baseline
    assert "_foreach_norm" in benchmark_ops.OPS["grad_stats"].baseline
    # the benchmark's own loops stay, labelled
    assert [b.impl for b in benchmark_ops.OPS["agc"].baselines[1:]] == ["torch: own loop"]
    assert [b.impl for b in benchmark_ops.OPS["grad_stats"].baselines[1:]] == ["torch: own loop"]
