"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: records every place where fastgrad's own
code turns a host value into a tensor on the default path (``aten.lift_fresh``: ``torch.tensor(x)`` and
``t[i] = x`` both start there). On a GPU that host value is then copied to the device, a synchronizing
host-to-device copy (``b["skipped"][slot] = 0`` failed the H100 run that way); on a CPU it is invisible
unless looked for. Device-side writes (``fill_`` with a Python number, ``copy_`` from a device tensor,
``torch.full``, ``torch.where`` with a Python scalar) do not go through ``lift_fresh``."""

from __future__ import annotations

import os
import sys
import traceback

from torch.utils._python_dispatch import TorchDispatchMode

import torch

import fastgrad

# the diagnosis (the monitor, check's hooks): the code these tests hold to it
_ROOT = os.path.dirname(os.path.abspath(fastgrad.__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_PKG = os.path.join(_ROOT, "diagnose")
# built once per parameter set and cached, then copied with non_blocking=True (no sync-debug error)
_ONCE = {"_layer_index"}


class HostValueWatch(TorchDispatchMode):
    """``with HostValueWatch() as w: ...`` then ``w.hits``: (op, the innermost fastgrad.diagnose frame) of each
    host value lifted into a tensor by the diagnosis code (the script's own ``torch.tensor`` calls, and the ops
    below the diagnosis, are not counted)."""

    def __init__(self):
        super().__init__()
        self.hits: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith("lift_fresh"):
            f = sys._getframe(1)
            while f is not None:
                path = os.path.abspath(f.f_code.co_filename)
                if not path.startswith(_TORCH + os.sep):  # the innermost frame outside torch decides
                    if path.startswith(_PKG + os.sep) and f.f_code.co_name not in _ONCE:
                        self.hits.append((str(func), "".join(traceback.format_stack(f, 1)).strip()))
                    break
                f = f.f_back
        return func(*args, **(kwargs or {}))
