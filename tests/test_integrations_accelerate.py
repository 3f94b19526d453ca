"""fastgrad.StepGuard on accelerate's prepared optimizer (CPU, a tiny model): accelerator.backward, gradient
accumulation (accelerator.accumulate) and bf16 mixed precision. A NaN batch at a known micro-step makes its
optimizer step a skip: parameters and optimizer state right after it equal those right before it, the run
ends finite; the same loop with accelerate's own clip goes NaN."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import fastgrad  # noqa: E402

from .integration_cases import batches, finite, same, snapshot  # noqa: E402

STEPS = 4


def _fresh():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _run(bad, guarded, accumulation, precision, fused):
    _fresh()
    acc = accelerate.Accelerator(cpu=True, mixed_precision=precision, gradient_accumulation_steps=accumulation)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused) if fused else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = batches(STEPS * accumulation, bad)
    model, opt = acc.prepare(model, opt)
    guard = fastgrad.StepGuard(opt, max_norm=1.0) if guarded else None
    per_step = []
    for i, (x, y) in enumerate(data):
        with acc.accumulate(model):
            with acc.autocast():
                loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients:
                if guard is not None:
                    guard.clip_()
                else:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                before = snapshot(list(model.parameters()), opt.optimizer)
            opt.step()
            if acc.sync_gradients:
                per_step.append((before, snapshot(list(model.parameters()), opt.optimizer)))
            opt.zero_grad()
    return model, guard, per_step


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("accumulation,bad,bad_steps", [(1, {0}, {0}), (2, {3}, {1}), (2, {4, 5}, {2})])
def test_nan_batch_is_skipped_with_accelerate(accumulation, bad, bad_steps, precision, fused):
    model, guard, per_step = _run(bad, True, accumulation, precision, fused)
    assert len(per_step) == STEPS
    for i, (before, after) in enumerate(per_step):
        assert same(after, before) == (i in bad_steps), i
    assert finite(model.parameters())
    st = guard.state()
    assert st["steps"] == STEPS and st["skipped_steps"] == len(bad_steps)
    assert fastgrad.guard.guard_for(guard.optimizer) is guard
    control, _, _ = _run(bad, False, accumulation, precision, fused)
    assert not finite(control.parameters())


@pytest.mark.parametrize("gated", [False, True], ids=["advances", "gated"])
def test_prepared_scheduler_on_a_guard_skip(gated):
    """accelerate's prepared scheduler steps once per optimizer step and holds back only on a GradScaler
    overflow (``step_was_skipped``): a step the guard skips still advances it, as docs/guard.md says. The
    documented way to keep it in step with the updates taken (``gated``): gate its step on the guard's
    decision where gradients were synced (one read of the flag per optimizer step)."""
    _fresh()
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = fastgrad.StepGuard(opt, max_norm=1.0)
    for x, y in batches(8, {2}):
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            if acc.sync_gradients:
                guard.clip_()
            opt.step()
            if not (gated and acc.sync_gradients and guard.last_step_skipped()):
                sched.step()
            opt.zero_grad()
    assert guard.state()["skipped_steps"] == 1 and not opt.step_was_skipped
    updates = int(opt.optimizer.state[model.weight]["step"])
    assert updates == 3
    if gated:  # the schedule counts the updates taken
        assert sched.scheduler.last_epoch == 3 and sched.get_last_lr()[0] == 1e-2 / 4
    else:  # one step more than the updates: the skipped one
        assert sched.scheduler.last_epoch == 4 and sched.get_last_lr()[0] == 1e-2 / 5
    assert finite(model.parameters())


@pytest.mark.parametrize("fused", [True, False])
def test_a_missing_or_misplaced_clip_is_refused_at_the_synced_step_only(fused):
    """With accumulation, accelerate's optimizer.step() on a micro-batch that is not synced never reaches
    the optimizer, so it needs no decision; the synced step without a clip_ (forgotten, or placed before
    backward) is refused before anything is written, and the loop written as docs/guard.md says steps."""
    for misuse in ("forgotten", "before-backward"):
        _fresh()
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        model, opt = acc.prepare(model, opt)
        guard = fastgrad.StepGuard(opt, max_norm=1.0)
        data = batches(4, {1})
        for i, (x, y) in enumerate(data):
            with acc.accumulate(model):
                if misuse == "before-backward" and acc.sync_gradients:
                    opt.zero_grad(set_to_none=True)
                    guard.clip_()
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                if not acc.sync_gradients:
                    opt.step()  # not synced: nothing reaches the optimizer, nothing refused
                    continue
                before = snapshot(list(model.parameters()), opt.optimizer)
                first = "has not been called" if i == 1 else "not seen by a clip_"  # (clip_ ran at step 1)
                with pytest.raises(RuntimeError, match=first if misuse == "forgotten" else "found no gradients"):
                    opt.step()
                assert same(snapshot(list(model.parameters()), opt.optimizer), before)
                guard.clip_()  # the right place: after the last backward of the accumulated batch
                opt.step()
                opt.zero_grad()
        assert guard.state()["steps"] == 2 and guard.state()["skipped_steps"] == 1
        assert finite(model.parameters())
