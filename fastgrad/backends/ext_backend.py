"""Backends of the compiled extension fastgrad._C: placeholder until it lands (issue 4)."""

from __future__ import annotations

from .base import Backend


class CpuBackend(Backend):
    name = "cpu"
    devices = ("cpu",)

    def unavailable_reason(self) -> str | None:
        return "the compiled extension fastgrad._C is not implemented yet"


class CudaBackend(Backend):
    name = "cuda"
    devices = ("cuda",)

    def unavailable_reason(self) -> str | None:
        return "the compiled extension fastgrad._C is not implemented yet"
