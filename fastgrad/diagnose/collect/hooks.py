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
- the red-flag interceptors (``interceptors``) watch the clip, ``zero_grad`` and the GradScaler.

Nothing on the script's path reads a device value: per-step values are written with device ops (never a
host number assigned into a device tensor, which on CUDA is a synchronizing copy)."""

from __future__ import annotations

import functools
import sys
import weakref

import torch
from torch import Tensor

from ...clip import multi_tensor_norm
from ...distributed import to_local_norm
from ...guard import StepGuard, guard_for
from ...stats import grad_stats
from .identity import IdentityMap
from .interceptors import ABSENT, RedFlagInterceptors, scaler_classes
from .manual import ManualLoopReader
from .naming import ParameterNames
from .optimizer_hooks import OptimizerStepReader
from .ranks import RankRecorder
from .steps import StepRecord, StopCheck
from .watch import ForwardWatcher

__all__ = ["Checker", "StopCheck"]





class Checker(OptimizerStepReader, ParameterNames, RedFlagInterceptors, ManualLoopReader, RankRecorder):
    """The hooks and interceptors of one checked run. ``install()``/``remove()`` bracket the script."""

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
        self.series_lr: list[float | None] = []
        self.optimizers_made = 0
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
        self._m_named: list = []
        self._any_zero = False
        self._opt_started = False
        self._m_last = None
        self.flags: dict[str, list[int]] = {"clip_scaled": [], "clip_after_step": [], "clip_partial": []}
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
        # per parameter, at how many read steps its gradient was present and nonzero: device counters per
        # (series, names) until the end (``_note_live``); a manual loop's apart, dropped if an optimizer steps
        self._live: dict = {}
        self._m_live: dict = {}
        self.live: dict = {}         # name -> (series, steps read, steps present, steps nonzero), after the run
        self._series_params: dict = {}  # series -> (id of its named list, [(name, requires_grad)])
        self.frozen: dict = {}       # names of the parameters the script froze (requires_grad False), in order
        self.script_vars: dict = {}  # the script's own names: "model", "lr" (a hand-written loop's)
        self._rank_init()  # a multi-process run's records of the clips (collect.ranks)

    # ---------------------------------------------------------------- install / remove
    def install(self) -> None:
        from torch.optim import optimizer as O

        self.watcher = ForwardWatcher()  # global hooks; advanced by our step boundary
        self._handles += [O.register_optimizer_step_pre_hook(self._pre_step),
                          O.register_optimizer_step_post_hook(self._post_step)]
        self._patch(torch.Tensor, "backward", self._wrap_backward)
        self._patch(torch.autograd, "backward", self._wrap_backward)
        self._patch(torch.optim.Optimizer, "zero_grad", self._wrap_zero_grad)
        self._patch(torch.optim.Optimizer, "__init__", self._wrap_opt_init)
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

        def loss(input, *args, **kwargs):
            # the class count is a shape, read on the host: a uniform guess scores ln(classes)
            if isinstance(input, Tensor) and input.dim() >= 1:
                chk.ce_classes = int(input.shape[1] if input.dim() >= 2 else input.shape[0])
            return orig(input, *args, **kwargs)
        return loss

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
            if self._scaled is not None and self._scaled[0]() is tensor:
                self._grads_scaled = True
                tensor = self._scaled[1]
            if tensor.numel() == 1 and tensor.is_floating_point():
                scalar = True
                self.scalar_backward_calls += 1
                loss = tensor.detach().reshape(()).to(torch.float64)
                self._losses.append(loss)
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
                raise StopCheck()
        self._m_losses.append(loss)
        return True

    def finish(self) -> None:
        """After the script: close an open hand-written step, read everything to the host."""
        if not self._opt_started and self._m_row is not None:
            try:
                if self._m_clip and not self._m_zeroed:  # the last step's clipped gradients, never zeroed
                    self._m_used = self._stats_row(grad_stats(self._m_named))
                self._manual_close()
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"last backward: {e}")
        self.flush()
        if not self.steps and (self._m_steps or self._m_host):
            self.steps = self._m_host + self._read(self._m_steps)
            self._m_steps = []
            self.last_stats = self._m_last
        if self.update_rows:
            vals = torch.stack([t.to(self.update_rows[0][2].device) for _, _, t in self.update_rows]) \
                if len({t.shape for _, _, t in self.update_rows}) == 1 else None
            rows = vals.tolist() if vals is not None else [t.tolist() for _, _, t in self.update_rows]
            self.updates = [(step, names, row) for (step, names, _), row in zip(self.update_rows, rows)]
            self.update_rows = []
        self._read_live()
        for i, ref in enumerate(self._opt_refs):
            opt = ref()
            if opt is not None and opt.param_groups:
                lr = opt.param_groups[0].get("lr")
                self.series_lr[i] = lr if isinstance(lr, (int, float)) else self.series_lr[i]

    def _note_live(self, live: dict, series: int, stats, named) -> None:
        """Count, on the device, the parameters of one read whose gradient is nonzero (a norm other than 0: NaN
        counts as nonzero); the names and the steps read are counted on the host. No sync."""
        key = (series, tuple(stats.names))
        nz = (stats.norm != 0).to(torch.int64)
        acc = live.get(key)
        if acc is None:
            live[key] = [nz, 1]
        else:
            acc[0] = acc[0] + nz
            acc[1] += 1
        kept = self._series_params.get(series)
        # the same list object while the optimizer's parameters stay (its id only: holding the list would keep a
        # dropped model alive; a series is one optimizer, so a freed list's id never comes back for it)
        if kept is None or kept[0] != id(named):
            self._series_params[series] = (id(named), [(n, p.requires_grad) for n, p in named])

    def _read_live(self) -> None:
        """After the run: per parameter, (series, steps read, steps with a gradient, steps with a nonzero one),
        for the optimizers' parameters (or the hand-written loop's, when no optimizer stepped). One sync."""
        live = self._live if self._opt_started else self._m_live
        if not live:
            return
        keys = list(live)
        vals = torch.cat([live[k][0].to(live[keys[0]][0].device) for k in keys]).tolist()
        reads: dict[int, int] = {}
        present: dict[str, list] = {}
        pos = 0
        for key in keys:
            series, names = key
            n = live[key][1]
            reads[series] = reads.get(series, 0) + n
            for name in names:
                acc = present.setdefault(name, [series, 0, 0])
                acc[1] += n
                acc[2] += int(vals[pos])
                pos += 1
        out = {}
        for series, (_, params) in self._series_params.items():
            for name, trainable in params:
                if not trainable:
                    continue
                _, got, nz = present.get(name, [series, 0, 0])
                out.setdefault(name, (series, reads.get(series, 0), got, nz))
        self.live = out
        self._live, self._m_live = {}, {}

    def _grad_norm_now(self) -> Tensor | None:
        """Device norm of the gradients the last optimizer holds before a new backward: nonzero when they
        were never zeroed. No sync."""
        opt = None if self._last_opt is None else self._last_opt()
        if opt is None:
            return None
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
        if not grads:
            return None
        return multi_tensor_norm(grads)

    # ---------------------------------------------------------------- optimizer step hooks
    def _boundary(self, opt, skipped: bool) -> None:
        """End of one training step (an optimizer step, or a step the GradScaler skipped)."""
        series = self._series_of(opt)
        self.steps_done += 1
        step = self.steps_done
        if self._clip_after_bw and self._bw_after_clip:
            self.flags["clip_partial"].append(step)
        unread = not skipped and getattr(self, "_read_failed", False)
        st = self.last_stats if not skipped and not unread else None
        dev = st.total_norm.device if st is not None and len(st) else torch.device("cpu")
        # a fill kernel, not torch.tensor(nan, device=dev): on CUDA that is a synchronizing host-to-device copy
        nan = torch.full((), float("nan"), dtype=torch.float64, device=dev)

        def val(t):
            # (a sharded run's norms may be DTensors: the value each rank holds)
            return nan if t is None else to_local_norm(t.detach()).reshape(()).to(dev, torch.float64)

        # the step's loss: everything backpropagated over the step (the micro-batch losses added up); for a
        # closure, its first evaluation's
        losses = self._step_losses if self._step_losses is not None else self._losses
        if not losses and self._bw == 0 and self._step_losses is None:
            # no backward since the previous step: these gradients came from that step's backward (one loss,
            # several optimizers stepping on it), so that is the loss behind this step too
            losses = self._prev_losses
        self._prev_losses = losses
        loss = torch.stack([v.to(dev) for v in losses]).sum() if losses else None
        if st is not None and len(st):
            norm, nonfin, zero = val(st.total_norm), val((st.nan + st.inf).sum()), val(st.zero.sum())
            if self._extra_bad is not None:
                nonfin = nonfin + val(self._extra_bad)
            numel = sum(map(_numel, st.shapes))
        elif skipped or unread:
            norm = nonfin = zero = nan
            numel = 0
        else:  # a step with no gradient at all: nothing learns (not "non-finite")
            norm = nonfin = zero = torch.zeros((), dtype=torch.float64, device=dev)
            numel = 0
        # a StepGuard's decision for this step (its device flag), when clip_ ran since the previous step
        g = guard_for(opt)
        gflag = None
        if g is not None and g.calls != self._guard_calls.get(g, 0) and g.skipped is not None:
            gflag = g.skipped.to(torch.float64)
        if g is not None:
            self._guard_calls[g] = g.calls
        row = torch.stack([norm, nonfin, zero, val(loss), val(self._leftover), val(self._clip_norm),
                           val(gflag) if gflag is not None else torch.zeros((), dtype=torch.float64, device=dev)])
        lr = opt.param_groups[0].get("lr") if opt.param_groups else None
        rec = StepRecord(step=step, skipped=skipped, numel=numel, has_loss=loss is not None,
                         clipped=self._clips > 0, zeroed=self._zeroed,
                         leftover_checked=self._leftover is not None, series=series,
                         evals=max(self._evals, 1), clip_max=self._clip_max if self._clips else None,
                         clip_read=self._clip_norm is not None,
                         lr=lr if isinstance(lr, (int, float)) else None, unread=unread)
        self._read_failed = False
        self._pending.append((rec, row))
        # reset the per-step state
        self._bw = 0
        self._clip_after_bw = self._bw_after_clip = False
        self._zeroed = False
        self._grads_scaled = False
        self._losses = []
        self._step_losses, self._evals, self._extra_bad = None, 0, None
        self._clip_norm = self._leftover = None
        self._clip_max = None
        self._clips = 0
        if self.watcher is not None:
            self.watcher.step()
        if len(self._pending) >= self.flush_every:
            self.flush()

    @staticmethod
    def _read(pending) -> list[StepRecord]:
        if not pending:
            return []
        dev = pending[0][1].device
        vals = torch.stack([r.to(dev) for _, r in pending]).tolist()
        out = []
        for (rec, _), (norm, nonfin, zero, loss, leftover, clip_norm, gskip) in zip(pending, vals):
            rec.total_norm, rec.nonfinite, rec.zero = norm, nonfin, zero
            rec.guard_skipped = gskip > 0
            rec.loss = loss if rec.has_loss else None
            rec.leftover = leftover if rec.leftover_checked else None
            rec.clip_norm = clip_norm if rec.clip_read else None
            out.append(rec)
        return out

    def flush(self) -> None:
        """Read the pending per-step rows to the host: one sync."""
        self.steps += self._read(self._pending)
        self._pending.clear()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


