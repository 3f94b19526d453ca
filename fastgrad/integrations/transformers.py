"""``StepGuardCallback``: fastgrad's step guard in a Hugging Face ``Trainer``.

    args = TrainingArguments(..., max_grad_norm=0)          # the guard clips; the Trainer must not
    trainer = Trainer(model, args, ..., callbacks=[StepGuardCallback(max_norm=1.0)])

The Trainer calls ``on_pre_optimizer_step`` right before ``optimizer.step()``, after the last backward of
the accumulated batch; there this callback calls ``guard.clip_()`` (the guard is built on the Trainer's
optimizer at the first such call and exposed as ``.guard``). A skipped step leaves the parameters, the
optimizer state and the model's buffers (BatchNorm running statistics) as they were: the buffers' keeper
(``fastgrad.guard.BufferKeeper``) is put on the model at the start of training, before the first forward. A skipped step still counts as a step for the
Trainer (``global_step``) and, by default, for its learning-rate schedule; ``hold_schedule=True`` holds the
schedule back on a skipped step (one device-to-host read of the flag per step), as the Trainer does itself
on a GradScaler overflow.
At each training log the counters are added to the logged values (``guard_skipped_steps`` etc.; one
device-to-host read per log): in ``trainer.state.log_history`` and in the ``logs`` that callbacks after this
one receive. At each checkpoint the guard's statistics and counters are saved into the checkpoint folder
(``fastgrad_guard.pt``) and loaded again when the Trainer resumes from ``output_dir/checkpoint-N``. A
checkpoint whose weights, buffers or optimizer state are not finite is refused before it is written
(GuardError; one host read per checkpoint).
"""

from __future__ import annotations

import os
import warnings

from ..guard import BufferKeeper, StepGuard
from ._common import (check_hold_schedule, check_no_model, counters, hold_accelerate_schedule,
                      refuse_unsafe_checkpoint, require)

_tf = require("transformers", "transformers", "fastgrad.integrations.transformers")

__all__ = ["StepGuardCallback"]


class StepGuardCallback(_tf.TrainerCallback):
    """Args: ``max_norm`` and any :class:`fastgrad.StepGuard` option, checked here; ``hold_schedule``: a
    skipped step does not advance the learning-rate schedule (one read of the flag per step)."""

    def __init__(self, max_norm: float | None = None, *, hold_schedule: bool = False, **options):
        import torch

        check_no_model(options)
        self.max_norm = max_norm
        self.options = options
        self.hold_schedule = check_hold_schedule(hold_schedule)
        probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        StepGuard(probe, max_norm, **options).remove()  # the options are checked now
        self.guard: StepGuard | None = None
        self._loaded: dict | None = None  # the guard state of the checkpoint resumed from
        self._keeper: BufferKeeper | None = None  # the model's buffers, saved from the first forward on

    def on_train_begin(self, args, state, control, **kwargs):
        if args.max_grad_norm not in (None, 0, 0.0):
            raise ValueError(
                f"StepGuardCallback clips the gradients itself, but TrainingArguments(max_grad_norm="
                f"{args.max_grad_norm}) makes the Trainer clip them too, before the guard. Pass "
                "TrainingArguments(max_grad_norm=0) and StepGuardCallback(max_norm=...)")
        model = kwargs.get("model")
        if self._keeper is not None:
            self._keeper.remove()
        self._keeper = BufferKeeper(model) if model is not None else None
        if state.global_step > 0:  # resumed: the Trainer has loaded the checkpoint's state
            path = os.path.join(_checkpoint_dir(args, state), GUARD_FILE)
            if os.path.isfile(path):
                import torch

                self._loaded = torch.load(path, map_location="cpu", weights_only=True)
            else:
                warnings.warn(f"StepGuardCallback: the run resumes at step {state.global_step} but {path} does "
                              "not exist; the guard starts afresh (counters from 0, a new warm-up)", stacklevel=2)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.guard is None or guard_target(optimizer) is not self.guard.optimizer:
            if self.guard is not None:
                self.guard.remove()
            self.guard = StepGuard(optimizer, self.max_norm, model=self._keeper, **self.options)
            if self._loaded is not None:
                self.guard.load_state_dict(self._loaded)
                self._loaded = None
        self.guard.clip_()

    def on_train_end(self, args, state, control, **kwargs):
        if self._keeper is not None:  # the model as it was: no hooks left on it
            self._keeper.remove()
            self._keeper = None

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # after optimizer.step(), before the Trainer asks accelerate whether the step was skipped
        if self.hold_schedule and self.guard is not None:
            hold_accelerate_schedule(optimizer, self.guard.last_step_skipped())

    def on_step_end(self, args, state, control, **kwargs):
        # the Trainer writes a checkpoint after this event when should_save is set (and calls on_save only
        # once it is written): a checkpoint that is not finite is refused here, before it is written
        if control.should_save:
            refuse_unsafe_checkpoint(self.guard, "Hugging Face Trainer")

    def on_save(self, args, state, control, **kwargs):
        """Next to the Trainer's checkpoint (``output_dir/checkpoint-N``): the guard's statistics and counters,
        loaded again when the Trainer resumes from it."""
        folder = _checkpoint_dir(args, state)
        if self.guard is not None and state.is_world_process_zero and os.path.isdir(folder):
            import torch

            torch.save(self.guard.state_dict(), os.path.join(folder, GUARD_FILE))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.guard is None or logs is None or "loss" not in logs:
            return
        metrics = counters(self.guard, "guard_")
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)


GUARD_FILE = "fastgrad_guard.pt"


def _checkpoint_dir(args, state) -> str:
    # where the Trainer writes the checkpoint of this step, and where resume_from_checkpoint=True finds it
    return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")


def guard_target(optimizer):
    from ..guard.core import unwrap_optimizer

    return unwrap_optimizer(optimizer)[0]
