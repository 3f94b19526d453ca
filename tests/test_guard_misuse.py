"""Misused guards: no ``optimizer.step()`` writes while no ``clip_`` decision covers the current gradients.

docs/guard-paths.md: "A ``step()`` on gradients that no ``clip_`` has seen ... raises before anything is written, and
keeps raising until the next ``clip_``; a ``step()`` with no gradients at all changes nothing. A ``clip_`` that
finds no gradients leaves no decision." Each misuse below is the loop a new user writes: ``clip_`` never
called, ``clip_`` placed before ``backward()`` (it finds no gradients), a guard built on an optimizer that
had already stepped, a decision taken before the last backward. Fused, foreach and for-loop optimizers, the
sync and restore skip paths, a parameter's first step and later ones, with and without a GradScaler. Each
refusal: a RuntimeError naming the missing or misplaced ``clip_`` and the fix, the parameters and the whole
optimizer state bit for bit as before, nothing left on the optimizer for its fused kernel, the gradients
untouched, raised again on a retry, and on the fused path (and restore, once the state exists) without a
read of device data on the host. Then the right call still guards the same gradients."""

from __future__ import annotations

import pytest
import torch

import fastgrad
from fastgrad import StepGuard

from .guard_cases import NAN, _same, _scaled, _set_grads, _snapshot, no_host_reads
from .helpers import bits

O = torch.optim
SHAPES = [(17, 33), (7,), (1,), (5, 3)]
OPTS = {
    "adamw-fused": (lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), True),
    "sgd-momentum-fused": (lambda ps: O.SGD(ps, lr=0.05, momentum=0.9, fused=True), True),
    "adamw-foreach": (lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True), False),
    "sgd-momentum-forloop": (lambda ps: O.SGD(ps, lr=0.05, momentum=0.9, foreach=False), False),
}
PATHS = [(n, m) for n in OPTS for m in ("sync", "restore") if not (OPTS[n][1] and m == "restore")]

# the user's loop up to the step that must be refused: what it does with the guard and the gradients
MISUSE = {
    # never decided
    "clip-never-called": ("has not been called", lambda ps, g, step: _set_grads(ps, step, poison=NAN)),
    # decided on no gradients: the loop, clip_ between zero_grad(set_to_none=True) and backward
    "clip-before-backward": ("no gradients", lambda ps, g, step: (_none(ps), g.clip_(),
                                                                   _set_grads(ps, step, poison=NAN))),
    # decided before the last backward: on gradients zeroed in place (zero_grad(set_to_none=False) after an
    # earlier backward), then the backward accumulates into them
    "clip-before-backward-zeroed": ("changed after the clip", lambda ps, g, step: (
        _set_grads(ps, step + 50), _zero(ps), g.clip_(), _accumulate(ps, step, poison=NAN))),
    # decided before the last backward: one more micro-batch after the clip
    "backward-after-clip": ("changed after the clip", lambda ps, g, step: (
        _set_grads(ps, step), g.clip_(), _accumulate(ps, step + 100, poison=NAN))),
    # a write into one gradient in the middle of the list after the decision (neither the first nor the last)
    "nan-written-in-middle": ("gradient 1 of 4 .* was written in place", lambda ps, g, step: (
        _set_grads(ps, step), g.clip_(), _write_nan(ps[1].grad))),
    "middle-zeroed-under-no-grad": ("gradient 2 of 4 .* was written in place", lambda ps, g, step: (
        _set_grads(ps, step, poison=NAN), g.clip_(), _under_no_grad(ps[2].grad.zero_))),
    "middle-replaced": ("gradient 2 of 4 .* is another tensor", lambda ps, g, step: (
        _set_grads(ps, step), g.clip_(), _replace_with_nan(ps[2]))),
}


def _write_nan(grad):
    grad.view(-1)[0] = float("nan")


def _under_no_grad(fn):
    with torch.no_grad():
        fn()


def _replace_with_nan(p):
    p.grad = torch.full_like(p.grad, float("nan"))  # same shape and values' kind: only its identity tells


