"""The end of a checked run: what ``python -m fastgrad.check`` reads to the host once the script has returned
(a hand-written loop's open step, the pending step rows, the sampled updates, the per-parameter counts of
nonzero gradients, the buffers found NaN/Inf, the activations saturated at the first forward, each optimizer's
final learning rate). A mixin of
:class:`~fastgrad.diagnose.collect.hooks.Checker`; ``_note_live`` is the device-side count that the step hooks
feed during the run (no sync), ``finish`` the reads after it."""

from __future__ import annotations

import torch


__all__ = ["RunReadout"]


class RunReadout:
    """``finish()`` after the script; the counts of live parameters kept on the device until then."""

    def finish(self) -> None:
        """After the script: close an open hand-written step, read everything to the host."""
        if not self._opt_started and self._m_row is not None:
            try:
                if self._m_clip and not self._m_zeroed:  # the last step's clipped gradients, never zeroed
                    used = self._consumed_row()
                    if used is not None and self._m_clip_max != 0:
                        # a positive bound scales a finite nonzero norm, never to 0: zeros read now were
                        # cleared by the script after its update (``p.grad.zero_()``), so the backward's read
                        # stands (chosen on the device: no sync)
                        row = self._m_row.to(used.device)
                        cleared = (used[0] == 0) & torch.isfinite(row[0]) & (row[0] > 0)
                        used = torch.where(cleared, row, used)
                    self._m_used = used
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
        try:
            self._read_targets()
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"could not read the target networks: {e}")
        if self.watcher is not None:
            # which parameters belong to a module that ran: a gradient that never came is then a cut in the graph
            # (a detach, torch.no_grad), not a module left out of the forward (host attributes only)
            self.ran_params = sorted({n for m in self.watcher.ran() for p in m.parameters(recurse=False)
                                      if (n := self._names.get(p)) is not None})
        try:
            self.saturation = self.saturation_report()
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"could not read the activations' saturation: {e}")
        try:
            self.buffers = self.buffer_report()
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"could not read the buffers: {e}")
        if self._ce_probs is not None:
            self.ce_probs = int(self._ce_probs)  # the one read of the cross-entropy inputs' count
            self._ce_probs = None
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

    def _sample_frozen(self, opt, series: int) -> None:
        """At a sampled step: which of the optimizer's parameters are frozen (requires_grad False) now. A name
        frozen at every sampled step of its optimizer ends in ``frozen_held`` (a GAN that freezes its critic
        while the generator steps, or a fine-tune that unfreezes later, is not). Host attributes only."""
        now = {n for n, p in self._named(opt) if not p.requires_grad}
        held = getattr(self, "_frozen_reads", None)
        if held is None:
            held = self._frozen_reads = {}
        held[series] = now if series not in held else held[series] & now
        self.frozen_held = {n: k for k, names in held.items() for n in sorted(names)}

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
