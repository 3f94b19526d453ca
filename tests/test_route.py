"""One plan per list (fastgrad.route): clip_grad_norm_'s route is chosen on a list's first call, cached, shown by
the plan's repr, taken straight on later calls, and chosen again when the list changes; the results are the
route-free ones bit for bit. The sharded routes (``sharded``, ``sharded-cpu``) are pinned on 2 gloo ranks in
tests/test_sharded_host.py, which reads the same plans."""

from __future__ import annotations

import pytest
import torch

import fastgrad
from fastgrad import _scan, route

from .helpers import bits, clone_params


def _model(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)
    m(torch.randn(4, 7, dtype=dtype)).square().sum().backward()
    return m


def _spy_cpu_calls(monkeypatch) -> list:
    calls = []
    real = _scan.clip_norm_cpu

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(_scan, "clip_norm_cpu", spy)
    return calls


needs_host = pytest.mark.skipif(_scan.helpers() is None, reason="needs the compiled host helpers")


def test_an_unseen_list_is_unplanned_and_its_first_call_plans_it():
    m = _model()
    plan = route.plan_of(m.parameters())
    assert plan.route is None and repr(plan) == "ListPlan(route=None, params=4)"
    fastgrad.clip_grad_norm_(m.parameters(), 1.0)
    again = route.plan_of(list(m.parameters()))
    assert again is plan  # cached: a new list object with the same parameters finds it
    assert plan.route == ("cpu" if _scan.helpers() is not None else "plain")
    assert repr(plan) == f"ListPlan(route={plan.route!r}, params=4)"


@needs_host
def test_a_planned_route_is_taken_straight(monkeypatch):
    m = _model(1)
    fastgrad.clip_grad_norm_(m.parameters(), 1.0)
    assert route.plan_of(m.parameters()).route == "cpu"
    calls = _spy_cpu_calls(monkeypatch)
    fastgrad.clip_grad_norm_(m.parameters(), 1.0)
    assert calls == [True]


@needs_host
def test_a_list_that_changed_is_planned_again_with_the_same_results(monkeypatch):
    m = _model(2)
    ref = clone_params(list(m.parameters()))
    fastgrad.clip_grad_norm_(m.parameters(), 0.1)
    torch.nn.utils.clip_grad_norm_(ref, 0.1)
    plan = route.plan_of(m.parameters())
    assert plan.route == "cpu"
    # a complex grad among them: torch's own implementation, recorded as the torch route
    c = torch.nn.Parameter(torch.randn(5, dtype=torch.complex64))
    c.grad = torch.randn(5, dtype=torch.complex64)
    mixed = [c] + list(m.parameters())
    fastgrad.clip_grad_norm_(mixed, 0.1)
    assert route.plan_of(mixed).route == "torch"
    # float64 grads on the reference backend: the plain route; back on the cpu backend: cpu again
    m64 = _model(3, torch.float64)
    ref64 = clone_params(list(m64.parameters()))
    out = fastgrad.clip_grad_norm_(m64.parameters(), 0.1, backend="torch")
    t = torch.nn.utils.clip_grad_norm_(ref64, 0.1)
    assert route.plan_of(m64.parameters()).route == "plain"
    assert torch.equal(out, t)
    calls = _spy_cpu_calls(monkeypatch)
    fastgrad.clip_grad_norm_(m64.parameters(), 1e9)
    assert calls == [True] and route.plan_of(m64.parameters()).route == "cpu"
    # a grad gone: the C++ call serves the rest (a None grad is skipped), still the cpu route
    m.__getitem__(0).bias.grad = None
    fastgrad.clip_grad_norm_(m.parameters(), 1e9)
    assert plan.route == "cpu"


def test_exact_and_process_group_never_take_the_cpu_route(monkeypatch, one_rank_group):
    m = _model(4)
    fastgrad.clip_grad_norm_(m.parameters(), 1.0)
    calls = _spy_cpu_calls(monkeypatch)
    ref = clone_params(list(m.parameters()))
    out = fastgrad.clip_grad_norm_(m.parameters(), 0.05, exact=True)
    assert calls == []  # the exact norm has its own reads
    assert torch.equal(out, fastgrad.get_total_norm([p.grad for p in ref], exact=True))
    # a process_group: the one-call C++ clip would read this rank's shards alone (no collective), so a list that
    # has no plan yet under that group never tries it, on its first call or later ones
    m = _model(9)
    for _ in range(2):
        fastgrad.clip_grad_norm_(m.parameters(), 1.0, process_group=one_rank_group)
    assert calls == []
    assert route.plan_of(m.parameters(), one_rank_group).route == "sharded"


