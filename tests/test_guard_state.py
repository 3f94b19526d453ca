"""The guard's readings at any point of its life: new, loaded from a checkpoint before its first ``clip_``,
mid-run (records not folded yet). ``state()``, ``state_dict()``, ``counters()`` and the last step's device
readings answer everywhere, and a save/load leaves every one of them as it was (docs/guard-reference.md: "``state()``
shows the same at any time"; Checkpoints)."""

from __future__ import annotations

import io

import pytest
import torch

from fastgrad import StepGuard
from fastgrad.guard import COUNTERS

from .guard_cases import NAN, _params, _set_grads

NAMES = ["total_norm", "clipped_norm", "coef", "clipped", "skipped", "steps", "clipped_steps", "skipped_steps",
         "consecutive_skipped", "nonfinite_steps", "spike_steps", "longest_consecutive_skipped", "engaged_steps"]
# the ledger of the steps since the previous read (tests/test_guard_ledger.py)
WINDOW = ["window_steps", "clip_share", "norm_p50", "norm_p90", "norm_p99", "norm_count", "window_longest_skipped"]
MODES = {
    "norm": dict(max_norm=1.0),
    "norm-spikes": dict(max_norm=1.0, skip_factor=3.0, warmup_steps=2),
    "zclip": dict(mode="zclip", warmup_steps=2),
    "autoclip": dict(mode="autoclip", history_size=4),
    "adagc": dict(mode="adagc", warmup_steps=2),
}


def _guard(kw, seed=0):
    ps = _params(seed)
    return ps, StepGuard(torch.optim.SGD(ps, lr=0.1, momentum=0.9), **kw)


def _run(ps, guard, steps, bad=()):
    for step in steps:
        _set_grads(ps, step, poison=NAN if step in bad else None)
        guard.clip_()
        guard.optimizer.step()
        guard.optimizer.zero_grad(set_to_none=True)


def _readings(guard) -> str:
    """Everything a user can read from the guard, as host values (a repr: NaN equals NaN there)."""
    def host(t):
        return None if t is None else t.tolist()
    return repr((guard.state(), guard.counters().tolist(), host(guard.total_norm), host(guard.skipped),
                 host(guard.clipped_norm), host(guard.coef), host(guard.clipped), guard.last_step_skipped()))


def _saved_and_loaded(guard, kw):
    buf = io.BytesIO()
    torch.save(guard.state_dict(), buf)
    buf.seek(0)
    _, other = _guard(kw, seed=1)
    other.load_state_dict(torch.load(buf))  # (torch.load's default weights_only=True reads it)
    return other


@pytest.mark.parametrize("mode", list(MODES))
def test_a_new_guard_reads_zero_counters_and_no_last_step(mode):
    _, guard = _guard(MODES[mode])
    st = guard.state()
    assert list(st) == NAMES + WINDOW
    assert all(st[k] == 0 and type(st[k]) is int for k in NAMES[5:])
    assert st["clip_share"] is None and st["norm_p50"] is None and st["norm_count"] == 0
    assert all(st[k] is None for k in NAMES[:5])
    c = guard.counters()
    assert c.shape == (len(COUNTERS),) and not c.any()
    assert guard.total_norm is None and guard.skipped is None and not guard.last_step_skipped()
    assert _readings(_saved_and_loaded(guard, MODES[mode])) == _readings(guard)


@pytest.mark.parametrize("last", ["taken", "skipped"])
@pytest.mark.parametrize("mode", list(MODES))
def test_save_and_load_leave_every_reading_as_it_was(mode, last):
    """Mid-run (the records of the last steps not folded yet): the loaded guard, before its first clip_,
    reads what the saved one reads; then both go on alike."""
    kw = MODES[mode]
    ps, guard = _guard(kw)
    _run(ps, guard, range(5), bad={1, 2} | ({4} if last == "skipped" else set()))
    assert guard._counters.records  # not folded yet: the save must fold them
    st = guard.state()
    assert st["steps"] == 5 and st["skipped"] == (last == "skipped")
    before = _readings(guard)
    loaded = _saved_and_loaded(guard, kw)
    assert _readings(loaded) == before
    assert _readings(guard) == before  # saving changed nothing either
    qs = loaded.optimizer.param_groups[0]["params"]
    _run(ps, guard, [5, 6])
    _run(qs, loaded, [5, 6])
    assert loaded.state() == guard.state() and loaded.state()["steps"] == 7


def test_a_checkpoint_without_the_last_step_still_loads():
    """A checkpoint written before state_dict kept the last step's readings: counters as saved, no last step."""
    ps, guard = _guard(MODES["norm"])
    _run(ps, guard, range(3), bad={1})
    sd = guard.state_dict()
    del sd["last"]
    _, other = _guard(MODES["norm"], seed=1)
    other.load_state_dict(sd)
    st = other.state()
    assert [st[k] for k in NAMES[5:]] == [guard.state()[k] for k in NAMES[5:]]
    assert all(st[k] is None for k in NAMES[:5]) and other.skipped is None
