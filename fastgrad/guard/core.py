"""``StepGuard``: clip, and keep a bad step (non-finite norm, or a spike) out of the weights and the optimizer
state, decided on the device from the norm of the clip's own read pass. See docs/guard.md.

One guard per optimizer::

    guard = fastgrad.StepGuard(optimizer, max_norm=1.0)            # or mode="zclip" / "autoclip" / "adagc"
    for batch in data:
        loss(batch).backward()
        guard.clip_()                  # or guard.clip_(scaler) after scaler.scale(loss).backward()
        optimizer.step()               # or scaler.step(optimizer); scaler.update()
        optimizer.zero_grad()

The parts: ``options`` (validation, before any work), one object per mode with its state on the device
(``norm``, ``zclip``, ``autoclip``, ``adagc``), ``read`` (the read passes that compute the norm and write
or hand over the clip), ``counters`` (device counters, folded lazily) and ``skip`` (the step hooks that
make the optimizer obey the decision). Nothing here reads device data on the host except where the methods'
docs say so.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch
from torch import Tensor

from .. import _inputs as inputs
from .. import optim_clip
from .. import route
from .. import scaler_state
from .._inputs import optimizer_params
from . import read
from . import finite
from .buffers import BufferKeeper
from .counters import COUNTERS, Counters, window_error
from .ledger import QUANTILES
from .modes import DEFAULT
from .options import MODES, check_options, make_mode, mode_options_doc
from .skip import NO_GRADS, Skipper, is_fused

__all__ = ["StepGuard", "guard_for", "COUNTERS", "MODES"]

_GUARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOG = logging.getLogger("fastgrad.guard")

# state()'s names: the last step's readings (Counters.last), then the counters (the slots of COUNTERS)
_LAST = ("total_norm", "clipped_norm", "coef", "clipped", "skipped")
_COUNTED = ("steps", "clipped_steps", "skipped_steps", "consecutive_skipped", "nonfinite_steps", "spike_steps",
            "longest_consecutive_skipped", "engaged_steps")
# then the read window's (ledger.Ledger.window): the norm's quantiles, how many norms they are over, the
# longest run of skips in the window
_WINDOW = tuple(k for k, _ in QUANTILES) + ("norm_count", "window_longest_skipped", "ended")

# Under torch.compile the guard's clip_ and its step hooks run eagerly, as graph breaks. A traced step
# pre-hook's setattr of found_inf / grad_scale never reaches the fused kernel (the compiled step would run
# unguarded); run eagerly, the hook sets them before the compiled rest of the step reads them as inputs.
# With fullgraph=True the break is an error, which torch raises with this text.
_EAGER = ("fastgrad.StepGuard runs guard.clip_() and its optimizer step hooks outside the compiled graph, so "
          "that a compiled optimizer.step() obeys the skip and the clip. torch.compile(..., fullgraph=True) "
          "cannot break the graph there: compile without fullgraph=True, or compile the model only "
          "(torch.compile(model)) and call guard.clip_() and optimizer.step() outside it")


_DISABLED: list = []  # (function, holder of its disabled twin) still to make: _make_eager, on the first StepGuard


def _eager(fn):
    """``fn`` kept out of any compiled graph (see _EAGER); called directly when not compiling, since the
    disable wrapper costs ~2 us a call. The disabled twin is made when the first StepGuard is built
    (:func:`_make_eager`): making it imports torch._dynamo, which ``import fastgrad`` must not."""
    off = [None]
    _DISABLED.append((fn, off))

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return off[0](*args, **kwargs)
        return fn(*args, **kwargs)
    return run


def _make_eager(fn=None):
    """Make the disabled twins of the class's methods (once); with ``fn`` (a guard's own step hook, made
    while the guard is built), also return ``fn`` wrapped as :func:`_eager` with its twin made now."""
    while _DISABLED:
        method, off = _DISABLED.pop()
        try:
            off[0] = torch.compiler.disable(method, reason=_EAGER)
        except TypeError:  # a torch whose disable() takes no reason: fullgraph's error then lacks our text
            off[0] = torch.compiler.disable(method)
    if fn is not None:
        run = _eager(fn)
        _make_eager()
        return run


def guard_for(optimizer) -> "StepGuard | None":
    """The StepGuard attached to ``optimizer``, or None: how a monitor or checker finds the skip counters of
    an optimizer it is handed (``guard_for(opt).counters()`` / ``.state()``)."""
    ref = _GUARDS.get(unwrap_optimizer(optimizer)[0])
    return ref() if ref is not None else None


def unwrap_optimizer(optimizer):
    """(the torch optimizer inside a framework's wrapper, the wrapper's GradScaler or None). accelerate's
    ``AcceleratedOptimizer`` subclasses ``torch.optim.Optimizer`` without its hook tables and calls the
    wrapped optimizer's ``step`` (through its GradScaler under fp16); Lightning's ``LightningOptimizer``
    forwards to ``_optimizer``. The guard hooks the optimizer that actually steps."""
    scaler = None
    for _ in range(4):
        mod = type(optimizer).__module__
        if mod.startswith("accelerate.") and isinstance(getattr(optimizer, "optimizer", None),
                                                        torch.optim.Optimizer):
            scaler = scaler if scaler is not None else getattr(optimizer, "scaler", None)
            optimizer = optimizer.optimizer
        elif mod.startswith(("lightning.", "pytorch_lightning.")) and \
                isinstance(getattr(optimizer, "_optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer._optimizer
        else:
            break
    return optimizer, scaler


def _check_scaler_arg(scaler) -> None:
    """``clip_``'s one argument is a GradScaler: anything else is a clear TypeError before any work (the
    likely mix-ups named: the optimizer, which the guard already holds; max_norm, given when it is built;
    the parameters, which it takes from the optimizer)."""
    if all(hasattr(scaler, a) for a in ("unscale_", "get_scale", "is_enabled")):
        return
    if isinstance(scaler, torch.optim.Optimizer) or hasattr(scaler, "param_groups"):
        why = ("got an optimizer: the guard already holds the optimizer it was built for "
               "(StepGuard(optimizer, ...)); call guard.clip_(), or guard.clip_(scaler) with a GradScaler")
    elif isinstance(scaler, (int, float)) or (isinstance(scaler, Tensor) and scaler.numel() == 1):
        why = (f"got {scaler!r}: max_norm is given when the guard is built (StepGuard(optimizer, max_norm=...)), "
               "not to clip_")
    else:
        why = (f"got {type(scaler).__name__}: the guard clips the parameters of its optimizer itself; pass "
               "nothing, or the torch.amp.GradScaler that scaled the loss")
    raise TypeError(f"StepGuard.clip_(scaler=None) takes an optional GradScaler; {why} (nothing was modified)")


class StepGuard:
    """Gradient clipping with a step guard. See the module docstring and docs/guard.md.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (not LBFGS: its ``step(closure)`` recomputes the gradients; not
            SparseAdam), or accelerate's prepared optimizer (its GradScaler, if any, is used by ``clip_``).
        max_norm: what it is to each mode: below (``mode="norm"``: the clip threshold, required).
        norm_type: as ``clip_grad_norm_`` (adaptive modes: 2 only, as their papers).
        mode: one of ``fastgrad.guard.MODES``, below: "norm" (fixed threshold), "zclip" (Kumar et al. 2025,
            arXiv 2504.02507), "autoclip" (Seetharaman et al. 2020, arXiv 2007.14469), "adagc" (Wang et al.
            2025, arXiv 2502.11034); docs/guard-reference.md's Modes table.
        skip_factor: also skip a finite step whose norm exceeds ``skip_factor`` times the mode's reference
            (norm: the run's own level, warm-up mean then EMA; zclip: the EMA mean; autoclip: the percentile
            threshold; adagc: any tensor's EMA). None (default): only non-finite steps are skipped; spikes are
            clipped by the mode's rule.
        max_consecutive_skips: raise :class:`GuardError` once this many steps in a row were skipped (checked
            at the next ``clip_``, see :meth:`clip_`; a run already ended, at :meth:`state`). None: never;
            either way the guard warns once (:class:`GuardWarning`) after ``WARN_AFTER`` (25) in a row.
        non_fused: "sync" or "restore", how optimizers other than torch's fused ones skip (fastgrad.guard.skip).
        zero_write: hand the clip coefficient to a fused optimizer's step instead of writing the gradients,
            as ``clip_optimizer_grad_norm_`` does (not for a per-tensor mode such as adagc).
        process_group: the gradients are this rank's disjoint shards (as ``clip_grad_norm_``); DTensor
            gradients need nothing. The decision then comes from the global norm on every rank.
        exact: every decision taken from the correctly rounded norm (fastgrad.exact; p = 1, 2, inf; AdaGC's
            per-tensor norms too), one more read of the gradients; with a GradScaler they are unscaled in
            place first (zero_write does not apply there).
        model: the ``torch.nn.Module`` the training step runs: a skipped step then also leaves its buffers
            (BatchNorm running statistics, ``num_batches_tracked``, any buffer a forward updates) as they were
            before the step's first forward, restored on the device by the skip flag (fastgrad.guard.buffers).
            Without it only the parameters and the optimizer state are kept.
        **mode_options: the mode's options by name (None: the default), each checked here. Per mode, from
            its declaration (fastgrad/guard/modes/):
{mode_options}
    """

    def __init__(self, optimizer, max_norm: float | None = None, norm_type: float = 2.0, *, mode: str = DEFAULT,
                 skip_factor: float | None = None, max_consecutive_skips: int | None = None,
                 non_fused: str = "sync", zero_write: bool = True, process_group=None, backend: str | None = None,
                 exact: bool = False, model=None, **mode_options):
        optimizer, self._wrapper_scaler = unwrap_optimizer(optimizer)
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
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise TypeError("StepGuard cannot guard SparseAdam: it takes sparse gradients, and the guard reads "
                            "dense ones only (its norm, flag and clip are dense read passes); clip sparse "
                            "gradients with fastgrad.clip_grad_norm_")
        if guard_for(optimizer) is not None:
            raise ValueError("this optimizer already has a StepGuard; use that one (fastgrad.guard.guard_for)")
        checked = check_options(mode=mode, max_norm=max_norm, norm_type=norm_type, skip_factor=skip_factor,
                                max_consecutive_skips=max_consecutive_skips, non_fused=non_fused,
                                zero_write=zero_write, backend=backend, exact=exact, **mode_options)
        self.mode = mode
        self.norm_type = checked.norm_type
        self.max_norm = checked.max_norm
        self.skip_factor = checked.skip_factor
        self.max_consecutive_skips = checked.max_consecutive_skips
        self.options = checked.mode_options
        self.non_fused = non_fused
        self.zero_write = zero_write
        self.process_group = process_group
        self.backend = backend
        self.exact = exact
        self._exact = checked.exact  # the norms from fastgrad.exact (read.general's exact route)
        # the buffers' keeper: ours to remove unless it was handed to us already saving
        self._own_keeper = model is not None and not isinstance(model, BufferKeeper)
        self._keeper = BufferKeeper(model) if self._own_keeper else model
        self._optimizer = optimizer
        self._mode = make_mode(mode, self.max_norm, self.skip_factor, self.options)
        # a clip at a fixed threshold engages above max_norm; an adaptive mode's where its coefficient is < 1
        self._counters = Counters(self.max_norm, self.max_norm if self._mode.kernel_clip else None)
        self._skip = Skipper(non_fused)
        self.calls = 0
        self._reported_skips = 0  # skipped_steps at the last state() read (the fastgrad.guard log record)
        self._read_at = (0, 0)  # (steps, engaged_steps) at the last state() read: clip_share's window
        self._device: torch.device | None = None
        self._one = None
        self._flags = None

        skip = self._skip

        # The hooks hold the guard's skipper (and the optimizer holds its hooks): a guard object that is not
        # kept (built on a line of its own, or inside a set-up function) still guards every step, until
        # remove(); guard_for(optimizer) finds it. Optimizer and guard are then collected together.
        @_make_eager
        def pre(opt, args, kwargs):
            return skip.pre_step(opt, args, kwargs)

        @_make_eager
        def post(opt, args, kwargs):
            skip.post_step(opt)

        pre.guard = self  # what keeps the guard object itself alive for guard_for
        self._hooks = (optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post))
        _GUARDS[optimizer] = weakref.ref(self)

    # ------------------------------------------------------------------ public
    def remove(self) -> None:
        """Detach from the optimizer (its hooks and the registry entry); a pending decision is dropped."""
        for h in self._hooks:
            h.remove()
        opt = self._optimizer
        if guard_for(opt) is self:
            del _GUARDS[opt]
        self._skip.clear()
        if self._own_keeper:
            self._keeper.remove()

    @property
    def optimizer(self):
        return self._optimizer

    def state_dict(self) -> dict:
        """The guard's statistics (the mode's EMAs / history / per-tensor gammas), counters and last step's
        readings, for a checkpoint next to the optimizer's. Tensors are cloned; nothing is read on the host."""
        c = self._counters
        c.fold()
        return {"mode": self.mode, "options": dict(self.options),
                "stats": {k: v.clone() for k, v in self._mode.state.items()},
                "counts": None if c.counts is None else c.counts.clone(),
                "last": None if c.last is None else tuple(t.clone() for t in c.last),
                "ledger": c.ledger.state_dict(), "read_at": self._read_at}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (tensors moved to the device of the next step's gradients): every
        reading (:meth:`state`, :meth:`counters`, ``total_norm``, ``skipped``, ...) is then what it was when
        the state was saved. A checkpoint without the last step's readings (an older fastgrad) loads with none."""
        if state.get("mode") != self.mode:
            raise ValueError(f"state_dict is for mode={state.get('mode')!r}, this guard is mode={self.mode!r}")
        if state.get("options") != self.options:
            raise ValueError(f"state_dict was made with options {state.get('options')}, this guard has "
                             f"{self.options}")
        self._mode.state = {k: v.clone() for k, v in state["stats"].items()}
        last = state.get("last")
        self._counters.clear(None if state["counts"] is None else state["counts"].clone(),
                             None if last is None else tuple(t.clone() for t in last), state.get("ledger"))
        self._read_at = tuple(state.get("read_at", (0, 0)))
        if "read_at" not in state and state["counts"] is not None:  # an older checkpoint: the window starts here
            self._read_at = (int(state["counts"][0]), 0)
        self._device = None if self._counters.counts is None else self._counters.counts.device
        # the loaded run's skips were that run's news: only skips after the load are logged (one read, here)
        counts = state["counts"]
        self._reported_skips = 0 if counts is None else int(counts[COUNTERS.index("skipped")])

    @_eager
    def clip_(self, scaler=None) -> Tensor:
        """Clip the optimizer's gradients by the mode's rule and decide whether its next step is skipped.

        Returns the total norm before clipping (0-dim, promoted grad dtype; with a GradScaler the norm of the
        unscaled gradients), like ``clip_grad_norm_``. With ``scaler`` (an enabled torch GradScaler) this
        also does ``scaler.unscale_(optimizer)``'s work in the same read pass, leaving the scaler state as
        ``fastgrad.scaler_unscale_and_clip`` does: its ``found_inf_per_device`` holds the OVERFLOW flag only,
        so ``scaler.update()`` backs the scale off on an overflow and not on a spike skip.

        On a skipped step the gradients are clipped by the step's coefficient as ``clip_grad_norm_`` would (a
        NaN norm makes them NaN), except on the CPU write path of mode "norm", which leaves them untouched;
        to name the culprit call ``fastgrad.find_nonfinite`` before ``clip_``. No host sync, except the
        non-fused paths described in fastgrad.guard.skip. The run of skips in a row (``max_consecutive_skips``
        and the WARN_AFTER warning) is read from the host copy made at the previous call (on CUDA only once
        that copy has landed, checked with an event, so never waiting); wording the warning reads the counters
        once. Under ``torch.compile`` this call and the step hooks run outside the graph (graph breaks).
        """
        opt = self._optimizer
        if opt is None:
            raise RuntimeError("the optimizer this StepGuard was built for no longer exists")
        if scaler is not None:
            _check_scaler_arg(scaler)
        if scaler is None and self._wrapper_scaler is not None:  # accelerate's fp16: its own scaler
            scaler = self._wrapper_scaler
        self._counters.check_consecutive(self.max_consecutive_skips)
        self._last_pre_hook(opt)
        self.calls += 1  # host count of clip_ calls: how GradientMonitor(guard=) pairs flags with its steps
        self._skip.clear()  # a new clip_ replaces the previous decision, also when it finds no gradients
        params = optimizer_params(opt)
        kernel_clip = self._mode.kernel_clip
        if kernel_clip and scaler is None and self.process_group is None and not is_fused(opt) and not self._exact:
            # the common CPU case first: clip_grad_norm_'s one-call C++ clip, which answers None (nothing
            # done) for anything but plain dense CPU gradients, before any Python pass over the list
            out = read.cpu_write(self, params)
            if out is not None:
                return out
        grads = inputs.grads_of(params)
        if grads and inputs.check_tensors(grads):
            raise TypeError("StepGuard supports dense real floating gradients (float16/bfloat16/float32/float64); "
                            "got sparse, complex or other gradients. Clip those with fastgrad.clip_grad_norm_ "
                            "(nothing was modified)")
        plan = route.lookup(params, self.process_group)
        sharded = plan.sharded(grads)
        use_scaler = scaler is not None and scaler.is_enabled()
        per_tensor = self._mode.per_tensor
        if use_scaler and sharded and (per_tensor or scaler_state.is_sharded(scaler)):
            raise NotImplementedError("StepGuard.clip_(scaler) with sharded (DTensor or process_group) gradients "
                                      "supports torch's plain GradScaler and the total-norm modes; for "
                                      f"{f'mode={self.mode}' if per_tensor else 'a ShardedGradScaler'} call "
                                      "fastgrad.scaler_unscale_and_clip first, then guard.clip_() (nothing was "
                                      "modified)")
        if not grads and not sharded:
            self._skip.clear(NO_GRADS)  # no decision: a step on gradients made later is refused
            if use_scaler:  # unscale_ records an empty flag set; so do we
                state = scaler_state.optimizer_state(scaler, opt, False)
                scaler_state.check_ready(scaler, state)
                state["found_inf_per_device"] = {}
                from torch.amp.grad_scaler import OptState
                state["stage"] = OptState.UNSCALED
            return torch.tensor(0.0)
        if use_scaler and not scaler_state.known_unscale(scaler):
            raise TypeError(f"StepGuard.clip_(scaler): {type(scaler).__name__} overrides unscale_; only torch's "
                            "GradScaler is supported (nothing was modified)")
        inv_scale = None
        state = None
        if use_scaler:
            state = scaler_state.optimizer_state(scaler, opt, False)
            scaler_state.check_ready(scaler, state)
            if inputs.has_dtype(grads, torch.float16):
                raise ValueError("Attempting to unscale FP16 gradients.")
            inv_scale = scaler_state.inv_scale(scaler)
        fused = is_fused(opt)
        # decided on the host before the read pass (checks of types and attributes only)
        # (exact=True under a scaler unscales in place first: nothing left to hand over)
        hand_over = (fused and self.zero_write and not sharded and not per_tensor and
                     not (self._exact and use_scaler) and
                     (scaler_state.zero_write_applies(scaler, opt, grads) if use_scaler
                      else optim_clip.zero_write_applies(opt, grads)))
        if kernel_clip and not sharded and not self._exact:
            # (outside no_grad, as clip_grad_norm_'s one-call path: these calls record nothing for autograd)
            out = read.one_call(self, params, grads, inv_scale, scaler, state, hand_over)
            if out is not None:
                return out
        with torch.no_grad():
            sh = plan.place(grads) if sharded else None  # (the grads' types were checked above: no torch route)
            return read.general(self, params, grads, inv_scale, scaler, state, hand_over, sh, use_scaler)

    def _last_pre_hook(self, opt) -> None:
        """The guard's step pre-hook runs after every other (a pre-hook registered later that writes a
        gradient is then caught by the check, not stepped on): torch runs them in the order of its table."""
        table = getattr(opt, "_optimizer_step_pre_hooks", None)
        hid = self._hooks[0].id
        if table is not None and hid in table and next(reversed(table)) != hid:
            table.move_to_end(hid)

    def _decided(self, total, coef, inv, bad, spike, scale, grads) -> None:
        """A read pass's outcome: record it for the counters and leave the flag for the next step."""
        self._counters.record(total, coef, inv, bad, spike)
        self._skip.pend(bad, scale, grads)
        if self._keeper is not None:
            self._keeper.restore(bad)
        if self.max_consecutive_skips is not None or not self._counters.warned:
            self._counters.copy_consecutive()  # read at the next clip_ (GuardError, the WARN_AFTER warning)

    def _ensure_state(self, total: Tensor, n_params: int) -> None:
        """The counters and the mode's state on the norm's device (created, or moved after a load)."""
        dev = total.device
        c = self._counters
        if c.counts is not None and self._device == dev:
            return
        c.fold()
        if c.counts is not None and self._mode.fits(n_params):  # loaded or moved: keep, on this device
            c.counts = c.counts.to(dev)
            self._mode.state = {k: v.to(dev) for k, v in self._mode.state.items()}
            self._device = dev
            return
        self._device = dev
        c.start(dev)
        self._mode.init(total, n_params)

    # ------------------------------------------------------------------ checkpoints
    def _checkpointed(self) -> list:
        """(name, tensor) of everything a checkpoint of this run holds that the guard can see."""
        opt = self._optimizer
        names = {}
        if self._keeper is not None and self._keeper.model is not None:
            names = {id(p): n for n, p in self._keeper.model.named_parameters()}
        items = []
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                pname = names.get(id(p), f"parameter {i} of param group {g} (shape {list(p.shape)})")
                items.append((pname, p))
                for k, v in opt.state.get(p, {}).items():
                    items.append((f"optimizer state {k!r} of {pname}", v))
        if self._keeper is not None:
            items += [(f"buffer {n}", b) for n, b in self._keeper.named()]
        items += [(f"the guard's {k}", v) for k, v in self._mode.state.items()]
        return items

    def safe_to_checkpoint(self) -> bool:
        """Whether the parameters, the optimizer state, the model's buffers (with ``model=``) and the guard's
        statistics are all finite now: what a checkpoint written now would hold. SYNCS once (one batched
        reduction per dtype and device, one read); call it when a checkpoint is about to be written."""
        return finite.all_finite(self._checkpointed())

    def nonfinite_state(self) -> list[str]:
        """The names of the first few tensors that make :meth:`safe_to_checkpoint` False (empty when it is
        True). Reads each tensor: for the message after a False."""
        return finite.nonfinite(self._checkpointed())

    # ------------------------------------------------------------------ reading the guard
    def last_step_skipped(self) -> bool:
        """Whether the last ``clip_`` decided to skip its step. SYNCS (reads one device value); for a
        sync-free signal use the ``skipped`` attribute (a 0-dim device bool tensor)."""
        return bool(self.skipped.item()) if self.skipped is not None else False

    @property
    def total_norm(self) -> Tensor | None:
        """The last step's total norm before clipping (0-dim device tensor; no sync)."""
        return self._counters.total_norm()

    @property
    def skipped(self) -> Tensor | None:
        """Whether the last step is (was) skipped, as a 0-dim device bool tensor (no sync)."""
        return self._counters.skipped()

    @property
    def clipped_norm(self) -> Tensor | None:
        """The last step's norm after clipping (device tensor; folds the records, no sync)."""
        return self._counters.folded(1)

    @property
    def coef(self) -> Tensor | None:
        """The last step's clip coefficient (AdaGC: post/pre norm ratio; device tensor, no sync)."""
        return self._counters.folded(2)

    @property
    def clipped(self) -> Tensor | None:
        """Whether the last step was clipped (and not skipped): device bool tensor, no sync."""
        return self._counters.folded(3)

    def counters(self) -> Tensor:
        """The counters as ONE device tensor (slots: ``fastgrad.guard.COUNTERS``); zeros (on the parameters'
        device) before the first step. Reading it (``.tolist()``) is one transfer."""
        c = self._counters
        c.fold()
        if c.counts is None:
            params = optimizer_params(self._optimizer)
            return c.zeros(params[0].device if params else torch.device("cpu"))
        return c.counts

    def state(self) -> dict:
        """Everything the guard knows, read in ONE device-to-host transfer: the last step's ``total_norm``
        (pre-clip), ``clipped_norm`` (post-clip), ``coef``, ``clipped``, ``skipped`` (None before any step);
        the counters over the run (``steps``, ``clipped_steps``, ``skipped_steps``, ``consecutive_skipped``,
        ``nonfinite_steps``, ``spike_steps``, ``longest_consecutive_skipped``, ``engaged_steps``; 0 before any
        step); and the ledger of the steps since the previous ``state()`` (the window): ``window_steps``,
        ``clip_share`` (the share of them on which the clip engaged; None for an empty window),
        ``norm_p50``, ``norm_p90``, ``norm_p99`` (of their finite total norms, the last ``RING`` = 1024 at
        most; None without one) with ``norm_count`` (how many norms those are), and
        ``window_longest_skipped``. Syncs, once; readable at any time (new, loaded, mid-run).

        Raises :class:`GuardError` (its ``state``: this dict) when ``max_consecutive_skips`` is set and a run
        of that many skips in a row ended in the window: a run the next ``clip_``'s check would not see (on
        CUDA it reads a copy only once landed); a run still going is stopped by that check."""
        last, vals = self._counters.read()
        out = dict(zip(_LAST, last if last is not None else [None] * len(_LAST)))
        for k in ("clipped", "skipped"):
            out[k] = None if out[k] is None else bool(out[k])
        out.update(zip(_COUNTED, (int(v) for v in vals[:len(COUNTERS)])))
        window = dict(zip(_WINDOW, vals[len(COUNTERS):]))
        steps0, engaged0 = self._read_at
        self._read_at = (out["steps"], out["engaged_steps"])
        n = out["steps"] - steps0
        out["window_steps"] = n
        out["clip_share"] = (out["engaged_steps"] - engaged0) / n if n else None
        for k, _ in QUANTILES:
            out[k] = None if window[k] != window[k] else window[k]  # NaN: no finite norm in the window
        out["norm_count"] = int(window["norm_count"])
        out["window_longest_skipped"] = int(window["window_longest_skipped"])
        self._log_new_skips(out)
        limit = self.max_consecutive_skips
        # a run still going is stopped by the next clip_ (its check); one a step taken ended, only here
        if limit is not None and int(window["ended"]) >= limit:
            err = window_error(out, int(window["ended"]), limit)
            raise err
        return out

    def _log_new_skips(self, st: dict) -> None:
        """A record from the ``fastgrad.guard`` logger when this read finds skips the previous one did not
        (no read of its own: a skip is not silent wherever the counters are read, e.g. by the callbacks)."""
        new = st["skipped_steps"] - self._reported_skips
        self._reported_skips = st["skipped_steps"]
        if new > 0:
            _LOG.warning("StepGuard: %d step(s) skipped since the last read (%d in all of %d steps: %d non-finite, "
                         "%d spikes); %d in a row now", new, st["skipped_steps"], st["steps"],
                         st["nonfinite_steps"], st["spike_steps"], st["consecutive_skipped"])


StepGuard.__doc__ = StepGuard.__doc__.replace("{mode_options}", mode_options_doc())
