"""Triton backend: placeholder until the Triton kernels land (issue 3)."""

from __future__ import annotations

from .base import Backend


class TritonBackend(Backend):
    name = "triton"
    devices = ("cuda", "cpu")

    def unavailable_reason(self) -> str | None:
        return "the Triton kernels are not implemented yet"
