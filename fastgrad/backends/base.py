"""The contract every fastgrad backend implements.

The public functions (``fastgrad.clip``, ``fastgrad.amp``, ...) do everything that is the same for all
backends: they collect gradients, validate arguments, reject bad input before anything is written,
group tensors by device, pick a backend for each group and combine per-device results. A backend only
implements the *primitives* below, each over one device's list of tensors.

What a primitive may assume about ``tensors`` (the public layer guarantees it):

* a non-empty list of dense (strided) tensors of dtype float16, bfloat16, float32 or float64, all on
  one device; dtypes may be mixed in one list; tensors may be non-contiguous or have zero elements;
* ``norm_type`` is a float the backend said it supports (see :meth:`Backend.supports`).

What a primitive must guarantee:

* no host synchronisation and no host read of device data (shapes and pointers only);
* accumulation in float32, float64 for float64 tensors; reductions deterministic (bitwise identical from
  run to run on the same device and inputs), so no floating-point atomics;
* ``foreach`` (norm, scale_, clip_value_) is torch's flag, passed through from the public call: the torch
  backend honours it exactly as ``torch.nn.utils`` does, fused backends ignore it;
* "accumulation dtype" below means ``float64`` if any tensor of the list is float64, else ``float32``
  (see :func:`acc_dtype`).
"""

from __future__ import annotations

import math

from typing import Sequence

import torch
from torch import Tensor

from .._scan import Checked, acc_dtype_of
# the decisions every route shares (fastgrad/decide.py); re-exported: the primitives below default to them
from ..decide import amp_factor, clip_coef

#: Names of the primitives, as passed to :meth:`Backend.supports`.
OPS = ("norm", "amp_norm", "scale", "clip_value", "agc", "centralize", "grad_stats")

#: Floating dtypes fastgrad kernels handle; anything else goes to the torch fallback or is rejected.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class BackendError(RuntimeError):
    """A backend that was asked for by name cannot serve the call; the message says why."""


def acc_dtype(tensors: Sequence[Tensor]) -> torch.dtype:
    """float64 when any tensor is float64, else float32: the dtype norms are accumulated and returned in."""
    if type(tensors) is Checked:
        return acc_dtype_of(tensors)
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def is_fast_norm_type(norm_type: float) -> bool:
    """Norm orders the fused kernels implement: 1, 2, inf and any finite p > 0. (``math.inf``, not
    ``float("inf")``: two calls each time were a third of the host fast path's backend check.)"""
    return norm_type == math.inf or 0.0 < norm_type < math.inf


