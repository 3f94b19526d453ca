"""The step guard: clip, and keep a bad step (non-finite norm, or a spike) out of the weights and the
optimizer state, decided on the device. ``StepGuard`` (core) is built from small parts: ``options``, one
object per mode (``modes/``: one file each, found there), ``read`` (the read passes), ``counters`` and
``skip`` (the step hooks), ``buffers`` (the model's buffers through a skip). See docs/guard.md."""

from .buffers import BufferKeeper
from .core import COUNTERS, MODES, StepGuard, guard_for
from .counters import WARN_AFTER, GuardError, GuardWarning

__all__ = ["StepGuard", "BufferKeeper", "GuardError", "GuardWarning", "WARN_AFTER", "guard_for", "COUNTERS", "MODES"]
