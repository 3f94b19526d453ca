"""The hooks of ``python -m fastgrad.check``: the ``Checker`` installs global optimizer step hooks, backward and
clip interceptors and a forward watcher around an unmodified script, and keeps each step's statistics on the
device until a flush (one sync per ``flush_every`` steps and one at the end).

- optimizer step hooks run the fused ``grad_stats`` pass over the optimizer's parameters where the step's
  gradients exist. Without a closure that is right before the step. With ``step(closure)`` (LBFGS, every
  Lightning run) the pre-hook wraps the closure: the step's norm and loss are those of its FIRST evaluation,
  and NaN/Inf gradients of any later evaluation are counted too;
- each optimizer is its own series (norms, spikes, loss), numbered in the order it first steps;
- until the first optimizer step, each scalar ``backward()`` is also read right after it returns
  (``manual``: a hand-written loop);
- ``torch.Tensor.backward``/``torch.autograd.backward`` keep the detached scalar loss (the unscaled one under
  a GradScaler) on the device;
- a :class:`~fastgrad.diagnose.collect.watch.ForwardWatcher` on every module remembers the first non-finite
  module output;
- the red-flag interceptors (``interceptors``) watch the clip, ``zero_grad`` and the GradScaler;
- the watched models' floating buffers are read for NaN/Inf at the sampled steps and when the script ends
  (``buffers``);
- each step's row is closed and flushed by ``bookkeeping``, and the run read to the host at its end by
  ``readout``.

Nothing on the script's path reads a device value: per-step values are written with device ops (never a
host number assigned into a device tensor, which on CUDA is a synchronizing copy)."""

from __future__ import annotations

import functools
import sys
import weakref

import torch
from torch import Tensor

from ...guard import StepGuard
from ..thresholds import RunLimits
from .bookkeeping import StepBookkeeping
from .buffers import BufferReader
from .children import ChildProcesses
from .identity import IdentityMap
from .interceptors import ABSENT, RedFlagInterceptors, scaler_classes
from .loss_inputs import criterion_sign, loss_node, probability_rows, softmax_made
from .manual import ManualLoopReader
from .naming import ParameterNames
from .optimizer_hooks import OptimizerStepReader
from .ranks import RankRecorder
from .readout import RunReadout
from .saturation import SaturationReader
from .steps import StepRecord, StopCheck
from .targets import MovingTargets
from .watch import ForwardWatcher

__all__ = ["Checker", "StopCheck"]


