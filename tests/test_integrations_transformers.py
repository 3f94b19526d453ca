"""fastgrad.integrations.transformers.StepGuardCallback in a real Hugging Face Trainer (CPU, a tiny model,
batches in order): a NaN batch at a known step leaves the parameters and the optimizer state exactly as
they were right before it, the run ends finite and the counters reach the Trainer's logs; the same run
without the callback (the Trainer's own clip) goes NaN."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastgrad.integrations.transformers import StepGuardCallback  # noqa: E402

from .integration_cases import BatchNormNet, batches, finite, model_bits, same, snapshot  # noqa: E402

STEPS = 6


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 2)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


class InOrder(transformers.Trainer):
    """Batches in data-set order, so the NaN batch lands at a known step."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


class Recorder(transformers.TrainerCallback):
    def __init__(self):
        self.before, self.after = [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        self.before.append(snapshot(list(model.parameters()), optimizer))

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        self.after.append(snapshot(list(model.parameters()), optimizer))


def _train(tmp_path, bad, callbacks, accumulation=1, model=None, drop=(), **kw):
    data = [{"x": x, "labels": y} for i, (x, y) in enumerate(batches(STEPS * accumulation, bad)) if i not in drop]
    args = transformers.TrainingArguments(**{**dict(
        output_dir=str(tmp_path), max_steps=len(data) // accumulation, per_device_train_batch_size=1,
        gradient_accumulation_steps=accumulation, learning_rate=1e-2, logging_steps=2, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, optim="adamw_torch_fused", lr_scheduler_type="constant",
    ), **kw})
    model = Tiny() if model is None else model
    trainer = InOrder(model=model, args=args, train_dataset=data, callbacks=callbacks,
                      data_collator=lambda rows: {k: rows[0][k] for k in rows[0]})
    trainer.train()
    return model, trainer


@pytest.mark.parametrize("accumulation,bad,bad_steps", [(1, {0}, {0}), (1, {3}, {3}), (2, {5}, {2})])
def test_nan_batch_is_skipped_in_a_trainer_run(tmp_path, accumulation, bad, bad_steps):
    rec = Recorder()
    cb = StepGuardCallback(max_norm=1.0)
    model, trainer = _train(tmp_path, bad, [cb, rec], accumulation, max_grad_norm=0)
    assert len(rec.before) == STEPS
    for i in range(STEPS):
        assert same(rec.after[i], rec.before[i]) == (i in bad_steps), i
    assert finite(model.parameters())
    st = cb.guard.state()
    assert st["steps"] == STEPS and st["skipped_steps"] == len(bad_steps)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and logs[-1]["guard_skipped_steps"] == len(bad_steps) and logs[-1]["guard_steps"] == STEPS
    control, _ = _train(tmp_path, bad, [], accumulation, max_grad_norm=1.0)
    assert not finite(control.parameters())


class BatchNormTiny(BatchNormNet):
    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(super().forward(x), labels)}


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch", "sgd"])
def test_twin_run_a_nan_batch_leaves_the_model_buffers_included_as_if_never_seen(tmp_path, optim):
    """The guarded run with a NaN batch against the plain Trainer on the same batches without it: parameters,
    BatchNorm running statistics, num_batches_tracked and optimizer state are the same bits."""
    cb = StepGuardCallback(max_norm=1e9)  # 1e9: no clip engages, so the plain Trainer is the twin
    model, trainer = _train(tmp_path / "a", {2}, [cb], model=BatchNormTiny(), max_grad_norm=0, optim=optim)
    twin, twin_trainer = _train(tmp_path / "b", {2}, [], model=BatchNormTiny(), drop={2}, max_grad_norm=0,
                                optim=optim)
    assert cb.guard.state()["skipped_steps"] == 1
    assert same(model_bits(model, trainer.optimizer), model_bits(twin, twin_trainer.optimizer))
    assert finite(model.buffers())
    assert not model.bn._forward_pre_hooks  # the keeper leaves with the training