@needs_host
def test_plans_are_bounded_and_the_list_in_use_keeps_its_plan():
    m = _model(5)
    fastgrad.clip_grad_norm_(m.parameters(), 1.0)
    mine = route.plan_of(m.parameters())
    others = []  # kept alive, so no other list reuses a first parameter's id
    for k in range(2 * route._CAP + 3):
        o = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
        for p in o:
            p.grad = torch.randn(3)
        fastgrad.clip_grad_norm_(o, 1.0)
        others.append(o)
        if k % 8 == 0:
            fastgrad.clip_grad_norm_(m.parameters(), 1.0)
            assert route.plan_of(m.parameters()) is mine, k
    assert len(route._PLANS) <= route._CAP
    assert route.plan_of(others[0]).route is None  # long evicted: planned anew by its next call


@pytest.mark.parametrize("entry", ["clip_grad_norm_", "scaler_unscale_and_clip", "grad_stats", "guard"])
def test_a_cached_plan_keeps_no_dead_model_alive(entry):
    """A sweep that builds a model per run: the plan cached for the first run's list must not hold its first
    parameter (with its gradient) once the script drops the model (check's sweep script once showed it kept)."""
    import gc
    import weakref

    m = _model(8)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    route.clear()
    if entry == "clip_grad_norm_":
        fastgrad.clip_grad_norm_(m.parameters(), 1.0)
    elif entry == "grad_stats":
        fastgrad.grad_stats(m.parameters())
    else:  # both with a GradScaler (the guard's CPU clip without one takes the C++ call, which plans nothing)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(m(torch.randn(4, 7)).square().sum()).backward()
        if entry == "scaler_unscale_and_clip":
            fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0)
        else:
            fastgrad.StepGuard(opt, 1.0).clip_(scaler)
    first = weakref.ref(next(m.parameters()))
    assert [p for p in route._PLANS.values() if p.first() is first()]  # the entry cached the list's plan
    del m, opt
    scaler = None  # (its per-optimizer state holds the optimizer's gradients' scale, not the model)
    gc.collect()
    assert first() is None


def test_a_traced_call_never_reaches_the_id_keyed_lookup(monkeypatch):
    """The 2026-11-27 H200 run (torch 2.11): every compiled clip_grad_norm_ stopped at an id() in the sharded
    layout lookup this plan replaced, which Dynamo 2.11 cannot trace. While tracing, plan_of returns a fresh plan
    before its id()-keyed lookup; eagerly the same call looks the plan up (the control: the watch sees it)."""
    seen = []

    class Watch(dict):
        def get(self, key, default=None):
            seen.append(key)
            return super().get(key, default)

    monkeypatch.setattr(route, "_PLANS", Watch())
    m = _model(6)
    route.plan_of(m.parameters())
    assert len(seen) == 1
    seen.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    plan = route.plan_of(m.parameters())
    assert seen == [] and plan.route is None


def test_clear_cache_forgets_the_plans():
    m = _model(7)
    fastgrad.clip_grad_norm_(m.parameters(), 1.0)
    plan = route.plan_of(m.parameters())
    fastgrad.distributed.clear_cache()
    assert route.plan_of(m.parameters()) is not plan


@pytest.mark.parametrize("max_norm", [1e-3, 1e9])
def test_a_planned_call_gives_the_bits_of_a_first_call(max_norm):
    """The route taken straight (planned) and the route found by a first call write the same gradients and
    return the same total, bit for bit, clipping or not."""
    planned, fresh = _model(8), _model(8)
    grads = [p.grad.clone() for p in planned.parameters()]
    fastgrad.clip_grad_norm_(planned.parameters(), max_norm)  # plans the list
    for p, g in zip(planned.parameters(), grads):
        p.grad = g.clone()
    out = fastgrad.clip_grad_norm_(planned.parameters(), max_norm)  # planned
    route.clear()
    ref = fastgrad.clip_grad_norm_(fresh.parameters(), max_norm)  # a first call
    assert torch.equal(bits(out), bits(ref))
    for p, q in zip(planned.parameters(), fresh.parameters()):
        assert torch.equal(bits(p.grad), bits(q.grad))


