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

import operator
import warnings

import torch
from torch import Tensor

from .counters import GuardWarning

__all__ = ["BufferKeeper"]


def _outside_graph(fn):
    """``fn`` run eagerly under ``torch.compile(model)`` (a graph break): traced, the snapshot's flat views of
    the buffers would enter the graph as inputs aliasing the buffers the forward updates, which torch's
    autograd tracing refuses. Called directly when not compiling (the disable wrapper costs ~2 us a call, and
    a model has tens of buffer owners); the disabled twin is made here, when a keeper is built, since making
    it imports torch._dynamo."""
    off = torch.compiler.disable(fn)

    def run(module, args):
        if torch.compiler.is_compiling():
            return off(module, args)
        return fn(module, args)
    return run


class BufferKeeper:
    """Keeps ``model``'s buffers as they were before the forward of a step the guard skips. Built by
    ``StepGuard(optimizer, model=model)``; build one yourself only to start saving before the guard exists
    (the Hugging Face callback does, at the start of training) and pass it as ``model=``."""

    def __init__(self, model):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"StepGuard(model=...) takes the torch.nn.Module whose forward the steps run (its "
                            f"buffers are restored on a skipped step), got {type(model).__name__}")
        self.model_name = type(model).__name__
        self.model = model
        # (module, name) of every buffer, each once (a buffer shared by two modules is one entry)
        self._slots: list[tuple[torch.nn.Module, str]] = []
        names = {id(b): n for n, b in model.named_buffers()}
        self.names: list[str] = []  # each slot's name in the model, for messages
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
                    self.names.append(names.get(id(buf), name))
        self._armed = True  # the next forward takes a new snapshot
        self._snap = None  # [(group, flat copy)] per dtype and device
        self._layout = None  # (the buffers, their groups), reused while the buffers are the same tensors
        self._warned = False
        hook = _outside_graph(self._before_forward)
        self._hooks = [mod.register_forward_pre_hook(hook) for mod in owners]

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

    def named(self) -> list:
        """(name, the buffer now) for every buffer kept."""
        return [(n, mod._buffers.get(name)) for n, (mod, name) in zip(self.names, self._slots)]

    def _current(self) -> list:
        return [mod._buffers.get(name) for mod, name in self._slots]

    def save(self) -> None:
        """One flat copy of the buffers per dtype and device (device ops only). The groups and the buffers'
        flat views are made once and reused while the buffers are the same tensors (the usual case: BatchNorm
        updates them in place), so a save is one ``torch.cat`` per group."""
        now = self._current()
        layout = self._layout
        if layout is None or len(now) != len(layout[0]) or not all(map(operator.is_, now, layout[0])):
            layout = self._layout = (now, self._group(now))
        with torch.no_grad():
            self._snap = [(g, torch.cat(g["flat"] if g["viewed"] else
                                        [b.detach().reshape(-1) for b in g["bufs"]])) for g in layout[1]]

    def _group(self, now: list) -> list:
        groups: dict = {}
        for (mod, name), buf in zip(self._slots, now):
            if isinstance(buf, Tensor):
                g = groups.setdefault((buf.dtype, buf.device), {"slots": [], "bufs": [], "flat": []})
                g["slots"].append((mod, name))
                g["bufs"].append(buf)
                # a flat view where the buffer allows one (contiguous), else a copy is joined at each save
                g["flat"].append(buf.detach().view(-1) if buf.is_contiguous() else buf.detach().reshape(-1))
        for (dtype, device), g in groups.items():
            g["dtype"], g["device"] = dtype, device
            g["numels"] = [b.numel() for b in g["bufs"]]
            g["viewed"] = all(b.is_contiguous() for b in g["bufs"])
        return list(groups.values())

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
            for g, flat in self._snap:
                device = g["device"]
                if device not in flags:
                    flags[device] = (bad > 0).to(device, non_blocking=True)
                flag = flags[device]
                now = [mod._buffers.get(name) for mod, name in g["slots"]]
                if g["viewed"] and all(map(operator.is_, now, g["bufs"])):  # the same tensors: in place
                    kept = torch.where(flag, flat, torch.cat(g["flat"])).split(g["numels"])
                    torch._foreach_copy_(g["flat"], list(kept))
                    continue
                shapes = [b.shape for b in g["bufs"]]
                if all(isinstance(b, Tensor) and b.shape == s and b.dtype == g["dtype"] and b.device == device
                       for b, s in zip(now, shapes)):  # replaced by tensors of the same kind
                    cur = torch.cat([b.detach().reshape(-1) for b in now])
                    kept = torch.where(flag, flat, cur).split(g["numels"])
                    torch._foreach_copy_([b.detach() for b in now], [k.view(s) for k, s in zip(kept, shapes)])
                    continue
                # a buffer replaced by another kind of tensor, or removed: decided on the host
                if bool(flag):
                    for (mod, name), s, piece in zip(g["slots"], shapes, flat.split(g["numels"])):
                        mod._buffers[name] = piece.clone().view(s)