def test_trainer_that_also_clips_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_grad_norm=1.0"):
        _train(tmp_path, set(), [StepGuardCallback(max_norm=1.0)], max_grad_norm=1.0)
    with pytest.raises(ValueError, match="skip_factor"):
        StepGuardCallback(max_norm=1.0, skip_factor=0.9)
    with pytest.raises(TypeError, match="guards the model the trainer trains"):
        StepGuardCallback(max_norm=1.0, model=torch.nn.Linear(1, 1))


@pytest.mark.parametrize("mode,kw", [("zclip", dict(warmup_steps=2)), ("norm", dict(max_norm=1.0))])
def test_resume_from_a_trainer_checkpoint_keeps_the_guard(tmp_path, mode, kw):
    """The callback saves the guard's state into each checkpoint folder; trainer.train(resume_from_checkpoint=
    True) continues it: the resumed run equals the uninterrupted one (parameters, optimizer state, guard)."""
    n = 8
    data = [{"x": x, "labels": y} for x, y in batches(n, {2, 5})]

    def run(out, max_steps, resume=None):
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=1, learning_rate=1e-2,
            logging_steps=2, report_to="none", save_strategy="steps", save_steps=4, use_cpu=True,
            disable_tqdm=True, optim="adamw_torch_fused", lr_scheduler_type="constant", max_grad_norm=0,
            data_seed=0, seed=0)
        model, cb = Tiny(), StepGuardCallback(mode=mode, skip_factor=4.0, **kw)
        trainer = InOrder(model=model, args=args, train_dataset=data, callbacks=[cb],
                          data_collator=lambda rows: {k: rows[0][k] for k in rows[0]})
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer, cb

    full, tr_full, cb_full = run(tmp_path / "full", n)
    run(tmp_path / "part", 4)
    assert (tmp_path / "part" / "checkpoint-4" / "fastgrad_guard.pt").is_file()
    resumed, tr_res, cb_res = run(tmp_path / "part", n, resume=True)
    assert tr_res.state.global_step == n
    assert same(snapshot(list(resumed.parameters()), tr_res.optimizer),
                snapshot(list(full.parameters()), tr_full.optimizer))
    assert cb_res.guard.state() == cb_full.guard.state()
    assert cb_res.guard.state()["skipped_steps"] == 2 and cb_res.guard.state()["steps"] == n


@pytest.mark.parametrize("hold", [False, True])
def test_hold_schedule_holds_the_lr_schedule_on_a_skip(tmp_path, hold):
    """By default a skipped step advances the Trainer's schedule (as a plain torch loop would);
    hold_schedule=True keeps it in step with the updates taken, as the Trainer does on a GradScaler overflow."""
    cb = StepGuardCallback(max_norm=1.0, hold_schedule=hold)
    model, trainer = _train(tmp_path, {1, 3}, [cb], max_grad_norm=0, lr_scheduler_type="linear")
    assert cb.guard.state()["skipped_steps"] == 2 and finite(model.parameters())
    taken = STEPS - 2 if hold else STEPS
    assert trainer.lr_scheduler.last_epoch == taken
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(1e-2 * (1 - taken / STEPS))
    assert trainer.state.global_step == STEPS  # the Trainer's step count is not the schedule's


def test_hold_schedule_is_checked_when_built():
    with pytest.raises(TypeError, match="hold_schedule must be True or False"):
        StepGuardCallback(max_norm=1.0, hold_schedule="yes")


class PoisonAt(transformers.TrainerCallback):
    """A write outside the optimizer step: NaN into a buffer after the step's update."""

    def __init__(self, step):
        self.step = step

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step == self.step - 1:  # global_step counts the step once it is done
            with torch.no_grad():
                model.bn.running_mean.view(-1)[0] = float("nan")


def test_a_checkpoint_that_is_not_finite_is_refused(tmp_path):
    from fastgrad.guard import GuardError

    with pytest.raises(GuardError, match="refusing to write this Hugging Face Trainer checkpoint: not finite: "
                                         "buffer bn.running_mean"):
        _train(tmp_path, set(), [StepGuardCallback(max_norm=1.0), PoisonAt(3)], model=BatchNormTiny(),
               max_grad_norm=0, save_strategy="steps", save_steps=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-1", "checkpoint-2"]
