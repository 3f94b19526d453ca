"""fastgrad: fused, sync-free gradient management for PyTorch.

Drop-ins for ``torch.nn.utils`` clipping, a fused GradScaler unscale + inf-check + clip, adaptive gradient
clipping, gradient centralization and one-pass gradient health statistics. Every function takes a
keyword-only ``backend=`` ("torch", "triton", "cuda", "cpu"; default: automatic, see
``python -m fastgrad.info``).
"""

__version__ = "0.1.0"

from .agc import adaptive_clip_grad_
from .amp import scaler_unscale_and_clip
from .backends import BackendError, available_backends, set_backend
from .centralize import centralize_gradient_
from .clip import clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_, get_total_norm, multi_tensor_norm
from .stats import GradStats, grad_stats
from .diagnose.report import GradientReport, gradient_report
from .diagnose.monitor import GradientMonitor
from .diagnose.collect.nonfinite import find_nonfinite
from .optim_clip import clip_optimizer_grad_norm_
from .guard import GuardError, StepGuard
from .patch import patch_torch, unpatch_torch

__all__ = [
    "clip_grad_norm_",
    "get_total_norm",
    "clip_grads_with_norm_",
    "clip_grad_value_",
    "multi_tensor_norm",
    "scaler_unscale_and_clip",
    "clip_optimizer_grad_norm_",
    "StepGuard",
    "GuardError",
    "adaptive_clip_grad_",
    "centralize_gradient_",
    "grad_stats",
    "GradStats",
    "GradientReport",
    "gradient_report",
    "GradientMonitor",
    "find_nonfinite",
    "patch_torch",
    "unpatch_torch",
    "available_backends",
    "set_backend",
    "BackendError",
]
