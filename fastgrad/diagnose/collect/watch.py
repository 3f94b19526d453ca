"""Where a NaN was born: a forward watcher that costs no host sync until it is asked.

Forward hooks on every module check each floating output for NaN/Inf on the device and fold the result into
ONE device-side int64 "first bad call" key with ``torch.minimum``. The key packs the step, the call's index in
execution order within that step and the module's id, so the smallest key is the first module, in execution
order, whose output became non-finite. Hooks fire when a module *finishes*, so an inner module that made the
NaN is seen before the containers whose outputs merely carry it. The first positional input of a root module
(the batch the script passes its model) is checked too, ordered before anything that call produces: NaN in
the batch is named as the model's input, not as its first layer. Reading the key (``first_nonfinite()``) is the only sync.

::

    watcher = fastgrad.ForwardWatcher(model, optimizer)   # optimizer: advances the step after each step()
    ...train...
    origin = watcher.first_nonfinite()                    # one sync; None when every output stayed finite
    if origin: print(origin)                              # "first non-finite output: layers.2 (Log) at step 7"
    watcher.remove()

Without a model, ``ForwardWatcher()`` hooks every module globally (what ``python -m fastgrad.check`` uses):
modules called outside any other module are roots and name their submodules.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from ...distributed.dtensor import is_dtensor
from .identity import IdentityMap

__all__ = ["ForwardWatcher", "NonFiniteOrigin"]

# Key layout (bits, low to high): module id 20, output-not-input 1, call index within the step 20, step 22.
# Larger values saturate at the field's maximum, which keeps the key ordered (a later call never sorts before an
# earlier one). A root's input is checked when the call starts, with the call index its first output will get:
# the input bit (0) sorts it before that output.
_MOD_BITS, _KIND_BITS, _CALL_BITS, _STEP_BITS = 20, 1, 20, 22
_LOW = _MOD_BITS + _KIND_BITS
_NONE = (1 << 63) - 1


@dataclass
class NonFiniteOrigin:
    """The first module call whose output held a NaN or Inf: its name, class, the step (0-based, as counted
    by the watcher) and the call's position in execution order within that step. ``where`` is "output", or
    "input" when the values were already non-finite in what the script passed to a root module (the model)."""

    module: str
    module_type: str
    step: int
    call: int
    where: str = "output"

    def __str__(self) -> str:
        what = "input" if self.where == "input" else "output"
        return (f"first non-finite {what}: {self.module} ({self.module_type}) at step {self.step}, "
                f"module call #{self.call} of that step")


def _tensors(out, depth: int = 0):
    """Floating (and complex) tensors of a module's output: tensors, tuples/lists, dicts (incl. HF
    ``ModelOutput``) up to a small depth; integer/bool tensors and other objects cannot be non-finite."""
    if isinstance(out, Tensor):
        if out.is_floating_point() or out.is_complex():
            yield out
    elif depth < 4 and isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o, depth + 1)
    elif depth < 4 and isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o, depth + 1)


class ForwardWatcher:
    """Watch module outputs for the first NaN/Inf without host syncs.

    ``model``: hook this module and its submodules (names as in ``named_modules()``); None hooks every
    module globally until :meth:`remove`. ``optimizer`` (optional, one or a list): the step counter
    advances after each of its ``step()`` calls; otherwise call :meth:`step` yourself once per step.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer=None):
        self.step_index = 0
        self._call = 0
        self._key: Tensor | None = None  # allocated on the first watched output's device
        self._mods: list[tuple[weakref.ref, str, str]] = []
        self._ids = IdentityMap()  # module -> its mid (weakly held: a dead module's id() may be reused)
        self._handles = []
        self._depth = 0
        self._roots: list[weakref.ref] = []
        self._root_inputs = IdentityMap()  # root module -> the mid of its input
        self._inputs: set[int] = set()  # ids (mid) that stand for a root's input
        self._ran: set[int] = set()  # mids of the modules whose forward finished at least once (host only)
        # modules that ran inside a root's forward but are no part of any root seen (a target network an agent
        # passes to its policy's forward: tianshou's ``model_old``), in the order first seen (host only)
        self._loose: list[weakref.ref] = []
        # root calls since the last take_calls(): an update's own forwards, and an agent's rollout between its
        # updates or an evaluation, with gradients on or off (host only)
        self._calls = 0
        if model is not None:
            self._roots.append(weakref.ref(model))
            for name, m in model.named_modules():
                mid = self._register(m, name or type(m).__name__)
                self._handles.append(m.register_forward_hook(self._make_hook(mid)))
            root_in = self._register_input(model, type(model).__name__)
            self._handles.append(model.register_forward_pre_hook(
                lambda module, args: self._observe_input(root_in, args)))
        else:
            from torch.nn.modules import module as M

            self._handles.append(M.register_module_forward_pre_hook(self._global_pre))
            self._handles.append(M.register_module_forward_hook(self._global_post, always_call=True))
        opts = [] if optimizer is None else (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        for opt in opts:
            self._handles.append(opt.register_step_post_hook(lambda *_: self.step()))

    # ---------------------------------------------------------------- bookkeeping (host only)
    def _register(self, m: torch.nn.Module, name: str) -> int:
        mid = self._ids.get(m)
        if mid is None:
            mid = self._ids[m] = len(self._mods)
            self._mods.append((weakref.ref(m), name, type(m).__name__))
        return mid

    def _register_input(self, m: torch.nn.Module, name: str) -> int:
        mid = len(self._mods)
        self._mods.append((weakref.ref(m), name, type(m).__name__))
        self._inputs.add(mid)
        return mid

    def _name_root(self, root: torch.nn.Module) -> None:
        # The first root keeps bare names (as its named_parameters() do); later roots are prefixed by class.
        prefix = "" if not self._roots else type(root).__name__ + ":"
        self._roots.append(weakref.ref(root))
        for name, m in root.named_modules():
            if m not in self._ids:
                self._register(m, prefix + name if name else type(root).__name__)

    def _global_pre(self, module, args) -> None:
        if self._depth == 0:
            if module not in self._ids:
                self._name_root(module)
            mid = self._root_inputs.get(module)
            if mid is None:
                mid = self._root_inputs[module] = self._register_input(module, self.name_of(module))
            self._observe_input(mid, args)
        self._depth += 1

    def _global_post(self, module, args, output) -> None:
        self._depth = max(0, self._depth - 1)
        mid = self._ids.get(module)
        if mid is None:  # created after its root was first named, or no part of it
            mid = self._register(module, f"<unnamed {type(module).__name__}>")
            self._loose.append(weakref.ref(module))
        self._observe(mid, output)

    def _make_hook(self, mid: int):
        def hook(module, args, output):
            self._observe(mid, output)
        return hook

    # ---------------------------------------------------------------- the hot path: device ops only
    def _observe_input(self, mid: int, args) -> None:
        """A root call's first positional argument (the batch), keyed with the call index its first output
        will get (no call consumed). Later arguments are left alone: an attention mask of -inf passed to a root
        module is not bad data."""
        self._calls += 1
        if args:
            self._fold(mid, self._call, 0, args[0])

    def _observe(self, mid: int, output) -> None:
        call = self._call
        self._call += 1
        self._ran.add(mid)
        self._fold(mid, call, 1, output)

    def _fold(self, mid: int, call: int, kind: int, output) -> None:
        key = None
        for t in _tensors(output):
            if not t.numel():
                continue
            if key is None:
                step = min(self.step_index, (1 << _STEP_BITS) - 1)
                c = min(call, (1 << _CALL_BITS) - 1)
                key = ((step << (_LOW + _CALL_BITS)) | (c << _LOW) | (kind << _MOD_BITS)
                       | min(mid, (1 << _MOD_BITS) - 1))
                if self._key is None:
                    self._key = torch.full((), _NONE, dtype=torch.int64, device=t.device)
            if is_dtensor(t):
                # this rank's piece, read before torch's own hooks redistribute it: a reduction of the DTensor
                # itself would dispatch on its placements (a Partial sum cannot be reduced by amax) and
                # communicate; watching must not change what the model computes
                t = t._local_tensor
            # amax propagates NaN and abs keeps Inf: one reduction answers "non-finite anywhere".
            finite = torch.isfinite(t.detach().abs().amax())
            if finite.device != self._key.device:
                finite = finite.to(self._key.device, non_blocking=True)
            torch.minimum(self._key, torch.where(finite, _NONE, key), out=self._key)

    # ---------------------------------------------------------------- public
    def step(self) -> None:
        """Advance the step counter (called by the optimizer hook when one was given)."""
        self.step_index += 1
        self._call = 0
        self._depth = 0

    def take_calls(self) -> int:
        """How many calls of a model (a root) ran since the last call of this: the update's own forwards, and the
        rollout an on-policy agent collects between its updates (with gradients on or off), or an evaluation.
        Counting restarts at 0."""
        n, self._calls = self._calls, 0
        return n

    def name_of(self, module: torch.nn.Module) -> str | None:
        """The name the watcher gave ``module`` (as its root's ``named_modules()`` do; a later root's prefixed by
        its class), or None for a module it has not seen."""
        mid = self._ids.get(module)
        return None if mid is None else self._mods[mid][1]

    def ran(self) -> list[torch.nn.Module]:
        """The modules still alive whose forward ran at least once while watched: a parameter of one of them that
        never received a gradient was computed with but cut off from the loss (a detach, torch.no_grad), not
        left out of the forward."""
        return [m for m in (self._mods[mid][0]() for mid in sorted(self._ran) if mid not in self._inputs)
                if m is not None]

    def roots(self) -> list[torch.nn.Module]:
        """The models seen so far that are still alive: without a model, the modules called outside any other
        module, in the order first called; with one, that model."""
        return [m for m in (r() for r in self._roots) if m is not None]

    def reset(self) -> None:
        """Forget what was seen (the step counter keeps running)."""
        if self._key is not None:
            self._key.fill_(_NONE)

    def first_nonfinite(self) -> NonFiniteOrigin | None:
        """The first module call whose output was non-finite, or None. One host sync."""
        if self._key is None:
            return None
        key = int(self._key.item())
        return self._decode(key)

    def device_key(self) -> Tensor | None:
        """The raw device key (for callers that batch it into their own single read); decode with
        :meth:`decode`."""
        return self._key

    def decode(self, key: int) -> NonFiniteOrigin | None:
        return self._decode(int(key))

    def _decode(self, key: int) -> NonFiniteOrigin | None:
        if key == _NONE:
            return None
        mid = key & ((1 << _MOD_BITS) - 1)
        call = (key >> _LOW) & ((1 << _CALL_BITS) - 1)
        step = key >> (_LOW + _CALL_BITS)
        _, name, typ = self._mods[mid]
        return NonFiniteOrigin(name, typ, step, call, "input" if mid in self._inputs else "output")

    def remove(self) -> None:
        """Remove every hook this watcher registered."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "ForwardWatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
