"""Every GPU, no crash (issue 12 item 1), checked without a GPU: which archs a build embeds
(fastgrad/_archs.py, used by setup.py), which devices the cuda backend then serves, and what happens when
a launch still fails with "no kernel image": automatic choice finishes the call on the next backend with
nothing written by the failed one, and a call naming the backend gets BackendError with the reason.

The device-agnostic logic runs on CPU tensors: a CudaBackend whose ``devices`` include "cpu" and whose op
namespace is a fake stands in for a build without code for the GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings

import pytest
import torch

import fastgrad
from fastgrad import _archs, _ext, backends
from fastgrad.backends import ext_backend

from .helpers import bits, clone_params, grads, make_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC13 = {"75", "80", "86", "87", "88", "89", "90", "100", "103", "110", "120", "121"}  # nvcc 13.0 --list-gpu-code


# ------------------------------------------------------------------------------------- arch selection
@pytest.mark.parametrize("spec, sass, ptx", [
    ("8.0;8.6;9.0+PTX", ["80", "86", "90"], ["90"]),
    ("80,90", ["80", "90"], []),  # fastgrad's old FASTGRAD_CUDA_ARCHS form
    ("sm_90a 10.0", ["90a", "100"], []),
    ("Hopper", ["90"], ["90"]),
    ("Ampere;Ada", ["80", "86", "89"], ["86", "89"]),
    ("Blackwell", ["100", "103", "120", "121"], ["121"]),
    ("9.0;8.0;9.0", ["80", "90"], []),  # sorted, no repeats
    ("12.0+PTX;7.5", ["75", "120"], ["120"]),
])
def test_parse_arch_list(spec, sass, ptx):
    assert _archs.parse_arch_list(spec) == (sass, ptx)


@pytest.mark.parametrize("spec", ["", "8", "eight", "8.0;x.y", "9.0b"])
def test_parse_arch_list_rejects_nonsense(spec):
    with pytest.raises(_archs.ArchError):
        _archs.parse_arch_list(spec)


def test_default_selection_is_common_archs_plus_ptx_of_the_newest():
    sass, ptx, source = _archs.select({}, NVCC13)
    assert source == "default"
    assert sass == ["75", "80", "86", "89", "90", "100", "120"] and ptx == ["120"]
    # An older nvcc (CUDA 12.0 knows sm_90 but no Blackwell): what it can build, PTX of its newest.
    sass, ptx, _ = _archs.select({}, {"50", "60", "70", "75", "80", "86", "89", "90"})
    assert sass == ["75", "80", "86", "89", "90"] and ptx == ["90"]
    # nvcc not askable: the common list as is.
    assert _archs.select({}, None)[:2] == (list(_archs.COMMON), [_archs.COMMON[-1]])


def test_explicit_lists_are_built_exactly():
    env = {"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"}
    assert _archs.select(env, NVCC13) == (["80", "90"], ["90"], "TORCH_CUDA_ARCH_LIST")
    # fastgrad's own variable wins over torch's
    env["FASTGRAD_CUDA_ARCHS"] = "90"
    assert _archs.select(env, NVCC13) == (["90"], [], "FASTGRAD_CUDA_ARCHS")
    # "native": the visible GPUs, newest with PTX, as torch does
    native = {"TORCH_CUDA_ARCH_LIST": "native"}
    assert _archs.select(native, NVCC13, lambda: [(9, 0), (8, 6), (9, 0)]) == (["86", "90"], ["90"], "TORCH_CUDA_ARCH_LIST")
    with pytest.raises(_archs.ArchError, match="no GPU is visible"):
        _archs.select(native, NVCC13, lambda: [])


def test_explicit_arch_the_nvcc_cannot_build_is_an_error():
    with pytest.raises(_archs.ArchError, match="sm_60.*cannot build"):
        _archs.select({"TORCH_CUDA_ARCH_LIST": "6.0;8.0"}, NVCC13)
    assert _archs.select({"TORCH_CUDA_ARCH_LIST": "9.0a"}, NVCC13)[0] == ["90a"]  # 'a' of a supported arch


def test_gencode_flags_and_define_round_trip():
    flags = _archs.gencode_flags(["80", "90a"], ["90a"])
    assert flags == ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a",
                     "-gencode", "arch=compute_90a,code=compute_90a"]
    for archs in ([], ["80"], ["75", "90a", "120"]):
        assert _archs.from_define(_archs.define_value(archs)) == archs


def test_the_build_plan_uses_the_selection(monkeypatch, tmp_path):
    """fastgrad/_buildplan.py (setup.py and the first-use build both build from its plan) picks the gencodes
    through _archs.select: a CUDA torch and an nvcc give SASS for the default archs that nvcc can build plus PTX
    of the newest, nvcc without FMA contraction, and the archs compiled into the module."""
    import types

    from fastgrad import _buildplan

    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("")
    monkeypatch.setattr(_archs, "nvcc_archs", lambda path: NVCC13 if path == str(nvcc) else None)
    fake_torch = types.SimpleNamespace(__version__="2.13.0+cu130", version=types.SimpleNamespace(cuda="13.0"),
                                       _C=types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True))
    fake_ext = types.SimpleNamespace(CUDA_HOME=str(tmp_path / "cuda"))
    plan = _buildplan.plan(fake_torch, fake_ext, _archs, os.path.join(ROOT, "csrc"), {})
    sass = [a for a in _archs.COMMON if a in NVCC13]
    assert plan["with_cuda"] and plan["sass"] == sass and plan["ptx"] == [sass[-1]]
    assert plan["nvcc"] == ["-O3", "--fmad=false", "-DFASTGRAD_WITH_CUDA=1"] + _archs.gencode_flags(sass, [sass[-1]])
    assert f"-DFASTGRAD_CUDA_SASS={_archs.define_value(sass)}" in plan["cxx"] and "-ffp-contract=off" in plan["cxx"]
    assert plan["record"]["arch_source"] == "default" and plan["cuda_sources"]
    # an explicit list wins, and one the nvcc cannot build is an error, not dropped
    plan = _buildplan.plan(fake_torch, fake_ext, _archs, os.path.join(ROOT, "csrc"), {"TORCH_CUDA_ARCH_LIST": "9.0"})
    assert plan["sass"] == ["90"] and plan["ptx"] == []
    with pytest.raises(_archs.ArchError, match="sm_61"):
        _buildplan.plan(fake_torch, fake_ext, _archs, os.path.join(ROOT, "csrc"), {"FASTGRAD_CUDA_ARCHS": "6.1"})
    src = open(os.path.join(ROOT, "setup.py")).read()
    assert "_buildplan.plan(torch, cpp_extension, _load(\"_archs\")" in src


# ------------------------------------------------------------------------------- per-device decision
@pytest.mark.parametrize("cc, sass, ptx, runs", [
    ((8, 0), ["80", "90"], [], "sm_80"),
    ((8, 6), ["80", "90"], [], "sm_80"),  # same major, higher minor
    ((8, 9), ["80", "86"], [], "sm_86"),  # the closest below wins
    ((9, 0), ["80"], [], None),  # SASS never crosses majors: the H100 run's sm_80-only build
    ((7, 5), ["80", "90"], ["90"], None),  # older than everything carried
    ((10, 0), ["80", "90"], [], None),  # Blackwell without PTX: the crash of finding 1
    ((10, 0), ["80", "90"], ["90"], "compute_90 (JIT)"),  # PTX JIT-compiles for any newer GPU
    ((12, 0), ["75", "120"], ["120"], "sm_120"),
    ((12, 1), ["120"], [], "sm_120"),
    ((9, 0), ["90a"], [], "sm_90a"),
    ((10, 0), ["90a"], ["90a"], None),  # arch-specific code runs on exactly that arch, SASS or PTX
    ((10, 0), ["90a"], ["90"], "compute_90 (JIT)"),
    ((8, 6), ["75"], ["80"], "compute_80 (JIT)"),
    ((8, 6), [], ["90"], None),
])
def test_runs_on(cc, sass, ptx, runs):
    assert _archs.runs_on(cc, sass, ptx) == runs
    why = _archs.decline_reason(cc, sass, ptx)
    if runs is None:
        assert why and f"{cc[0]}.{cc[1]}" in why and "TORCH_CUDA_ARCH_LIST" in why
    else:
        assert why is None


def _cuda_backend(monkeypatch, archs, cc, probe=""):
    """The registered cuda backend, made to believe it has kernels carrying ``archs`` and a GPU of ``cc``."""
    b = ext_backend.CudaBackend()

    class FakeOps:
        calls = []

        def cuda_probe(self, index):
            self.calls.append(index)
            return probe

    monkeypatch.setattr(ext_backend.CudaBackend, "ops", FakeOps())
    monkeypatch.setattr(_ext, "cuda_archs", lambda: archs)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return b, FakeOps


def test_device_decision_declines_a_gpu_without_code(monkeypatch):
    b, ops = _cuda_backend(monkeypatch, (["80"], []), (9, 0))
    why = b.device_reason(torch.device("cuda", 0))
    assert "compute capability 9.0" in why and "sm_80" in why and "no PTX" in why
    assert ops.calls == []  # decided from the archs alone: no probe


def test_device_decision_probes_once_and_caches(monkeypatch):
    b, ops = _cuda_backend(monkeypatch, (["80", "90"], ["90"]), (10, 0))
    assert b.device_reason(torch.device("cuda", 0)) is None
    assert b.device_reason(torch.device("cuda", 0)) is None
    assert ops.calls == [0]
    # A probe that fails (e.g. a PTX the driver is too old to JIT) declines with its error.
    b, ops = _cuda_backend(monkeypatch, (["80", "90"], ["90"]), (10, 0),
                           probe="cudaErrorUnsupportedPtxVersion: the provided PTX was compiled with an unsupported toolchain.")
    assert "cudaErrorUnsupportedPtxVersion" in b.device_reason(torch.device("cuda", 1))
    assert ops.calls == [1]


def test_no_probe_inside_capture(monkeypatch):
    b, ops = _cuda_backend(monkeypatch, (["90"], []), (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert b.device_reason(torch.device("cuda", 0)) is None
    assert ops.calls == []  # undecided: probed at the next call outside the capture


# ------------------------------------------------------------------------- first launch without image
NO_IMAGE = ("fastgrad::{} CUDA launch failed: cudaErrorNoKernelImageForDevice: no kernel image is available "
            "for execution on the device")


class FailingOps:
    """torch.ops.fastgrad whose every op fails like a launch on a GPU the build has no code for."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def op(*args):
            self.calls.append(name)
            raise RuntimeError(NO_IMAGE.format(name))
        return op


