"""A guard lives as long as its optimizer, or until ``remove()`` (docs/guard-reference.md, "Lifetime"): a guard
object that nobody keeps still guards every step and ``guard_for(optimizer)`` finds it; once removed it is
gone; optimizer and guard do not keep each other alive after the user drops both."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import fastgrad
from fastgrad.guard import guard_for

from .guard_cases import NAN, _same, _set_grads, _snapshot


def _make():
    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    return ps, torch.optim.AdamW(ps, lr=1e-2, fused=True)


def _set_up(opt):
    fastgrad.StepGuard(opt, max_norm=1.0)  # the result not kept: the loop below never names it


@pytest.mark.parametrize("how", ["line-of-its-own", "set-up-function"])
def test_a_guard_not_kept_still_guards(how):
    ps, opt = _make()
    if how == "line-of-its-own":
        fastgrad.StepGuard(opt, max_norm=1.0)
    else:
        _set_up(opt)
    gc.collect()
    guard = guard_for(opt)
    assert guard is not None
    # a step with no decision is still refused
    _set_grads(ps, 0, poison=NAN)
    before = _snapshot(ps, opt)
    with pytest.raises(RuntimeError, match="clip_"):
        opt.step()
    assert _same(_snapshot(ps, opt), before)
    # and a NaN step still skipped
    guard_for(opt).clip_()
    del guard
    gc.collect()
    opt.step()
    assert _same(_snapshot(ps, opt), before) and guard_for(opt).state()["skipped_steps"] == 1


def test_removed_guard_is_gone_and_the_optimizer_steps_unguarded():
    ps, opt = _make()
    guard = fastgrad.StepGuard(opt, max_norm=1.0)
    ref = weakref.ref(guard)
    guard.remove()
    del guard
    gc.collect()
    assert ref() is None and guard_for(opt) is None
    _set_grads(ps, 0)
    opt.step()  # no guard: torch's own step


def test_optimizer_and_guard_are_collected_together():
    ps, opt = _make()
    model = torch.nn.BatchNorm1d(3)
    guard = fastgrad.StepGuard(opt, max_norm=1.0, model=model)
    refs = weakref.ref(opt), weakref.ref(guard)
    del opt, guard
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


# ---------------------------------------------------------------- safe_to_checkpoint


def test_safe_to_checkpoint_sees_weights_optimizer_state_and_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    guard = fastgrad.StepGuard(opt, 1.0, model=model)
    model(torch.randn(5, 3)).sum().backward()
    guard.clip_()
    opt.step()
    assert guard.safe_to_checkpoint() and guard.nonfinite_state() == []
    for where, tensor in (("0.weight", model[0].weight), ("'exp_avg'", opt.state[model[0].bias]["exp_avg"]),
                          ("buffer 1.running_var", model[1].running_var)):
        saved = tensor.detach().clone()
        with torch.no_grad():
            tensor.view(-1)[1] = float("inf")
        assert not guard.safe_to_checkpoint()
        assert any(where in n for n in guard.nonfinite_state()), (where, guard.nonfinite_state())
        with torch.no_grad():
            tensor.copy_(saved)
        assert guard.safe_to_checkpoint()
    # without model= the buffers are not the guard's to see
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model[1].running_mean.fill_(float("nan"))
    assert fastgrad.StepGuard(opt2, 1.0).safe_to_checkpoint()


# ---------------------------------------------------------------- the fastgrad.guard log record


def test_a_read_that_finds_new_skips_logs_one_record(caplog):
    ps, opt = _make()
    guard = fastgrad.StepGuard(opt, 1.0)

    def step(poison):
        _set_grads(ps, 0, poison=poison)
        guard.clip_()
        opt.step()

    caplog.set_level("INFO", logger="fastgrad.guard")
    step(None)
    guard.state()
    assert not caplog.records  # no skip: nothing said
    step(NAN)
    step(NAN)
    step(None)
    guard.state()
    assert len(caplog.records) == 1 and caplog.records[0].name == "fastgrad.guard"
    assert caplog.records[0].levelname == "WARNING"
    assert "2 step(s) skipped since the last read (2 in all of 4 steps: 2 non-finite" in caplog.text
    guard.state()
    assert len(caplog.records) == 1  # nothing new since
    # a resumed guard does not report the loaded run's skips again
    ps2, opt2 = _make()
    resumed = fastgrad.StepGuard(opt2, 1.0)
    resumed.load_state_dict(guard.state_dict())
    resumed.state()
    assert len(caplog.records) == 1
