"""``clip_optimizer_grad_norm_``: clip an optimizer's gradients by their total norm, and with torch's
``fused=True`` optimizers hand the clip to the optimizer's own step instead of writing the gradients.

The plain (non-AMP) counterpart of ``scaler_unscale_and_clip(..., zero_write=True)`` (fastgrad/amp.py). torch's
fused Adam/AdamW/SGD/Adagrad kernels divide every gradient by ``optimizer.grad_scale`` while they read it for
the update (and store the quotient back into ``.grad``). So where that applies, the clip reads the gradients
once for the norm and leaves ``1 / coef`` (a float32 device tensor) pending for the optimizer's next step;
nothing is written. Elsewhere it is ``fastgrad.clip_grad_norm_`` over the optimizer's parameters.

The pending factor is consumed once. It is kept here, not on the optimizer: a step pre-hook (registered once
per optimizer) installs it as ``grad_scale`` just before that step reads it (multiplied into a ``grad_scale``
someone else set meanwhile, e.g. ``GradScaler.step``) and a post-hook puts back what was there before. The
pre-hook refuses a factor whose gradients changed after the clip (a backward, ``zero_grad``, an in-place
write, or a ``step(closure)`` that recomputes them): the coefficient would otherwise apply to gradients it
was not computed from. A second clip before the step replaces the factor. A clip inside a ``step(closure)``
closure comes after that step's pre-hook, so it writes the gradients (as ``clip_grad_norm_``); the hooks
flag the step, and a look up the call stack finds it where they cannot (the optimizer's first clip, made
inside a step that started before the hooks existed; a flag left by a step that raised). See docs/amp-reference.md for
the maths.
"""

from __future__ import annotations

import inspect
import sys
import weakref

import torch
from torch import Tensor

from . import _inputs as inputs
from . import route
from .clip import clip_grad_norm_

__all__ = ["clip_optimizer_grad_norm_", "zero_write_applies"]

_MISSING = object()


# ---------------------------------------------------------------- which optimizers
_KNOWN_STEPS: set | None = None


def _torch_fused_steps() -> set:
    """The step functions whose fused kernels compute ``grad / grad_scale`` (torch's own Adam, AdamW, SGD,
    Adagrad), unwrapped from torch's profiling and no-grad decorators."""
    global _KNOWN_STEPS
    if _KNOWN_STEPS is None:
        classes = [getattr(torch.optim, n, None) for n in ("Adam", "AdamW", "SGD", "Adagrad")]
        _KNOWN_STEPS = {inspect.unwrap(c.step) for c in classes if c is not None}
    return _KNOWN_STEPS


_STEP_CODES: frozenset | None = None


def _step_codes() -> frozenset:
    global _STEP_CODES
    if _STEP_CODES is None:
        _STEP_CODES = frozenset(f.__code__ for f in _torch_fused_steps())
    return _STEP_CODES


def _inside_step(optimizer) -> bool:
    """Whether the caller runs inside ``optimizer.step`` (in its closure): a frame of one of the known step
    functions whose ``self`` is this optimizer is on the call stack. Costs a walk up the stack; asked only
    where the step hooks cannot tell (see the module's docstring)."""
    codes = _step_codes()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes and frame.f_locals.get("self") is optimizer:
            return True
        frame = frame.f_back
    return False


