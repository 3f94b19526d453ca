"""``StepGuardCallback``: fastgrad's step guard in a Lightning ``Trainer`` (automatic optimization).

    trainer = lightning.Trainer(callbacks=[StepGuardCallback(max_norm=1.0)])

At fit start it guards the module's optimizer (``fastgrad.StepGuard(optimizer, max_norm, model=module,
**options)``, exposed as ``.guard``): a skipped step leaves the parameters, the optimizer state and the
module's buffers (BatchNorm running statistics) as they were. Lightning's automatic optimization calls ``optimizer.step(closure)``; the closure
runs forward and backward and then ``on_before_optimizer_step``, where this callback calls ``guard.clip_()``,
so the decision is applied inside the step, before the update (sync-free with a fused optimizer). Under
"16-mixed" Lightning unscales the gradients before that hook; the guard then sees the unscaled ones. At
the Trainer's logging steps (``log_every_n_steps``) the counters go to the module's loggers as
``guard/skipped_steps`` etc. (one device-to-host read per logging step). The guard's statistics and
counters are saved in Lightning's checkpoints (the callback's ``state_dict``) and restored on
``trainer.fit(ckpt_path=...)``. A checkpoint whose weights, buffers or optimizer state are not finite is
refused before it is written (GuardError; one host read per checkpoint). A skipped step still advances the learning-rate schedulers by default;
with ``hold_schedule=True`` the schedulers stepped per step (``interval="step"``) hold back on a skipped step
(one device-to-host read of the flag per step; the callback wraps the module's ``lr_scheduler_step`` for the
fit); per-epoch schedulers count epochs and are left alone.
"""

from __future__ import annotations

from ..guard import StepGuard
from ._common import check_hold_schedule, check_no_model, counters, refuse_unsafe_checkpoint, require

_pl = require("lightning.pytorch", "lightning", "fastgrad.integrations.lightning")

__all__ = ["StepGuardCallback"]


class StepGuardCallback(_pl.Callback):
    """Args: ``max_norm`` and any :class:`fastgrad.StepGuard` option (``mode``, ``skip_factor``,
    ``max_consecutive_skips``, ...), checked here, before the Trainer starts."""

    def __init__(self, max_norm: float | None = None, *, hold_schedule: bool = False, **options):
        check_no_model(options)
        self.max_norm = max_norm
        self.options = options
        self.hold_schedule = check_hold_schedule(hold_schedule)
        # the options are checked now, not at fit start: a throwaway guard on a throwaway optimizer
        import torch

        probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        StepGuard(probe, max_norm, **options).remove()
        self.guard: StepGuard | None = None
        self._logged_step = -1
        self._loaded: dict | None = None  # a checkpoint's guard state, until the guard exists

    def on_fit_start(self, trainer, pl_module) -> None:
        clip = trainer.gradient_clip_val
        if clip is not None and clip != 0:
            raise ValueError(
                f"StepGuardCallback clips the gradients itself, but the Trainer also clips them "
                f"(gradient_clip_val={clip}); the second clip would apply after the guard's decision. Remove "
                "gradient_clip_val from the Trainer and pass max_norm to StepGuardCallback")
        if not pl_module.automatic_optimization:
            raise ValueError(
                "StepGuardCallback works with Lightning's automatic optimization; with manual optimization "
                "build fastgrad.StepGuard(optimizer, ...) yourself and call guard.clip_() before "
                "optimizer.step()")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"StepGuardCallback guards one optimizer; this module configures "
                             f"{len(trainer.optimizers)}")
        if self.guard is None or self.guard.optimizer is not trainer.optimizers[0]:
            if self.guard is not None:
                self.guard.remove()
            self.guard = StepGuard(trainer.optimizers[0], self.max_norm, model=pl_module, **self.options)
        if self._loaded is not None:
            self.guard.load_state_dict(self._loaded)
            self._loaded = None
        if self.hold_schedule:
            self._hold_schedule(trainer, pl_module)

    def _hold_schedule(self, trainer, pl_module) -> None:
        """Wrap the module's ``lr_scheduler_step`` (Lightning's hook for stepping each scheduler) so that a
        per-step scheduler does not step after a skipped step."""
        own = pl_module.__dict__.get("lr_scheduler_step")
        inner = getattr(own, "_fastgrad_inner", None) or pl_module.lr_scheduler_step
        per_step = {id(c.scheduler) for c in trainer.lr_scheduler_configs if c.interval == "step"}
        cb = self

        def lr_scheduler_step(scheduler, metric):
            if id(scheduler) in per_step and cb.guard.last_step_skipped():
                return None
            return inner(scheduler, metric)

        lr_scheduler_step._fastgrad_inner = inner
        pl_module.lr_scheduler_step = lr_scheduler_step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        """Before Lightning writes the file: a checkpoint whose weights, buffers or optimizer state hold a NaN
        or an inf is refused (GuardError), so it never replaces a healthy one."""
        refuse_unsafe_checkpoint(self.guard, "Lightning")

    def state_dict(self) -> dict:
        """Saved by Lightning in every checkpoint: the guard's statistics and counters (its state_dict)."""
        return {} if self.guard is None else {"guard": self.guard.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Lightning restores callbacks before or after ``on_fit_start`` depending on the strategy: load into
        the guard if it exists, else when ``on_fit_start`` builds it."""
        sd = state_dict.get("guard")
        if sd is None:
            return
        if self.guard is not None:
            self.guard.load_state_dict(sd)
        else:
            self._loaded = sd

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.guard.clip_()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        every = trainer.log_every_n_steps
        if not trainer.loggers or not every or step == self._logged_step or step % every:
            return
        self._logged_step = step
        metrics = counters(self.guard, "guard/")
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def on_fit_end(self, trainer, pl_module) -> None:
        own = pl_module.__dict__.get("lr_scheduler_step")
        if getattr(own, "_fastgrad_inner", None) is not None:
            del pl_module.lr_scheduler_step  # the module as it was
        if not trainer.loggers or trainer.global_step == self._logged_step:
            return
        metrics = counters(self.guard, "guard/")  # the final counters, whatever the logging interval
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