def _none(ps):
    for p in ps:
        p.grad = None


def _zero(ps):
    for p in ps:
        if p.grad is not None:
            p.grad.zero_()


def _accumulate(ps, step, poison=None):
    """A backward into existing gradients (in place, as autograd accumulates)."""
    old = [p.grad for p in ps]
    _set_grads(ps, step, poison=poison)
    for p, o in zip(ps, old):
        if o is not None:
            o.add_(p.grad)
            p.grad = o


def _make(name, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).float()) for s in SHAPES]
    return ps, OPTS[name][0](ps)


def _structure(opt):
    return [sorted(opt.state[p]) if p in opt.state else None for p in opt.param_groups[0]["params"]]


def _healthy_steps(ps, opt, guard, n):
    for step in range(n):
        _set_grads(ps, step)
        guard.clip_()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _refused(ps, opt, match, read_free):
    """The step raises naming ``match`` and the fix, writes nothing, and raises again on a retry."""
    before, shape = _snapshot(ps, opt), _structure(opt)
    grads = [bits(p.grad).clone() for p in ps]
    for _ in range(2):
        if read_free:
            with no_host_reads(), pytest.raises(RuntimeError, match=match) as err:
                opt.step()
        else:
            with pytest.raises(RuntimeError, match=match) as err:
                opt.step()
        msg = str(err.value)
        assert "guard.clip_()" in msg and "after the last backward" in msg and "Nothing was stepped" in msg, msg
        assert _same(_snapshot(ps, opt), before) and _structure(opt) == shape
        assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
        assert all(torch.equal(bits(p.grad), g) for p, g in zip(ps, grads))


@pytest.mark.parametrize("stepped", [0, 2], ids=["first-step", "state-exists"])
@pytest.mark.parametrize("misuse", list(MISUSE))
@pytest.mark.parametrize("name,non_fused", PATHS)
def test_a_step_no_clip_decided_is_refused_before_anything_is_written(name, non_fused, misuse, stepped):
    ps, opt = _make(name)
    guard = StepGuard(opt, 1.0, non_fused=non_fused)
    _healthy_steps(ps, opt, guard, stepped)
    match, loop = MISUSE[misuse]
    if misuse == "clip-never-called" and stepped:  # clip_ ran at the earlier steps, not at this one
        match = "not seen by a clip_"
    loop(ps, guard, stepped)
    read_free = stepped > 0 and (OPTS[name][1] or non_fused == "restore")
    _refused(ps, opt, match, read_free)
    # the right call on the same (bad) gradients: decided, and the bad step skipped
    before = _snapshot(ps, opt)
    guard.clip_()
    opt.step()
    assert _same(_snapshot(ps, opt), before) and guard.last_step_skipped()


@pytest.mark.parametrize("name,non_fused", PATHS)
def test_a_guard_built_on_an_optimizer_that_already_stepped_refuses_until_clip(name, non_fused):
    ps, opt = _make(name)
    for step in range(2):  # the run before the guard existed
        _set_grads(ps, step)
        fastgrad.clip_grad_norm_(ps, 1.0)
        opt.step()
    guard = StepGuard(opt, 1.0, non_fused=non_fused)
    _set_grads(ps, 2, poison=NAN)
    _refused(ps, opt, "has not been called", OPTS[name][1] or non_fused == "restore")
    assert guard.state()["steps"] == 0


@pytest.mark.parametrize("name,non_fused", PATHS)
def test_a_new_backward_after_a_decided_step_is_refused(name, non_fused):
    """clip_, step, then a new backward without a clip_: into the same gradients (no zero_grad) or into new
    ones (after zero_grad(set_to_none=True))."""
    for fresh in (False, True):
        ps, opt = _make(name)
        guard = StepGuard(opt, 1.0, non_fused=non_fused)
        _healthy_steps(ps, opt, guard, 1)
        _set_grads(ps, 1)
        guard.clip_()
        opt.step()
        if fresh:
            _none(ps)
            _set_grads(ps, 2, poison=NAN)
        else:
            _accumulate(ps, 2, poison=NAN)
        _refused(ps, opt, "not seen by a clip_", OPTS[name][1] or non_fused == "restore")