class Backend:
    """Base class; subclasses override the primitives they implement.

    ``supports`` defaults to "every primitive this class overrides, for dense real floating tensors on the
    devices in ``devices``". Override it to add finer checks (norm types, dtypes, alignment...).
    """

    #: registry name: "torch", "triton", "cuda" or "cpu"
    name: str = ""
    #: device types (``torch.device.type``) whose tensors this backend can process; empty means any
    devices: tuple[str, ...] = ()

    # ------------------------------------------------------------------ availability
    def unavailable_reason(self) -> str | None:
        """None when the backend can be used in this process, else a one-line reason (for errors and
        ``python -m fastgrad.info``). Must be cheap after the first call and must not raise."""
        return None

    def supports(self, op: str, tensors: Sequence[Tensor], **params) -> str | None:
        """None when this backend can run primitive ``op`` on ``tensors`` (one device) with ``params``
        (``norm_type=...`` for the norm primitives), else a short reason naming what is not supported."""
        if op not in OPS:
            return f"unknown op {op!r}"
        if type(self)._impl(op) is getattr(Backend, _METHOD[op]):
            return f"{op} is not implemented by the {self.name} backend"
        dev = tensors[0].device.type if tensors else "cpu"
        if self.devices and dev not in self.devices:
            return f"{dev} tensors are not supported (supports: {', '.join(self.devices)})"
        if type(tensors) is Checked:  # strided, floating, one device: checked in one pass already
            return None
        for t in tensors:
            if t.layout != torch.strided:
                return f"{t.layout} tensors are not supported"
            if t.dtype not in KERNEL_DTYPES:
                return f"dtype {t.dtype} is not supported"
        return None

    @classmethod
    def _impl(cls, op: str):
        return getattr(cls, _METHOD[op])

    # ------------------------------------------------------------------ primitives
    def norm(self, tensors: Sequence[Tensor], norm_type: float, *, per_tensor: bool = False,
             foreach: bool | None = None) -> tuple[Tensor, Tensor | None]:
        """Total p-norm of the list and, when ``per_tensor``, each tensor's p-norm.

        Returns ``(total, per)``: ``total`` a 0-dim tensor, ``per`` a 1-D tensor of ``len(tensors)`` in
        input order (None unless asked), both in the accumulation dtype on the tensors' device.
        For finite p the total is ``(sum_i sum_j |x_ij|^p)^(1/p)``; for inf it is ``max |x|`` with NaN
        propagating. A zero-size tensor has norm 0.
        """
        raise NotImplementedError

    def amp_norm(self, tensors: Sequence[Tensor], inv_scale: Tensor, norm_type: float
                 ) -> tuple[Tensor, Tensor]:
        """One read pass for the fused AMP path.

        Returns ``(total, found_inf)``: ``total`` the p-norm of the *unscaled* values
        ``float(x) * inv_scale`` (accumulation dtype, 0-dim) and ``found_inf`` a 0-dim float32 tensor equal
        to exactly 1.0 if any element of any tensor (the scaled values, as stored) is NaN or +-inf, else
        0.0. ``inv_scale`` is a 0-dim float32 tensor on the tensors' device.
        """
        raise NotImplementedError

    def scale_(self, tensors: Sequence[Tensor], factor: Tensor, *, foreach: bool | None = None) -> None:
        """In place: every element becomes ``T(x * factor)``, the product taken in float32 (float64 for
        float64 tensors; a float64 factor may be used in float64 too, as the Triton backend does, or rounded
        to float32 first, as torch's ``mul_`` does for float32 tensors). ``factor`` is a 0-dim tensor on the
        tensors' device.

        Fused backends must not touch gradient memory when ``factor == 1`` (a device-side decision:
        the clip coefficient is clamped to 1, so "not clipping" costs one read of ``factor`` per block);
        a NaN factor writes NaN everywhere, exactly as torch does.
        """
        raise NotImplementedError

    def clip_norm_(self, grads: Sequence[Tensor], max_norm: float, norm_type: float, *,
                   foreach: bool | None = None) -> Tensor:
        """Norm clipping in place (docs/contract.md section 3), the whole of ``clip_grad_norm_`` on one device:
        ``total = norm(grads)``, ``coef = min(max_norm / (total + 1e-6), 1)`` in the accumulation dtype,
        evaluated exactly as ``torch.clamp(max_norm / (total + 1e-6), max=1.0)`` on the 0-dim total (NaN
        stays NaN), then ``scale_(grads, coef)`` (no write where coef is 1). Returns ``total`` (0-dim,
        accumulation dtype).

        This default composes the primitives above, so every backend has it; fused backends override it
        to keep the coefficient inside their kernels (no torch ops, fewer launches). The public layer calls
        it only when one backend serves both the norm and the scale of the list."""
        total, _ = self.norm(grads, norm_type, foreach=foreach)
        self.scale_(grads, clip_coef(total, max_norm), foreach=foreach)
        return total

    def amp_clip_(self, grads: Sequence[Tensor], inv_scale: Tensor, max_norm: float, norm_type: float,
                  write: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """The fused AMP unscale + norm clip (docs/contract.md section 4) on one device, in place.

        ``(total, found_inf) = amp_norm(grads, inv_scale, norm_type)``, then ``factor = inv_scale * coef`` in
        the accumulation dtype, where ``coef`` is :func:`clip_coef` of the total (inv_scale converted to that
        dtype first, the product rounded once, as torch multiplies two 0-dim tensors), then, if ``write``,
        ``scale_(grads, factor)`` (no write where the factor is 1). ``write=False`` only computes: the
        caller hands ``factor`` to an optimizer that unscales inside its step. Returns ``(total, found_inf,
        factor)`` (total and factor 0-dim in the accumulation dtype, found_inf 0-dim float32 1.0/0.0), all on
        the tensors' device; ``inv_scale`` is a 0-dim float32 tensor there. No host sync.

        This default composes the primitives exactly as ``fastgrad.amp`` did before the primitive existed;
        fused backends override it with the same bits in fewer launches and no torch op between them.
        Selected as op ``"amp_norm"`` (with ``norm_type``); the public layer calls it only when the same
        backend serves ``amp_norm`` and ``scale`` of the list."""
        total, found = self.amp_norm(grads, inv_scale, norm_type)
        factor = amp_factor(total, max_norm, inv_scale)
        if write:
            self.scale_(grads, factor)
        return total, found, factor

    def clip_value_(self, tensors: Sequence[Tensor], clip_value: float, *, foreach: bool | None = None
                    ) -> None:
        """In place, one pass: ``x = min(max(x, -clip_value), clip_value)``; NaN stays NaN."""
        raise NotImplementedError

    def agc_(self, params: Sequence[Tensor], grads: Sequence[Tensor], clip_factor: float, eps: float,
             norm_type: float) -> None:
        """Adaptive gradient clipping (docs/contract.md section 5, timm's formula), in place on ``grads``.

        ``params[i]`` and ``grads[i]`` have the same shape and device. A unit is the whole tensor when
        ``ndim <= 1``, else each slice along dim 0. For each unit:
        ``max_norm = clip_factor * max(||W||, eps)``, ``g_norm = ||G||``; when ``not (g_norm < max_norm)``
        (so NaN clips, as in timm) ``G *= max_norm / max(g_norm, 1e-6)``, ratio computed first, in the
        accumulation dtype or wider (the fused backends use float64 and round the product once); otherwise G
        is untouched.
        """
        raise NotImplementedError

    def centralize_(self, grads: Sequence[Tensor]) -> None:
        """Gradient centralisation, in place: every tensor has ``ndim > 1``; each slice along dim 0 has
        its mean (accumulated in float32, float64 for float64) subtracted: ``x = T(float(x) - mean)``."""
        raise NotImplementedError

    def grad_stats(self, tensors: Sequence[Tensor]) -> dict[str, Tensor]:
        """One read pass of health statistics, per tensor, as 1-D tensors of ``len(tensors)`` on the device:

        ``"norm"`` L2 norm (accumulation dtype), ``"max_abs"`` max |x| (accumulation dtype, NaN if the
        tensor holds a NaN, 0 for zero-size), ``"nan"``, ``"inf"``, ``"zero"`` counts (int64).
        """
        raise NotImplementedError


_METHOD = {
    "norm": "norm",
    "amp_norm": "amp_norm",
    "scale": "scale_",
    "clip_value": "clip_value_",
    "agc": "agc_",
    "centralize": "centralize_",
    "grad_stats": "grad_stats",
}
