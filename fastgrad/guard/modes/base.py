"""What the mode objects share: their constructor and state, and state tensors on the norm's device, in its
dtype."""

from __future__ import annotations

import torch
from torch import Tensor


def zeros(like: Tensor, *shape: int) -> Tensor:
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


class Mode:
    """A guard mode: its thresholds (``max_norm``, ``skip_factor``), its checked ``options`` (``o``) and its
    device ``state``, which ``init`` fills; ``per_tensor``: whether its rule needs every tensor's norm."""

    per_tensor = False

    def __init__(self, max_norm: float | None, skip_factor: float | None, options: dict):
        self.max_norm = max_norm
        self.skip_factor = skip_factor
        self.o = options
        self.state: dict[str, Tensor] = {}
