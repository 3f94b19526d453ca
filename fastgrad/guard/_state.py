"""Small helpers the mode objects share: state tensors on the norm's device, in its dtype."""

from __future__ import annotations

import torch
from torch import Tensor


def zeros(like: Tensor, *shape: int) -> Tensor:
    return torch.zeros(shape, dtype=like.dtype, device=like.device)
