"""The models' buffers in a checked run: which floating buffers (BatchNorm's running statistics, any buffer a
forward updates) hold NaN/Inf, and from which read on.

A NaN batch through a BatchNorm in training mode writes NaN into ``running_mean`` and ``running_var`` during
the forward, before any clip, GradScaler or StepGuard decides about the step: a skipped step keeps the weights
finite, not the buffers (unless the guard was given ``model=``), and the model evaluates to NaN from then on.
So check reads the buffers of every model the forward watcher saw (its roots): at the steps whose update it
measures (the first ``UPDATE_ALWAYS``, then every ``UPDATE_EVERY``-th: walking a large model's buffers costs a
few milliseconds on the host, too much for every step) and once when the script ends, while its objects still
live. Each read is device ops only (one inf-norm per buffer, a NaN or Inf in it makes that norm non-finite);
the flags are read to the host once, after the run (``buffer_report``). A mixin of
:class:`~fastgrad.diagnose.collect.hooks.Checker`."""

from __future__ import annotations

import torch
from torch import Tensor

from ...distributed.dtensor import is_dtensor
from .identity import IdentityMap
from .optimizer_hooks import UPDATE_ALWAYS, UPDATE_EVERY

__all__ = ["BufferReader", "sampled"]

_NEVER = torch.iinfo(torch.int64).max  # "not seen non-finite yet" in a buffer's first-step slot
_END = _NEVER - 1                      # first seen non-finite at the read after the script ended


def sampled(step: int) -> bool:
    """Whether the buffers are read after ``step`` (1-based): the steps whose update is measured."""
    return step <= UPDATE_ALWAYS or step % UPDATE_EVERY == 0


class BufferReader:
    """Device flags of the watched models' floating buffers; ``_buf_init()`` from the Checker's ``__init__``."""

    def _buf_init(self) -> None:
        self._buf_roots = IdentityMap()   # root module -> its index in _buf_meta (weakly held)
        self._buf_meta: list[dict] = []   # per root: prefix, type, script variable
        # (root index, buffer names, module types) -> [first step non-finite (device int64), non-finite at the
        # latest read (device bool), the step of that read]
        self._buf_rows: dict = {}
        self._buf_final = False
        self.buffers: list[dict] = []     # after the run: buffer_report()

    def _root_meta(self, root: torch.nn.Module) -> int:
        k = self._buf_roots.get(root)
        if k is None:
            k = self._buf_roots[root] = len(self._buf_meta)
            self._buf_meta.append({"prefix": self._root_prefix(root, k),
                                   "var": self._var_name(root) if not self._buf_final else None})
        return k

    def _root_prefix(self, root: torch.nn.Module, k: int) -> str:
        """The prefix check's parameter names give this model (the first model bare, a later one prefixed by
        its class), read off one of its named parameters; by the same rule where none is named."""
        for path, p in root.named_parameters():
            name = self._names.get(p)
            if name is not None and name.endswith(path):
                return name[:len(name) - len(path)]
            break
        return "" if not k else type(root).__name__ + ":"

    def _sample_buffers(self, step: int | None) -> None:
        """Fold the non-finite flags of every watched model's floating buffers into the device rows (``step``:
        the step just closed; None at the end of the script). No host read."""
        roots = self.watcher.roots() if self.watcher is not None else []
        seen: set[int] = set()   # a submodule called on its own is a root too: its buffers are read once
        for root in roots:
            k = self._root_meta(root)
            pre = self._buf_meta[k]["prefix"]
            mods = dict(root.named_modules())
            groups: dict = {}
            for name, b in root.named_buffers():
                if b is None or not b.is_floating_point() or b.device.type == "meta" or not b.numel() \
                        or id(b) in seen:
                    continue
                seen.add(id(b))
                if is_dtensor(b):  # this rank's piece: a reduction of the DTensor itself would communicate
                    b = b._local_tensor
                owner = mods.get(name.rsplit(".", 1)[0] if "." in name else "")
                groups.setdefault(b.device, []).append((pre + name, type(owner).__name__ if owner is not None
                                                        else type(root).__name__, b.detach()))
            for dev, items in groups.items():
                # the inf-norm is NaN where a value is NaN and Inf where one is Inf: one number per buffer
                norms = torch._foreach_norm([b for _, _, b in items], float("inf"))
                bad = ~torch.isfinite(torch.stack([n.to(torch.float64) for n in norms]))   # float64: no overflow
                key = (k, tuple(n for n, _, _ in items), tuple(t for _, t, _ in items))
                row = self._buf_rows.get(key)
                first = torch.full_like(bad, _NEVER, dtype=torch.int64) if row is None else row[0]
                at = torch.full_like(first, _END if step is None else step)
                self._buf_rows[key] = [torch.where(bad, torch.minimum(first, at), first), bad, step]

    def buffers_at_end(self) -> None:
        """The read when the script has ended (its models still alive): the state the model is left in."""
        self._buf_final = True
        self._sample_buffers(None)

    def buffer_report(self) -> list[dict]:
        """After the run, one host read: per floating buffer that was NaN/Inf at some read, its name, the type
        of the module owning it, the script's variable for its model, the first step it was seen non-finite
        (None when first seen at the end of the script), whether it still was at the last read (``at_end``)
        and whether that last read was the end of the script (``final_read``; False when the script's models
        were gone by then and the last sampled step is what is known)."""
        if not self._buf_rows:
            return []
        keys = list(self._buf_rows)
        dev = self._buf_rows[keys[0]][0].device
        vals = torch.cat([torch.stack([r[0], r[1].to(torch.int64)], 1).to(dev)
                          for r in self._buf_rows.values()]).tolist()
        first: dict = {}
        latest: dict = {}   # name -> (the order of its latest read, non-finite then)
        about: dict = {}
        pos = 0
        for key in keys:
            k, names, types = key
            at = self._buf_rows[key][2]
            order = float("inf") if at is None else at
            for name, typ in zip(names, types):
                f, bad = vals[pos]
                pos += 1
                first[name] = min(first.get(name, _NEVER), f)
                if name not in latest or order >= latest[name][0]:
                    latest[name] = (order, bool(bad))
                about[name] = (typ, self._buf_meta[k]["var"])
        return [{"name": n, "module_type": about[n][0], "model": about[n][1],
                 "first_step": None if f == _END else f, "at_end": latest[n][1],
                 "final_read": latest[n][0] == float("inf")}
                for n, f in first.items() if f != _NEVER]
