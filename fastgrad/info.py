"""``python -m fastgrad.info``: versions, backends and why each is or is not usable, build info."""

from __future__ import annotations

import json
import os
import platform
import sys


def collect() -> dict:
    import torch

    import fastgrad
    from fastgrad import backends

    info: dict = {
        "fastgrad": fastgrad.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
        "FASTGRAD_BACKEND": os.environ.get("FASTGRAD_BACKEND"),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
    }
    info["triton"] = _triton_version(info["cuda_available"] or backends.get("triton").unavailable_reason() is None)
    try:
        from fastgrad import _ext

        info["extension"] = _ext.build_info()
    except Exception as exc:  # noqa: BLE001
        info["extension"] = {"built": False, "error": f"{type(exc).__name__}: {exc}"}
    try:
        from fastgrad import _scan

        info["host_scan"] = _scan.describe()
    except Exception as exc:  # noqa: BLE001
        info["host_scan"] = f"unavailable ({type(exc).__name__}: {exc})"
    info["backends"] = {
        name: {"usable": b.unavailable_reason() is None, "reason": b.unavailable_reason()}
        for name, b in backends.registered().items()
    }
    info["auto_order"] = {dev: list(order) for dev, order in backends.AUTO_ORDER.items()}
    info["measured_order"] = {dev: {op: list(o) for op, o in ops.items()}
                              for dev, ops in backends.MEASURED_ORDER.items()}
    info["long_list"] = {"min_tensors": backends.LONG_LIST_MIN,
                         "order": {dev: {op: list(o) for op, o in ops.items()}
                                   for dev, ops in backends.MEASURED_LONG_ORDER.items()}}
    info["default_backend"] = backends.get_default_backend() or "automatic"
    from . import patch

    info["patch_torch"] = patch.describe()
    info["verdict"] = verdict(info)
    return info


def _triton_version(needed: bool) -> str:
    """Triton's version. Imported (about a second) only where the triton backend could run, so that a broken
    install shows; elsewhere the installed distribution's version is read without importing it."""
    if needed:
        try:
            import triton

            return triton.__version__
        except Exception as exc:  # noqa: BLE001 - any import failure just means "no triton"
            return f"not importable ({type(exc).__name__}: {exc})"
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "not installed"
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        version = "installed"
    return f"{version} (not imported: no CUDA device here, and TRITON_INTERPRET is not set)"


def _cuda_device_line(index: int) -> str:
    """What serves CUDA tensors on device ``index`` under automatic choice, and why not the faster one."""
    from fastgrad import _archs, _ext, backends

    import torch

    cuda = backends.get("cuda")
    why = cuda.unavailable_reason() or cuda.device_reason(index)
    if why is None:
        carried = _ext.cuda_archs()
        if carried is None:
            return "cuda kernels"
        cc = tuple(torch.cuda.get_device_capability(index))
        return f"cuda kernels ({_archs.describe(*carried)}; runs as {_archs.runs_on(cc, *carried)})"
    triton = backends.get("triton")
    t_why = triton.unavailable_reason()
    if t_why is None:
        return f"Triton kernels (not the cuda kernels: {why})"
    return f"torch (not the cuda kernels: {why}; not Triton: {t_why})"


def verdict(info: dict) -> list[str]:
    """One line per device type: what automatic choice runs on its tensors, and why not the faster one."""
    import torch

    from fastgrad import backends

    lines = []
    if info["cuda_available"]:
        n = len(info["gpus"])
        per = [_cuda_device_line(i) for i in range(n)]
        if len(set(per)) == 1:
            lines.append(f"CUDA tensors: {per[0]}")
        else:
            lines += [f"CUDA tensors on cuda:{i}: {line}" for i, line in enumerate(per)]
    else:
        lines.append(f"CUDA tensors: no GPU visible (torch {torch.__version__}"
                     f"{', CUDA ' + torch.version.cuda if torch.version.cuda else ', a CPU-only build'})")
    cpu_why = backends.get("cpu").unavailable_reason()
    ext = info.get("extension") or {}
    origin = {"installed": " (installed with fastgrad)",
              "first-use build": " (compiled for this torch at first use, loaded from the build cache)"}.get(
        ext.get("origin"), "")
    lines.append(f"CPU tensors: C++ kernels{origin}" if cpu_why is None
                 else f"CPU tensors: torch (no C++ kernels: {cpu_why})")
    return lines


