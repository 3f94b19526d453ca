"""torch's own clipping functions, captured when fastgrad is imported (before any ``patch_torch()``).

fastgrad's fallbacks (sparse and complex grads, norm orders without a fused kernel) call these, never the
``torch.nn.utils`` attributes, so a patched torch cannot route a fallback back into fastgrad. They live in
this bottom-layer module because both ``fastgrad.clip`` (which calls them) and ``fastgrad.patch`` (which
replaces torch's attributes, above clip) need them.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn.utils  # noqa: F401 - also imports torch.nn.utils.clip_grad

NAMES = ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")
#: Set on fastgrad's routers in torch.nn.utils; the value is the fastgrad function's name.
MARK = "__fastgrad_routes__"


def unrouted(obj):
    """``obj``, or torch's function behind it when ``obj`` is one of fastgrad's routers (fastgrad imported
    again while torch is patched must still capture torch's function)."""
    while getattr(obj, MARK, None) is not None:
        obj = obj.__wrapped_torch__
    return obj


# Attribute access mirrors torch.nn.utils, so a name this torch lacks (get_total_norm before 2.6) raises
# AttributeError as before.
TORCH = SimpleNamespace(**{n: unrouted(getattr(torch.nn.utils, n)) for n in NAMES if hasattr(torch.nn.utils, n)})
