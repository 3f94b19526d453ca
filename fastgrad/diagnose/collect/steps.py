"""``StepRecord``: one training step of a checked run, as the host saw it after a flush."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["StepRecord", "StopCheck"]


class StopCheck(BaseException):
    """Raised from the optimizer post-step hook after ``--steps`` steps. A BaseException, so the script's own
    ``except Exception`` blocks do not swallow it."""


@dataclass
class StepRecord:
    """One training step. ``total_norm`` is the norm of the gradients the update used (after any clip);
    ``clip_norm`` what the clip call returned (the norm before clipping), when it was readable (not the norm
    of still-scaled AMP gradients)."""

    step: int
    skipped: bool = False
    numel: int = 0
    has_loss: bool = False
    clipped: bool = False
    zeroed: bool = False
    leftover_checked: bool = False
    series: int = 0             # which optimizer (0, 1, ... in the order they first stepped)
    evals: int = 1              # closure evaluations of the step (LBFGS: several; the first one is read)
    source: str = "optimizer"   # "optimizer", "backward" for a hand-written loop (no torch.optim step), "log"
    clip_max: float | None = None  # the max_norm the script passed to a norm clip, when a number
    lr: float | None = None     # the optimizer's learning rate at the step (first param group)
    unread: bool = False        # the checker failed to read this step's gradients (see checker_error)
    guard_skipped: bool = False  # a fastgrad.StepGuard kept this step out of the weights and the optimizer
    clip_read: bool = False     # a clip between backward and step returned a readable norm (clip_norm)
    total_norm: float = math.nan
    nonfinite: float = 0.0
    zero: float = 0.0
    loss: float | None = None   # the sum of the losses backpropagated over the step
    leftover: float | None = None
    clip_norm: float | None = None
    # calls of a model (a root module) since the step before (any optimizer's), with gradients on or off: this
    # update's own forwards, and the rollout an on-policy agent collected before it, or an evaluation
    calls: int = 0
    norm_read: bool = True      # False: a log without a gradient norm (total_norm NaN says nothing then)

    @property
    def grad_norm(self) -> float:
        """The step's gradient norm before any clipping (what the backward passes produced), where the clip
        told it; else the norm the update used."""
        return self.clip_norm if self.clip_norm is not None else self.total_norm

    @property
    def overflow(self) -> bool:
        """The norm is infinite while no gradient value is: the sum of squares overflowed float32 (the true
        norm is above ~1.8e19). A clip then scales every gradient by 0: the update is zeroed."""
        return (self.norm_read and not self.skipped and not self.unread and not self.guard_skipped
                and self.nonfinite == 0 and math.isinf(self.grad_norm))

    @property
    def bad(self) -> bool:
        """The optimizer stepped on NaN/Inf gradients (not a skipped or unread step, not an overflowed norm
        of finite gradients)."""
        return not self.skipped and not self.guard_skipped and not self.unread and not self.overflow and \
            ((self.norm_read and not math.isfinite(self.total_norm)) or self.nonfinite > 0)
