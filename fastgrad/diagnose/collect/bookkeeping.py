"""Step bookkeeping of ``python -m fastgrad.check``: where one training step ends (an optimizer step, or one the
GradScaler skipped), its statistics, loss, leftover and clip norm become one device row, and the rows are read
to the host in a flush (one sync per ``flush_every`` steps). A mixin of
:class:`~fastgrad.diagnose.collect.hooks.Checker`, whose ``__init__`` holds the per-step state it reads and
resets.

Nothing here reads a device value except ``flush`` (and ``_read``, which it and the end of the run call)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...clip import multi_tensor_norm
from ...distributed import to_local_norm
from ...guard import guard_for
from .buffers import sampled
from .steps import StepRecord

__all__ = ["StepBookkeeping"]


class StepBookkeeping:
    """Closes each step's device row (``_boundary``) and reads the rows to the host (``flush``)."""

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

    def _boundary(self, opt, skipped: bool) -> None:
        """End of one training step (an optimizer step, or a step the GradScaler skipped)."""
        series = self._series_of(opt)
        self.steps_done += 1
        self._note_targets()
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
        # the pull towards zero each step adds (lr x weight decay, the largest of the groups; host numbers)
        pull = max((g.get("lr", 0) * g.get("weight_decay", 0) for g in opt.param_groups
                    if isinstance(g.get("lr"), (int, float)) and isinstance(g.get("weight_decay"), (int, float))),
                   default=0.0)
        if pull > 0:
            wd = max(g.get("weight_decay", 0) for g in opt.param_groups
                     if isinstance(g.get("weight_decay"), (int, float)))
            self.decay[series] = (max(pull, self.decay.get(series, (0.0,))[0]), wd, type(opt).__name__)
        rec = StepRecord(step=step, skipped=skipped, numel=numel, has_loss=loss is not None,
                         clipped=self._clips > 0, zeroed=self._zeroed,
                         leftover_checked=self._leftover is not None, series=series,
                         evals=max(self._evals, 1), clip_max=self._clip_max if self._clips else None,
                         clip_read=self._clip_norm is not None,
                         lr=lr if isinstance(lr, (int, float)) else None, unread=unread,
                         calls=self.watcher.take_calls() if self.watcher is not None else 0)
        self._read_failed = False
        self._pending.append((rec, row))
        # a closure's evaluations are not a window of micro-batches
        self.windows.append((step, 0 if self._evals else self._bw_scalar, self._bw_straight, self._bw_node))
        # reset the per-step state
        self._bw = 0
        self._bw_scalar = self._bw_straight = 0
        self._bw_node = None
        self._clip_after_bw = self._bw_after_clip = False
        self._zeroed = False
        self._grads_scaled = False
        self._losses = []
        self._step_losses, self._evals, self._extra_bad = None, 0, None
        self._clip_norm = self._leftover = None
        self._clip_max = None
        self._clips = 0
        if sampled(step):
            try:
                self._sample_buffers(step)
                self._sample_frozen(opt, series)
            except Exception as e:  # noqa: BLE001 - a buffer check never costs the step's row
                self.errors.append(f"step {step}: could not read the buffers or the frozen parameters: {e}")
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


