"""Backends of the compiled extension fastgrad._C: ``cpu`` (C++ kernels) and ``cuda`` (CUDA kernels).

Both call the same ``torch.ops.fastgrad.*`` ops; the dispatcher picks the CPU or CUDA kernel from the
tensors' device. The extension is imported lazily (first ``unavailable_reason`` call), so importing
fastgrad never fails or slows down because of it.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .base import Backend, is_fast_norm_type

_NORM_OPS = ("norm", "amp_norm", "agc")


class _ExtBackend(Backend):
    _reason: str | None
    _checked = False

    def _compute_reason(self) -> str | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def unavailable_reason(self) -> str | None:
        if not self._checked:
            try:
                self._reason = self._compute_reason()
            except Exception as exc:  # noqa: BLE001 - must never raise
                self._reason = f"fastgrad._C could not be inspected: {exc.__class__.__name__}: {exc}"
            self._checked = True
        return self._reason

    def supports(self, op: str, tensors: Sequence[Tensor], **params) -> str | None:
        why = super().supports(op, tensors, **params)
        if why is not None:
            return why
        if op in _NORM_OPS and "norm_type" in params:
            p = float(params["norm_type"])
            if not is_fast_norm_type(p):
                return f"norm_type={p} has no fused kernel (fast kernels: 1, 2, inf and finite p > 0)"
        return None

    # ------------------------------------------------------------------ primitives
    def norm(self, tensors, norm_type, *, per_tensor=False, foreach=None):
        total, per = torch.ops.fastgrad.norm(list(tensors), float(norm_type))
        return total, (per if per_tensor else None)

    def amp_norm(self, tensors, inv_scale, norm_type):
        return torch.ops.fastgrad.amp_norm(list(tensors), inv_scale, float(norm_type))

    def scale_(self, tensors, factor, *, foreach=None):
        torch.ops.fastgrad.scale_(list(tensors), factor)

    def clip_value_(self, tensors, clip_value, *, foreach=None):
        torch.ops.fastgrad.clip_value_(list(tensors), float(clip_value))

    def agc_(self, params, grads, clip_factor, eps, norm_type):
        torch.ops.fastgrad.agc_(list(params), list(grads), float(clip_factor), float(eps), float(norm_type))

    def centralize_(self, grads):
        torch.ops.fastgrad.centralize_(list(grads))

    def grad_stats(self, tensors):
        norm, max_abs, nan, inf, zero = torch.ops.fastgrad.grad_stats(list(tensors))
        return {"norm": norm, "max_abs": max_abs, "nan": nan, "inf": inf, "zero": zero}


class CpuBackend(_ExtBackend):
    name = "cpu"
    devices = ("cpu",)

    def _compute_reason(self) -> str | None:
        from .. import _ext

        if _ext.load() is None:
            return _ext.load_error()
        if not _ext.has_cpu_kernels():
            return "fastgrad._C has no CPU kernels"
        return None


class CudaBackend(_ExtBackend):
    name = "cuda"
    devices = ("cuda",)

    def _compute_reason(self) -> str | None:
        from .. import _ext

        if _ext.load() is None:
            return _ext.load_error()
        if not _ext.has_cuda_kernels():
            built = _ext.build_info()
            why = built.get("cuda_skipped_because")
            return "fastgrad._C was built without CUDA kernels" + (f" ({why})" if why else "")
        if not torch.cuda.is_available():
            return "no CUDA GPU is available"
        return None

    def supports(self, op: str, tensors: Sequence[Tensor], **params) -> str | None:
        why = super().supports(op, tensors, **params)
        if why is None and torch.cuda.is_current_stream_capturing():
            # Each call stages its tensor table in pinned host memory that is recycled after the copy; a
            # captured copy would re-read that memory at replay. The Triton backend keeps its tables
            # cached on the device, so automatic choice moves to it during capture.
            return "CUDA graph capture (the cuda backend uploads its tensor table on every call)"
        return why