@pytest.mark.parametrize("registered", ["after-the-guard", "before-the-guard"])
@pytest.mark.parametrize("name,non_fused", PATHS)
def test_a_step_pre_hook_that_writes_a_gradient_is_caught(name, non_fused, registered):
    """Another step pre-hook puts a NaN into a middle gradient after the decision: torch runs the pre-hooks
    in order, and the guard's check runs after every other (also one registered after the guard was built),
    so the step is refused before anything is written, instead of stepping on a gradient no decision saw."""
    ps, opt = _make(name)

    def poison(opt, args, kwargs):
        with torch.no_grad():
            ps[1].grad.view(-1)[0] = float("nan")

    handle = opt.register_step_pre_hook(poison) if registered == "before-the-guard" else None
    guard = StepGuard(opt, 1.0, non_fused=non_fused)
    if handle is None:
        handle = opt.register_step_pre_hook(poison)
    _set_grads(ps, 0)
    guard.clip_()
    before = _snapshot(ps, opt)
    with pytest.raises(RuntimeError, match="gradient 1 of 4 .* was written in place"):
        opt.step()
    assert _same(_snapshot(ps, opt), before)
    assert all(p.isfinite().all() for p in ps)
    handle.remove()


@pytest.mark.parametrize("name,non_fused", PATHS)
def test_a_write_after_a_decided_step_is_refused_at_the_next_step(name, non_fused):
    """The decision holds for a second step() only on the very gradients the first one used: a NaN written
    into a middle gradient after the step is refused at the next step (no new clip_)."""
    ps, opt = _make(name)
    guard = StepGuard(opt, 1.0, non_fused=non_fused)
    _healthy_steps(ps, opt, guard, 1)
    _set_grads(ps, 1)
    guard.clip_()
    opt.step()
    _write_nan(ps[2].grad)
    _refused(ps, opt, "not seen by a clip_", OPTS[name][1] or non_fused == "restore")


def test_torch_optimizers_leave_their_gradients_versions_alone():
    """Why the seen versions are not read again after a torch optimizer's step (the step's host cost): no
    implementation of theirs writes a gradient. Were one to, a second step() would be refused wrongly."""
    kinds = [dict(foreach=False), dict(foreach=True), dict(fused=True)]
    for cls in (O.SGD, O.Adam, O.AdamW, O.Adagrad, O.Adamax, O.NAdam, O.RAdam, O.RMSprop, O.Adadelta, O.ASGD,
                O.Rprop):
        for kw in kinds:
            p = torch.nn.Parameter(torch.randn(5))
            p.grad = torch.randn(5)
            try:
                opt = cls([p], lr=0.01, **kw) if cls is not O.SGD else cls([p], lr=0.01, momentum=0.9, **kw)
            except (RuntimeError, TypeError, ValueError):
                continue  # no such implementation (fused) for this class
            v = p.grad._version
            opt.step()
            opt.step()
            assert p.grad._version == v, (cls.__name__, kw)


