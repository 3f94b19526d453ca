"""The interceptors of ``python -m fastgrad.check`` that spot the red flags of a training loop: where the clip
runs (between scale and unscale_, after the step, inside an accumulation window), with which bound, whether
the gradients are zeroed, what the GradScaler did. Host bookkeeping only: nothing here reads a device value.
A mixin of :class:`~fastgrad.diagnose.collect.hooks.Checker`, which owns the state."""

from __future__ import annotations

import linecache
import os
import sys
import weakref

import torch
from torch import Tensor

from ...distributed import to_local_norm
from .loss_inputs import criterion_sign, loss_node

__all__ = ["RedFlagInterceptors", "scaler_classes"]

ABSENT = object()  # an attribute to delete, not restore, when the interceptors are removed


def scaler_classes() -> list[type]:
    """torch.amp.GradScaler and every subclass defined so far (FSDP's ShardedGradScaler once its module is
    imported). Subclasses defined later, while the script runs, are caught as they are created
    (``RedFlagInterceptors._watch_scaler_subclasses``): importing torch.distributed.fsdp up front only to find
    one cost every checked run seconds of start-up."""
    out, todo = [], [torch.amp.GradScaler]
    while todo:
        cls = todo.pop(0)
        if cls not in out:
            out.append(cls)
            todo += cls.__subclasses__()
    return out


def _clip_bound(args, kwargs, bound_at: int | None) -> float | None:
    """A clip's max_norm: a host number when the script passed one (a value clip's or AGC's bound is not a norm
    bound, ``bound_at`` None, and is not quoted as one)."""
    if bound_at is None:
        return None
    bound = kwargs.get("max_norm", args[bound_at] if len(args) > bound_at else None)
    return float(bound) if isinstance(bound, (int, float)) and not isinstance(bound, bool) else None


def _params_listed(args, kwargs):
    """``(args, kwargs, params)``: a clip's parameters as a list (made one where the script passed a one-pass
    iterator, which the clip then receives instead), or None where there are none to read."""
    params = kwargs.get("parameters", args[0] if args else None)
    if params is None:
        return args, kwargs, None
    if isinstance(params, Tensor):
        return args, kwargs, [params]
    if not isinstance(params, (list, tuple)):
        params = list(params)
        if "parameters" in kwargs:
            kwargs = dict(kwargs, parameters=params)
        else:
            args = (params,) + tuple(args[1:])
    return args, kwargs, [p for p in params if isinstance(p, Tensor)]


def _no_parameter(params: list) -> bool:
    """A clip handed tensors none of which can hold a gradient an optimizer uses: no parameter and no leaf that
    requires grad (a loss, an activation, a detached copy). A computed tensor keeps no ``.grad``, so such a clip
    bounds nothing."""
    return bool(params) and not any(isinstance(p, torch.nn.Parameter) or (p.is_leaf and p.requires_grad)
                                    for p in params)


def _what(t: Tensor) -> str:
    """A tensor a clip was handed, in words (the shape, and what it is: a scalar with a graph is a loss)."""
    shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
    if t.requires_grad and t.numel() == 1:
        return f"a scalar the graph computed (shape {shape}: a loss)"
    if t.requires_grad:
        return f"a tensor the graph computed (shape {shape})"
    return f"a tensor that requires no gradient (shape {shape})"


