"""``patch_torch()`` / ``unpatch_torch()``: route ``torch.nn.utils``' clipping functions to fastgrad (docs/contract.md section 11).

Lightning, the Hugging Face ``Trainer`` and ``accelerate`` clip by calling ``torch.nn.utils.clip_grad_norm_``
(and friends) themselves, so their users cannot change an import. ``patch_torch()`` replaces
``clip_grad_norm_``, ``clip_grad_value_``, ``get_total_norm`` and ``clip_grads_with_norm_`` in
``torch.nn.utils`` and, where torch defines them there, in ``torch.nn.utils.clip_grad``, with thin routers
to fastgrad's functions of the same names (``fastgrad/clip.py``; same signatures, keyword-only extras).

Semantics:

* Idempotent: patching an already patched torch changes nothing.
* Reversible: ``unpatch_torch()`` puts back the exact objects that were there before the patch. An attribute
  that someone else replaced after our patch is left alone (theirs wins; we only remove our own routers).
* Context manager: ``with fastgrad.patch_torch(): ...`` patches, and on exit restores the state found on
  entry, so nested blocks, and a block inside a process-wide ``patch_torch()``, leave the outer patch on.
* Call-time lookup only: code that looks the function up when it clips is routed. Lightning 2.6
  (``Precision.clip_grad_by_norm``/``_by_value``, Fabric's strategies), accelerate 1.15
  (``Accelerator.clip_grad_norm_``/``clip_grad_value_``) and transformers 5.23 (``Trainer``, through
  accelerate, and a function-local import for mixed DTensor meshes) all call ``torch.nn.utils.<fn>(...)``
  at clip time, so they are routed even when imported before the patch. A module that ran
  ``from torch.nn.utils import clip_grad_norm_`` before the patch keeps torch's function: call
  ``patch_torch()`` before importing it. (A module that imports it while patched keeps fastgrad's.)

fastgrad's own sparse/complex fallbacks call :data:`TORCH` (``fastgrad/_torch_fns.py``), torch's functions as
captured when fastgrad was imported, never the patched attributes, so a patched torch cannot recurse into fastgrad.
"""

from __future__ import annotations

import functools
import importlib
import threading

import torch.nn.utils  # noqa: F401 - also imports torch.nn.utils.clip_grad

from . import clip
from ._torch_fns import MARK as _MARK, NAMES, TORCH

__all__ = ["patch_torch", "unpatch_torch", "patched", "call_counts", "describe", "TORCH"]

MODULES = ("torch.nn.utils", "torch.nn.utils.clip_grad")

_lock = threading.Lock()
_saved: dict[tuple[str, str], object] = {}  # (module, name) -> the object our router replaced
_calls = {n: 0 for n in NAMES}


def _router(name: str, replaced):
    fast = getattr(clip, name)

    # Looks fastgrad's function up at call time so tools wrapping fastgrad.clip.<name> see framework calls.
    @functools.wraps(fast)
    def routed(*args, **kwargs):
        _calls[name] += 1
        return getattr(clip, name)(*args, **kwargs)

    setattr(routed, _MARK, name)
    routed.__wrapped_torch__ = replaced
    return routed


def _is_ours(obj) -> bool:
    return getattr(obj, _MARK, None) is not None


def _apply() -> None:
    with _lock:
        for mod_name in MODULES:
            mod = importlib.import_module(mod_name)
            for name in NAMES:
                if not hasattr(mod, name):  # never add names this torch does not have
                    continue
                current = getattr(mod, name)
                if _is_ours(current):
                    continue
                _saved[(mod_name, name)] = current
                setattr(mod, name, _router(name, current))


def _restore() -> None:
    with _lock:
        for (mod_name, name), original in list(_saved.items()):
            mod = importlib.import_module(mod_name)
            if _is_ours(getattr(mod, name, None)):
                setattr(mod, name, original)
            del _saved[(mod_name, name)]


class _Patch:
    """What ``patch_torch()`` returns: the patch is already applied; as a context manager it restores, on
    exit, whether torch was patched when the block was entered."""

    def __init__(self, was_patched: bool):
        self._was_patched = was_patched

    def __enter__(self) -> "_Patch":
        return self

    def __exit__(self, *exc) -> None:
        if not self._was_patched:
            _restore()

    def __repr__(self) -> str:
        return f"<fastgrad.patch_torch: {len(patched())} functions routed to fastgrad>"


def patch_torch() -> _Patch:
    """Route ``torch.nn.utils.{clip_grad_norm_, clip_grad_value_, get_total_norm, clip_grads_with_norm_}``
    (also in ``torch.nn.utils.clip_grad``) to fastgrad. Idempotent. Use as a plain call for the whole
    process, or as ``with fastgrad.patch_torch():`` for one block. Undo with ``unpatch_torch()``."""
    was = bool(patched())
    _apply()
    return _Patch(was)


def unpatch_torch() -> None:
    """Put back the objects ``patch_torch()`` replaced (no-op when not patched)."""
    _restore()


def patched() -> dict[str, str]:
    """What is routed now: ``{"torch.nn.utils.clip_grad_norm_": "fastgrad.clip_grad_norm_", ...}``; empty when
    torch is not patched."""
    out = {}
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        for name in NAMES:
            target = getattr(getattr(mod, name, None), _MARK, None)
            if target is not None:
                out[f"{mod_name}.{name}"] = f"fastgrad.{target}"
    return out


def call_counts() -> dict[str, int]:
    """Calls that reached fastgrad through the patch since fastgrad was imported, per function name."""
    return dict(_calls)


def describe() -> str:
    """One line for ``python -m fastgrad.info``."""
    routes = patched()
    if not routes:
        return "not patched (fastgrad.patch_torch() routes torch.nn.utils' clipping to fastgrad)"
    names = sorted({r.rsplit(".", 1)[1] for r in routes})
    counts = call_counts()
    return ("patched: torch.nn.utils[.clip_grad] " + ", ".join(f"{n} ({counts[n]} calls)" for n in names)
            + " -> fastgrad")
