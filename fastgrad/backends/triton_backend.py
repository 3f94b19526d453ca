"""Triton backend: every primitive of the backend contract as fused multi-tensor Triton kernels
(``fastgrad.triton_kernels``).

Serves CUDA tensors, and CPU tensors only under ``TRITON_INTERPRET=1`` (how CI runs the kernels without a
GPU). Triton is imported lazily, so this module imports fine without it. Eager calls go straight to the
kernel launchers; under ``torch.compile`` the same work goes through the ``fastgrad_triton::*`` custom ops.
"""

from __future__ import annotations

import os

import torch

from .base import Backend, is_fast_norm_type

_kernels = None
_import_error: str | None = None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _load():
    """The kernels package (imports Triton and registers the custom ops on first use)."""
    global _kernels
    if _kernels is None:
        from .. import triton_kernels

        _kernels = triton_kernels
    return _kernels


_interp_reason: str | None | bool = False  # False: not probed yet


def interpreter_reason() -> str | None:
    """Why the Triton interpreter cannot run fastgrad's kernels on CPU tensors here (None: it can).

    Known case: Triton 3.6's interpreter holds a loaded scalar as a 1-element array and converts it with
    ``int()`` where a kernel loops ``range(0, n, BLOCK)`` over it, which NumPy 2.4 refuses ("only
    0-dimensional arrays can be converted to Python scalars"); every kernel has such a loop. Found once per
    process by running a tiny kernel with that pattern on CPU tensors (no GPU involved)."""
    global _interp_reason
    if _interp_reason is False:
        import triton
        import triton.language as tl

        @triton.jit
        def _probe(tab, out):
            n = tl.load(tab)
            acc = 0
            for _ in range(0, n, 2):
                acc += 1
            tl.store(out, acc)

        out = torch.zeros(1, dtype=torch.int64)
        try:
            _probe[(1,)](torch.tensor([5], dtype=torch.int64), out)
            _interp_reason = None if int(out[0]) == 3 else f"the Triton interpreter ran a probe kernel wrongly ({int(out[0])} != 3)"
        except Exception as e:  # noqa: BLE001 - any failure means the kernels cannot run there
            import numpy

            _interp_reason = (f"the Triton {triton.__version__} interpreter cannot run fastgrad's kernels with NumPy "
                              f"{numpy.__version__} ({type(e).__name__}: {e}); NumPy < 2.4 or a newer Triton runs them")
    return _interp_reason


def _compiling() -> bool:
    return torch.compiler.is_compiling()


class TritonBackend(Backend):
    name = "triton"
    devices = ("cuda", "cpu")

    def __init__(self) -> None:
        self._reason: str | None = None
        self._checked = False

    # ------------------------------------------------------------------ availability
    def unavailable_reason(self) -> str | None:
        # The device test first: it is cheap, and on a machine with neither a GPU nor the interpreter asked
        # for, importing Triton (about a second) would only confirm that the backend cannot serve anything.
        if not (torch.cuda.is_available() or _interpret()):
            return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU tensors in the interpreter)"
        if not self._checked:
            self._checked = True
            try:
                import triton  # noqa: F401
            except Exception as e:  # ImportError, or a broken install
                self._reason = f"Triton is not importable ({type(e).__name__}: {e})"
        return self._reason

    def supports(self, op, tensors, **params):
        why = super().supports(op, tensors, **params)
        if why is not None:
            return why
        if tensors and tensors[0].device.type == "cpu":
            if not _interpret():
                return "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
            why = interpreter_reason()
            if why is not None:
                return why
        norm_type = params.get("norm_type")
        if norm_type is not None and not is_fast_norm_type(float(norm_type)):
            return f"norm_type={norm_type} has no Triton kernel (fast kernels: 1, 2, inf, any finite p > 0)"
        return None

    # ------------------------------------------------------------------ primitives
    def norm(self, tensors, norm_type, *, per_tensor=False, foreach=None):
        k = _load()
        if _compiling():
            total, per = k.norm_op(list(tensors), float(norm_type))
        else:
            total, per, _ = k.launch_norm(tensors, float(norm_type))
        return total, (per if per_tensor else None)

    def amp_norm(self, tensors, inv_scale, norm_type):
        k = _load()
        if _compiling():
            return k.amp_norm_op(list(tensors), inv_scale, float(norm_type))
        return k.launch_amp_norm(tensors, inv_scale, float(norm_type))

    def scale_(self, tensors, factor, *, foreach=None):
        k = _load()
        if _compiling():
            k.scale_op(list(tensors), factor)
        else:
            k.launch_scale_(tensors, factor)

    def clip_norm_(self, grads, max_norm, norm_type, *, foreach=None):
        k = _load()
        if _compiling():
            return k.clip_norm_op(list(grads), float(max_norm), float(norm_type))
        return k.launch_clip_norm_(grads, float(max_norm), float(norm_type))

    def amp_clip_(self, grads, inv_scale, max_norm, norm_type, write=True):
        k = _load()
        if _compiling():
            return k.amp_clip_op(list(grads), inv_scale, float(max_norm), float(norm_type), bool(write))
        return k.launch_amp_clip_(grads, inv_scale, float(max_norm), float(norm_type), bool(write))

    def clip_value_(self, tensors, clip_value, *, foreach=None):
        k = _load()
        if _compiling():
            k.clip_value_op(list(tensors), float(clip_value))
        else:
            k.launch_clip_value_(tensors, float(clip_value))

    def agc_(self, params, grads, clip_factor, eps, norm_type):
        k = _load()
        if _compiling():
            k.agc_op(list(params), list(grads), float(clip_factor), float(eps), float(norm_type))
        else:
            k.launch_agc_(params, grads, float(clip_factor), float(eps), float(norm_type))

    def centralize_(self, grads):
        k = _load()
        if _compiling():
            k.centralize_op(list(grads))
        else:
            k.launch_centralize_(grads)

    def grad_stats(self, tensors):
        k = _load()
        if _compiling():
            out = k.grad_stats_op(list(tensors))
        else:
            out = k.launch_grad_stats(tensors)
        return dict(zip(("norm", "max_abs", "nan", "inf", "zero"), out))