class StandIn(ext_backend.CudaBackend):
    """The cuda backend serving CPU tensors through failing ops (the recovery logic is device-agnostic)."""

    devices = ("cpu",)
    ops = None  # an instance attribute below (the base class's is a read-only property)

    def __init__(self):
        super().__init__()
        self.ops = FailingOps()

    def unavailable_reason(self):
        return None


@pytest.fixture
def standin(monkeypatch):
    b = StandIn()
    monkeypatch.setitem(backends._REGISTRY, "cuda", b)
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ("cuda", "torch"))
    return b


SHAPES = [(33, 7), (5,), (4, 3, 2), (0,), (1000,)]


@pytest.mark.parametrize("call", ["clip", "norm", "value", "agc", "gc", "stats"])
def test_first_launch_failure_falls_back_and_declines_the_device(standin, call):
    params = make_params(SHAPES, [torch.float32, torch.bfloat16], "cpu", seed=3)
    mine, ref = clone_params(params), clone_params(params)
    run = {
        "clip": lambda ps, b: fastgrad.clip_grad_norm_(ps, 0.5, backend=b),
        "norm": lambda ps, b: fastgrad.get_total_norm(grads(ps), 3.0, backend=b),
        "value": lambda ps, b: fastgrad.clip_grad_value_(ps, 0.1, backend=b),
        "agc": lambda ps, b: fastgrad.adaptive_clip_grad_(ps, 0.01, backend=b),
        "gc": lambda ps, b: fastgrad.centralize_gradient_(ps, backend=b),
        "stats": lambda ps, b: fastgrad.grad_stats(ps, backend=b),
    }[call]
    with pytest.warns(RuntimeWarning, match="no kernel image.*Using the torch backend"):
        out = run(mine, None)
    want = run(ref, "torch")
    assert standin.ops.calls, "the cuda backend was not tried"
    if call == "clip":  # the whole clip is one op: its failure leaves nothing half done
        assert standin.ops.calls == ["clip_norm_"]
    # Same result as the torch backend alone: the failed launch wrote nothing, the fallback did the rest.
    for g, r in zip(grads(mine), grads(ref)):
        assert torch.equal(bits(g), bits(r))
    if isinstance(out, torch.Tensor):
        assert torch.equal(bits(out), bits(want))
    # Declined from now on, with the reason: no second try, no second warning.
    n = len(standin.ops.calls)
    assert "no kernel image" in standin.device_reason(torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(clone_params(params), None)
    assert len(standin.ops.calls) == n


def test_first_launch_failure_raises_backend_error_when_named(standin):
    params = make_params(SHAPES, torch.float32, "cpu", seed=4)
    before = [g.clone() for g in grads(params)]
    with pytest.raises(fastgrad.BackendError, match="'cuda' cannot run norm.*no kernel image"):
        fastgrad.clip_grad_norm_(params, 0.1, backend="cuda")
    assert all(torch.equal(bits(g), bits(b)) for g, b in zip(grads(params), before))
    # and later calls naming it are refused up front, with the same reason
    with pytest.raises(fastgrad.BackendError, match="no kernel image"):
        fastgrad.clip_grad_norm_(params, 0.1, backend="cuda")


def test_first_launch_failure_named_through_the_environment(standin, monkeypatch):
    monkeypatch.setenv("FASTGRAD_BACKEND", "cuda")
    params = make_params(SHAPES, torch.float32, "cpu", seed=5)
    with pytest.raises(fastgrad.BackendError, match="no kernel image"):
        fastgrad.clip_grad_value_(params, 0.1)


class IllegalAddressOps:
    """Every op fails with a launch error that is not about a missing kernel image."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def op(*args):
            raise RuntimeError(f"fastgrad::{name} CUDA launch failed: cudaErrorIllegalAddress: an illegal memory access")
        return op


def test_other_launch_errors_are_not_swallowed(standin):
    standin.ops = IllegalAddressOps()
    params = make_params(SHAPES, torch.float32, "cpu", seed=6)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        fastgrad.clip_grad_norm_(params, 0.1)
    assert standin.device_reason(torch.device("cpu")) is None


@pytest.mark.parametrize("text, expected", [
    (NO_IMAGE.format("norm"), True),
    ("CUDA error: no kernel image is available for execution on the device", True),
    ("fastgrad::agc_ CUDA launch failed: cudaErrorInvalidDeviceFunction: invalid device function", True),
    ("fastgrad::norm CUDA launch failed: cudaErrorUnsupportedPtxVersion: the provided PTX was compiled with an "
     "unsupported toolchain.", True),
    ("CUDA out of memory", False),
    ("fastgrad::norm: tensor 3 is on cuda:1, expected cuda:0", False),
])
def test_no_image_error_classification(text, expected):
    assert ext_backend.is_no_image_error(RuntimeError(text)) is expected
    assert not ext_backend.is_no_image_error(ValueError(text))


# ----------------------------------------------------------------------------- info and missing build
def test_info_opens_with_a_verdict_per_device_type():
    from fastgrad import info

    data = info.collect()
    text = info.render(data)
    lines = text.splitlines()
    assert lines[0].startswith("CUDA tensors: ")
    assert lines[1].startswith("CPU tensors: ")
    if backends.get("cpu").unavailable_reason() is None:  # and where they come from
        assert lines[1] in ("CPU tensors: C++ kernels (installed with fastgrad)",
                            "CPU tensors: C++ kernels (compiled for this torch at first use, loaded from the build cache)")
        assert lines[1].endswith("(installed with fastgrad)") == (_ext.build_info()["origin"] == "installed")
    assert "extension fastgrad._C:" in lines
    assert not any(line.startswith("extension fastgrad._C: ") and "=" in line for line in lines)  # not one dict line


def test_info_verdict_names_why_not_the_cuda_kernels(monkeypatch):
    from fastgrad import info

    b, _ = _cuda_backend(monkeypatch, (["80"], []), (9, 0))
    monkeypatch.setitem(backends._REGISTRY, "cuda", b)
    monkeypatch.setattr(b, "unavailable_reason", lambda: None)
    monkeypatch.setattr(backends.get("triton"), "unavailable_reason", lambda: None)
    line = info._cuda_device_line(0)
    assert line.startswith("Triton kernels (not the cuda kernels:") and "sm_80" in line
    b2, _ = _cuda_backend(monkeypatch, (["80", "86", "90"], ["90"]), (9, 0))
    monkeypatch.setitem(backends._REGISTRY, "cuda", b2)
    monkeypatch.setattr(b2, "unavailable_reason", lambda: None)
    assert info._cuda_device_line(0) == ("cuda kernels (sm_80 sm_86 sm_90 SASS, PTX compute_90 for newer GPUs; "
                                         "runs as sm_90)")


_MISSING = """
import sys, warnings
sys.modules['fastgrad._C'] = None  # as if it was never built
warnings.simplefilter('always')
with warnings.catch_warnings(record=True) as w:
    import fastgrad, torch
    ps = [torch.nn.Parameter(torch.ones(3))]
    ps[0].grad = torch.ones(3)
    fastgrad.clip_grad_norm_(ps, 1.0)
    fastgrad.clip_grad_norm_(ps, 1.0)
msgs = [str(x.message) for x in w if 'fastgrad._C' in str(x.message)]
print(len(msgs))
print(msgs[0] if msgs else '')
"""


@pytest.mark.parametrize("quiet", [False, True])
def test_missing_extension_warns_once_with_the_build_command(quiet, tmp_path):
    # without the first-use build (tests/test_first_use_build.py has it), an empty build cache
    env = dict(os.environ, FASTGRAD_NO_EXT_WARNING="1" if quiet else "0", FASTGRAD_AUTO_BUILD="0",
               FASTGRAD_CACHE_DIR=str(tmp_path))
    out = subprocess.run([os.sys.executable, "-c", _MISSING], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    count, msg = (out.stdout.splitlines() + [""])[:2]
    if quiet:
        assert count == "0"
    else:
        assert count == "1", out.stdout
        assert "python -m fastgrad.build builds it" in msg and "FASTGRAD_NO_EXT_WARNING" in msg


# --------------------------------------------------------------------------------------- build script
RUN_GPU = os.path.join(ROOT, "benchmarks", "run_gpu.sh")


# A stand-in for python: "pip install" "builds" a module (a file naming the C++ compiler it was built with); the
# smoke check (a script on stdin) fails for a module built with the compiler in BAD_CXX, as the GPU image's
# /opt/gcc g++ gives a module that crashes.
_FAKE_PY = """#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$CXX" > "$FAKE_SO"; exit 0; fi
if [ "$1" = "-" ]; then
    cat > /dev/null
    if [ "$(cat "$FAKE_SO")" = "$BAD_CXX" ]; then echo "smoke: crashed with SIGSEGV"; exit 1; fi
    echo "smoke: passed"; exit 0
fi
exit 0
"""


@pytest.mark.skipif(shutil.which("bash") is None or not os.access("/usr/bin/g++", os.X_OK)
                    or not os.access("/usr/bin/gcc", os.X_OK), reason="needs bash and /usr/bin/gcc, g++")
def test_run_gpu_keeps_the_first_compiler_that_passes_the_smoke_check(tmp_path):
    # The script runs from a copy of its folder layout (its install stage cleans the build outputs there).
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(RUN_GPU, repo / "benchmarks" / "run_gpu.sh")
    py = tmp_path / "python"
    py.write_text(_FAKE_PY)
    py.chmod(0o755)
    image = {"CC": "/opt/gcc/bin/gcc", "CXX": "/opt/gcc/bin/g++"}

    def run(out, bad):
        env = dict(os.environ, PYTHON=str(py), STAGES="install", BAD_CXX=bad, FAKE_SO=str(tmp_path / "so"), **image)
        res = subprocess.run(["bash", str(repo / "benchmarks" / "run_gpu.sh"), str(tmp_path / out)],
                             capture_output=True, text=True, env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        return (tmp_path / out / "summary.txt").read_text()

    # The image's compilers are set and build a module that crashes: rejected by the smoke check, not kept
    # because CC/CXX are set; the distribution's are kept and exported to the later stages.
    summary = run("out", image["CXX"])
    assert "rejected: CC=/opt/gcc/bin/gcc CXX=/opt/gcc/bin/g++" in summary
    assert "kept: CC=/usr/bin/gcc CXX=/usr/bin/g++ (smoke check passed)" in summary
    assert "compilers: CC=/usr/bin/gcc CXX=/usr/bin/g++" in summary
    # Compilers from the environment that pass are kept, with no second build.
    summary = run("out2", "none")
    assert "kept: CC=/opt/gcc/bin/gcc CXX=/opt/gcc/bin/g++" in summary and "/usr/bin/g++" not in summary
    assert summary.count("== build with") == 1
