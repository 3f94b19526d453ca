"""Loader of the optional compiled extension ``fastgrad._C`` and the fake (meta) kernels of its ops.

``fastgrad._C`` registers the ops ``torch.ops.fastgrad.*`` (schemas and CPU kernels, plus CUDA kernels
in CUDA builds) when imported. Which build is loaded, at first use (not at ``import fastgrad``):

1. the one installed with the package, when its build record names the running torch (a C++ extension built
   against one torch is not promised to load or run under another; fastgrad/_buildplan.py ``mismatch``);
2. else one compiled for the running torch on first use, from the cache or compiled now (fastgrad/_build.py);
3. else none: fastgrad runs on its Triton and torch backends, and one warning says why.

Either build is smoke-checked in a child process before it is loaded (fastgrad/_smoke.py). Nothing here
raises: :func:`load` returns None and :func:`load_error` says why. The fake implementations let the ops run
under ``torch.compile`` and ``torch.library.opcheck``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import threading
import warnings
from types import ModuleType

from . import _build, _buildplan

_lock = threading.Lock()
_state: dict = {"done": False, "module": None, "error": None, "smoke": None, "origin": None, "not_installed": None,
                "record": None}

INFO_FILE = _buildplan.INFO_NAME
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

#: Set to 1 to silence the one warning an install without usable compiled kernels gives at first use.
QUIET_ENV = "FASTGRAD_NO_EXT_WARNING"

BUILD_COMMAND = "python -m fastgrad.build"


class _Declined(Exception):
    """The build's smoke check failed: never loaded."""


def load() -> ModuleType | None:
    """Import ``fastgrad._C`` once (and register the fakes); None when it is not available.

    Before the first import the build is smoke-checked in a child process (fastgrad/_smoke.py, cached per build):
    a build that crashes or fails there is never imported, and its backends (cpu, cuda, the compiled host scan)
    are declined with one RuntimeWarning that names the cause and the fix."""
    if _state["done"]:
        return _state["module"]
    with _lock:
        if not _state["done"]:
            try:
                _state["module"] = _resolve()
                _register_fakes()
            except _Declined as exc:
                _state["error"] = str(exc)
                _warn_declined(str(exc))
            except Exception as exc:  # noqa: BLE001 - any import/registration failure means "not usable"
                _state["error"] = _describe(exc)
                _warn_missing(_state["error"])
            _state["done"] = True
    return _state["module"]


def installed() -> tuple[str | None, dict, str | None]:
    """(path, build record, why it is not used) of the ``fastgrad._C`` installed with the package; the path is
    None when there is none, the reason None when it fits the running torch."""
    import torch

    spec = importlib.util.find_spec("fastgrad._C")
    if spec is None or not spec.origin or not os.path.exists(spec.origin):
        return None, _read_record(os.path.join(PACKAGE_DIR, INFO_FILE)), "fastgrad._C is not built for this install"
    record = _read_record(os.path.join(os.path.dirname(os.path.abspath(spec.origin)), INFO_FILE))
    why = _buildplan.mismatch(record, _buildplan.torch_identity(torch))
    return spec.origin, record, None if why is None else "the installed fastgrad._C " + why.removeprefix("it ")


def _resolve() -> ModuleType:
    """The module to use (see the module's docstring); raises why there is none."""
    import torch

    path, record, why = installed()
    _state["not_installed"] = why
    if why is None:
        _smoke_check(path, record)
        mod = importlib.import_module("fastgrad._C")
        _state["origin"], _state["record"] = "installed", record
        return mod
    try:
        target = _build.target(PACKAGE_DIR)
        record = _build.find(target)  # compiled before, by a first use or python -m fastgrad.build
        if record is None:
            if not _build.enabled():
                raise _Unbuilt(f"{why}; {BUILD_COMMAND} builds it for torch {torch.__version__} ({_build.OFF_ENV}=0 "
                               "turned off the build on first use)")
            record = _build.ensure(target, why)
    except _build.Unavailable as exc:
        raise _Unbuilt(f"{why}, and no build for torch {torch.__version__} can be made: {exc}") from None
    _smoke_check(target.module, record)
    mod = _import_from(target.module)
    _state["origin"], _state["record"] = "first-use build", record
    return mod


class _Unbuilt(Exception):
    """No build fits the running torch (the message says why)."""


