"""The guard under ``torch.compile``: a compiled ``optimizer.step``, a compiled function holding backward +
``guard.clip_()`` + ``optimizer.step()``, and a compiled model, with fused, foreach and for-loop AdamW.

Reference: a twin run compiled the same way that never sees the bad batches and clips its healthy ones with
the unguarded clip (``fastgrad.clip_optimizer_grad_norm_``, kept out of the graph as the guard's clip is, so
that both hand the same coefficient to the same kernels). After every step taken, parameters and optimizer
state equal the twin's bit for bit. Bad batches at the first step (state that torch creates lazily) and at a
later one. Every batch's norm is above ``max_norm``: a clip lost in the compiled step shows as well as a skip.
inductor compiles for tens of seconds on a loaded CPU: all scenarios run on aot_eager, one per optimizer
flavour on inductor."""

from __future__ import annotations

import pytest
import torch

import fastgrad
from fastgrad import StepGuard

from .guard_cases import _same
from .helpers import bits
from .helpers import optimizer_state as _opt_state

FLAVOURS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False}}
BAD = (0, 2)
STEPS = 5


def _batches():
    gen = torch.Generator().manual_seed(1)
    out = [(torch.randn(8, 4, generator=gen) * 10, torch.randn(8, 2, generator=gen)) for _ in range(STEPS)]
    for i in BAD:
        out[i][0][0, 0] = float("nan")
    return out


def _snap(model, opt):
    return [bits(p.detach()).clone() for p in model.parameters()] + [bits(t).clone() for t in _opt_state(opt)]


def _run(flavour, where, backend, guarded):
    """The parameters and optimizer state after each step taken (the guarded run's bad steps included)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, **FLAVOURS[flavour])
    guard = StepGuard(opt, max_norm=1.0) if guarded else None
    plain_clip = torch.compiler.disable(lambda: fastgrad.clip_optimizer_grad_norm_(opt, 1.0))
    clip = guard.clip_ if guarded else plain_clip
    fwd = torch.compile(model, backend=backend) if where == "model" else model
    step = torch.compile(opt.step, backend=backend) if where == "step" else opt.step

    def train(x, y):
        torch.nn.functional.mse_loss(fwd(x), y).backward()
        clip()
        step()

    train_fn = torch.compile(train, backend=backend) if where == "function" else train
    snaps = [(-1, _snap(model, opt))]
    for i, (x, y) in enumerate(_batches()):
        if i in BAD and not guarded:
            continue
        train_fn(x, y)
        opt.zero_grad(set_to_none=True)
        snaps.append((i, _snap(model, opt)))
    return snaps, guard


CASES = [(f, w, "aot_eager") for f in FLAVOURS for w in ("step", "function", "model")] + [
    ("fused", "step", "inductor"), ("foreach", "function", "inductor"), ("forloop", "model", "inductor")]


@pytest.mark.parametrize("flavour,where,backend", CASES)
def test_compiled_step_is_guarded_like_an_eager_twin(flavour, where, backend):
    torch._dynamo.reset()
    got, guard = _run(flavour, where, backend, guarded=True)
    want, _ = _run(flavour, where, backend, guarded=False)
    want = dict(want)
    for (_, prev), (i, snap) in zip(got, got[1:]):
        if i in BAD:  # the bad step left everything as it was (at the first step: no optimizer state at all)
            assert _same(snap, prev), (flavour, where, backend, i)
        else:
            assert _same(snap, want[i]), (flavour, where, backend, i)
    st = guard.state()
    assert st["skipped_steps"] == st["nonfinite_steps"] == len(BAD) and st["steps"] == STEPS
    assert st["clipped_steps"] == STEPS - len(BAD)


def test_fullgraph_refuses_with_what_to_do():
    """fullgraph=True cannot run the guard's hooks outside the graph: torch raises at the first step, with
    the guard's text naming what to do, before anything is written."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = StepGuard(opt, max_norm=1.0)
    model(torch.randn(3, 4)).sum().backward()
    guard.clip_()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(Exception, match="compile without fullgraph=True"):
        torch.compile(opt.step, backend="aot_eager", fullgraph=True)()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state


def _bn_run(guarded, keeper_first):
    """A CNN with BatchNorm, ``torch.compile(model)``, a NaN batch at step 1 (the twin never sees it)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = StepGuard(opt, 1.0, model=model) if guarded and keeper_first else None
    fwd = torch.compile(model, backend="aot_eager")
    if guarded and not keeper_first:
        guard = StepGuard(opt, 1.0, model=fwd)  # the compiled module: its buffers are the model's
    clip = guard.clip_ if guarded else torch.compiler.disable(lambda: fastgrad.clip_optimizer_grad_norm_(opt, 1.0))
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        x, y = torch.randn(5, 3, 8, 8, generator=gen), torch.randn(5, 2, generator=gen)
        if i == 1:
            if not guarded:
                continue
            x[0, 0, 0, 0] = float("nan")
        torch.nn.functional.mse_loss(fwd(x), y).backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [bits(t.detach()).clone() for t in [*model.parameters(), *model.buffers()]], guard


@pytest.mark.slow  # two aot_eager compiles: ~40 s on the loaded 2-core CPU
@pytest.mark.parametrize("keeper_first", [True, False])
def test_a_compiled_model_keeps_its_buffers_through_a_skip(keeper_first):
    """StepGuard(model=...) with torch.compile(model): the buffer keeper's forward pre-hooks run outside the
    graph (traced, its views of the buffers would enter it as aliased inputs, which torch refuses), and the
    model, BatchNorm statistics included, is bit for bit the twin that never saw the NaN batch."""
    got, guard = _bn_run(True, keeper_first)
    want, _ = _bn_run(False, keeper_first)
    assert _same(got, want)
    assert guard.state()["skipped_steps"] == 1