def _with_a_complex_grad(seed: int = 9) -> list:
    torch.manual_seed(seed)
    c = torch.nn.Parameter(torch.randn(5, dtype=torch.complex64))
    c.grad = torch.randn(5, dtype=torch.complex64)
    r = torch.nn.Parameter(torch.randn(4))
    r.grad = torch.randn(4)
    return [c, r]


def test_torchs_own_implementation_is_refused_in_one_order(one_rank_group):
    """A list only torch's implementation reads (a complex gradient): ``process_group=`` refuses it first
    (fastgrad's reduction only), then ``exact=True``, then a fastgrad backend asked for by name, for every entry
    that could hand it to torch, before anything is written; an automatic choice gets torch's own result."""
    from fastgrad.backends import BackendError

    ps = _with_a_complex_grad()
    grads = [p.grad.clone() for p in ps]
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    opt = torch.optim.SGD(ps, lr=0.1)
    with pytest.raises(TypeError, match="process_group= supports dense real floating"):
        fastgrad.clip_grad_norm_(ps, 0.1, backend="cpu", process_group=one_rank_group, exact=True)
    with pytest.raises(TypeError, match="process_group= supports dense real floating"):
        fastgrad.get_total_norm(grads, backend="cpu", process_group=one_rank_group, exact=True)
    with pytest.raises(TypeError, match="process_group= supports dense real floating"):
        fastgrad.scaler_unscale_and_clip(scaler, opt, 0.1, backend="cpu", process_group=one_rank_group, exact=True)
    with pytest.raises(TypeError, match="complex tensors are not supported"):  # never torch's: its own words
        fastgrad.multi_tensor_norm(grads, process_group=one_rank_group)
    with pytest.raises(TypeError, match="exact=True supports dense real floating"):
        fastgrad.clip_grad_norm_(ps, 0.1, backend="cpu", exact=True)
    with pytest.raises(TypeError, match="exact=True supports dense real floating"):
        fastgrad.scaler_unscale_and_clip(scaler, opt, 0.1, backend="cpu", exact=True)
    with pytest.raises(BackendError, match="sparse, complex"):
        fastgrad.clip_grad_norm_(ps, 0.1, backend="cpu")
    with pytest.raises(BackendError, match="sparse, complex"):
        fastgrad.clip_grads_with_norm_(ps, 0.1, torch.tensor(3.0), backend="cpu")
    assert all(torch.equal(p.grad, g) for p, g in zip(ps, grads))  # nothing written
    ref = _with_a_complex_grad()
    out = fastgrad.clip_grad_norm_(ps, 0.1)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.1)
    assert torch.equal(out, want) and all(torch.equal(p.grad, q.grad) for p, q in zip(ps, ref))
    assert route.plan_of(ps).route == "torch"


def test_one_fused_call_only_when_the_reading_backend_also_writes(monkeypatch):
    """``route.one_call_backend``: a plain list takes the one fused call (``clip_norm_``, ``amp_clip_``) only when
    the backend that reads it is the one that writes it. On the CPU a norm order without a fused kernel (p = 0) is
    read by the torch backend and written by the cpu backend: two calls, never torch's whole clip."""
    from fastgrad.backends import get

    cpu, ref = get("cpu"), get("torch")
    if cpu.unavailable_reason() is not None:
        pytest.skip(cpu.unavailable_reason())
    calls = []
    spied = ((cpu, ("scale_", "clip_norm_", "amp_clip_")), (ref, ("scale_", "clip_norm_", "amp_clip_")))
    for b, names in spied:
        for name in names:
            def spy(self, *args, _name=f"{b.name}.{name}", _orig=getattr(type(b), name), **kwargs):
                calls.append(_name)
                return _orig(self, *args, **kwargs)
            monkeypatch.setattr(type(b), name, spy)
    m = _model(10)
    fastgrad.clip_grad_norm_(m.parameters(), 1e-3, 0.0)
    assert calls == ["cpu.scale_"], calls  # (the read: torch's norm)
    calls.clear()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    fastgrad.scaler_unscale_and_clip(scaler, torch.optim.SGD(m.parameters(), lr=0.1), 1e-3, 0.0)
    assert calls == ["cpu.scale_"], calls
