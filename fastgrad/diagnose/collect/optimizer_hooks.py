"""The optimizer step hooks of a checked run: right before ``step()`` (or, with ``step(closure)``, when the
closure's FIRST evaluation returns) the fused ``grad_stats`` pass reads the step's gradients and keeps the
results on the device; NaN/Inf gradients of later closure evaluations are counted too; after the step the
step's row is closed (``StepBookkeeping._boundary`` of ``collect.bookkeeping``). A mixin of
:class:`~fastgrad.diagnose.collect.hooks.Checker`, which owns the state."""

from __future__ import annotations

import functools
import weakref

import torch

from ...clip import multi_tensor_norm
from ...distributed import to_local_norm
from ...distributed.dtensor import has_dtensor, is_dtensor
from ...stats import grad_stats
from .steps import StopCheck

__all__ = ["OptimizerStepReader", "UPDATE_ALWAYS", "UPDATE_EVERY"]

#: the steps whose update is measured: every one of the first UPDATE_ALWAYS (where a learning rate far too
#: high shows first), then every UPDATE_EVERY-th. A measured step holds one copy of the optimizer's parameters
#: for the duration of its step().
UPDATE_ALWAYS = 8
UPDATE_EVERY = 16


class OptimizerStepReader:
    def _grad_stats(self, named0: list):
        """grad_stats of (name, parameter) pairs (it reads sparse gradients through their values), with the
        watched modules' embeddings named as row-sparse (the depth rule leaves out rows a batch never
        looked up)."""
        stats = grad_stats(named0)
        if self._row_sparse_ids:
            extra = [n for n, p in named0 if p in self._row_sparse_ids and n not in stats.row_sparse]
            if extra:
                stats.row_sparse = list(stats.row_sparse) + extra
        return stats


    def _keep_weights(self, opt) -> None:
        """On a sampled step, a device copy of the optimizer's parameters, so that the update can be measured
        after the step (``_measure_update``). No host value is read."""
        self._upd_before = None
        step = self.steps_done + 1
        if step > UPDATE_ALWAYS and step % UPDATE_EVERY:
            return
        named = [(n, p) for n, p in self._named(opt) if p.grad is not None]
        if named:
            self._upd_before = (weakref.ref(opt), named, [p.detach().clone() for _, p in named])

    def _measure_update(self, opt) -> None:
        """After a sampled step: per parameter, the norm of the update (new - old) and of the weights before it,
        kept on the device until the run ends."""
        kept, self._upd_before = self._upd_before, None
        if kept is None or kept[0]() is not opt:
            return
        _, named, old = kept
        new = [p.detach() for _, p in named]
        # one foreach call when the list is of one kind; DTensors beside plain tensors (a parallelized layer in
        # a model otherwise replicated) cannot share one, so each difference is taken on its own
        diff = (torch._foreach_sub(new, old) if not has_dtensor(new) or all(map(is_dtensor, new))
                else [a - b for a, b in zip(new, old)])
        _, upd = multi_tensor_norm(diff, per_tensor=True)
        _, size = multi_tensor_norm(old, per_tensor=True)  # the weights the update was applied to
        # sharded parameters (FSDP2): the whole tensors' norms, replicated DTensors: the value every rank holds
        upd, size = to_local_norm(upd), to_local_norm(size)
        self.update_rows.append((self.steps_done + 1, [n for n, _ in named],
                                 torch.stack([upd.to(torch.float64), size.to(upd.device, torch.float64)])))

    def _pre_step(self, opt, args, kwargs):
        try:
            self._keep_weights(opt)
        except Exception as e:  # noqa: BLE001 - the update size is evidence, never a reason to fail the step
            self._upd_before = None
            self.errors.append(f"step {self.steps_done + 1}: could not keep the weights: {e}")
        if not self._opt_started:  # the first optimizer step: the hand-written-loop reading ends
            self._opt_started = True
            self._m_steps, self._m_host, self._m_row, self._m_used = [], [], None, None
            self._m_named = []  # (its parameters: a model the script drops later must not live on here)
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
        self._last_opt = weakref.ref(opt)
        named = self._named(opt)
        stats = self._grad_stats(named)
        self.last_stats = stats
        self._read_this_step = True
        self._note_live(self._live, self._series_of(opt), stats, named)
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
            self._measure_update(opt)
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"step {self.steps_done + 1}: could not measure the update: {e}")
        try:
            self._boundary(opt, skipped=False)
        except Exception as e:  # noqa: BLE001 - never break the user's optimizer step
            self.errors.append(f"step {self.steps_done}: step hook: {e}")
        if self.max_steps is not None and self.steps_done >= self.max_steps:
            self.stop_raised = True
            raise StopCheck()