class Checker(OptimizerStepReader, StepBookkeeping, RunReadout, ParameterNames, RedFlagInterceptors,
              ManualLoopReader, RankRecorder, BufferReader, MovingTargets, SaturationReader, ChildProcesses):
    """The hooks and interceptors of one checked run (its state, what it installs, the backward interceptor).
    ``install()``/``remove()`` bracket the script; each step is closed by ``StepBookkeeping`` and the run read
    by ``RunReadout.finish()``."""

    def __init__(self, max_steps: int | None = None, flush_every: int = 64):
        self.max_steps = max_steps
        self.script_path = ""  # set by run_script: the frames of the script, to name its optimizers
        self.flush_every = max(1, flush_every)
        self.steps: list[StepRecord] = []  # host side, filled by flushes
        self._pending: list[tuple[StepRecord, Tensor]] = []  # device rows not yet read
        self.watcher: ForwardWatcher | None = None
        self._undo: list = []
        self._handles: list = []
        # per object the script built (weakly held: a dead one's entry goes, its id() may be reused)
        self._names = IdentityMap()  # parameter -> its name
        self._names_given = False
        self._named_cache = IdentityMap()  # optimizer -> [(name, parameter)] of its param_groups
        self.module_types: set[str] = set()  # class names of the modules seen (to pick advice that fits)
        self.last_stats = None
        self._bad_steps: Tensor | None = None  # per parameter: steps with NaN/Inf gradients (device)
        self._bad_names: list[str] = []
        # one series per optimizer, in the order they first step
        self._series = IdentityMap()  # optimizer -> its series number
        self.series_names: list[str] = []
        self._opt_refs: list = []
        self._targets_init()  # target networks the run moves (targets.py)
        self.series_lr: list[float | None] = []
        self.series_sched: list[str | None] = []  # the script's scheduler variable per series
        self.series_maximize: list[bool] = []     # an optimizer built with maximize=True, per series
        # scalar backward calls, and of them those reaching a loss function negated / as returned (host)
        self.loss_signs = {"calls": 0, "negated": 0, "kept": 0, "node": None}
        self.optimizers_made = 0
        self.stop_raised = False  # --steps stopped the script (whatever it did with the StopCheck after)
        self._children_init()  # processes the script trains in (children.py)
        # red-flag state (host only: never depends on device values)
        self.steps_done = 0
        self._bw = 0              # backward calls since the last step
        self.backward_calls = 0
        self.scalar_backward_calls = 0
        self._clip_after_bw = False
        self._bw_after_clip = False
        self._zeroed = False      # zero_grad seen since the last step
        self._grads_scaled = False
        self.scaler_used = False
        self._scaled: tuple | None = None  # (weakref to the last scaler.scale output, the unscaled loss)
        self._clip_depth = 0
        self._losses: list[Tensor] = []
        self._prev_losses: list[Tensor] = []  # the losses of the previous step (several optimizers, one backward)
        self._step_losses: list[Tensor] | None = None  # frozen after a closure's first evaluation
        self._evals = 0           # closure evaluations of the current step
        self._extra_bad: Tensor | None = None  # NaN/Inf values of the later closure evaluations (device)
        self._clip_norm: Tensor | None = None
        self._clip_max: float | None = None
        self.misplaced_clip_max: float | None = None  # the max_norm of the last clip that ran after a step
        # ... and whether every such clip found every gradient None (zero_grad() had dropped them: the clip sits
        # before backward(), not after step())
        self.misplaced_clip_bare: bool | None = None
        self.clips_found_grads = 0  # before any optimizer step: the norm clips that found a gradient to clip
        self._clips = 0
        self._leftover: Tensor | None = None
        self._last_opt = None  # weakref to the optimizer that stepped last
        # hand-written loops: each scalar backward() read right after it, until an optimizer steps
        self._m_steps: list[tuple[StepRecord, Tensor]] = []
        self._m_host: list[StepRecord] = []
        self._m_row: Tensor | None = None      # the open manual step's statistics row
        self._m_used: Tensor | None = None     # its gradients re-read at zero_grad() after a clip
        self._m_losses: list[Tensor] = []
        self._m_clip = False
        self._m_clip_max: float | None = None
        self._m_zeroed = False
        self._m_leftover: Tensor | None = None  # the open step's gradients before its backward (never zeroed)
        self._m_named: list = []
        self._any_zero = False
        self._opt_started = False
        self._m_last = None
        self.flags: dict[str, list[int]] = {"clip_scaled": [], "clip_after_step": [], "clip_partial": [],
                                            "clip_not_params": []}
        self.clip_not_params: dict | None = None  # the first clip handed no parameter: where, which tensor
        self.clip_calls = 0
        self.zero_grad_calls = 0
        self.skipped = 0
        self._row_sparse_ids = IdentityMap()  # parameters of nn.Embedding/EmbeddingBag modules (as a set)
        self._guard_calls = IdentityMap()  # StepGuard.calls seen at the previous step, per guard
        self._read_this_step = False
        self._read_failed = False
        self.errors: list[str] = []  # failures of the checker itself (reported, never raised into the script)
        self._upd_before = None  # (optimizer ref, named parameters, their copies) on a sampled step
        self.update_rows: list = []  # (step, names, device [2, n]: update norm, weight norm per parameter)
        self.updates: list = []      # the same on the host, read once after the run
        self.ce_classes: int | None = None  # classes of the last cross-entropy the script computed (its chance level)
        # cross-entropy calls checked, those handed a softmax's output (host) and those whose input rows were
        # probabilities (a device count, read once at the end: ``ce_probs``)
        self.ce_calls = 0
        self.ce_softmax = 0
        self._ce_probs: Tensor | None = None
        self.ce_probs = 0
        # per optimizer step: (step, scalar backward calls, how many of them backpropagated a loss function's
        # output as it returned it, that node's name); host only
        self.windows: list[tuple[int, int, int, str | None]] = []
        self._bw_scalar = self._bw_straight = 0
        self._bw_node: str | None = None
        self._scaled_node: str | None = None
        self._scaled_sign: tuple | None = None  # criterion_sign of the loss handed to GradScaler.scale
        # per series: (the largest lr x weight_decay of a step, its weight_decay, the optimizer's class); host only
        self.decay: dict[int, tuple[float, float, str]] = {}
        # per parameter, at how many read steps its gradient was present and nonzero: device counters per
        # (series, names) until the end (``_note_live``); a manual loop's apart, dropped if an optimizer steps
        self._live: dict = {}
        self._m_live: dict = {}
        self.live: dict = {}         # name -> (series, steps read, steps present, steps nonzero), after the run
        self.ran_params: list | None = None  # names of the parameters whose module's forward ran, after the run
        self._series_params: dict = {}  # series -> (id of its named list, [(name, requires_grad)])
        self.frozen: dict = {}       # names of the parameters the script froze (requires_grad False), in order
        self.script_vars: dict = {}  # the script's own names: "model", "lr" (a hand-written loop's)
        self._rank_init()  # a multi-process run's records of the clips (collect.ranks)
        self._buf_init()   # the models' buffers that turn NaN/Inf (collect.buffers)
        self._sat_init()   # activations saturated before the first backward (collect.saturation)

    # ---------------------------------------------------------------- install / remove
    def install(self) -> None:
        from torch.optim import optimizer as O

        self.watcher = ForwardWatcher()  # global hooks; advanced by our step boundary
        self._sat_install()              # after the watcher: its hooks name a module first
        self._handles += [O.register_optimizer_step_pre_hook(self._pre_step),
                          O.register_optimizer_step_post_hook(self._post_step)]
        self._patch(torch.Tensor, "backward", self._wrap_backward)
        self._patch(torch.autograd, "backward", self._wrap_backward)
        self._patch(torch.optim.Optimizer, "zero_grad", self._wrap_zero_grad)
        self._patch(torch.optim.Optimizer, "__init__", functools.partial(self._wrap_counting, "optimizers_made"))
        # a script that trains in processes it starts itself (A3C's workers): counted, and the script's own
        # handed to a checker of their own (children.py)
        import multiprocessing.process as mp_process

        self._patch(mp_process.BaseProcess, "start", self._wrap_start)
        self._patch(torch.nn.Module, "zero_grad", self._wrap_zero_grad)
        for cls in scaler_classes():
            self._patch_scaler(cls)
        self._watch_scaler_subclasses()
        from ... import agc as fg_agc, amp as fg_amp, clip as fg_clip
        from torch.nn.utils import clip_grad as tc

        # the package's own namespace (fastgrad.clip_grad_norm_ ...): already imported, as every submodule
        # import runs it first
        root = sys.modules[__name__.split(".")[0]]
        for mod in (torch.nn.utils, tc, root, fg_clip):
            self._patch(mod, "clip_grad_norm_", functools.partial(self._wrap_clip, ranks=True))
            if hasattr(mod, "clip_grads_with_norm_"):  # a norm the script computed itself, then clipped with
                self._patch(mod, "clip_grads_with_norm_",
                            functools.partial(self._wrap_clip, norm_at=2, ranks=True))
            self._patch(mod, "clip_grad_value_", functools.partial(self._wrap_clip, bound_at=None))
        for mod in (root, fg_agc):
            self._patch(mod, "adaptive_clip_grad_", functools.partial(self._wrap_clip, bound_at=None))
        for mod in (root, fg_amp):
            self._patch(mod, "scaler_unscale_and_clip", self._wrap_fused_amp)
        self._patch(StepGuard, "clip_", self._wrap_guard_clip)
        if torch.distributed.is_available():
            # a multi-process run's records go to rank 0 while the default group still lives
            from torch.distributed import distributed_c10d as c10d

            for mod in (torch.distributed, c10d):
                self._patch(mod, "destroy_process_group", self._wrap_destroy)
        # nn.CrossEntropyLoss and NLLLoss call these through the module attribute: one patch sees both forms
        for name in ("cross_entropy", "nll_loss"):
            self._patch(torch.nn.functional, name, self._wrap_class_loss)

    def _patch(self, owner, name: str, wrapper) -> None:
        orig = getattr(owner, name)
        # Patched once per owner; a subclass attribute lookup finds the patched base method.
        setattr(owner, name, functools.update_wrapper(wrapper(orig), orig))
        self._undo.append((owner, name, orig))

    def remove(self) -> None:
        for owner, name, orig in reversed(self._undo):
            if orig is ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
        self._undo.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.watcher is not None:
            self.watcher.remove()
        self._sat_close()

    # ---------------------------------------------------------------- interceptors (host logic, no syncs)
    def _wrap_backward(self, orig):
        chk = self

        def backward(tensor, *args, **kwargs):
            outer = not getattr(chk, "_in_bw", False)
            manual = False
            if outer:
                try:
                    manual = chk._on_backward(tensor)
                except StopCheck:
                    raise
                except Exception as e:  # noqa: BLE001 - never break the user's backward
                    chk.errors.append(f"step {chk.steps_done + 1}: backward hook: {e}")
                chk._in_bw = True
            try:
                out = orig(tensor, *args, **kwargs)
            finally:
                if outer:
                    chk._in_bw = False
                    chk._sat_close()   # the weights the script built are read; an update may follow
            if manual:
                try:
                    chk._manual_read(tensor)
                except Exception as e:  # noqa: BLE001
                    chk.errors.append(f"backward {chk.backward_calls}: could not read the gradients: {e}")
            return out
        return backward

    def _wrap_destroy(self, orig):
        chk = self

        def destroy_process_group(group=None, *args, **kwargs):
            import torch.distributed as dist

            if group is None or group is dist.group.WORLD:
                try:
                    chk._rank_gather()
                except Exception as e:  # noqa: BLE001 - never keep the script from tearing down
                    chk.errors.append(f"could not gather the ranks' norm records: {e}")
            return orig(group, *args, **kwargs)
        return destroy_process_group

    def _wrap_class_loss(self, orig):
        chk = self

        ce = orig.__name__ == "cross_entropy"

        def loss(input, *args, **kwargs):
            # the class count is a shape, read on the host: a uniform guess scores ln(classes)
            if isinstance(input, Tensor) and input.dim() >= 1:
                chk.ce_classes = int(input.shape[1] if input.dim() >= 2 else input.shape[0])
                if ce and not torch.compiler.is_compiling():
                    try:
                        chk._note_ce_input(input)
                    except Exception as e:  # noqa: BLE001 - the note is evidence, never a reason to fail the loss
                        chk.errors.append(f"cross_entropy: could not read its input: {e}")
            return orig(input, *args, **kwargs)
        return loss

    def _note_ce_input(self, input: Tensor) -> None:
        """Count a cross-entropy call whose input is a softmax's output (host) or whose rows are
        probabilities (device, no sync): cross_entropy applies its own log-softmax to what it gets."""
        self.ce_calls += 1
        if softmax_made(input):
            self.ce_softmax += 1
        flag = probability_rows(input, RunLimits.prob_row_tol)
        if flag is not None:
            flag = flag.to(torch.int64)
            self._ce_probs = flag if self._ce_probs is None else self._ce_probs + flag.to(self._ce_probs.device)

    def _on_backward(self, tensor) -> bool:
        """Host bookkeeping before a backward(); returns whether to read the gradients after it (a scalar
        backward while no optimizer has stepped yet)."""
        if isinstance(tensor, (list, tuple)):
            tensor = tensor[0] if len(tensor) == 1 else None
        self.backward_calls += 1
        if self._bw == 0 and self.steps_done and not self._zeroed:
            self._leftover = self._grad_norm_now()
        scalar = False
        if isinstance(tensor, Tensor):
            node = loss_node(tensor)
            sign = None
            if self._scaled is not None and self._scaled[0]() is tensor:
                self._grads_scaled = True
                tensor = self._scaled[1]
                node = self._scaled_node  # what the scaler was handed
                sign = self._scaled_sign
            if tensor.numel() == 1 and tensor.is_floating_point():
                scalar = True
                self.scalar_backward_calls += 1
                self._bw_scalar += 1
                if node is not None:
                    self._bw_straight += 1
                    # one loss function each time: several different losses are not a window of micro-batches
                    self._bw_node = node if self._bw_node in (None, node) else "mixed"
                loss = tensor.detach().reshape(()).to(torch.float64)
                self._losses.append(loss)
                neg, kept, crit = sign or criterion_sign(tensor)
                signs = self.loss_signs
                signs["calls"] += 1
                signs["negated"] += neg > 0 and not kept
                signs["kept"] += kept > 0
                signs["node"] = signs["node"] or crit
        self._bw += 1
        if self._clip_after_bw:
            self._bw_after_clip = True
        if not scalar or self._opt_started:
            return False
        # a hand-written loop: the previous backward's step ends here when the gradients were zeroed since
        # (or when the script never zeroes them: then every backward is a step)
        if self._m_row is not None and (self._m_zeroed or not self._any_zero):
            self._manual_close()
            if (self.max_steps is not None and not self.optimizers_made
                    and len(self._m_steps) + len(self._m_host) >= self.max_steps):
                self.stop_raised = True
                raise StopCheck()
            if not self._any_zero:
                # no zero_grad() yet: what this backward adds to (zero where the script zeroes or drops the
                # gradients by hand, as many hand-written updates do; no sync)
                self._m_leftover = self._manual_leftover()
        self._m_losses.append(loss)
        return True

