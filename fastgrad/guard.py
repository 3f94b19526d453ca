"""``StepGuard``: clip, and keep a bad step (non-finite norm, or a spike) out of the weights and the optimizer
state, decided on the device from the norm of the clip's own read pass. See docs/guard.md.

One guard per optimizer::

    guard = fastgrad.StepGuard(optimizer, max_norm=1.0)            # or mode="zclip" / "autoclip" / "adagc"
    for batch in data:
        loss(batch).backward()
        guard.clip_()                  # or guard.clip_(scaler) after scaler.scale(loss).backward()
        optimizer.step()               # or scaler.step(optimizer); scaler.update()
        optimizer.zero_grad()

``clip_`` computes the total norm (and, for AdaGC, the per-tensor norms) in one read of the gradients, turns
it into a clip coefficient by the mode's rule and a 0-dim "bad step" flag, and leaves that flag pending for
the optimizer's next ``step``, which a step pre/post hook pair (registered once, at construction) enforces:

* torch's ``fused=True`` Adam/AdamW/SGD/Adagrad: the flag goes in as ``optimizer.found_inf`` (OR-ed into the
  one ``GradScaler.step`` passes), so the fused kernel skips the update on the device: parameters, moments
  and step counters unchanged, no host sync. Where ``clip_optimizer_grad_norm_`` would hand the coefficient
  over as ``grad_scale`` (zero-write), so does the guard.
* any other optimizer, ``non_fused="sync"`` (default): the pre-hook reads the flag (ONE host sync per step)
  and on a bad step hides the gradients from the step (``p.grad = None`` for its duration; torch's
  optimizers then leave those parameters and their state alone), restoring them afterwards.
* ``non_fused="restore"``: no host sync; the pre-hook snapshots the parameters and every state tensor, the
  post-hook puts the snapshot back where the flag says (``torch.where``). Costs one extra copy of parameters
  + state in memory and ~3 extra reads and 2 writes of them per step. Falls back to one flag read for a step
  where the state is created or is not on the flag's device (e.g. the CPU ``step`` counter of a non-capturable
  Adam on CUDA), or where the step adds state entries.

Nothing here reads device data on the host except where the text above or the methods' docs say so.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import Tensor

from . import _inputs as I
from . import _scan
from . import distributed as D
from .amp import _check_ready, _inv_scale, _is_sharded, _known_unscale, _optimizer_state, _record_read_pass, \
    device_amp_norms, combine_device_totals, optimizer_params
from .amp import zero_write_applies as _amp_zero_write_applies
from .backends import acc_dtype, clip_coef
from .backends.torch_backend import combine_norms
from .clip import _norm, _scale, _sharded_norm
from .optim_clip import _Record, _fused_torch_optimizer, zero_write_applies

__all__ = ["StepGuard", "GuardError", "guard_for"]

MODES = ("norm", "zclip", "autoclip", "adagc")

#: Counter slots of ``StepGuard.counters`` (one device tensor, float64 where the device has it).
_FOLD = 256  # steps between two folds of the per-step records into the counters (a fold is ~15 small
#              ops, ~0.3 ms on a CPU: amortised over 256 steps it is ~1 us per step)

COUNTERS = ("steps", "clipped", "skipped", "consecutive_skipped", "nonfinite", "spikes")

_GUARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def guard_for(optimizer) -> "StepGuard | None":
    """The StepGuard attached to ``optimizer``, or None: how a monitor or checker finds the skip counters of
    an optimizer it is handed (``guard_for(opt).counters()`` / ``.state()``)."""
    ref = _GUARDS.get(optimizer)
    return ref() if ref is not None else None


class GuardError(RuntimeError):
    """Raised after ``max_consecutive_skips`` bad steps in a row: training is not making progress."""


_STALE = ("StepGuard.clip_() decided on this optimizer's next step, but {why}, so the decision no longer "
          "belongs to those gradients. Call guard.clip_() after the last backward and right before "
          "optimizer.step() / scaler.step(optimizer). Nothing was stepped.")


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if D.is_dtensor(t) else t


class _Pending:
    """What ``clip_`` leaves for the next step: the flag, the zero-write factor (or None), the gradients'
    fingerprint (optim_clip's, O(1) host work)."""

    __slots__ = ("bad", "scale", "record")

    def __init__(self, bad: Tensor, scale: Tensor | None, grads: list[Tensor]):
        self.bad = bad
        self.scale = scale
        self.record = _Record()
        self.record.pend(scale, grads)


class StepGuard:
    """Gradient clipping with a step guard. See the module docstring and docs/guard.md.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (not LBFGS: its ``step(closure)`` recomputes the gradients).
        max_norm: ``mode="norm"``: the clip threshold (required). zclip/autoclip: an optional hard cap on top
            of the adaptive threshold. adagc: the global threshold of its warm-up (``lambda_abs``, default 1.0).
        norm_type: as ``clip_grad_norm_`` (adaptive modes: 2 only, as their papers).
        mode: "norm" (fixed threshold, bit-identical to ``clip_grad_norm_`` on healthy steps), "zclip"
            (Kumar et al. 2025, arXiv 2504.02507), "autoclip" (Seetharaman et al. 2020, arXiv 2007.14469),
            "adagc" (Wang et al. 2025, arXiv 2502.11034).
        skip_factor: also skip a finite step whose norm exceeds ``skip_factor`` times the mode's reference
            (norm: the run's own level, warm-up mean then EMA; zclip: the EMA mean; autoclip: the percentile threshold; adagc: any tensor's
            EMA). None (default): only non-finite steps are skipped; spikes are clipped by the mode's rule.
        max_consecutive_skips: raise :class:`GuardError` once this many steps in a row were skipped (checked
            at the next ``clip_``; see :meth:`clip_` for when it reads the counter). None: never.
        non_fused: "sync" or "restore", how optimizers other than torch's fused ones skip (module docstring).
        zero_write: hand the clip coefficient to a fused optimizer's step instead of writing the gradients,
            as ``clip_optimizer_grad_norm_`` does (not for adagc, whose coefficients are per tensor).
        process_group: the gradients are this rank's disjoint shards (as ``clip_grad_norm_``); DTensor
            gradients need nothing. The decision then comes from the global norm on every rank.
        alpha, z_thresh, warmup_steps, eps, clip_factor: ZClip (defaults 0.97, 2.5, 25, 1e-6, 1.0).
        alpha, warmup_steps (mode "norm" with skip_factor): the spike reference, the mean of the first
            warmup_steps finite norms then their EMA (defaults 0.97, 25).
        percentile, history_size: AutoClip (defaults 10, 1000).
        lambda_rel, beta, warmup_steps, eps: AdaGC (defaults 1.05, 0.98, 100, 1e-8).
    """

    def __init__(self, optimizer, max_norm: float | None = None, norm_type: float = 2.0, *, mode: str = "norm",
                 skip_factor: float | None = None, max_consecutive_skips: int | None = None,
                 non_fused: str = "sync", zero_write: bool = True, process_group=None, backend: str | None = None,
                 alpha: float | None = None, z_thresh: float | None = None, warmup_steps: int | None = None,
                 eps: float | None = None, clip_factor: float | None = None, percentile: float | None = None,
                 history_size: int | None = None, lambda_rel: float | None = None, beta: float | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            if hasattr(optimizer, "unscale_") and hasattr(optimizer, "get_scale"):
                raise TypeError("StepGuard(optimizer, ...): got a GradScaler; pass the optimizer here and the "
                                "scaler to guard.clip_(scaler)")
            raise TypeError(f"StepGuard(optimizer, ...): optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}; the guard skips a step through the optimizer's step "
                            "hooks, which only torch.optim.Optimizer has")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("StepGuard cannot guard LBFGS: its step(closure) re-evaluates the gradients, so a "
                             "decision made on the clip's gradients does not hold for the step; clip inside the "
                             "closure with fastgrad.clip_grad_norm_ instead")
        if guard_for(optimizer) is not None:
            raise ValueError("this optimizer already has a StepGuard; use that one (fastgrad.guard.guard_for)")
        if mode not in MODES:
            raise ValueError(f"StepGuard mode must be one of {', '.join(MODES)}; got {mode!r}")
        if non_fused not in ("sync", "restore"):
            raise ValueError(f"non_fused must be 'sync' or 'restore', got {non_fused!r}")
        if not isinstance(zero_write, bool):
            raise TypeError(f"zero_write must be True or False, got {zero_write!r}")
        self.norm_type = I.check_norm_type(norm_type)
        if mode != "norm" and self.norm_type != 2.0:
            raise ValueError(f"mode={mode!r} is defined on the 2-norm (as its paper); norm_type must be 2")
        if mode == "norm":
            if max_norm is None:
                raise ValueError("mode='norm' needs max_norm (the clip threshold)")
        elif mode == "adagc" and max_norm is None:
            max_norm = 1.0  # the paper's lambda_abs
        self.max_norm = None if max_norm is None else I.check_max_norm(max_norm)
        if skip_factor is not None:
            skip_factor = I._as_float("skip_factor", skip_factor)
            if not skip_factor > 0:
                raise ValueError(f"skip_factor must be > 0, got {skip_factor}")
        self.skip_factor = skip_factor
        if max_consecutive_skips is not None and (isinstance(max_consecutive_skips, bool) or
                                                  not isinstance(max_consecutive_skips, int) or
                                                  max_consecutive_skips < 1):
            raise ValueError(f"max_consecutive_skips must be a positive int or None, got {max_consecutive_skips!r}")
        self.max_consecutive_skips = max_consecutive_skips

        given = {k: v for k, v in dict(alpha=alpha, z_thresh=z_thresh, warmup_steps=warmup_steps, eps=eps,
                                       clip_factor=clip_factor, percentile=percentile, history_size=history_size,
                                       lambda_rel=lambda_rel, beta=beta).items() if v is not None}
        allowed = {"norm": {"alpha", "warmup_steps"} if skip_factor is not None else set(), "zclip": {"alpha", "z_thresh", "warmup_steps", "eps", "clip_factor"},
                   "autoclip": {"percentile", "history_size"},
                   "adagc": {"lambda_rel", "beta", "warmup_steps", "eps"}}[mode]
        extra = sorted(set(given) - allowed)
        if extra:
            raise TypeError(f"mode={mode!r} does not take {', '.join(extra)} (it takes: "
                            f"{', '.join(sorted(allowed)) or 'no mode options'})")
        defaults = {"norm": dict(alpha=0.97, warmup_steps=25) if skip_factor is not None else {},
                    "zclip": dict(alpha=0.97, z_thresh=2.5, warmup_steps=25, eps=1e-6, clip_factor=1.0),
                    "autoclip": dict(percentile=10.0, history_size=1000),
                    "adagc": dict(lambda_rel=1.05, beta=0.98, warmup_steps=100, eps=1e-8)}[mode]
        self.options: dict[str, Any] = {**defaults, **given}
        o = self.options
        if "warmup_steps" in o and (not isinstance(o["warmup_steps"], int) or o["warmup_steps"] < 1):
            raise ValueError(f"warmup_steps must be a positive int, got {o['warmup_steps']!r}")
        if "history_size" in o and (not isinstance(o["history_size"], int) or o["history_size"] < 1):
            raise ValueError(f"history_size must be a positive int, got {o['history_size']!r}")
        if "percentile" in o and not 0 <= o["percentile"] <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {o['percentile']!r}")
        for k in ("alpha", "beta"):
            if k in o and not 0 <= o[k] < 1:
                raise ValueError(f"{k} must be in [0, 1), got {o[k]!r}")
        for k in ("z_thresh", "lambda_rel", "clip_factor"):
            if k in o and not o[k] > 0:
                raise ValueError(f"{k} must be > 0, got {o[k]!r}")

        self.mode = mode
        self.non_fused = non_fused
        self.zero_write = zero_write
        self.process_group = process_group
        self.backend = backend
        self._optimizer = optimizer
        self._pending: _Pending | None = None
        self.calls = 0
        self._undo = None  # what the pre-hook must undo in the post-hook
        self._device: torch.device | None = None
        self._stats: dict[str, Tensor] = {}
        self._counts: Tensor | None = None
        self._records: list = []  # per step since the last fold: (total, factor, inv_scale, bad, spike)
        self._last = None  # the last folded step: (total, post-clip norm, coef, clipped, skipped)
        self._host_counts = None  # (host copy of the counters, cuda event) for the lazy consecutive check
        self._one = None
        self._flags = None

        ref = weakref.ref(self)

        def pre(opt, args, kwargs):
            g = ref()
            if g is not None:
                g._pre_step(opt, args, kwargs)

        def post(opt, args, kwargs):
            g = ref()
            if g is not None:
                g._post_step(opt)

        self._hooks = (optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post))
        _GUARDS[optimizer] = weakref.ref(self)  # the guard holds the optimizer, not the other way

    # ------------------------------------------------------------------ public
    def remove(self) -> None:
        """Detach from the optimizer (its hooks and the registry entry); a pending decision is dropped."""
        for h in self._hooks:
            h.remove()
        opt = self._optimizer
        if guard_for(opt) is self:
            del _GUARDS[opt]
        self._pending = None

    @property
    def optimizer(self):
        return self._optimizer

    def state_dict(self) -> dict:
        """The guard's statistics (the mode's EMAs / history / per-tensor gammas) and counters, for a
        checkpoint next to the optimizer's. Tensors are cloned; nothing is read on the host."""
        self._fold()
        return {"mode": self.mode, "options": dict(self.options),
                "stats": {k: v.clone() for k, v in self._stats.items()},
                "counts": None if self._counts is None else self._counts.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (tensors moved to the device of the next step's gradients)."""
        if state.get("mode") != self.mode:
            raise ValueError(f"state_dict is for mode={state.get('mode')!r}, this guard is mode={self.mode!r}")
        if state.get("options") != self.options:
            raise ValueError(f"state_dict was made with options {state.get('options')}, this guard has "
                             f"{self.options}")
        self._records = []
        self._last = None
        self._stats = {k: v.clone() for k, v in state["stats"].items()}
        self._counts = None if state["counts"] is None else state["counts"].clone()
        self._device = None if self._counts is None else self._counts.device

    def clip_(self, scaler=None) -> Tensor:
        """Clip the optimizer's gradients by the mode's rule and decide whether its next step is skipped.

        Returns the total norm before clipping (0-dim, promoted grad dtype; with a GradScaler the norm of the
        unscaled gradients), like ``clip_grad_norm_``. With ``scaler`` (an enabled torch GradScaler) this
        also does ``scaler.unscale_(optimizer)``'s work in the same read pass, leaving the scaler state as
        ``fastgrad.scaler_unscale_and_clip`` does: its ``found_inf_per_device`` holds the OVERFLOW flag only,
        so ``scaler.update()`` backs the scale off on an overflow and not on a spike skip.

        On a skipped step the gradients are clipped by the step's coefficient as ``clip_grad_norm_`` would (a
        NaN norm makes them NaN), except on the CPU write path of mode "norm", which leaves them untouched;
        to name the culprit call ``fastgrad.find_nonfinite`` before ``clip_``. No host sync, except: ``max_consecutive_skips``
        reads the counter copy made at the previous call (on CUDA only once that copy has landed, checked
        with an event, so never waiting; on the CPU a plain read), and the non-fused paths described in the
        module docstring.
        """
        opt = self._optimizer
        if opt is None:
            raise RuntimeError("the optimizer this StepGuard was built for no longer exists")
        self._check_consecutive()
        self.calls += 1  # host count of clip_ calls: how GradientMonitor(guard=) pairs flags with its steps
        self._pending = None
        params = optimizer_params(opt)
        if self.mode == "norm" and scaler is None and self.process_group is None and \
                not _fused_torch_optimizer(opt):
            # the common CPU case first: clip_grad_norm_'s one-call C++ clip, which answers None (nothing
            # done) for anything but plain dense CPU gradients, before any Python pass over the list
            out = self._clip_cpu_write(params)
            if out is not None:
                return out
        grads = I.grads_of(params)
        if grads and I.check_tensors(grads):
            raise TypeError("StepGuard supports dense real floating gradients (float16/bfloat16/float32/float64); "
                            "got sparse, complex or other gradients. Clip those with fastgrad.clip_grad_norm_ "
                            "(nothing was modified)")
        sharded = self.process_group is not None or D.has_dtensor(grads)
        use_scaler = scaler is not None and scaler.is_enabled()
        if use_scaler and sharded and (self.mode == "adagc" or _is_sharded(scaler)):
            raise NotImplementedError("StepGuard.clip_(scaler) with sharded (DTensor or process_group) gradients "
                                      "supports torch's plain GradScaler and the total-norm modes; for "
                                      f"{'mode=adagc' if self.mode == 'adagc' else 'a ShardedGradScaler'} call "
                                      "fastgrad.scaler_unscale_and_clip first, then guard.clip_() (nothing was "
                                      "modified)")
        if not grads and not sharded:
            if use_scaler:  # unscale_ records an empty flag set; so do we
                state = _optimizer_state(scaler, opt, False)
                _check_ready(scaler, state)
                state["found_inf_per_device"] = {}
                from torch.amp.grad_scaler import OptState
                state["stage"] = OptState.UNSCALED
            return torch.tensor(0.0)
        if use_scaler and not _known_unscale(scaler):
            raise TypeError(f"StepGuard.clip_(scaler): {type(scaler).__name__} overrides unscale_; only torch's "
                            "GradScaler is supported (nothing was modified)")
        per_tensor = self.mode == "adagc"
        p = self.norm_type
        inv_scale = None
        state = None
        if use_scaler:
            state = _optimizer_state(scaler, opt, False)
            _check_ready(scaler, state)
            if I.has_dtype(grads, torch.float16):
                raise ValueError("Attempting to unscale FP16 gradients.")
            inv_scale = _inv_scale(scaler)
        fused = _fused_torch_optimizer(opt)
        # decided on the host before the read pass (checks of types and attributes only)
        hand_over = (fused and self.zero_write and not sharded and not per_tensor and
                     (_amp_zero_write_applies(scaler, opt, grads) if use_scaler else zero_write_applies(opt, grads)))
        if self.mode == "norm" and not sharded:
            # (outside no_grad, as clip_grad_norm_'s one-call path: these calls record nothing for autograd)
            out = self._clip_one_call(opt, params, grads, inv_scale, scaler, state, hand_over, fused)
            if out is not None:
                return out
        with torch.no_grad():
            return self._clip_general(opt, params, grads, inv_scale, scaler, state, hand_over, fused, sharded,
                                      use_scaler, per_tensor)

    def _clip_general(self, opt, params, grads, inv_scale, scaler, state, hand_over, fused, sharded, use_scaler,
                      per_tensor) -> Tensor:
        """Every mode, any layout: norms (per tensor for AdaGC) through clip.py's dispatch, the mode's rule
        in device ops, then the write or the hand-over."""
        p = self.norm_type
        if use_scaler and sharded:
            # one all-reduce carries the global norm of the unscaled shards and the global overflow flag, so
            # every rank records the same found_inf and takes the same decision (fastgrad.amp's sharded path)
            sh = D.prepare(grads, self.process_group)
            backend = self.backend

            def local_amp(ts):
                groups = I.split_by_device(ts)
                parts = device_amp_norms(groups, inv_scale, p, backend)
                total = combine_device_totals([t for t, _ in parts], p, ts[0].device, acc_dtype(ts))
                return total, torch.stack([f.to(ts[0].device).reshape(()) for _, f in parts]).amax()

            total, _, flag = D.reduced_amp_norm(sh, p, local_amp)
            groups = I.split_by_device(sh.writes)
            found = {g[0].device: flag.to(g[0].device).reshape(()) for g in groups}
            _record_read_pass(scaler, state, False, found, total, p, False, groups, inv_scale, self.backend)
            writes, per = sh.writes, None
        elif use_scaler:
            groups = I.split_by_device(grads)
            if per_tensor:
                total, per, found = self._amp_norms_per_tensor(grads, inv_scale)
            else:
                parts = device_amp_norms(groups, inv_scale, p, self.backend)
                total = combine_device_totals([t for t, _ in parts], p, grads[0].device, acc_dtype(grads))
                found = {g[0].device: f.reshape(()) for g, (_, f) in zip(groups, parts)}
                per = None
            _record_read_pass(scaler, state, False, found, total, p, False, groups, inv_scale, self.backend)
            writes, sh = grads, None
        elif sharded:
            total, per, sh = _sharded_norm(grads, p, self.backend, None, per_tensor, self.process_group)
            writes = sh.writes
        else:
            total, per = _norm(grads, p, self.backend, None, per_tensor)
            writes, sh = grads, None

        self._ensure_state(total, len(params))
        if per_tensor:
            index = self._param_index(params, grads)
            coefs, bad, clipped_norm, spike = self._adagc(total, per, index)
            if inv_scale is not None:
                coefs = coefs * inv_scale.to(coefs.device, coefs.dtype)
            self._scale_per_tensor(writes, coefs)
            coef = clipped_norm / total
            factor = None
        else:
            coef, bad, spike = self._rule(total)
            factor = coef if inv_scale is None else inv_scale.to(coef.device, coef.dtype) * coef
            if not hand_over and writes:
                _scale(writes, factor, self.backend, None)
        bad = bad.to(torch.float32)
        self._record(total, coef, None, bad, spike)
        self._pend(bad, factor.reciprocal() if hand_over else None, grads, fused)
        out = total.to(I.promoted_dtype(grads)) if grads else total
        return D.wrap_like(out, sh) if sh is not None else out

    def _clip_one_call(self, opt, params, grads, inv_scale, scaler, state, hand_over, fused) -> Tensor | None:
        """mode="norm" on one device: the read pass, the non-finite flag, the coefficient and the write in ONE
        backend call (the fused AMP primitive, with an unscale factor of exactly 1 when there is no scaler:
        ``g * 1`` is ``g``, so the norm and the clip are clip_grad_norm_'s bit for bit), and no torch op
        after it unless ``skip_factor`` is set. None when two backends would serve the read and the write.

        CPU gradients that are written (no scaler, no hand-over): clip_grad_norm_'s own one-call C++ path
        with its finiteness check, which on a non-finite norm writes nothing and says so (CPU memory: no
        device to wait for). The flag is then one of two cached constant tensors."""
        p = self.norm_type
        if inv_scale is None and not hand_over and grads[0].device.type == "cpu":
            out = self._clip_cpu_write(params, grads)
            if out is not None:
                return out
        if len(I.split_by_device(grads)) != 1:
            return None
        b = I.pick("amp_norm", grads, self.backend, norm_type=p)
        if I.pick("scale", grads, self.backend) is not b:
            return None
        dev = grads[0].device
        if self._one is None or self._one.device != dev:
            self._one = torch.ones((), dtype=torch.float32, device=dev)
        inv = self._one if inv_scale is None else inv_scale.to(dev, non_blocking=True)
        total, found, factor = b.amp_clip_(grads, inv, self.max_norm, p, not hand_over)
        if state is not None:
            _record_read_pass(scaler, state, False, {dev: found.reshape(())}, total, p, False, [grads], inv_scale,
                              self.backend)
        self._ensure_state(total, 0)
        spike = None
        bad = found
        if self.skip_factor is not None:
            spike = self._norm_spike(total, torch.isfinite(total)).to(torch.float32)
            bad = torch.maximum(found, spike)
        self._record(total, factor, None if inv_scale is None else inv, bad, spike)
        self._pend(bad, factor.reciprocal() if hand_over else None, grads, fused)
        return total.to(I.promoted_dtype(grads))

    def _clip_cpu_write(self, params, grads=None) -> Tensor | None:
        """mode="norm", gradients written, CPU: clip_grad_norm_'s one-call C++ clip with its finiteness check
        (a non-finite norm writes nothing and says so; CPU memory: no device to wait for). The flag is then
        one of two cached constant tensors. None when that path cannot serve (nothing done)."""
        fast = _scan.clip_norm_cpu(params, self.max_norm, self.norm_type, True, self.backend)
        if fast is None:
            return None
        total, nonfinite = fast
        if grads is None:
            grads = _scan.plain_grads_of(params) or I.grads_of(params)  # (validated by the C++ clip)
        self._ensure_state(total, 0)
        if self._flags is None:
            self._flags = (torch.zeros((), dtype=torch.float32), torch.ones((), dtype=torch.float32))
        bad = self._flags[bool(nonfinite)]
        spike = None
        if self.skip_factor is not None:
            spike = self._norm_spike(total, torch.isfinite(total)).to(torch.float32)
            bad = torch.maximum(bad, spike)
        self._record(total, None, None, bad, spike)
        self._pend(bad, None, grads, False)
        return total

    def _pend(self, bad: Tensor, scale: Tensor | None, grads: list, fused: bool) -> None:
        self._pending = _Pending(bad, scale, grads if grads else [bad])
        if not grads:  # a rank owning no shard: nothing to fingerprint, nothing to check at the step
            self._pending.record.fingerprint = None
        if self.max_consecutive_skips is not None:
            self._fold()
            cons = self._counts[3:4]
            if cons.device.type == "cuda":
                host = torch.empty(1, dtype=cons.dtype, pin_memory=True)
                host.copy_(cons, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                self._host_counts = (host, ev)
            else:
                self._host_counts = (cons, None)

    def last_step_skipped(self) -> bool:
        """Whether the last ``clip_`` decided to skip its step. SYNCS (reads one device value); for a
        sync-free signal use the ``skipped`` attribute (a 0-dim device bool tensor)."""
        return bool(self.skipped.item()) if self.skipped is not None else False

    def counters(self) -> Tensor | None:
        """The counters as ONE device tensor (slots: ``fastgrad.guard.COUNTERS``), or None before the first
        clip_. Reading it (``.tolist()``) is one transfer."""
        self._fold()
        return self._counts

    def state(self) -> dict:
        """Everything the guard knows, read in ONE device-to-host transfer: the last step's ``total_norm``
        (pre-clip), ``clipped_norm`` (post-clip), ``coef``, ``clipped``, ``skipped``, and the counters
        (``steps``, ``clipped_steps``, ``skipped_steps``, ``consecutive_skipped``, ``nonfinite_steps``,
        ``spike_steps``). Syncs, once."""
        if self._counts is None:
            return {}
        self._fold()
        dt = self._counts.dtype
        vals = torch.cat([torch.stack([self.total_norm.to(dt), self.clipped_norm.to(dt), self.coef.to(dt),
                                       self.clipped.to(dt), self.skipped.to(dt)]), self._counts]).tolist()
        names = ["total_norm", "clipped_norm", "coef", "clipped", "skipped", "steps", "clipped_steps",
                 "skipped_steps", "consecutive_skipped", "nonfinite_steps", "spike_steps"]
        out = dict(zip(names, vals))
        for k in ("clipped", "skipped"):
            out[k] = bool(out[k])
        for k in names[5:]:
            out[k] = int(out[k])
        return out

    # ------------------------------------------------------------------ per-mode rules
    def _ensure_state(self, total: Tensor, n_params: int) -> None:
        dev = total.device
        if self._counts is not None and self._device == dev:
            return
        self._fold()
        if self._counts is not None and self._stats_fit(n_params):  # loaded or moved: keep, on this device
            self._counts = self._counts.to(dev)
            self._stats = {k: v.to(dev) for k, v in self._stats.items()}
            self._device = dev
            return
        self._device = dev
        cdt = torch.float32 if dev.type == "mps" else torch.float64
        self._counts = torch.zeros(len(COUNTERS), dtype=cdt, device=dev)
        dt = total.dtype
        o = self.options
        z = lambda *s: torch.zeros(s, dtype=dt, device=dev)  # noqa: E731
        if self.mode == "norm" and self.skip_factor is not None:
            self._stats = dict(n=z(), mean=z())
        elif self.mode == "zclip":
            self._stats = dict(n=z(), buf=z(o["warmup_steps"]), mean=z(), var=z(),
                               slots=torch.arange(o["warmup_steps"], device=dev))
        elif self.mode == "autoclip":
            self._stats = dict(n=torch.zeros((), dtype=torch.long, device=dev),
                               ring=torch.full((o["history_size"],), math.nan, dtype=dt, device=dev))
        elif self.mode == "adagc":
            self._stats = dict(n=z(), gamma=torch.full((n_params,), math.inf, dtype=dt, device=dev))

    def _stats_fit(self, n_params: int) -> bool:
        if self.mode == "norm":
            return self.skip_factor is None or "mean" in self._stats
        if self.mode == "adagc":
            return "gamma" in self._stats and (n_params == 0 or self._stats["gamma"].numel() == n_params)
        return bool(self._stats)

    def _rule(self, total: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """(coefficient, bad, spike-or-None) for the total-norm modes, all on the total's device."""
        finite = torch.isfinite(total)
        if self.mode == "norm":
            coef = clip_coef(total, self.max_norm)
            if self.skip_factor is None:
                return coef, ~finite, None
            spike = self._norm_spike(total, finite)
            return coef, spike | ~finite, spike
        if self.mode == "zclip":
            return self._zclip(total, finite)
        return self._autoclip(total, finite)

    def _norm_spike(self, g: Tensor, finite: Tensor) -> Tensor:
        """mode="norm" with skip_factor=k: is this finite norm more than k times the run's usual norm?

        The reference is the mean of the first ``warmup_steps`` finite norms (no spike is declared before it
        exists: a run's first norms are often far above max_norm and legitimate), then their EMA (``alpha``).
        A spike feeds the EMA k times the reference instead of its own value, so one huge norm moves it a
        bounded amount while a lasting shift of the norm's level is followed within a few skipped steps (with
        alpha=0.97 and k=10 the reference grows 1.27x per skipped step) rather than skipped forever. A
        non-finite norm changes nothing. Device ops only."""
        o, s = self.options, self._stats
        k, a = self.skip_factor, o["alpha"]
        ready = s["n"] >= o["warmup_steps"]
        ref = s["mean"]
        spike = ready & finite & (g > k * ref)
        x = torch.where(spike, k * ref, g)
        warm_mean = ref + (g - ref) / (s["n"] + 1)
        new = torch.where(ready, a * ref + (1 - a) * x, warm_mean)
        s["mean"] = torch.where(finite, new, ref)
        s["n"] = s["n"] + finite.to(s["n"].dtype)
        return spike

    def _zclip(self, g: Tensor, finite: Tensor):
        o, s = self.options, self._stats
        W, a, zt = o["warmup_steps"], o["alpha"], o["z_thresh"]
        ready = s["n"] >= W
        std = s["var"].sqrt()
        z = (g - s["mean"]) / (std + o["eps"])
        outlier = ready & (z > zt) & finite
        # ZClip's "adaptive scaling": mean + z_thresh * std / (z / z_thresh), times clip_factor
        thr = (s["mean"] + (zt * std) / (z / zt)) * o["clip_factor"]
        inf = torch.full_like(g, math.inf)
        limit = torch.where(outlier, thr, torch.where(ready, g, inf))
        if self.max_norm is not None:
            limit = torch.clamp(limit, max=self.max_norm)
        coef = torch.where(g > limit, limit / (g + 1e-6), torch.ones_like(g))
        spike = None
        bad = ~finite
        if self.skip_factor is not None:
            spike = ready & finite & (g > self.skip_factor * s["mean"])
            bad = bad | spike
        # statistics: warm-up buffer, then the EMA of the (ZClip-clipped) norm; a non-finite norm changes nothing
        take = finite & ~ready
        s["buf"] = torch.where((s["slots"] == s["n"]) & take, g, s["buf"])
        n_new = s["n"] + take.to(g.dtype)
        init_mean = s["buf"].mean()
        init_var = (s["buf"] - init_mean).square().mean()
        x = torch.where(outlier, thr, g)
        ema_mean = a * s["mean"] + (1 - a) * x
        ema_var = a * s["var"] + (1 - a) * (x - ema_mean).square()
        upd = ready & finite
        just = take & (n_new >= W)
        s["mean"] = torch.where(upd, ema_mean, torch.where(just, init_mean, s["mean"]))
        s["var"] = torch.where(upd, ema_var, torch.where(just, init_var, s["var"]))
        s["n"] = n_new
        return coef, bad, spike

    def _autoclip(self, g: Tensor, finite: Tensor):
        o, s = self.options, self._stats
        H = o["history_size"]
        idx = (s["n"] % H).reshape(1)
        old = s["ring"].gather(0, idx)
        s["ring"] = s["ring"].scatter(0, idx, torch.where(finite, g.reshape(1), old))
        s["n"] = s["n"] + finite.long()
        # the paper's threshold: the percentile of every norm seen so far, this one included (np.percentile's
        # linear interpolation = torch's); unfilled slots are NaN and ignored
        thr = torch.nanquantile(s["ring"], o["percentile"] / 100.0)
        limit = thr if self.max_norm is None else torch.clamp(thr, max=self.max_norm)
        coef = torch.clamp(limit / (g + 1e-6), max=1.0)  # clip_grad_norm_(params, limit)'s coefficient
        spike = None
        bad = ~finite
        if self.skip_factor is not None:
            spike = finite & (g > self.skip_factor * thr)
            bad = bad | spike
        return coef, bad, spike

    def _param_index(self, params: list, grads: list) -> Tensor | None:
        if len(grads) == len(params):
            return None
        return torch.tensor([i for i, q in enumerate(params) if q.grad is not None], device=self._device)

    def _adagc(self, total: Tensor, per: Tensor, index: Tensor | None):
        o, s = self.options, self._stats
        W, lr, b, eps = o["warmup_steps"], o["lambda_rel"], o["beta"], o["eps"]
        per = per.to(total.device, total.dtype)
        finite = torch.isfinite(total)
        gamma_all = s["gamma"]
        gamma = gamma_all if index is None else gamma_all.index_select(0, index)
        warm = s["n"] < W
        # warm-up: global clipping at lambda_abs (= max_norm); gamma tracks the minimum clipped norm
        h_glob = torch.clamp(self.max_norm / (total + eps), max=1.0)
        # then per tensor: h_i = min(lambda_rel * gamma_i / (||g_i|| + eps), 1), gamma_i <- EMA of ||h_i g_i||
        h_loc = torch.clamp(lr * gamma / (per + eps), max=1.0)
        h = torch.where(warm, h_glob.expand_as(per), h_loc)
        clipped = h * per
        seen = torch.isfinite(gamma)
        ema = torch.where(seen, b * gamma + (1 - b) * clipped, clipped)  # a tensor first seen late starts fresh
        new_gamma = torch.where(warm, torch.minimum(gamma, clipped), ema)
        new_gamma = torch.where(finite, new_gamma, gamma)
        spike = None
        bad = ~finite
        if self.skip_factor is not None:
            spike = finite & ~warm & (per > self.skip_factor * gamma).any()
            bad = bad | spike
        s["gamma"] = new_gamma if index is None else gamma_all.index_copy(0, index, new_gamma)
        s["n"] = s["n"] + finite.to(total.dtype)
        post = combine_norms(clipped, 2.0)
        return h, bad, post, spike

    def _amp_norms_per_tensor(self, grads, inv_scale):
        """AdaGC under a GradScaler: the overflow flags from the AMP read pass, then the per-tensor norms of
        the unscaled values (a second read: the AMP primitive has no per-tensor output)."""
        p = self.norm_type
        groups = I.split_by_device(grads)
        parts = device_amp_norms(groups, inv_scale, p, self.backend)
        found = {g[0].device: f.reshape(()) for g, (_, f) in zip(groups, parts)}
        total = combine_device_totals([t for t, _ in parts], p, grads[0].device, acc_dtype(grads))
        _, per = _norm(grads, p, self.backend, None, True)
        per = per * inv_scale.to(per.device, per.dtype)
        return total, per, found

    @staticmethod
    def _scale_per_tensor(writes: list[Tensor], coefs: Tensor) -> None:
        if not writes:
            return
        if len({g.device for g in writes}) == 1:  # one foreach call (same bits as one mul_ per tensor)
            torch._foreach_mul_(writes, list(coefs.to(writes[0].device).unbind(0)))
            return
        for g, c in zip(writes, coefs.unbind(0)):
            g.mul_(c.to(g.device))

    # ------------------------------------------------------------------ bookkeeping
    def _record(self, total, factor, inv, bad, spike) -> None:
        """Per step only a list append: the counters are folded from these records on the device when asked
        for, every ``_FOLD`` steps, or every step with ``max_consecutive_skips``."""
        self._records.append((total, factor, inv, bad, spike))
        if len(self._records) >= _FOLD:
            self._fold()

    def _fold(self) -> None:
        recs, self._records = self._records, []
        if not recs:
            return
        c = self._counts
        dt, dev = c.dtype, c.device
        n = len(recs)
        # (torch.stack promotes mixed dtypes; one conversion per stacked vector, not per record)
        T = torch.stack([r[0] for r in recs]).to(dev, dt)
        factors = [r[1] for r in recs]
        if all(f is None for f in factors):  # the one-call CPU path keeps no coefficient: clip_grad_norm_'s
            coef = clip_coef(T.to(torch.float32), self.max_norm).to(dt)
        elif any(f is None for f in factors):
            derived = clip_coef(T.to(torch.float32), self.max_norm).to(dt).unbind(0)
            coef = torch.stack([f.to(dev, dt) if f is not None else d for f, d in zip(factors, derived)])
        else:
            coef = torch.stack(factors).to(dev, dt)
        if any(r[2] is not None for r in recs):  # factor = inv_scale * coef: divide the unscale back out
            coef = coef / torch.stack([r[2] if r[2] is not None else self._one_like(r[1]) for r in recs]).to(dev, dt)
        B = torch.stack([r[3] for r in recs]).to(dev) > 0
        if any(r[4] is not None for r in recs):
            S = torch.stack([r[4].to(torch.float32) if r[4] is not None else B.new_zeros((), dtype=torch.float32)
                             for r in recs]).to(dev)
            spikes = ((S > 0) & torch.isfinite(T)).sum()  # a non-finite norm counts as non-finite only
        else:
            spikes = c.new_zeros(())
        clipped = (coef < 1) & ~B
        good = ~B
        last_good = torch.where(good, torch.arange(n, device=dev), -1).max()
        cons = torch.where(last_good < 0, c[3] + n, (n - 1 - last_good).to(dt))
        inc = torch.stack([c.new_full((), n), clipped.sum().to(dt), B.sum().to(dt), c.new_zeros(()),
                           (~torch.isfinite(T)).sum().to(dt), spikes.to(dt)])
        new = c + inc
        new[3] = cons
        self._counts = new
        self._last = (T[-1], T[-1] * coef[-1], coef[-1], clipped[-1], B[-1])

    @staticmethod
    def _one_like(t: Tensor) -> Tensor:
        return torch.ones((), dtype=torch.float32, device=t.device)

    @property
    def total_norm(self) -> Tensor | None:
        """The last step's total norm before clipping (0-dim device tensor; no sync)."""
        if self._records:
            return self._records[-1][0]
        return self._last[0] if self._last is not None else None

    @property
    def skipped(self) -> Tensor | None:
        """Whether the last step is (was) skipped, as a 0-dim device bool tensor (no sync)."""
        if self._records:
            return self._records[-1][3] > 0
        return self._last[4] if self._last is not None else None

    @property
    def clipped_norm(self) -> Tensor | None:
        """The last step's norm after clipping (device tensor; folds the records, no sync)."""
        self._fold()
        return self._last[1] if self._last is not None else None

    @property
    def coef(self) -> Tensor | None:
        """The last step's clip coefficient (AdaGC: post/pre norm ratio; device tensor, no sync)."""
        self._fold()
        return self._last[2] if self._last is not None else None

    @property
    def clipped(self) -> Tensor | None:
        """Whether the last step was clipped (and not skipped): device bool tensor, no sync."""
        self._fold()
        return self._last[3] if self._last is not None else None

    def _check_consecutive(self) -> None:
        if self.max_consecutive_skips is None or self._host_counts is None:
            return
        host, ev = self._host_counts
        if ev is not None and not ev.query():
            return  # not landed yet: check at a later call rather than wait
        n = int(host[0])
        if n >= self.max_consecutive_skips:
            raise GuardError(
                f"StepGuard skipped {n} steps in a row (max_consecutive_skips={self.max_consecutive_skips}): "
                "every recent step had a non-finite gradient norm or a spike. Training is not progressing; "
                "check the data, the learning rate and the loss scale (fastgrad.find_nonfinite names the "
                "gradients that went non-finite). Nothing was modified by this call.")

    # ------------------------------------------------------------------ the step hooks
    def _pre_step(self, opt, args, kwargs) -> None:
        if self._undo is not None:  # a previous step raised before its post-hook ran
            self._post_step(opt)
        pend = self._pending
        if pend is None:
            return
        self._pending = None
        rest = args[1:] if args and args[0] is opt else args
        closure = rest[0] if rest else kwargs.get("closure")
        if closure is not None:
            raise RuntimeError(_STALE.format(why="step(closure) recomputes the gradients"))
        if pend.record.fingerprint is not None and not pend.record.unchanged(I.grads_of(optimizer_params(opt))):
            raise RuntimeError(_STALE.format(
                why="the gradients changed after the clip (a backward, zero_grad() or an in-place write)"))
        if _fused_torch_optimizer(opt):
            self._undo = ("fused", self._hand_to_fused(opt, pend))
        elif self.non_fused == "restore":
            with torch.no_grad():
                snap = self._snapshot(opt, pend.bad)
            self._undo = ("restore", snap) if snap is not None else self._hide_if_bad(opt, pend.bad)
        else:
            self._undo = self._hide_if_bad(opt, pend.bad)

    def _post_step(self, opt) -> None:
        undo, self._undo = self._undo, None
        if undo is None:
            return
        kind, data = undo
        if kind == "fused":
            for name, applied, prev in data:
                if getattr(opt, name, None) is applied:
                    if prev is _MISSING:
                        delattr(opt, name)
                    else:
                        setattr(opt, name, prev)
        elif kind == "hidden":
            for q, g in data:
                q.grad = g
        elif kind == "restore":
            with torch.no_grad():
                self._merge(opt, *data)

    def _hand_to_fused(self, opt, pend: _Pending) -> list:
        """found_inf (and the zero-write grad_scale) for torch's fused kernels, combined with what a
        GradScaler.step already set; undone by the post-hook."""
        done = []
        prev = getattr(opt, "found_inf", _MISSING)
        flag = pend.bad.to(torch.float32)
        if prev is not _MISSING and prev is not None:
            flag = torch.maximum(prev, flag.to(prev.device, non_blocking=True))
        done.append(("found_inf", flag, prev))
        setattr(opt, "found_inf", flag)
        if pend.scale is not None:
            prev = getattr(opt, "grad_scale", _MISSING)
            gs = pend.scale if prev is _MISSING or prev is None else prev * pend.scale.to(prev.device,
                                                                                          non_blocking=True)
            done.append(("grad_scale", gs, prev))
            setattr(opt, "grad_scale", gs)
        return done

    @staticmethod
    def _hide_if_bad(opt, bad: Tensor):
        """The sync path: one host read of the flag; on a bad step the step sees no gradients."""
        if not bool(bad):
            return None
        hidden = []
        for group in opt.param_groups:
            for q in group["params"]:
                if q.grad is not None:
                    hidden.append((q, q.grad))
                    q.grad = None
        return ("hidden", hidden)

    def _snapshot(self, opt, bad: Tensor):
        """Clones of every parameter with a gradient and of its state tensors, or None when a sync-free
        restore cannot be exact (state not created yet, or on another device than the flag)."""
        bad = bad > 0
        dev = bad.device
        tensors, others, keys = [], [], {}
        for group in opt.param_groups:
            for q in group["params"]:
                if q.grad is None:
                    continue
                st = opt.state.get(q)
                if not st:
                    return None
                keys[id(st)] = set(st)
                lq = _local(q)
                if lq.device != dev:
                    return None
                tensors.append((None, q, lq, lq.clone()))
                for k, v in st.items():
                    if isinstance(v, Tensor):
                        lv = _local(v)
                        if lv.device != dev:
                            return None
                        tensors.append((st, k, v, lv.clone()))
                    else:
                        others.append((st, k, v))
        return bad, tensors, others, keys

    def _merge(self, opt, bad, tensors, others, keys) -> None:
        """Post-hook of the restore path: where ``bad``, put the snapshot back."""
        for st, key, orig, snap in tensors:
            if st is None:  # a parameter
                lq = orig
                lq.copy_(torch.where(bad, snap, lq))
                continue
            cur = st.get(key)
            if cur is orig:
                lv = _local(cur)
                lv.copy_(torch.where(bad, snap, lv))
            elif isinstance(cur, Tensor) and not D.is_dtensor(cur):
                st[key] = torch.where(bad, snap.to(cur.dtype), cur)
            else:  # replaced by something we cannot merge on the device: decide on the host
                if bool(bad):
                    st[key] = orig
                    _local(orig).copy_(snap)
        changed = [(st, k, v) for st, k, v in others if st.get(k, _MISSING) is not v]
        added = [(st, k) for group in opt.param_groups for q in group["params"]
                 if q.grad is not None for st in [opt.state.get(q)] if st is not None
                 for k in st if k not in keys.get(id(st), ())]
        if (changed or added) and bool(bad):  # host state moved: one read of the flag decides
            for st, k, v in changed:
                st[k] = v
            for st, k in added:
                del st[k]


_MISSING = object()