def fused_torch_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's Adam/AdamW/SGD/Adagrad built with ``fused=True`` (every group
    fused, ``step`` not overridden): its kernels compute ``grad / grad_scale``."""
    # _step_supports_amp_scaling is set by fused=True at construction; every group must still be fused (a
    # group added with fused=False would assert that grad_scale is None), and a subclass that overrides step
    # is not a kernel we know the arithmetic of.
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if inspect.unwrap(type(optimizer).step) not in _torch_fused_steps():
        return False
    return all(g.get("fused") and not g.get("differentiable", False) for g in optimizer.param_groups)


def zero_write_applies(optimizer, grads: list[Tensor] | None = None) -> bool:
    """Whether ``clip_optimizer_grad_norm_(optimizer, ..., zero_write=True)`` hands its coefficient to
    ``optimizer`` instead of writing the gradients: one of torch's Adam/AdamW/SGD/Adagrad built with
    ``fused=True`` (every parameter group fused, ``step`` not overridden), no ``optimizer.grad_scale`` already
    set by someone else, not called from inside that optimizer's step (a closure), not while dynamo traces,
    and gradients that are dense, real, not float64 (the kernels take a float32 scale) and not DTensors."""
    if torch.compiler.is_compiling() or not fused_torch_optimizer(optimizer):
        return False
    if getattr(optimizer, "grad_scale", None) is not None:
        return False
    rec = _RECORDS.get(optimizer)
    if rec is not None and rec.in_step and _inside_step(optimizer):  # in_step alone may be left by a raise
        return False
    if grads is None:
        grads = inputs.grads_of(inputs.optimizer_params(optimizer))
    plan = route.plan_for(grads, None)
    if plan.place(grads, for_norm=False) is not None or plan.route != "plain":  # sharded, or torch's to serve
        return False
    return not inputs.has_dtype(grads, torch.float64)


# ---------------------------------------------------------------- the pending factor and its hooks
class PendingScale:
    """Per optimizer: the pending ``grad_scale`` with a fingerprint of the gradients it belongs to, and what
    the pre-hook replaced (restored by the post-hook). Holds no reference to the optimizer, and only weak
    ones to gradients (a zero_grad(set_to_none=True) must still free them).

    The fingerprint is the number of gradients and the identity and autograd version of the first and the
    last: O(1) host work per clip and step whatever the model's size. A backward (accumulating or after
    zero_grad), zero_grad itself and torch's in-place writes over the gradients all change it; a change to
    some middle gradient alone does not."""

    __slots__ = ("scale", "fingerprint", "in_step", "applied", "prev", "__weakref__")

    def __init__(self):
        self.scale = None
        self.fingerprint = None
        self.in_step = False
        self.applied = None
        self.prev = _MISSING

    @staticmethod
    def _ends(grads: list[Tensor]) -> tuple:
        first, last = grads[0], grads[-1]
        return len(grads), first._version, last._version

    def pend(self, scale: Tensor, grads: list[Tensor]) -> None:
        self.scale = scale
        self.fingerprint = (weakref.ref(grads[0]), weakref.ref(grads[-1]), self._ends(grads))

    def drop(self) -> None:
        self.scale = self.fingerprint = None

    def unchanged(self, grads: list[Tensor]) -> bool:
        first, last, ends = self.fingerprint
        return bool(grads) and first() is grads[0] and last() is grads[-1] and self._ends(grads) == ends


_RECORDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

_STALE_MSG = (
    "clip_optimizer_grad_norm_(zero_write=True) left a clip coefficient for this optimizer's next step, but "
    "{why}, so the coefficient no longer belongs to them. Call the clip after the last backward and right "
    "before optimizer.step() (or pass zero_write=False, which writes the clipped gradients). The coefficient "
    "was discarded and nothing was stepped."
)


def _restore(optimizer, rec: PendingScale) -> None:
    """Put back the ``grad_scale`` the pre-hook replaced, unless the step changed it itself."""
    if getattr(optimizer, "grad_scale", None) is rec.applied:
        if rec.prev is _MISSING:
            del optimizer.grad_scale
        else:
            optimizer.grad_scale = rec.prev
    rec.applied, rec.prev = None, _MISSING


def _pre_step(rec: PendingScale, optimizer, args, kwargs) -> None:
    rec.in_step = True
    if rec.applied is not None:  # a previous step raised before its post-hook: undo what it left
        _restore(optimizer, rec)
    scale = rec.scale
    if scale is None:
        return
    try:
        rest = args[1:] if args and args[0] is optimizer else args  # torch passes (self, *step_args)
        closure = rest[0] if rest else kwargs.get("closure")
        if closure is not None:
            raise RuntimeError(_STALE_MSG.format(
                why="step(closure) recomputes the gradients (clip inside the closure, after its backward)"))
        if not rec.unchanged(inputs.grads_of(inputs.optimizer_params(optimizer))):
            raise RuntimeError(_STALE_MSG.format(
                why="the gradients changed after the clip (a backward, zero_grad() or an in-place write)"))
    except RuntimeError:
        rec.in_step = False
        raise
    finally:
        rec.drop()  # consumed (or refused) either way: a factor never reaches a second step
    prev = getattr(optimizer, "grad_scale", _MISSING)
    if prev is _MISSING or prev is None:
        applied = scale
    else:  # e.g. GradScaler.step without unscale_: its scale times ours, as it multiplies in its own
        applied = prev * scale.to(prev.device, non_blocking=True)
    rec.applied, rec.prev = applied, prev
    optimizer.grad_scale = applied


def _post_step(rec: PendingScale, optimizer, args, kwargs) -> None:
    rec.in_step = False
    if rec.applied is not None:
        _restore(optimizer, rec)


def _record_for(optimizer) -> PendingScale:
    rec = _RECORDS.get(optimizer)
    if rec is None:
        rec = PendingScale()
        ref = weakref.ref(rec)  # the hooks live on the optimizer; the record lives while the optimizer does

        def pre(opt, args, kwargs):
            r = ref()
            if r is not None:
                _pre_step(r, opt, args, kwargs)

        def post(opt, args, kwargs):
            r = ref()
            if r is not None:
                _post_step(r, opt, args, kwargs)

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)
        _RECORDS[optimizer] = rec
    return rec


# ---------------------------------------------------------------- public
def _params(optimizer) -> list[Tensor]:
    try:
        return inputs.optimizer_params(optimizer)
    except (AttributeError, TypeError, KeyError, IndexError):
        pass
    if hasattr(optimizer, "unscale_") and hasattr(optimizer, "get_scale"):
        fix = ("got a GradScaler; with AMP use fastgrad.scaler_unscale_and_clip(scaler, optimizer, max_norm, "
               "zero_write=True)")
    elif isinstance(optimizer, (Tensor, torch.nn.Module)) or inspect.isgenerator(optimizer) \
            or isinstance(optimizer, (list, tuple)):
        fix = ("got parameters, not an optimizer; pass the optimizer whose step follows, or clip parameters "
               "with fastgrad.clip_grad_norm_(parameters, max_norm)")
    else:
        fix = f"optimizer must be a torch.optim.Optimizer (with param_groups), got {type(optimizer).__name__}"
    raise TypeError(f"clip_optimizer_grad_norm_(optimizer, max_norm): {fix}; the gradients were not modified") \
        from None


@torch.no_grad()
def clip_optimizer_grad_norm_(optimizer, max_norm: float, norm_type: float = 2.0,
                              error_if_nonfinite: bool = False, *, zero_write: bool = True,
                              backend: str | None = None, exact: bool = False) -> Tensor:
    """Clip the total norm of the gradients of ``optimizer``'s parameters (all its groups) to ``max_norm``,
    like ``clip_grad_norm_(params, max_norm, norm_type)``; returns the total norm before clipping.

    With ``zero_write=True`` (default) and where :func:`zero_write_applies` (torch's ``fused=True``
    Adam/AdamW/SGD/Adagrad), the gradients are only read: ``1 / coef`` goes to the optimizer's next step as
    its ``grad_scale`` (the fused kernel computes ``grad / grad_scale``), consumed by that step and by no
    later one. Until that step ``.grad`` holds the unclipped values; after it, the clipped ones as the kernel
    stored them (``grad / (1 / coef)``, within one ulp of ``grad * coef``). Call ``optimizer.step()`` (or
    ``scaler.step(optimizer)``) next, with no backward, ``zero_grad`` or gradient write in between: the
    step refuses a coefficient whose gradients changed. Everywhere else the gradients are clipped in place
    (``fastgrad.clip_grad_norm_``). No host sync, unless ``error_if_nonfinite=True`` (checked before
    anything is handed over or written). ``exact=True``: the norm and coefficient of ``clip_grad_norm_(...,
    exact=True)`` (fastgrad.exact).
    """
    max_norm = inputs.check_max_norm(max_norm)
    p = inputs.check_norm_type(norm_type)
    ex = inputs.check_exact(exact, p)
    if not isinstance(zero_write, bool):
        raise TypeError(f"zero_write must be True or False, got {zero_write!r}; the gradients were not modified")
    params = _params(optimizer)
    rec = _RECORDS.get(optimizer)
    if rec is not None:
        rec.drop()  # a new clip replaces a coefficient still pending from an earlier one
    grads = inputs.grads_of(params) if zero_write and fused_torch_optimizer(optimizer) else None
    if grads is not None and rec is None and not torch.compiler.is_compiling() and _inside_step(optimizer):
        # the first clip, inside a step that started before there were hooks: that step's pre-hook never ran
        # and cannot install a factor now. Register the hooks and flag the step (its post-hook, registered
        # now, still runs and clears the flag), so this clip and any other in the closure write.
        _record_for(optimizer).in_step = True
    if grads is None or not zero_write_applies(optimizer, grads):
        return clip_grad_norm_(params, max_norm, p, error_if_nonfinite, backend=backend, exact=exact)
    if not grads:
        return torch.tensor(0.0)
    # clip_grad_norm_'s plain route, op for op, the factor handed over instead of written (zero_write_applies:
    # plain dense grads, whose accumulation dtype is float32: float64 grads never get here)
    pending = _record_for(optimizer)
    return route.clip_(None, grads, max_norm, p, error_if_nonfinite, None, backend, ex,
                       hand_over=lambda scale: pending.pend(scale, grads))
