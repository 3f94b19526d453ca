"""The model's buffers through a skipped step: what the forward wrote into them (BatchNorm's running statistics
and ``num_batches_tracked``, any module's buffer updated in training) is put back when the guard skips.

A forward pre-hook on every module that owns a buffer takes ONE snapshot of all the model's buffers at the
first forward after a decision (whichever module runs first: a training step may call submodules rather than
the model itself), before any of them can have written. The decision (``clip_``) then restores them where
its flag says, on the device: per dtype and device, the current values and the snapshot are joined, and
``torch.where`` by the flag is copied back, a handful of ops and no host read. Until the next forward the
snapshot stays, so a second ``clip_`` on the same step restores from it too.

The buffers are those the model has when the keeper is built (a buffer registered later is not kept). A
buffer that a forward replaced by a tensor of another shape, dtype or device, or removed, is decided on the
host (one read of the flag), the only read here.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .counters import GuardWarning

__all__ = ["BufferKeeper"]


class BufferKeeper:
    """Keeps ``model``'s buffers as they were before the forward of a step the guard skips. Built by
    ``StepGuard(optimizer, model=model)``; build one yourself only to start saving before the guard exists
    (the Hugging Face callback does, at the start of training) and pass it as ``model=``."""

    def __init__(self, model):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"StepGuard(model=...) takes the torch.nn.Module whose forward the steps run (its "
                            f"buffers are restored on a skipped step), got {type(model).__name__}")
        self.model_name = type(model).__name__
        # (module, name) of every buffer, each once (a buffer shared by two modules is one entry)
        self._slots: list[tuple[torch.nn.Module, str]] = []
        seen = set()
        owners = []
        for mod in model.modules():
            own = [(n, b) for n, b in mod._buffers.items() if isinstance(b, Tensor)]
            if own:
                owners.append(mod)
            for name, buf in own:
                if id(buf) not in seen:
                    seen.add(id(buf))
                    self._slots.append((mod, name))
        self._armed = True  # the next forward takes a new snapshot
        self._snap = None  # [(slots, shapes, dtype, device, flat copy)] per dtype and device
        self._warned = False
        self._hooks = [mod.register_forward_pre_hook(self._before_forward) for mod in owners]

    @property
    def empty(self) -> bool:
        return not self._slots

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._snap = None

    def _before_forward(self, module, args):
        if self._armed:
            self._armed = False
            self.save()

    def save(self) -> None:
        """One flat copy of the buffers per dtype and device (device ops only)."""
        groups: dict = {}
        for mod, name in self._slots:
            buf = mod._buffers.get(name)
            if isinstance(buf, Tensor):
                groups.setdefault((buf.dtype, buf.device), []).append((mod, name, buf))
        snap = []
        with torch.no_grad():
            for (dtype, device), entries in groups.items():
                flat = torch.cat([b.detach().reshape(-1) for _, _, b in entries])
                snap.append(([(m, n) for m, n, _ in entries], [b.shape for _, _, b in entries], dtype, device,
                             flat))
        self._snap = snap

    def restore(self, bad: Tensor) -> None:
        """Where ``bad`` (the step's 0-dim skip flag, on any device), put the snapshot back; the next forward
        then takes a new one. No host read unless a buffer changed its shape, dtype or device."""
        self._armed = True
        if self._snap is None:
            if not self._warned and self._slots:
                self._warned = True
                warnings.warn(
                    f"StepGuard(model={self.model_name}): the guard decided a step but none of the model's "
                    "modules that own buffers ran a forward since the previous decision, so there is no "
                    "snapshot of the buffers to restore on a skip; pass the model whose forward the training "
                    "step runs", GuardWarning, stacklevel=4)
            return
        flags = {}
        with torch.no_grad():
            for slots, shapes, dtype, device, flat in self._snap:
                if device not in flags:
                    flags[device] = (bad > 0).to(device, non_blocking=True)
                flag = flags[device]
                now = [mod._buffers.get(name) for mod, name in slots]
                if all(isinstance(b, Tensor) and b.shape == s and b.dtype == dtype and b.device == device
                       for b, s in zip(now, shapes)):
                    cur = torch.cat([b.detach().reshape(-1) for b in now])
                    kept = torch.where(flag, flat, cur).split([s.numel() for s in shapes])
                    torch._foreach_copy_([b.detach() for b in now], [k.view(s) for k, s in zip(kept, shapes)])
                    continue
                # a buffer replaced by another kind of tensor, or removed: decided on the host
                if bool(flag):
                    for (mod, name), s, piece in zip(slots, shapes, flat.split([s.numel() for s in shapes])):
                        mod._buffers[name] = piece.clone().view(s)