@pytest.mark.parametrize("name", ["adamw-fused", "adamw-foreach"])
def test_under_a_gradscaler_a_write_after_the_clip_is_refused(name):
    ps, opt = _make(name)
    guard = StepGuard(opt, 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    _scaled(ps, scaler, 0)
    guard.clip_(scaler)
    _write_nan(ps[2].grad)
    before = _snapshot(ps, opt)
    with pytest.raises(RuntimeError, match="gradient 2 of 4 .* was written in place"):
        scaler.step(opt)
    assert _same(_snapshot(ps, opt), before)


class _DecayIntoGrad(torch.optim.Optimizer):
    """SGD written as older code did: weight decay added into ``p.grad`` in place, inside the step."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1, "weight_decay": 0.01})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.add_(p, alpha=group["weight_decay"])
                    p.add_(p.grad, alpha=-group["lr"])


def test_a_step_that_writes_its_own_gradients_does_not_void_the_decision():
    """The step's own write is not a write after the decision: the seen versions are read again after each
    step, so a second step() on the same gradients obeys the decision as after any step, and a write after it
    is still refused."""
    ps, _ = _make("adamw-foreach")
    opt = _DecayIntoGrad(ps)
    guard = StepGuard(opt, 1.0)
    _set_grads(ps, 0)
    guard.clip_()
    opt.step()
    opt.step()  # the same gradients, the same decision: steps again, as it would unguarded
    _write_nan(ps[1].grad)
    with pytest.raises(RuntimeError, match="not seen by a clip_"):
        opt.step()


@pytest.mark.parametrize("name", ["adamw-fused", "adamw-foreach"])
def test_a_step_with_no_gradients_at_all_stays_legitimate(name):
    """Nothing to guard: no decision and no gradient (a new guard; a clip_ that found none) steps as torch
    does, and changes nothing."""
    ps, opt = _make(name)
    guard = StepGuard(opt, 1.0)
    opt.step()
    guard.clip_()  # finds no gradients: no decision
    opt.step()
    _healthy_steps(ps, opt, guard, 2)
    before, shape = _snapshot(ps, opt), _structure(opt)
    guard.clip_()
    with no_host_reads():
        opt.step()
    assert _same(_snapshot(ps, opt), before) and _structure(opt) == shape


@pytest.mark.parametrize("name", ["adamw-fused", "adamw-foreach"])
def test_under_a_gradscaler_the_undecided_step_is_refused(name):
    """scaler.step(optimizer) with no guard.clip_(scaler) at this step: the scaler unscales, finds no
    overflow and calls optimizer.step(), which is refused. A clip_(scaler) before backward records no
    overflow check (as scaler.unscale_ on no gradients): torch's non-fused scaler.step then refuses by
    itself, the fused one reaches the guard's refusal. Parameters and state untouched either way."""
    for misplaced in (False, True):
        ps, opt = _make(name)
        guard = StepGuard(opt, 1.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for step in range(2):
            _scaled(ps, scaler, step)
            guard.clip_(scaler)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        if misplaced:
            guard.clip_(scaler)  # before backward
        _scaled(ps, scaler, 2)
        before, shape = _snapshot(ps, opt), _structure(opt)
        if misplaced and not OPTS[name][1]:
            exc, match = AssertionError, "No inf checks were recorded"
        else:
            exc, match = RuntimeError, "found no gradients" if misplaced else "not seen by a clip_"
        with pytest.raises(exc, match=match):
            scaler.step(opt)
        assert _same(_snapshot(ps, opt), before) and _structure(opt) == shape


def test_the_refusal_names_each_cause():
    """One message per cause, each naming where clip_ goes."""
    ps, opt = _make("adamw-fused")
    guard = StepGuard(opt, 1.0)
    _set_grads(ps, 0)
    with pytest.raises(RuntimeError) as never:
        opt.step()
    _none(ps)
    guard.clip_()
    _set_grads(ps, 0)
    with pytest.raises(RuntimeError) as empty:
        opt.step()
    assert "guard.clip_() has not been called" in str(never.value)
    assert "the last guard.clip_() found no gradients" in str(empty.value)
    assert "before backward()" in str(empty.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("misuse", ["clip-never-called", "clip-before-backward", "backward-after-clip"])
def test_cuda_fused_refusal_without_sync(misuse):
    """Fused AdamW on CUDA, state created: the refused step raises with torch's sync debug mode set to
    raise on any synchronizing call, and writes nothing."""
    ps = [torch.nn.Parameter(p.detach().cuda()) for p in _make("adamw-fused")[0]]
    opt = OPTS["adamw-fused"][0](ps)
    guard = StepGuard(opt, 1.0)
    _healthy_steps(ps, opt, guard, 2)
    match, loop = MISUSE[misuse]
    if misuse == "clip-never-called":
        match = "not seen by a clip_"
    loop(ps, guard, 2)
    before = _snapshot(ps, opt)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match=match):
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert _same(_snapshot(ps, opt), before)
