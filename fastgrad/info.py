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
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001 - any import failure just means "no triton"
        info["triton"] = f"not importable ({type(exc).__name__}: {exc})"
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
    info["default_backend"] = backends.get_default_backend() or "automatic"
    return info


def render(info: dict) -> str:
    lines = [f"fastgrad {info['fastgrad']}  (python {info['python']}, {info['platform']})",
             f"torch {info['torch']}  CUDA runtime: {info['torch_cuda']}  GPU available: {info['cuda_available']}"]
    for i, name in enumerate(info["gpus"]):
        lines.append(f"  cuda:{i}: {name}")
    lines.append(f"triton: {info['triton']}")
    ext = info["extension"]
    lines.append("extension fastgrad._C: " + ", ".join(f"{k}={v}" for k, v in ext.items()))
    lines.append(f"host-side list scan: {info['host_scan']}")
    lines.append("backends:")
    for name, b in info["backends"].items():
        state = "usable" if b["usable"] else f"not usable: {b['reason']}"
        lines.append(f"  {name:7s} {state}")
    lines.append("automatic choice: " + "; ".join(f"{d} tensors -> {' > '.join(o)}" for d, o in info["auto_order"].items())
                 + "; other devices -> torch")
    lines.append(f"default backend: {info['default_backend']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    info = collect()
    print(json.dumps(info, indent=2, default=str) if "--json" in argv else render(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
