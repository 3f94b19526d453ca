"""Backend registry and selection (docs/contract.md section 8) and ``python -m fastgrad.info``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import fastgrad
from fastgrad import BackendError, backends

from .helpers import make_params


def test_torch_backend_always_available():
    assert "torch" in fastgrad.available_backends()
    assert set(backends.registered()) >= {"torch", "triton", "cuda", "cpu"}


def test_automatic_choice_for_cpu_tensors():
    t = [torch.randn(3)]
    chosen = backends.select("norm", t, None, norm_type=2.0)
    expected = "cpu" if "cpu" in fastgrad.available_backends() else "torch"
    assert chosen.name == expected
    # norm types the fused kernels lack fall back quietly
    assert backends.select("norm", t, None, norm_type=0.0).name == "torch"


def test_named_unusable_backend_raises_with_reason():
    unusable = [n for n, b in backends.registered().items() if b.unavailable_reason() is not None]
    if not unusable:
        pytest.skip("every backend is usable here")
    name = unusable[0]
    params = make_params([(4,)], torch.float32, "cpu")
    with pytest.raises(BackendError, match=f"backend '{name}' cannot run norm"):
        fastgrad.clip_grad_norm_(params, 1.0, backend=name)


def test_env_and_set_backend_order(monkeypatch):
    t = [torch.randn(3)]
    monkeypatch.setenv("FASTGRAD_BACKEND", "torch")
    assert backends.get_default_backend() == "torch"
    assert backends.select("norm", t, None, norm_type=2.0).name == "torch"
    unusable = [n for n, b in backends.registered().items() if b.unavailable_reason() is not None]
    if unusable:
        monkeypatch.setenv("FASTGRAD_BACKEND", unusable[0])
        with pytest.raises(BackendError):
            backends.select("norm", t, None, norm_type=2.0)
        # the argument wins over the environment
        assert backends.select("norm", t, "torch", norm_type=2.0).name == "torch"
    fastgrad.set_backend("torch")
    assert backends.get_default_backend() == "torch"  # set_backend overrides the environment
    fastgrad.set_backend(None)
    with pytest.raises(ValueError, match="unknown fastgrad backend"):
        fastgrad.set_backend("tpu")


def test_supports_reasons_name_the_problem():
    tb = backends.get("torch")
    assert tb.supports("norm", [torch.randn(2)], norm_type=2.0) is None
    assert "sparse" in tb.supports("norm", [torch.randn(2).to_sparse()], norm_type=2.0)
    assert "dtype" in tb.supports("norm", [torch.ones(2, dtype=torch.int32)], norm_type=2.0)
    assert "unknown op" in tb.supports("nope", [torch.randn(2)])


def test_info_cli_reports_backends():
    out = subprocess.run([sys.executable, "-m", "fastgrad.info"], capture_output=True, text=True, check=True)
    assert "torch   usable" in out.stdout
    for name in ("triton", "cuda", "cpu"):
        assert name in out.stdout
    js = subprocess.run([sys.executable, "-m", "fastgrad.info", "--json"], capture_output=True, text=True,
                        check=True)
    info = json.loads(js.stdout)
    assert info["backends"]["torch"]["usable"] is True
    assert info["torch"] == torch.__version__


class _Ready(backends.Backend):
    """A stand-in that is available and supports everything, so only the order decides."""

    def __init__(self, name):
        self.name = name

    def supports(self, op, tensors, **params):
        return None


class _Refuses(_Ready):
    def supports(self, op, tensors, **params):
        return "refuses every call"


def _cuda_list(n):
    # select() reads only .device of the tensors and hands the list to supports(): no GPU needed.
    from types import SimpleNamespace

    return [SimpleNamespace(device=torch.device("cuda"))] * n


@pytest.mark.parametrize("op", backends.OPS)
def test_measured_table_drives_automatic_choice_for_cuda(monkeypatch, op):
    for name in ("cuda", "triton"):
        monkeypatch.setitem(backends._REGISTRY, name, _Ready(name))
    monkeypatch.delenv("FASTGRAD_BACKEND", raising=False)
    monkeypatch.setattr(backends, "_default", None)
    short, long = _cuda_list(148), _cuda_list(backends.LONG_LIST_MIN)
    # What the run named by backends.MEASURED_RUN measured (its AUTO_ORDER.md under benchmarks/results/gpu/): cuda
    # for every op on lists of up to a few hundred tensors; on long lists of small tensors triton, except AGC and GC.
    assert backends.select(op, short).name == "cuda"
    assert backends.select(op, long).name == ("cuda" if op in ("agc", "centralize") else "triton")
    # The table, not a fixed order, decides: flipping its entry flips the choice.
    flipped = tuple(reversed(backends.MEASURED_ORDER["cuda"][op][:2])) + ("torch",)
    monkeypatch.setitem(backends.MEASURED_ORDER["cuda"], op, flipped)
    assert backends.select(op, short).name == flipped[0]
    # The first entry cannot serve: the next one in the table does, quietly.
    monkeypatch.setitem(backends._REGISTRY, flipped[0], _Refuses(flipped[0]))
    assert backends.select(op, short).name == flipped[1]
    # A named backend still wins over the table.
    assert backends.select(op, short, flipped[1]).name == flipped[1]


def test_selects_builtin_matches_select_for_cpu(monkeypatch):
    # The clip_grad_norm_ host fast path asks selects_builtin() instead of select(): they must agree.
    ts = [torch.randn(3)]
    monkeypatch.delenv("FASTGRAD_BACKEND", raising=False)
    monkeypatch.setattr(backends, "_default", None)
    for backend in (None, "cpu", "torch"):
        for p in (2.0, 1.0, float("inf"), 0.5, 0.0):
            try:
                chosen = backends.select("norm", ts, backend, norm_type=p).name
            except BackendError:
                chosen = None
            assert backends.selects_builtin("cpu", "norm", backend, p) == (chosen == "cpu"), (backend, p)
    monkeypatch.setitem(backends._REGISTRY, "cpu", _Ready("cpu"))  # replaced: not the built-in any more
    assert not backends.selects_builtin("cpu", "norm", None, 2.0)


def test_triton_declines_cpu_tensors_when_its_interpreter_cannot_run_the_kernels(monkeypatch):
    # (Triton 3.6's interpreter with NumPy >= 2.4 fails every kernel.) The probe's reason must reach
    # supports(), a call naming the backend and automatic choice, which moves on to another backend.
    import fastgrad
    from fastgrad.backends import triton_backend

    tb = backends.get("triton")
    if tb.unavailable_reason() is not None or torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter on a machine without a GPU")
    assert triton_backend.interpreter_reason() is None  # this machine's interpreter works (the suite relies on it)
    why = "the Triton 3.6.0 interpreter cannot run fastgrad's kernels with NumPy 2.4.6 (TypeError: ...)"
    monkeypatch.setattr(triton_backend, "_interp_reason", why)
    assert tb.supports("norm", [torch.randn(3)], norm_type=2.0) == why
    g = [torch.randn(5, requires_grad=True)]
    g[0].grad = torch.randn(5)
    with pytest.raises(backends.BackendError, match="NumPy 2.4.6"):
        fastgrad.clip_grad_norm_(g, 1.0, backend="triton")
    assert backends.select("norm", [g[0].grad], norm_type=2.0).name != "triton"
