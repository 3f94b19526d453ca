"""Triton kernels of fastgrad and their ``torch.library`` registrations.

Importing this package imports Triton; ``fastgrad.backends.triton_backend`` does so lazily. Each op
family lives in its own module (kernel, then launcher): ``multi_tensor`` (pointer/block tables and their
cache), ``norm``, ``amp``, ``clip``, ``agc``, ``centralize``, ``stats``. The launchers are registered as
custom ops under the ``fastgrad_triton`` namespace with fake implementations so that they trace under
``torch.compile``; eager calls go straight to the launchers to keep per-call overhead low. (The op objects are named
``*_op`` so they do not shadow the submodules.)
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor

from .agc import launch_agc_
from .amp import launch_amp_clip_, launch_amp_norm
from .centralize import launch_centralize_
from .clip import launch_clip_norm_, launch_clip_value_, launch_scale_
from .multi_tensor import Config, acc_of, cache_stats, clear_cache, release_captured
from .norm import launch_norm
from .stats import launch_grad_stats

__all__ = [
    "Config", "cache_stats", "clear_cache", "release_captured", "launch_norm", "launch_amp_norm", "launch_amp_clip_",
    "launch_scale_", "launch_clip_norm_", "launch_clip_value_", "launch_agc_", "launch_centralize_",
    "launch_grad_stats", "norm_op", "amp_norm_op", "scale_op", "clip_norm_op", "amp_clip_op", "clip_value_op",
    "agc_op", "centralize_op", "grad_stats_op",
]

_NS = "fastgrad_triton"


# ---------------------------------------------------------------------------------------------- ops
@torch.library.custom_op(f"{_NS}::norm", mutates_args=())
def norm_op(tensors: List[Tensor], norm_type: float) -> Tuple[Tensor, Tensor]:
    total, per, _ = launch_norm(tensors, norm_type)
    return total, per


@norm_op.register_fake
def _(tensors, norm_type):
    acc = acc_of(tensors)
    return tensors[0].new_empty((), dtype=acc), tensors[0].new_empty((len(tensors),), dtype=acc)


@torch.library.custom_op(f"{_NS}::amp_norm", mutates_args=())
def amp_norm_op(tensors: List[Tensor], inv_scale: Tensor, norm_type: float) -> Tuple[Tensor, Tensor]:
    return launch_amp_norm(tensors, inv_scale, norm_type)


@amp_norm_op.register_fake
def _(tensors, inv_scale, norm_type):
    return (tensors[0].new_empty((), dtype=acc_of(tensors)),
            tensors[0].new_empty((), dtype=torch.float32))


@torch.library.custom_op(f"{_NS}::scale_", mutates_args=("tensors",))
def scale_op(tensors: List[Tensor], factor: Tensor) -> None:
    launch_scale_(tensors, factor)


@scale_op.register_fake
def _(tensors, factor):
    return None


@torch.library.custom_op(f"{_NS}::clip_norm_", mutates_args=("tensors",))
def clip_norm_op(tensors: List[Tensor], max_norm: float, norm_type: float) -> Tensor:
    return launch_clip_norm_(tensors, max_norm, norm_type)


@clip_norm_op.register_fake
def _(tensors, max_norm, norm_type):
    return tensors[0].new_empty((), dtype=acc_of(tensors))


@torch.library.custom_op(f"{_NS}::amp_clip_", mutates_args=("tensors",))
def amp_clip_op(tensors: List[Tensor], inv_scale: Tensor, max_norm: float, norm_type: float, write: bool
                ) -> Tuple[Tensor, Tensor, Tensor]:
    return launch_amp_clip_(tensors, inv_scale, max_norm, norm_type, write)


@amp_clip_op.register_fake
def _(tensors, inv_scale, max_norm, norm_type, write):
    acc = acc_of(tensors)
    t = tensors[0]
    return t.new_empty((), dtype=acc), t.new_empty((), dtype=torch.float32), t.new_empty((), dtype=acc)


@torch.library.custom_op(f"{_NS}::clip_value_", mutates_args=("tensors",))
def clip_value_op(tensors: List[Tensor], clip_value: float) -> None:
    launch_clip_value_(tensors, clip_value)


@clip_value_op.register_fake
def _(tensors, clip_value):
    return None


@torch.library.custom_op(f"{_NS}::agc_", mutates_args=("grads",))
def agc_op(params: List[Tensor], grads: List[Tensor], clip_factor: float, eps: float, norm_type: float) -> None:
    launch_agc_(params, grads, clip_factor, eps, norm_type)


@agc_op.register_fake
def _(params, grads, clip_factor, eps, norm_type):
    return None


@torch.library.custom_op(f"{_NS}::centralize_", mutates_args=("grads",))
def centralize_op(grads: List[Tensor]) -> None:
    launch_centralize_(grads)


@centralize_op.register_fake
def _(grads):
    return None


@torch.library.custom_op(f"{_NS}::grad_stats", mutates_args=())
def grad_stats_op(tensors: List[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return launch_grad_stats(tensors)


@grad_stats_op.register_fake
def _(tensors):
    n = len(tensors)
    acc = acc_of(tensors)
    t = tensors[0]
    return (t.new_empty((n,), dtype=acc), t.new_empty((n,), dtype=acc),
            *(t.new_empty((n,), dtype=torch.int64) for _ in range(3)))
