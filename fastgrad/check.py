"""``python -m fastgrad.check [--steps N] [--out DIR] SCRIPT [ARGS...]``: check an unmodified training script.

The script runs as ``__main__`` in this process (its arguments in ``sys.argv``, its directory on ``sys.path``,
the working directory left as it is) while global hooks watch it:

- optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``/``post_hook``) run the
  fused ``grad_stats`` pass over the optimizer's parameters where the step's gradients exist and keep the
  results on the device; the host reads them every ``--flush`` steps and at the end (one sync each time).
  Without a closure that is right before the step. With ``step(closure)`` (LBFGS, every Lightning run) the
  pre-hook wraps the closure: the step's norm and loss are those of its FIRST evaluation (the gradients at
  the parameters the step started from, the loss ``step()`` returns), and NaN/Inf gradients of any later
  evaluation are counted too;
- each optimizer is its own series (norms, spikes, loss), numbered in the order it first steps;
- until the first optimizer step, each scalar ``backward()`` is also read right after it returns: a script
  that never steps a torch.optim optimizer (hand-written updates) is checked with these, one step per
  ``zero_grad()`` (or per ``backward()`` when the script never calls one);
- ``torch.Tensor.backward``/``torch.autograd.backward`` keep the detached scalar loss (the unscaled one
  under a GradScaler) on the device;
- a :class:`~fastgrad.watch.ForwardWatcher` on every module remembers the first non-finite module output;
- interceptors on ``GradScaler.scale/unscale_/step``, the clip functions of torch and fastgrad and
  ``zero_grad`` spot the red flags of the gradient-management guide (see ``fastgrad.check_report``).

Everything is removed when the script ends. Then the report is printed (and with ``--out`` written as
report.md, report.json and grad_norm.png). Exit codes: see :data:`EXIT_CODES`.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import runpy
import sys
import traceback
import re
import weakref

import torch
from torch import Tensor

from .clip import multi_tensor_norm
from .check_report import CheckResult, StepRecord, build_result
from .guard import guard_for
from .stats import grad_stats
from .watch import ForwardWatcher

__all__ = ["EXIT_CODES", "Checker", "main", "run_script"]

EXIT_CODES = {
    0: "no critical finding (warnings and notices may be present)",
    1: "a critical finding (NaN/Inf gradients or loss, norm > 1000, no learning, a critical red flag)",
    2: "usage error (bad command line, script not found)",
    3: "the script raised an exception or exited with a non-zero status (the report covers what ran)",
    4: "nothing could be checked: no optimizer step and no scalar backward() (the report says why)",
}



_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def _scaler_classes() -> list[type]:
    """torch.amp.GradScaler and every subclass known at install time (FSDP's ShardedGradScaler is imported
    for the purpose when torch.distributed is built). A subclass the script defines later and that overrides
    these methods without calling the base class is not seen."""
    if torch.distributed.is_available():
        try:
            importlib.import_module("torch.distributed.fsdp.sharded_grad_scaler")  # defines the subclass
        except Exception:  # noqa: BLE001 - a broken distributed build must not stop the check
            pass
    out, todo = [], [torch.amp.GradScaler]
    while todo:
        cls = todo.pop(0)
        if cls not in out:
            out.append(cls)
            todo += cls.__subclasses__()
    return out


class _StopCheck(BaseException):
    """Raised from the optimizer post-step hook after ``--steps`` steps. A BaseException, so the script's own
    ``except Exception`` blocks do not swallow it."""


class Checker:
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
        self._names: dict[int, str] = {}
        self._named_cache: dict[int, tuple[int, list]] = {}
        self.module_types: set[str] = set()  # class names of the modules seen (to pick advice that fits)
        self.last_stats = None
        self._bad_steps: Tensor | None = None  # per parameter: steps with NaN/Inf gradients (device)
        self._bad_names: list[str] = []
        # one series per optimizer, in the order they first step
        self._series: dict[int, int] = {}
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
        self._step_losses: list[Tensor] | None = None  # frozen after a closure's first evaluation
        self._evals = 0           # closure evaluations of the current step
        self._extra_bad: Tensor | None = None  # NaN/Inf values of the later closure evaluations (device)
        self._clip_norm: Tensor | None = None
        self._clip_max: float | None = None
        self._clips = 0
        self._leftover: Tensor | None = None
        self._last_opt = None
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
        self._row_sparse_ids: set[int] = set()  # parameters of nn.Embedding/EmbeddingBag modules
        self._guard_calls: dict[int, int] = {}  # StepGuard.calls seen at the previous step, per guard
        self._read_this_step = False
        self._read_failed = False
        self.errors: list[str] = []  # failures of the checker itself (reported, never raised into the script)

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
        for cls in _scaler_classes():
            # a subclass that overrides one of these (FSDP's ShardedGradScaler: scale and unscale_) needs its
            # own interceptor: the patched base method is never reached through it
            for name, wrap in (("scale", self._wrap_scale), ("unscale_", self._wrap_unscale),
                               ("step", self._wrap_scaler_step)):
                if name in vars(cls):
                    self._patch(cls, name, wrap)
        import fastgrad
        from fastgrad import agc as fg_agc, amp as fg_amp, clip as fg_clip
        from torch.nn.utils import clip_grad as tc

        for mod in (torch.nn.utils, tc, fastgrad, fg_clip):
            for fn in ("clip_grad_norm_", "clip_grad_value_"):
                self._patch(mod, fn, self._wrap_clip)
        for mod in (fastgrad, fg_agc):
            self._patch(mod, "adaptive_clip_grad_", self._wrap_clip)
        for mod in (fastgrad, fg_amp):
            self._patch(mod, "scaler_unscale_and_clip", self._wrap_fused_amp)
        from fastgrad.guard import StepGuard
        self._patch(StepGuard, "clip_", self._wrap_guard_clip)

    def _patch(self, owner, name: str, wrapper) -> None:
        orig = getattr(owner, name)
        # Patched once per owner; a subclass attribute lookup finds the patched base method.
        setattr(owner, name, functools.update_wrapper(wrapper(orig), orig))
        self._undo.append((owner, name, orig))

    def remove(self) -> None:
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.watcher is not None:
            self.watcher.remove()

    # ---------------------------------------------------------------- interceptors (host logic, no syncs)
    def _wrap_opt_init(self, orig):
        chk = self

        def __init__(opt, *args, **kwargs):
            chk.optimizers_made += 1
            return orig(opt, *args, **kwargs)
        return __init__

    def _wrap_backward(self, orig):
        chk = self

        def backward(tensor, *args, **kwargs):
            outer = not getattr(chk, "_in_bw", False)
            manual = False
            if outer:
                try:
                    manual = chk._on_backward(tensor)
                except _StopCheck:
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
                raise _StopCheck()
        self._m_losses.append(loss)
        return True

    def _manual_params(self, tensor) -> list:
        self._refresh_names()
        roots = [r() for r in self.watcher._roots] if self.watcher else []
        seen, named = set(), []
        for root in roots:
            if root is None:
                continue
            for p in root.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    named.append((self._names.get(id(p), f"param.{len(named)}"), p))
        if named:
            return named
        # no module ran: the leaves of the loss's graph (raw tensors with requires_grad)
        fn = getattr(tensor, "grad_fn", None)
        todo, visited = [fn] if fn is not None else [], set()
        while todo and len(visited) < 100_000:
            f = todo.pop()
            if f is None or id(f) in visited:
                continue
            visited.add(id(f))
            v = getattr(f, "variable", None)
            if isinstance(v, Tensor) and id(v) not in seen:
                seen.add(id(v))
                named.append((f"tensor.{len(named)}", v))
            todo += [g for g, _ in f.next_functions]
        return named

    def _manual_read(self, tensor) -> None:
        if self._m_row is None or self._m_zeroed or not self._any_zero:
            self._m_named = self._manual_params(tensor)
        stats = self._grad_stats(self._m_named)
        self._m_last = stats
        self._m_row = self._stats_row(stats)
        self._m_used = None
        self._m_clip = False
        self._m_zeroed = False

    def _grad_stats(self, named0: list):
        """grad_stats of (name, parameter) pairs (it reads sparse gradients through their values), with the
        watched modules' embeddings named as row-sparse (the depth rule leaves out rows a batch never
        looked up)."""
        stats = grad_stats(named0)
        if self._row_sparse_ids:
            extra = [n for n, p in named0 if id(p) in self._row_sparse_ids and n not in stats.row_sparse]
            if extra:
                stats.row_sparse = list(stats.row_sparse) + extra
        return stats

    def _stats_row(self, stats) -> Tensor:
        """(norm, NaN+Inf count, zero count) of one statistics pass, float64 on its device; no sync."""
        if not len(stats):
            return torch.zeros(3, dtype=torch.float64)
        return torch.stack([stats.total_norm.reshape(()).to(torch.float64),
                            (stats.nan + stats.inf).sum().to(torch.float64), stats.zero.sum().to(torch.float64)])

    def _manual_close(self) -> None:
        row = self._m_row
        dev = row.device
        loss = torch.stack([v.to(dev) for v in self._m_losses]).sum() if self._m_losses else None
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=dev)
        used = self._m_used.to(dev) if self._m_used is not None else row
        full = torch.cat([used, (loss if loss is not None else nan).reshape(1), nan.reshape(1),
                          (row[:1] if self._m_clip else nan.reshape(1)), torch.zeros(1, dtype=torch.float64,
                                                                                     device=dev)])
        n = len(self._m_steps) + len(self._m_host) + 1
        numel = sum(p.numel() for _, p in self._m_named)
        rec = StepRecord(step=n, numel=numel, has_loss=loss is not None, clipped=self._m_clip,
                         zeroed=self._m_zeroed, source="backward", clip_max=self._m_clip_max)
        self._m_steps.append((rec, full))
        self._m_row = self._m_used = None
        self._m_losses = []
        self._m_clip, self._m_clip_max = False, None
        if len(self._m_steps) >= self.flush_every:
            self._m_host += self._read(self._m_steps)
            self._m_steps = []

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
        for i, ref in enumerate(self._opt_refs):
            opt = ref()
            if opt is not None and opt.param_groups:
                lr = opt.param_groups[0].get("lr")
                self.series_lr[i] = lr if isinstance(lr, (int, float)) else self.series_lr[i]

    def _grad_norm_now(self) -> Tensor | None:
        """Device norm of the gradients the last optimizer holds before a new backward: nonzero when they
        were never zeroed. No sync."""
        if self._last_opt is None:
            return None
        grads = [p.grad for g in self._last_opt.param_groups for p in g["params"] if p.grad is not None]
        grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
        if not grads:
            return None
        return multi_tensor_norm(grads)

    def _wrap_zero_grad(self, orig):
        chk = self

        def zero_grad(self_, *args, **kwargs):
            chk._zeroed = True
            chk._any_zero = True
            chk.zero_grad_calls += 1
            if chk._m_row is not None and not chk._opt_started:
                if chk._m_clip and not chk._m_zeroed:
                    try:  # the gradients the hand-written update consumed: clipped since the backward
                        chk._m_used = chk._stats_row(grad_stats(chk._m_named))
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
                chk._last_opt = optimizer
                chk._boundary(optimizer, skipped=True)
            return out
        return step

    def _wrap_clip(self, orig):
        chk = self

        def clip(*args, **kwargs):
            if chk._clip_depth:
                return orig(*args, **kwargs)
            chk._on_clip(args, kwargs)
            chk._clip_depth += 1
            try:
                out = orig(*args, **kwargs)
            finally:
                chk._clip_depth -= 1
            # A norm of still-scaled gradients is not the gradient norm: keep it out of the history.
            # Only a clip between backward and step tells the norm the step would have used.
            if isinstance(out, Tensor) and out.dim() == 0 and not chk._grads_scaled and chk._bw:
                chk._clip_norm = out.detach()
            return out
        return clip

    def _wrap_fused_amp(self, orig):
        chk = self
        clip = self._wrap_clip(orig)

        def scaler_unscale_and_clip(*args, **kwargs):
            if not chk._clip_depth:
                chk._grads_scaled = False  # it unscales before it clips
            return clip(*args, **kwargs)
        return scaler_unscale_and_clip

    def _wrap_guard_clip(self, orig):
        """StepGuard.clip_(scaler=None): a clip (its norm is the one before clipping, its bound the guard's
        max_norm) that also unscales when given a scaler."""
        chk = self
        clip = self._wrap_clip(orig)

        def clip_(guard, scaler=None):
            if not chk._clip_depth and scaler is not None:
                chk._grads_scaled = False
            out = clip(guard, scaler)
            if guard.max_norm is not None and chk._bw:
                chk._clip_max = float(guard.max_norm)
            return out
        return clip_

    def _on_clip(self, args=(), kwargs=None) -> None:
        kwargs = kwargs or {}
        self.clip_calls += 1
        self._clips += self._bw > 0
        # the clip's bound (max_norm / clip_value / clipping): a host number when the script passed one
        bound = next((kwargs[k] for k in ("max_norm", "clip_value", "clipping") if k in kwargs),
                     args[1] if len(args) > 1 and not isinstance(args[1], Tensor) else None)
        if isinstance(bound, (int, float)):
            self._clip_max = float(bound)
        if self._m_row is not None and not self._opt_started:
            self._m_clip = True
            self._m_clip_max = self._clip_max
        step = self.steps_done + 1
        if self._grads_scaled:
            self.flags["clip_scaled"].append(step)
        if self._bw == 0 and self.steps_done:
            # after optimizer.step() and before the next backward: this clip changes nothing the optimizer uses
            self.flags["clip_after_step"].append(self.steps_done)
        elif self._bw:
            self._clip_after_bw = True

    # ---------------------------------------------------------------- optimizer step hooks
    def _named(self, opt) -> list:
        params = [p for g in opt.param_groups for p in g["params"]]
        cached = self._named_cache.get(id(opt))
        if cached is None or cached[0] != len(params):
            self._refresh_names()
            named = [(self._names.get(id(p), f"param_groups.{gi}.{i}"), p)
                     for gi, g in enumerate(opt.param_groups) for i, p in enumerate(g["params"])]
            self._named_cache[id(opt)] = cached = (len(params), named)
        return cached[1]

    def _refresh_names(self) -> None:
        roots = [r() for r in self.watcher._roots] if self.watcher else []
        for k, root in enumerate(r for r in roots if r is not None):
            prefix = "" if not self._names else type(root).__name__ + ":"
            for n, p in root.named_parameters():
                self._names.setdefault(id(p), prefix + n)
            # embeddings: only the rows a batch looked up get gradient, which the depth rule must know
            for m in root.modules():
                if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                    self._row_sparse_ids.add(id(m.weight))
            self.module_types.update(type(m).__name__ for m in root.modules())

    def _series_of(self, opt) -> int:
        k = self._series.get(id(opt))
        if k is None:
            k = self._series[id(opt)] = len(self.series_names)
            var = self._var_name(opt)
            self.series_names.append(f"{type(opt).__name__} #{k + 1}" + (f" ({var})" if var else ""))
            self._opt_refs.append(weakref.ref(opt))
            lr = opt.param_groups[0].get("lr") if opt.param_groups else None
            self.series_lr.append(lr if isinstance(lr, (int, float)) else None)
        return k

    def _var_name(self, obj) -> str | None:
        """The name the script gave ``obj`` (a variable in one of the script's frames on the stack)."""
        f = sys._getframe(1)
        while f is not None:
            if os.path.abspath(f.f_code.co_filename) == self.script_path:
                for scope in (f.f_locals, f.f_globals):
                    for n, v in scope.items():
                        if v is obj and not n.startswith("_") and n != "self":
                            return n
            f = f.f_back
        return None

    def _pre_step(self, opt, args, kwargs):
        if not self._opt_started:  # the first optimizer step: the hand-written-loop reading ends
            self._opt_started = True
            self._m_steps, self._m_host, self._m_row, self._m_used = [], [], None, None
        self._evals, self._step_losses, self._extra_bad = 0, None, None
        self._read_this_step = False
        # the hook's args start with the optimizer itself (torch passes step()'s own *args)
        at = 1 if args and args[0] is opt else 0
        closure = kwargs.get("closure", args[at] if len(args) > at else None)
        if callable(closure):
            return self._wrap_closure(opt, closure, args, kwargs, at)
        try:
            self._record_stats(opt)
        except Exception as e:  # noqa: BLE001 - the checker must never break the user's training step
            self.errors.append(f"step {self.steps_done + 1}: could not read the gradients: {e}")
            self.last_stats, self._read_failed = None, True
        return None

    def _wrap_closure(self, opt, closure, args, kwargs, at):
        chk = self

        def closure_read(*a, **k):
            if chk._evals:  # a later evaluation: its own backward calls, its own clip placement
                chk._bw = 0
                chk._clip_after_bw = chk._bw_after_clip = False
            out = closure(*a, **k)
            chk._evals += 1
            try:
                if chk._evals == 1:
                    chk._record_stats(opt)
                    chk._step_losses = list(chk._losses)
                else:
                    st = grad_stats(chk._named(opt))
                    if len(st):
                        bad = (st.nan + st.inf).to(torch.int64)
                        chk._extra_bad = bad.sum() if chk._extra_bad is None else chk._extra_bad + bad.sum()
                        if chk._bad_steps is not None and chk._bad_names == st.names:
                            chk._bad_steps += (bad > 0).to(torch.int64)
            except Exception as e:  # noqa: BLE001
                chk.errors.append(f"step {chk.steps_done + 1}: could not read the gradients: {e}")
                chk._read_failed = chk._read_failed or chk._evals == 1
            return out

        functools.update_wrapper(closure_read, closure)
        if "closure" in kwargs:
            return args, dict(kwargs, closure=closure_read)
        args = tuple(args)
        return args[:at] + (closure_read,) + args[at + 1:], kwargs

    def _record_stats(self, opt) -> None:
        self._last_opt = opt
        stats = self._grad_stats(self._named(opt))
        self.last_stats = stats
        self._read_this_step = True
        if len(stats):
            bad = ((stats.nan + stats.inf) > 0).to(torch.int64)
            if self._bad_steps is None or self._bad_names != stats.names:
                self._bad_steps, self._bad_names = torch.zeros_like(bad), list(stats.names)
            self._bad_steps += bad

    def _post_step(self, opt, args, kwargs) -> None:
        if not self._read_this_step and not self._read_failed:  # a closure the optimizer never called
            try:
                self._record_stats(opt)
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"step {self.steps_done + 1}: could not read the gradients: {e}")
                self._read_failed = True
        try:
            self._boundary(opt, skipped=False)
        except Exception as e:  # noqa: BLE001 - never break the user's optimizer step
            self.errors.append(f"step {self.steps_done}: step hook: {e}")
        if self.max_steps is not None and self.steps_done >= self.max_steps:
            raise _StopCheck()

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
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=dev)

        def val(t):
            return nan if t is None else t.detach().reshape(()).to(dev, torch.float64)

        # the step's loss: everything backpropagated over the step (the micro-batch losses added up); for a
        # closure, its first evaluation's
        losses = self._step_losses if self._step_losses is not None else self._losses
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
        if g is not None and g.calls != self._guard_calls.get(id(g), 0) and g.skipped is not None:
            gflag = g.skipped.to(torch.float64)
        if g is not None:
            self._guard_calls[id(g)] = g.calls
        row = torch.stack([norm, nonfin, zero, val(loss), val(self._leftover), val(self._clip_norm),
                           val(gflag) if gflag is not None else torch.zeros((), dtype=torch.float64, device=dev)])
        lr = opt.param_groups[0].get("lr") if opt.param_groups else None
        rec = StepRecord(step=step, skipped=skipped, numel=numel, has_loss=loss is not None,
                         clipped=self._clips > 0, zeroed=self._zeroed,
                         leftover_checked=self._leftover is not None, series=series,
                         evals=max(self._evals, 1), clip_max=self._clip_max if self._clips else None,
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
            rec.clip_norm = clip_norm if rec.clipped else None
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


# ---------------------------------------------------------------------------------------------- running
def run_script(script: str, args: list[str], *, steps: int | None = None, flush_every: int = 64) -> CheckResult:
    """Run ``script`` as ``__main__`` with ``args`` under a :class:`Checker` and return the result."""
    chk = Checker(steps, flush_every)
    chk.script_path = os.path.abspath(script)
    old_argv, old_path = sys.argv[:], sys.path[:]
    sys.argv = [script] + list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    crashed, stopped, crash_text = False, False, None
    chk.install()
    try:
        runpy.run_path(script, run_name="__main__")
    except _StopCheck:
        stopped = True
    except SystemExit as e:
        if e.code not in (None, 0):
            crashed, crash_text = True, f"the script exited with status {e.code!r}"
    except BaseException as e:  # noqa: BLE001 - any failure of the script is reported, not re-raised
        if isinstance(e, KeyboardInterrupt):
            raise
        crashed = True
        # rich/colored exception texts carry ANSI escape codes: the report is Markdown and JSON
        crash_text = _ANSI.sub("", "".join(traceback.format_exception_only(type(e), e))).strip()
        traceback.print_exc()
    finally:
        chk.remove()
        sys.argv, sys.path[:] = old_argv, old_path
    chk.finish()
    return build_result(chk, script=script, args=list(args), crashed=crashed, crash_text=crash_text,
                        stopped=stopped, max_steps=steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fastgrad.check",
        description="Run an unmodified training script and report its gradient health (docs/contract.md section 10).",
        epilog="exit codes: " + "; ".join(f"{k}: {v}" for k, v in EXIT_CODES.items()))
    parser.add_argument("--steps", type=int, default=None, help="stop the script after N optimizer steps")
    parser.add_argument("--out", default=None, help="write report.md, report.json and grad_norm.png here")
    parser.add_argument("--flush", type=int, default=64, help="read the device statistics every K steps")
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    ns = parser.parse_args(argv)
    if ns.steps is not None and ns.steps < 1:
        parser.error(f"--steps must be a positive number of optimizer steps, got {ns.steps}")
    if not os.path.isfile(ns.script):
        parser.error(f"script not found: {ns.script}")
    result = run_script(ns.script, ns.args, steps=ns.steps, flush_every=ns.flush)
    md = result.to_markdown()
    sys.stdout.flush()
    print("\n" + md, flush=True)
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
        with open(os.path.join(ns.out, "report.md"), "w") as f:
            f.write(md)
        with open(os.path.join(ns.out, "report.json"), "w") as f:
            json.dump(result.to_dict(), f, indent=2, default=str)
        try:
            result.plot(os.path.join(ns.out, "grad_norm.png"))
        except ImportError as e:
            print(f"(no plot: {e})", file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())

