"""Backends of the compiled extension fastgrad._C: ``cpu`` (C++ kernels) and ``cuda`` (CUDA kernels).

Both call the same ``torch.ops.fastgrad.*`` ops; the dispatcher picks the CPU or CUDA kernel from the
tensors' device. The extension is imported lazily (first ``unavailable_reason`` call), so importing
fastgrad never fails or slows down because of it.
"""

from __future__ import annotations

import re
import sys
import threading
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .base import Backend, BackendError, is_fast_norm_type

_NORM_OPS = ("norm", "amp_norm", "agc")

#: Launch errors that mean "this build has no code this GPU can run" (as opposed to a bug or bad input):
#: no SASS for the arch and no usable PTX, a PTX newer than the driver's JIT, or no JIT at all. The CUDA
#: binding puts cudaGetErrorName and cudaGetErrorString in its message.
_NO_IMAGE = re.compile(
    r"cudaErrorNoKernelImageForDevice|no kernel image is available|cudaErrorInvalidDeviceFunction|"
    r"invalid device function|cudaErrorUnsupportedPtxVersion|cudaErrorInvalidPtx|cudaErrorJitCompilerNotFound|"
    r"cudaErrorJitCompilationDisabled")


def is_no_image_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a launch failure of the "no kernel image for this GPU" kind."""
    return isinstance(exc, RuntimeError) and _NO_IMAGE.search(str(exc)) is not None


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
    #: the op namespace the primitives call (tests substitute a fake)
    @property
    def ops(self) -> Any:
        return torch.ops.fastgrad

    def _call(self, op: str, method: str, tensors: Sequence[Tensor], params: dict, args: tuple, kwargs: dict,
              fn: Callable[[], Any]) -> Any:
        """Run fn (the op call); the cuda backend overrides this to recover from a missing kernel image."""
        return fn()

    def norm(self, tensors, norm_type, *, per_tensor=False, foreach=None):
        def run():
            total, per = self.ops.norm(list(tensors), float(norm_type))
            return total, (per if per_tensor else None)
        return self._call("norm", "norm", tensors, {"norm_type": norm_type}, (tensors, norm_type),
                          {"per_tensor": per_tensor, "foreach": foreach}, run)

    def amp_norm(self, tensors, inv_scale, norm_type):
        return self._call("amp_norm", "amp_norm", tensors, {"norm_type": norm_type}, (tensors, inv_scale, norm_type),
                          {}, lambda: self.ops.amp_norm(list(tensors), inv_scale, float(norm_type)))

    def scale_(self, tensors, factor, *, foreach=None):
        self._call("scale", "scale_", tensors, {}, (tensors, factor), {"foreach": foreach},
                   lambda: self.ops.scale_(list(tensors), factor))

    def clip_norm_(self, tensors, max_norm, norm_type, *, foreach=None):
        # selected and recovered as "norm" (the op whose kernels run first; a failed launch writes nothing)
        return self._call("norm", "clip_norm_", tensors, {"norm_type": norm_type}, (tensors, max_norm, norm_type),
                          {"foreach": foreach},
                          lambda: self.ops.clip_norm_(list(tensors), float(max_norm), float(norm_type)))

    def amp_clip_(self, grads, inv_scale, max_norm, norm_type, write=True):
        # selected and recovered as "amp_norm" (its read pass runs first; a failed launch writes nothing)
        return self._call("amp_norm", "amp_clip_", grads, {"norm_type": norm_type},
                          (grads, inv_scale, max_norm, norm_type, write), {},
                          lambda: self.ops.amp_clip_(list(grads), inv_scale, float(max_norm), float(norm_type),
                                                     bool(write)))

    def clip_value_(self, tensors, clip_value, *, foreach=None):
        self._call("clip_value", "clip_value_", tensors, {}, (tensors, clip_value), {"foreach": foreach},
                   lambda: self.ops.clip_value_(list(tensors), float(clip_value)))

    def agc_(self, params, grads, clip_factor, eps, norm_type):
        self._call("agc", "agc_", list(params) + list(grads), {"norm_type": norm_type},
                   (params, grads, clip_factor, eps, norm_type), {},
                   lambda: self.ops.agc_(list(params), list(grads), float(clip_factor), float(eps), float(norm_type)))

    def centralize_(self, grads):
        self._call("centralize", "centralize_", grads, {}, (grads,), {}, lambda: self.ops.centralize_(list(grads)))

    def grad_stats(self, tensors):
        def run():
            norm, max_abs, nan, inf, zero = self.ops.grad_stats(list(tensors))
            return {"norm": norm, "max_abs": max_abs, "nan": nan, "inf": inf, "zero": zero}
        return self._call("grad_stats", "grad_stats", tensors, {}, (tensors,), {}, run)


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
    """The CUDA kernels. Which GPUs they serve is decided per device: the archs the build carries
    (``fastgrad._C.cuda_sass`` / ``cuda_ptx``) against the device's compute capability
    (:mod:`fastgrad._archs`), then once per device a probe that loads the kernels for it without launching
    anything. A device the build cannot serve is declined in :meth:`supports`, so automatic choice moves to
    the next backend (triton, then torch) and a call naming this backend raises BackendError with the reason.
    A launch that still fails with "no kernel image" (a case neither check foresaw) declines the device the
    same way from then on, and the failing call is finished by the next backend (or raises BackendError when
    this backend was asked for by name): the binding fails such a call at its first launch, before anything
    is written.

    CUDA graph capture is supported: the binding caches its device tables (csrc/cuda/bindings.cpp
    TableCache) and enqueues no host-to-device copy once a tensor list has been seen; a list first seen
    during capture raises an error asking for one warm-up call (as the Triton backend does).
    """

    name = "cuda"
    devices = ("cuda",)

    def __init__(self) -> None:
        #: device -> None (serves it) or the reason it does not; a device missing here is not decided yet
        self._device_reason: dict[torch.device, str | None] = {}
        self._lock = threading.Lock()

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

    # ------------------------------------------------------------------ per device
    def device_reason(self, device: torch.device | int) -> str | None:
        """None when the kernels run on ``device``, else why not (for errors and ``python -m fastgrad.info``)."""
        if isinstance(device, int):
            device = torch.device("cuda", device)
        elif device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        known = self._device_reason.get(device, False)
        if known is not False:
            return known
        if device.type != "cuda":
            return None
        why = self._static_reason(device)
        # The probe loads the kernels' module (JIT-compiling PTX where needed): never inside a capture or
        # while torch.compile traces. Undecided until it has run, so the static answer stands meanwhile.
        if why is None and (torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling()):
            return None
        if why is None:
            err = self.ops.cuda_probe(device.index) if hasattr(self.ops, "cuda_probe") else ""
            if err:
                why = f"the compiled CUDA kernels cannot run on {self._describe(device)}: {err}"
        with self._lock:
            self._device_reason.setdefault(device, why)
        return self._device_reason[device]

    @staticmethod
    def _describe(device: torch.device) -> str:
        try:
            major, minor = torch.cuda.get_device_capability(device)
            return f"{device} ({torch.cuda.get_device_name(device)}, compute capability {major}.{minor})"
        except Exception:  # noqa: BLE001 - only for a message
            return str(device)

    def _static_reason(self, device: torch.device) -> str | None:
        from .. import _archs, _ext

        archs = _ext.cuda_archs()
        if archs is None:  # an older build that does not say: the probe decides
            return None
        cc = tuple(torch.cuda.get_device_capability(device))
        why = _archs.decline_reason(cc, *archs)
        return None if why is None else f"{self._describe(device)}: {why}"

    def disable(self, device: torch.device, reason: str) -> None:
        """Decline ``device`` from now on (this process) with ``reason``."""
        with self._lock:
            self._device_reason[device] = reason

    def supports(self, op: str, tensors: Sequence[Tensor], **params) -> str | None:
        why = super().supports(op, tensors, **params)
        if why is None and tensors:
            why = self.device_reason(tensors[0].device)
        return why

    # ------------------------------------------------------------------ first-launch recovery
    def _call(self, op, method, tensors, params, args, kwargs, fn):
        try:
            return fn()
        except RuntimeError as exc:
            if not is_no_image_error(exc) or not tensors:
                raise
            device = tensors[0].device
            reason = f"the compiled CUDA kernels cannot run on {self._describe(device)}: {exc}"
            self.disable(device, reason)
            if _named_explicitly(self.name):
                raise BackendError(
                    f"fastgrad backend {self.name!r} cannot run {op}: {reason}. Pass backend=None (and unset "
                    "FASTGRAD_BACKEND) for automatic choice with fallback.") from exc
            nxt = _REGISTRY_FNS["select_automatic"](op, tensors, **params)  # this device is declined now: cuda is skipped
            warnings.warn(f"fastgrad: {reason}. Using the {nxt.name} backend for {device} from now on "
                          "(python -m fastgrad.info shows why).", RuntimeWarning, stacklevel=4)
            return getattr(nxt, method)(*args, **kwargs)


# The registry (fastgrad.backends) imports this module, so it hands its selection functions down at import
# (set_registry) rather than this module importing the layer above it.
_REGISTRY_FNS: dict[str, Callable] = {}


def set_registry(select_automatic: Callable, get_default_backend: Callable) -> None:
    """Called once by ``fastgrad.backends``: the functions a first-launch failure needs to hand its call on."""
    _REGISTRY_FNS.update(select_automatic=select_automatic, get_default_backend=get_default_backend)


def _named_explicitly(name: str) -> bool:
    """Whether the running public call asked for backend ``name`` by name (argument, set_backend or
    FASTGRAD_BACKEND). Only asked on the rare first-launch failure: the primitive does not receive the
    caller's ``backend=`` argument, so it is read from the nearest fastgrad frame that has one."""
    get_default_backend = _REGISTRY_FNS["get_default_backend"]
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            break
        mod = frame.f_globals.get("__name__", "")
        if mod.startswith("fastgrad") and not mod.startswith("fastgrad.backends") and "backend" in frame.f_locals:
            asked = frame.f_locals["backend"]
            if asked is None or isinstance(asked, str):
                return (asked if asked is not None else get_default_backend()) == name
        frame = frame.f_back
    return get_default_backend() == name