def _call_site() -> dict:
    """The caller of a clip outside fastgrad and torch: its file's name, line and source text."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    skip = (here, os.path.dirname(os.path.abspath(torch.__file__)))
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(skip):
        f = f.f_back
    if f is None:
        return {}
    path = f.f_code.co_filename
    return {"file": os.path.basename(path), "line": f.f_lineno,
            "code": linecache.getline(path, f.f_lineno).strip()}


class RedFlagInterceptors:
    """Wrappers of the clip functions, ``zero_grad``, ``GradScaler.scale/unscale_/step``, ``StepGuard.clip_``,
    and the counted calls (``Optimizer.__init__``); each returns the replacement of ``orig``."""

    def _patch_scaler(self, cls: type) -> None:
        # a subclass that overrides one of these (FSDP's ShardedGradScaler: scale and unscale_) needs its own
        # interceptor: the patched base method is never reached through it
        for name, wrap in (("scale", self._wrap_scale), ("unscale_", self._wrap_unscale),
                           ("step", self._wrap_scaler_step)):
            if name in vars(cls):
                self._patch(cls, name, wrap)

    def _watch_scaler_subclasses(self) -> None:
        """Intercept the GradScaler subclasses the script defines or imports while it runs (ShardedGradScaler
        when it imports torch.distributed.fsdp), as each class is created; undone by ``remove``."""
        base = torch.amp.GradScaler
        had = "__init_subclass__" in vars(base)
        orig = vars(base).get("__init_subclass__")
        chk = self

        def __init_subclass__(cls, **kwargs):
            if orig is not None:
                orig.__get__(None, cls)(**kwargs)
            else:
                super(base, cls).__init_subclass__(**kwargs)
            try:
                chk._patch_scaler(cls)
            except Exception as e:  # noqa: BLE001 - never break the script's class definition
                chk.errors.append(f"GradScaler subclass {cls.__name__}: {e}")

        base.__init_subclass__ = classmethod(__init_subclass__)
        self._undo.append((base, "__init_subclass__", orig if had else ABSENT))

    def _wrap_counting(self, counter: str, orig):
        """``orig``, counting its calls in the checker's attribute ``counter`` (the optimizers the script
        makes)."""
        chk = self

        def counted(obj, *args, **kwargs):
            setattr(chk, counter, getattr(chk, counter) + 1)
            return orig(obj, *args, **kwargs)
        return counted

    def _wrap_zero_grad(self, orig):
        chk = self

        def zero_grad(self_, *args, **kwargs):
            chk._zeroed = True
            chk._any_zero = True
            chk.zero_grad_calls += 1
            if chk._m_row is not None and not chk._opt_started:
                if chk._m_clip and not chk._m_zeroed:
                    try:  # the gradients the hand-written update consumed: clipped since the backward
                        chk._m_used = chk._consumed_row()
                    except Exception as e:  # noqa: BLE001
                        chk.errors.append(f"zero_grad: could not read the gradients: {e}")
                chk._m_zeroed = True
            return orig(self_, *args, **kwargs)
        return zero_grad

    def _wrap_scale(self, orig):
        chk = self

        def scale(scaler, outputs):
            out = orig(scaler, outputs)
            if scaler.is_enabled() and isinstance(out, Tensor) and isinstance(outputs, Tensor):
                # lets backward find the unscaled loss and know that the grads it makes are scaled
                chk._scaled = (weakref.ref(out), outputs.detach())
                chk._scaled_node = loss_node(outputs)
                chk._scaled_sign = criterion_sign(outputs)  # the loss's graph (the scaled one's is a device factor)
                chk.scaler_used = True
            return out
        return scale

    def _wrap_unscale(self, orig):
        chk = self

        def unscale_(scaler, optimizer):
            chk._grads_scaled = False
            return orig(scaler, optimizer)
        return unscale_

    def _wrap_scaler_step(self, orig):
        chk = self

        def step(scaler, optimizer, *args, **kwargs):
            before = chk.steps_done
            out = orig(scaler, optimizer, *args, **kwargs)
            if chk.steps_done == before:  # the scaler found Inf/NaN and skipped optimizer.step()
                chk.skipped += 1
                chk._opt_started = True
                chk._last_opt = weakref.ref(optimizer)
                chk._boundary(optimizer, skipped=True)
            return out
        return step

    def _wrap_clip(self, orig, bound_at: int | None = 1, norm_at: int | None = None, ranks: bool = False,
                   listed: bool = True):
        """``bound_at``: the position of the function's ``max_norm`` argument (None: a clip without a norm
        bound, e.g. clip_grad_value_'s clip_value or AGC's clipping ratio, which are never quoted as one);
        ``norm_at``: the position of the norm the script hands in (``clip_grads_with_norm_``'s total_norm),
        None where the clip returns the norm it computed; ``ranks``: a norm clip whose norm a multi-process
        run compares with the truth (``collect.ranks``); ``listed``: its first argument is the tensors to clip."""
        chk = self

        def clip(*args, **kwargs):
            if chk._clip_depth:
                return orig(*args, **kwargs)
            params = None
            if listed:  # (parameters, ...): read once, as a list (a one-pass iterator is made one)
                args, kwargs, params = _params_listed(args, kwargs)
                if params and _no_parameter(params):
                    chk._on_clip_of_no_parameter(orig, params, args, kwargs, bound_at)
                    return orig(*args, **kwargs)
            if not chk._opt_started and bound_at == 1:  # (parameters, max_norm, ...)
                # a hand-written loop: a clip whose every parameter has no gradient (zero_grad() or the update
                # dropped them) bounds nothing; it runs before the next backward()
                if params and any(p.grad is not None for p in params):
                    chk.clips_found_grads += 1
                elif params and chk._m_row is not None:
                    chk._on_clip_without_grads(args, kwargs, bound_at)
                    return orig(*args, **kwargs)
            if chk._bw == 0 and chk.steps_done and chk._opt_started and bound_at == 1:  # (parameters, max_norm)
                # misplaced (after a step, before the next backward): where zero_grad() already dropped every
                # gradient, the script's clip sits before backward(); reading .grad is no sync
                bare = bool(params) and all(p.grad is None for p in params)
                chk.misplaced_clip_bare = bare and chk.misplaced_clip_bare is not False
            chk._on_clip(args, kwargs, bound_at)
            rec = None
            if ranks:
                try:
                    rec = chk._rank_before_clip(params)
                except Exception as e:  # noqa: BLE001 - the record is evidence, never a reason to fail the clip
                    chk.errors.append(f"step {chk.steps_done + 1}: could not record the ranks' gradients: {e}")
            chk._clip_depth += 1
            try:
                out = orig(*args, **kwargs)
            finally:
                chk._clip_depth -= 1
            norm = out
            if norm_at is not None:
                norm = kwargs.get("total_norm", args[norm_at] if len(args) > norm_at else None)
            if isinstance(norm, Tensor):
                # a sharded clip's DTensor norm (FSDP2, tensor parallel): the value every rank holds
                norm = to_local_norm(norm)
            if rec is not None:
                try:
                    chk._rank_keep(rec, norm, chk._clip_max)
                except Exception as e:  # noqa: BLE001
                    chk.errors.append(f"step {chk.steps_done + 1}: could not record the clip's norm: {e}")
            # A norm of still-scaled gradients is not the gradient norm: keep it out of the history.
            # Only a clip between backward and step tells the norm the step would have used.
            if isinstance(norm, Tensor) and norm.dim() == 0 and not chk._grads_scaled and chk._bw:
                chk._clip_norm = norm.detach()
            return out
        return clip

    def _rank_before_clip(self, params):
        """This rank's record of the gradients of ``params`` (the clip's tensors, which its wrapper listed once
        with ``_params_listed``: the clip then gets the same list), or None when not recorded."""
        if self._grads_scaled or params is None:
            return None
        return self._rank_record(params)

    def _wrap_fused_amp(self, orig):
        chk = self
        clip = self._wrap_clip(orig, bound_at=2, listed=False)  # (scaler, optimizer, max_norm)

        def scaler_unscale_and_clip(*args, **kwargs):
            if not chk._clip_depth:
                chk._grads_scaled = False  # it unscales before it clips
            return clip(*args, **kwargs)
        return scaler_unscale_and_clip

    def _wrap_guard_clip(self, orig):
        """StepGuard.clip_(scaler=None): a clip (its norm is the one before clipping, its bound the guard's
        max_norm) that also unscales when given a scaler."""
        chk = self
        clip = self._wrap_clip(orig, bound_at=None, listed=False)

        def clip_(guard, scaler=None):
            if not chk._clip_depth and scaler is not None:
                chk._grads_scaled = False
            out = clip(guard, scaler)
            if guard.max_norm is not None and chk._bw:
                chk._clip_max = float(guard.max_norm)
            return out
        return clip_

    def _on_clip_of_no_parameter(self, orig, params: list, args, kwargs, bound_at: int | None) -> None:
        """A clip handed no parameter (``clip_grad_norm_(loss, 1.0)``): counted as a call (the script does
        clip, at the wrong tensors), flagged at the step it sits in, its first call site and tensor kept for the
        report; no step is marked clipped."""
        self.clip_calls += 1
        step = self.steps_done + 1
        self.flags["clip_not_params"].append(step)
        if self.clip_not_params is None:
            self.clip_not_params = dict(_call_site(), fn=getattr(orig, "__name__", "clip"), what=_what(params[0]),
                                        count=len(params), max_norm=_clip_bound(args, kwargs, bound_at))

    def _on_clip_without_grads(self, args, kwargs, bound_at: int) -> None:
        """A hand-written loop's clip that found no gradient at all: counted as a call, flagged as a clip that
        ran before backward() (at the step whose update dropped the gradients), its bound kept for the report;
        the open step is not marked clipped (its gradients were gone)."""
        self.clip_calls += 1
        self.misplaced_clip_max = _clip_bound(args, kwargs, bound_at)
        self.flags["clip_after_step"].append(len(self._m_steps) + len(self._m_host) + 1)

    def _on_clip(self, args=(), kwargs=None, bound_at: int | None = 1) -> None:
        kwargs = kwargs or {}
        self.clip_calls += 1
        self._clips += self._bw > 0
        bound = _clip_bound(args, kwargs, bound_at)
        if bound is not None:
            self._clip_max = bound
        if self._m_row is not None and not self._opt_started:
            self._m_clip = True
            self._m_clip_max = self._clip_max
        step = self.steps_done + 1
        if self._grads_scaled:
            self.flags["clip_scaled"].append(step)
        if self._bw == 0 and self.steps_done:
            # after optimizer.step() and before the next backward: this clip changes nothing the optimizer uses
            self.flags["clip_after_step"].append(self.steps_done)
            self.misplaced_clip_max = self._clip_max  # the bound it would have applied (None: not a norm bound)
        elif self._bw:
            self._clip_after_bw = True

