"""``StepGuardCallback``: fastgrad's step guard in a Hugging Face ``Trainer``.

    args = TrainingArguments(..., max_grad_norm=0)          # the guard clips; the Trainer must not
    trainer = Trainer(model, args, ..., callbacks=[StepGuardCallback(max_norm=1.0)])

The Trainer calls ``on_pre_optimizer_step`` right before ``optimizer.step()``, after the last backward of
the accumulated batch; there this callback calls ``guard.clip_()`` (the guard is built on the Trainer's
optimizer at the first such call and exposed as ``.guard``). A skipped step still counts as a step for the
Trainer (``global_step``, the learning-rate schedule), as a GradScaler's overflow skip does in plain torch.
At each training log the counters are added to the logged values (``guard_skipped_steps`` etc.; one
device-to-host read per log): in ``trainer.state.log_history`` and in the ``logs`` that callbacks after this
one receive.
"""

from __future__ import annotations

from ..guard import StepGuard
from ._common import counters, require

_tf = require("transformers", "transformers", "fastgrad.integrations.transformers")

__all__ = ["StepGuardCallback"]


class StepGuardCallback(_tf.TrainerCallback):
    """Args: ``max_norm`` and any :class:`fastgrad.StepGuard` option, checked here."""

    def __init__(self, max_norm: float | None = None, **options):
        import torch

        self.max_norm = max_norm
        self.options = options
        probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        StepGuard(probe, max_norm, **options).remove()  # the options are checked now
        self.guard: StepGuard | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if args.max_grad_norm not in (None, 0, 0.0):
            raise ValueError(
                f"StepGuardCallback clips the gradients itself, but TrainingArguments(max_grad_norm="
                f"{args.max_grad_norm}) makes the Trainer clip them too, before the guard. Pass "
                "TrainingArguments(max_grad_norm=0) and StepGuardCallback(max_norm=...)")

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self.guard is None or guard_target(optimizer) is not self.guard.optimizer:
            if self.guard is not None:
                self.guard.remove()
            self.guard = StepGuard(optimizer, self.max_norm, **self.options)
        self.guard.clip_()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.guard is None or logs is None or "loss" not in logs:
            return
        metrics = counters(self.guard, "guard_")
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)


def guard_target(optimizer):
    from ..guard.core import unwrap_optimizer

    return unwrap_optimizer(optimizer)[0]
