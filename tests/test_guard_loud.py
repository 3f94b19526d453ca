"""A run that stops learning is not frozen in silence: after ``WARN_AFTER`` skips in a row the guard warns,
once, naming the cause, the count, the first skipped step and what to try; a bad batch now and then stays
quiet. The check reads only the guard's host copy of its run of skips (no device sync on the default path)."""

from __future__ import annotations

import warnings

import pytest
import torch

from fastgrad import StepGuard
from fastgrad.guard import WARN_AFTER, GuardError, GuardWarning

from .guard_cases import NAN, OPTIMIZERS, _params, _set_grads, no_host_reads


def _run(opt_name, bad_steps, steps, **kw):
    """Run ``steps`` guarded steps, NaN at ``bad_steps``; returns the guard and {step: warning messages}."""
    ps = _params()
    opt = OPTIMIZERS[opt_name](ps)
    guard = StepGuard(opt, max_norm=1.0, **kw)
    got = {}
    for step in range(steps):
        _set_grads(ps, step, poison=NAN if step in bad_steps else None)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            guard.clip_()
        opt.step()
        opt.zero_grad()
        msgs = [str(x.message) for x in w if issubclass(x.category, GuardWarning)]
        if msgs:
            got[step] = msgs
    return guard, got


@pytest.mark.parametrize("opt_name", ["adamw-fused", "adamw-foreach"])
def test_a_run_that_stops_learning_warns_once(opt_name):
    """The issue's run: every step after the first is NaN (59 of 60 skipped)."""
    guard, got = _run(opt_name, set(range(1, 60)), 60)
    # skips at steps 1..25 (0-based) make WARN_AFTER in a row; the next clip_ (step 26) says so, and only it
    assert list(got) == [WARN_AFTER + 1] and len(got[WARN_AFTER + 1]) == 1, got
    msg = got[WARN_AFTER + 1][0]
    assert f"skipped the last {WARN_AFTER} steps in a row, from step 2 on" in msg
    assert f"{WARN_AFTER} of {WARN_AFTER + 1} steps were skipped" in msg
    assert "non-finite gradient norm" in msg and "spikes" not in msg
    assert "learning rate" in msg and "max_consecutive_skips" in msg
    st = guard.state()
    assert (st["steps"], st["skipped_steps"], st["consecutive_skipped"], st["nonfinite_steps"]) == (60, 59, 59, 59)


def test_bad_batches_now_and_then_stay_quiet():
    """One bad batch, and WARN_AFTER - 1 in a row twice (a healthy step between), warn nothing."""
    n = WARN_AFTER - 1
    bad = {3} | set(range(5, 5 + n)) | set(range(6 + n, 6 + 2 * n))
    guard, got = _run("adamw-fused", bad, 8 + 2 * n)
    assert got == {} and guard.state()["skipped_steps"] == len(bad)


def test_spikes_are_named_as_the_cause():
    ps = _params()
    opt = OPTIMIZERS["adamw-fused"](ps)
    guard = StepGuard(opt, max_norm=1.0, skip_factor=10.0, warmup_steps=2)
    caught = []
    for step in range(WARN_AFTER + 4):
        # after 2 healthy steps, norms growing 2x a step from 1000x: faster than the reference follows skips
        _set_grads(ps, step, scale=1.0 if step < 2 else 1000.0 * 2.0 ** (step - 2))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            guard.clip_()
        opt.step()
        caught += [str(x.message) for x in w if issubclass(x.category, GuardWarning)]
    assert len(caught) == 1 and f"{WARN_AFTER} as spikes (skip_factor)" in caught[0], caught
    assert "with a non-finite gradient norm" not in caught[0]


def test_max_consecutive_skips_raises_before_the_warning():
    with pytest.raises(GuardError, match="skipped 3 steps in a row"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", GuardWarning)
            _run("adamw-foreach", set(range(40)), 40, max_consecutive_skips=3)


def test_the_check_reads_no_device_value():
    """The fused default path stays sync-free with the check armed: only the guard's host copy is read."""
    ps = _params()
    opt = OPTIMIZERS["adamw-fused"](ps)
    guard = StepGuard(opt, max_norm=1.0)
    _set_grads(ps, 0)
    guard.clip_()
    opt.step()  # creates the state (a read, outside the check)
    with no_host_reads():
        for step in range(1, WARN_AFTER):
            _set_grads(ps, step, poison=NAN)
            guard.clip_()
            opt.step()
    assert guard.state()["consecutive_skipped"] == WARN_AFTER - 1