def _fmt(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) if value else "-"
    return "-" if value is None else str(value)


_EXT_LABELS = (
    ("built", "importable"), ("origin", "in use"), ("path", "module"), ("installed_not_used", "installed build not used"),
    ("build_seconds", "first-use build took (s)"), ("sources_match", "built from these sources"), ("cpu_kernels", "C++ kernels"), ("cuda_kernels", "CUDA kernels"),
    ("sass", "SASS (machine code)"), ("ptx", "PTX (JIT for newer GPUs)"), ("arch_source", "archs chosen by"),
    ("cuda_skipped_because", "no CUDA kernels because"), ("torch", "built against torch"), ("cuda", "built with CUDA"),
    ("torch_now", "running torch"), ("compilers", "built with compilers"), ("smoke", "smoke test"),
    ("smoke_at_build", "smoke test at build"), ("load_error", "load error"), ("build_error", "build error"),
)


def smoke_text(result) -> str | None:
    """One line for a smoke check result (fastgrad/_smoke.py), None when there is none."""
    if not result:
        return None
    if result.get("skipped"):
        return "skipped (FASTGRAD_EXT_SMOKE=0)"
    if "cached" not in result:  # setup.py's record
        return "passed" if result.get("ok") else f"FAILED: {result.get('reason')}"
    where = f"cached in {result['cache']}" if result.get("cached") else "run now"
    return f"passed ({where})" if result.get("ok") else f"FAILED ({where}): {result.get('reason')}"


def render(info: dict) -> str:
    lines = list(info.get("verdict") or verdict(info))
    lines += ["", f"fastgrad {info['fastgrad']}  (python {info['python']}, {info['platform']})",
              f"torch {info['torch']}  CUDA runtime: {info['torch_cuda']}  GPU available: {info['cuda_available']}"]
    for i, name in enumerate(info["gpus"]):
        lines.append(f"  cuda:{i}: {name}")
    lines.append(f"triton: {info['triton']}")
    ext = info["extension"]
    lines.append("extension fastgrad._C:")
    shown = set()
    for key, label in _EXT_LABELS:
        if key in ext:
            shown.add(key)
            value = smoke_text(ext[key]) if key in ("smoke", "smoke_at_build") else ext[key]
            if key in ("sass", "ptx", "arch_source", "cuda_skipped_because", "load_error", "build_error", "compilers",
                       "smoke", "smoke_at_build", "origin", "installed_not_used", "build_seconds") and not value:
                continue
            if key == "sources_match" and value is None:
                continue
            lines.append(f"  {label + ':':26s} {_fmt(value)}")
    for key, value in ext.items():
        if key not in shown and key != "archs":
            lines.append(f"  {key + ':':26s} {_fmt(value)}")
    lines.append(f"host-side list scan: {info['host_scan']}")
    lines.append("backends:")
    for name, b in info["backends"].items():
        state = "usable" if b["usable"] else f"not usable: {b['reason']}"
        lines.append(f"  {name:7s} {state}")
    lines.append("automatic choice: " + "; ".join(f"{d} tensors -> {' > '.join(o)}" for d, o in info["auto_order"].items())
                 + "; other devices -> torch")
    if info["cuda_available"]:
        for dev, ops in info["measured_order"].items():
            lines.append(f"  {dev} tensors, per op (measured, fastgrad.backends.MEASURED_ORDER): "
                         + "; ".join(f"{op} {'>'.join(o)}" for op, o in ops.items()))
        for dev, ops in info["long_list"]["order"].items():
            lines.append(f"  {dev} tensors, lists of {info['long_list']['min_tensors']}+ tensors, per op: "
                         + "; ".join(f"{op} {'>'.join(o)}" for op, o in ops.items()))
    elif info["measured_order"]:
        # the per-op CUDA order means nothing without a GPU: one line saying where it applies
        lines.append("  (on CUDA machines the order is measured per op: fastgrad.backends.MEASURED_ORDER, "
                     "or --json here)")
    lines.append(f"default backend: {info['default_backend']}")
    # a fresh `python -m fastgrad.info` process is never patched; render(collect()) inside a training
    # process shows the live state
    lines.append(f"torch.nn.utils clipping: {info['patch_torch']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    info = collect()
    print(json.dumps(info, indent=2, default=str) if "--json" in argv else render(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
