"""Reading a hand-written training loop (no torch.optim step): each scalar ``backward()`` is read right after
it returns, one step per ``zero_grad()`` (or per ``backward()`` when the script never zeroes). A mixin of
:class:`~fastgrad.diagnose.collect.hooks.Checker`, which owns the state."""

from __future__ import annotations

import torch
from torch import Tensor

from ...clip import multi_tensor_norm
from ...stats import grad_stats
from .steps import StepRecord

__all__ = ["ManualLoopReader"]


class ManualLoopReader:
    """Until the first optimizer step: the statistics row of the open hand-written step, closed at the next
    scalar backward after a ``zero_grad()``."""

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
                    named.append((self._names.get(p, f"param.{len(named)}"), p))
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
        self._note_live(self._m_live, 0, stats, self._m_named)
        self._script_names()
        self._m_row = self._stats_row(stats)
        self._m_used = None
        self._m_clip = False
        self._m_zeroed = False


    def _consumed_row(self) -> Tensor | None:
        """The gradients a hand-written update consumed, re-read after a clip (at ``zero_grad()``, or at the end
        of the run): None where the script already dropped them itself (``p.grad = None`` in its update), so
        the backward's own read stands; no gradient left is not a clip that zeroed them. No sync."""
        stats = grad_stats(self._m_named)
        return self._stats_row(stats) if len(stats) else None

    def _manual_leftover(self) -> Tensor | None:
        """Device norm of the gradients the last read step's tensors hold before a new backward (0 where every
        one is None); None before any read. No sync."""
        if not self._m_named:
            return None
        grads = [p.grad for _, p in self._m_named if p.grad is not None]
        grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
        return multi_tensor_norm(grads).reshape(()) if grads else torch.zeros((), dtype=torch.float64)

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
        nan = torch.full((), float("nan"), dtype=torch.float64, device=dev)  # a fill: no host-to-device copy
        used = self._m_used.to(dev) if self._m_used is not None else row
        left = self._m_leftover
        left = nan if left is None else left.to(device=dev, dtype=torch.float64)
        full = torch.cat([used, (loss if loss is not None else nan).reshape(1), left.reshape(1),
                          (row[:1] if self._m_clip else nan.reshape(1)), torch.zeros(1, dtype=torch.float64,
                                                                                     device=dev)])
        n = len(self._m_steps) + len(self._m_host) + 1
        numel = sum(p.numel() for _, p in self._m_named)
        rec = StepRecord(step=n, numel=numel, has_loss=loss is not None, clipped=self._m_clip, clip_read=self._m_clip,
                         zeroed=self._m_zeroed, source="backward", clip_max=self._m_clip_max,
                         leftover_checked=self._m_leftover is not None,
                         calls=self.watcher.take_calls() if self.watcher is not None else 0)
        self._m_leftover = None
        self._m_steps.append((rec, full))
        self._m_row = self._m_used = None
        self._m_losses = []
        self._m_clip, self._m_clip_max = False, None
        if len(self._m_steps) >= self.flush_every:
            self._m_host += self._read(self._m_steps)
            self._m_steps = []

