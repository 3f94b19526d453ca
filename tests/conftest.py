"""Shared test harness: every public-API test that takes the ``bd`` fixture runs once per usable
(backend, device) pair, so a backend is covered by the whole suite the moment it registers and reports
itself usable. On a machine without CUDA the Triton backend runs on CPU tensors in the interpreter."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any Triton kernel is defined (triton.jit reads it at decoration time).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastgrad import backends  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def usable_pairs() -> list[tuple[str, str]]:
    pairs = []
    for name, b in backends.registered().items():
        if b.unavailable_reason() is not None:
            continue
        for dev in DEVICES:
            probe = [torch.ones(3, device=dev)]
            if b.supports("norm", probe, norm_type=2.0) is None:
                pairs.append((name, dev))
    return pairs


BACKEND_DEVICES = usable_pairs()


@pytest.fixture(params=BACKEND_DEVICES, ids=[f"{b}-{d}" for b, d in BACKEND_DEVICES])
def bd(request) -> tuple[str, str]:
    """(backend name, device) for one usable pair."""
    return request.param


@pytest.fixture(autouse=True)
def _clean_backend_state(monkeypatch):
    # Tests choose backends explicitly; a developer's FASTGRAD_BACKEND or a leaked set_backend must not leak in.
    monkeypatch.delenv("FASTGRAD_BACKEND", raising=False)
    backends.set_backend(None)
    yield
    backends.set_backend(None)


def pytest_report_header(config):
    return "fastgrad (backend, device) pairs under test: " + ", ".join(f"{b}-{d}" for b, d in BACKEND_DEVICES)