def _import_from(path: str) -> ModuleType:
    """Import the extension at ``path`` as ``fastgrad._C`` (so a later ``import fastgrad._C`` gets this one, never
    the installed build that does not fit)."""
    spec = importlib.util.spec_from_file_location("fastgrad._C", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fastgrad._C"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop("fastgrad._C", None)
        raise
    setattr(sys.modules["fastgrad"], "_C", mod)
    return mod


def _smoke_check(path: str, record: dict) -> None:
    """Raise :class:`_Declined` when the build at ``path`` failed its smoke check (passed, skipped: returns)."""
    import torch

    from . import _smoke

    result = _smoke.check(path, torch.__version__, compilers=record.get("compilers"))
    _state["smoke"] = result
    if not result["ok"]:
        raise _Declined(result["reason"])


def _warn_declined(reason: str) -> None:
    """Once per process (load() runs its body once). Not silenced by FASTGRAD_NO_EXT_WARNING: a build that
    crashes is a fault to fix, not a missing speed-up."""
    from . import _smoke

    warnings.warn(f"fastgrad: {reason}. The cpu and cuda backends are off in this process; fastgrad runs on its "
                  f"Triton and torch backends (python -m fastgrad.info shows this; {_smoke.ENV}=0 skips the check).",
                  RuntimeWarning, stacklevel=3)


def _warn_missing(error: str) -> None:
    """Once per process (load() runs its body once): the install works, but slower than it could."""
    if os.environ.get(QUIET_ENV, "").strip() not in ("", "0"):
        return
    warnings.warn(f"fastgrad: {error}. fastgrad runs on its torch and Triton backends without it (slower on CPU "
                  f"tensors; no cuda backend). Set {QUIET_ENV}=1 to silence this.", RuntimeWarning, stacklevel=3)


def _describe(exc: Exception) -> str:
    if isinstance(exc, _Unbuilt):
        return str(exc)
    if isinstance(exc, ModuleNotFoundError) and exc.name == "fastgrad._C":
        return f"fastgrad._C (the compiled kernels) is not built; build it with: {BUILD_COMMAND}"
    return f"fastgrad._C failed to load: {exc.__class__.__name__}: {exc}"


def load_error() -> str | None:
    """Why ``fastgrad._C`` is not usable, or None when it loaded."""
    load()
    return _state["error"]


def has_cpu_kernels() -> bool:
    mod = load()
    return bool(mod is not None and getattr(mod, "has_cpu", 0))


def has_cuda_kernels() -> bool:
    mod = load()
    return bool(mod is not None and getattr(mod, "has_cuda", 0))


def cuda_archs() -> tuple[list[str], list[str]] | None:
    """(SASS archs, PTX archs) the loaded module's CUDA kernels carry, as nvcc numbers ("80", "90a"); None
    when there are no CUDA kernels or the build does not say (built before the lists were recorded)."""
    from . import _archs

    mod = load()
    if mod is None or not getattr(mod, "has_cuda", 0):
        return None
    if hasattr(mod, "cuda_sass"):
        return _archs.from_define(mod.cuda_sass), _archs.from_define(mod.cuda_ptx)
    recorded = _recorded()
    if "sass" in recorded:
        return ([a.removeprefix("sm_") for a in recorded["sass"]],
                [a.removeprefix("compute_") for a in recorded.get("ptx", [])])
    return None


def _read_record(path: str) -> dict:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _recorded() -> dict:
    """The build record of the loaded module, else of the installed one (what info shows when none loaded)."""
    if _state["record"] is not None:
        return _state["record"]
    spec = importlib.util.find_spec("fastgrad._C")
    if spec is not None and spec.origin and os.path.exists(spec.origin):
        return _read_record(os.path.join(os.path.dirname(os.path.abspath(spec.origin)), INFO_FILE))
    return _read_record(os.path.join(PACKAGE_DIR, INFO_FILE))


def _sources_match(recorded: dict) -> bool | None:
    """Whether the build was compiled from the sources this fastgrad carries (None: unknown, e.g. no sources
    here or a build from before the hash was recorded). False in a checkout whose csrc/ changed since."""
    csrc = _buildplan.source_dir(PACKAGE_DIR)
    if csrc is None or not recorded.get("sources"):
        return None
    return recorded["sources"] == _buildplan.sources_hash(csrc)


def build_info() -> dict:
    """What was built and how, for ``python -m fastgrad.info``.

    Keys: ``built`` (fastgrad._C importable), ``cpu_kernels``, ``cuda_kernels`` (kernels present in the
    loaded module), ``torch``/``cuda``/``archs`` (as recorded at build time, None when unknown), ``sass`` and
    ``ptx`` (the code the CUDA kernels carry), ``arch_source`` (default, TORCH_CUDA_ARCH_LIST or
    FASTGRAD_CUDA_ARCHS),
    ``torch_now`` (the running torch), ``path`` (the module file), ``load_error`` and ``build_error``,
    ``smoke`` (this process's smoke check: ok, reason, cached, cache; None when nothing was checked),
    ``smoke_at_build`` (setup.py's) and ``compilers`` (CC/CXX of the build), ``origin`` ("installed" with the
    package or "first-use build"), ``installed_not_used`` (why the installed build was passed over),
    ``build_seconds`` (of a first-use build) and ``sources_match`` (built from the sources here; None: unknown).
    """
    import torch

    mod = load()
    recorded = _recorded()
    carried = cuda_archs()
    return {
        "built": mod is not None,
        "cpu_kernels": has_cpu_kernels(),
        "cuda_kernels": has_cuda_kernels(),
        "torch": recorded.get("torch"),
        "cuda": recorded.get("cuda"),
        "archs": recorded.get("archs", []),
        # what the loaded module says it carries (compiled in), else what the build recorded
        "sass": [f"sm_{a}" for a in carried[0]] if carried else recorded.get("sass", []),
        "ptx": [f"compute_{a}" for a in carried[1]] if carried else recorded.get("ptx", []),
        "arch_source": recorded.get("arch_source"),
        "cuda_skipped_because": recorded.get("cuda_skipped_because"),
        "torch_now": torch.__version__,
        "path": getattr(mod, "__file__", None) or (_state.get("smoke") or {}).get("path"),
        "load_error": _state["error"],
        "build_error": recorded.get("build_error"),
        # the smoke check of this process's first load (None: nothing built to check), and the build's own
        "smoke": _state.get("smoke"),
        "smoke_at_build": recorded.get("smoke"),
        "compilers": recorded.get("compilers"),
        "origin": _state["origin"],
        "installed_not_used": _state["not_installed"],
        "build_seconds": recorded.get("seconds") if _state["origin"] == "first-use build" else None,
        "sources_match": _sources_match(recorded) if mod is not None else None,
    }


# ------------------------------------------------------------------------------------------- fakes
def _acc(tensors):
    import torch

    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _register_fakes() -> None:
    import torch

    def fake(name):
        def deco(fn):
            torch.library.register_fake(f"fastgrad::{name}")(fn)
            return fn
        return deco

    @fake("norm")
    def _norm(tensors, norm_type):
        dt, dev = _acc(tensors), tensors[0].device
        return tensors[0].new_empty((), dtype=dt, device=dev), tensors[0].new_empty((len(tensors),), dtype=dt, device=dev)

    @fake("amp_norm")
    def _amp_norm(tensors, inv_scale, norm_type):
        dev = tensors[0].device
        return (tensors[0].new_empty((), dtype=_acc(tensors), device=dev),
                tensors[0].new_empty((), dtype=torch.float32, device=dev))

    @fake("scale_")
    def _scale(tensors, factor):
        return None

    @fake("clip_norm_")
    def _clip_norm(grads, max_norm, norm_type):
        return grads[0].new_empty((), dtype=_acc(grads), device=grads[0].device)

    @fake("amp_clip_")
    def _amp_clip(grads, inv_scale, max_norm, norm_type, write):
        acc, dev = _acc(grads), grads[0].device
        return (grads[0].new_empty((), dtype=acc, device=dev), grads[0].new_empty((), dtype=torch.float32, device=dev),
                grads[0].new_empty((), dtype=acc, device=dev))

    @fake("clip_value_")
    def _clip_value(tensors, clip_value):
        return None

    @fake("agc_")
    def _agc(params, grads, clip_factor, eps, norm_type):
        return None

    @fake("centralize_")
    def _centralize(grads):
        return None

    @fake("grad_stats")
    def _grad_stats(tensors):
        n, dt, dev = len(tensors), _acc(tensors), tensors[0].device
        t0 = tensors[0]
        return (t0.new_empty((n,), dtype=dt, device=dev), t0.new_empty((n,), dtype=dt, device=dev),
                t0.new_empty((n,), dtype=torch.int64, device=dev), t0.new_empty((n,), dtype=torch.int64, device=dev),
                t0.new_empty((n,), dtype=torch.int64, device=dev))

    @fake("exact_limbs")
    def _exact_limbs(tensors, p, base, nlimbs, per_tensor):
        rows, t0 = (len(tensors) if per_tensor else 1), tensors[0]
        return (t0.new_empty((rows, nlimbs), dtype=torch.int64, device=t0.device),
                t0.new_empty((rows, 2), dtype=torch.int64, device=t0.device))

    @fake("exact_total")
    def _exact_total(tensors, p, base, nlimbs, a, b):
        t0, rows = tensors[0], torch.library.get_ctx().new_dynamic_size(max=1)
        return (t0.new_empty((), dtype=a), t0.new_empty((), dtype=b), t0.new_empty((rows, nlimbs), dtype=torch.int64),
                t0.new_empty((rows, 2), dtype=torch.int64))
