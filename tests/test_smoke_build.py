"""The smoke check of the built extension (fastgrad/_smoke.py, fastgrad/_ext.py): a build that crashes when a
TORCH_CHECK message formats a number (a C++ compiler whose runtime does not match torch's; the H100 runs'
image) is found in a child process before a training process loads it, declined with one warning naming the
cause and the fix, and fastgrad falls back to its Triton/torch backends with correct results.

A crashing build is simulated with FASTGRAD_EXT_SMOKE_FAULT (the child kills itself with that signal after
loading the module); each test caches in its own folder (FASTGRAD_CACHE_DIR), so no result reaches other tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from fastgrad import _ext, _smoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = importlib.util.find_spec("fastgrad._C")
needs_build = pytest.mark.skipif(SPEC is None or _ext.load() is None, reason="fastgrad._C is not built here")


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv(_smoke.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(_smoke.ENV, raising=False)
    monkeypatch.delenv(_smoke.FAULT_ENV, raising=False)
    return tmp_path


def _copy_of_the_build(tmp_path) -> str:
    target = tmp_path / "build" / os.path.basename(SPEC.origin)
    target.parent.mkdir()
    shutil.copy2(SPEC.origin, target)
    return str(target)


def _counting_runs(monkeypatch) -> list:
    calls = []
    real = _smoke.run

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(_smoke, "run", counted)
    return calls


@needs_build
def test_this_build_passes_and_the_result_is_cached_per_build(cache_env, monkeypatch):
    so = _copy_of_the_build(cache_env)
    runs = _counting_runs(monkeypatch)
    first = _smoke.check(so, torch.__version__)
    assert first["ok"] and first["reason"] is None and not first["cached"], first
    again = _smoke.check(so, torch.__version__)
    assert again["ok"] and again["cached"] and len(runs) == 1  # no second child process
    # a rebuild (new mtime) or another torch is another build: checked again
    st = os.stat(so)
    os.utime(so, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not _smoke.check(so, torch.__version__)["cached"] and len(runs) == 2
    assert not _smoke.check(so, torch.__version__ + "-other")["cached"] and len(runs) == 3
    monkeypatch.setenv(_smoke.ENV, "force")
    assert not _smoke.check(so, torch.__version__)["cached"] and len(runs) == 4
    monkeypatch.setenv(_smoke.ENV, "0")
    skipped = _smoke.check(so, torch.__version__)
    assert skipped["ok"] and skipped["skipped"] and len(runs) == 4


@needs_build
def test_a_crash_is_named_with_its_signal_and_the_fix(cache_env, monkeypatch):
    so = _copy_of_the_build(cache_env)
    monkeypatch.setenv(_smoke.FAULT_ENV, "SIGSEGV")
    out = _smoke.check(so, torch.__version__, compilers="CC=/opt/gcc/bin/gcc CXX=/opt/gcc/bin/g++")
    assert not out["ok"] and not out["cached"]
    assert "crashed with SIGSEGV" in out["reason"] and "CXX=/opt/gcc/bin/g++" in out["reason"]
    assert "CC=/usr/bin/gcc CXX=/usr/bin/g++ pip install --no-build-isolation" in out["reason"]
    assert _smoke.check(so, torch.__version__)["cached"]
    # the fault is part of the key: a process without it does not inherit the failure
    monkeypatch.delenv(_smoke.FAULT_ENV)
    assert _smoke.check(so, torch.__version__)["ok"]


def test_a_module_that_does_not_load_fails_with_its_error(cache_env):
    fake = cache_env / "_C.cpython-fake.so"
    fake.write_text("not a shared object")
    out = _smoke.check(str(fake), torch.__version__)
    assert not out["ok"] and "failed (exit status 1" in out["reason"] and "ImportError" in out["reason"], out


# ------------------------------------------------------------------------------ end to end, in fresh processes
_CHILD = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import torch
        import fastgrad
        from fastgrad import _ext, _scan, backends, info
        loaded_at_import = _ext._state["done"]
        g = torch.Generator().manual_seed(5)
        shapes = [(17, 33), (7,), (300,)]
        ours = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        for p in ours:
            p.grad = torch.randn(p.shape, generator=g)
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        for p, q in zip(theirs, ours):
            p.grad = q.grad.clone()
        total = fastgrad.clip_grad_norm_(ours, 0.5)
        total_t = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        close = bool(torch.allclose(total, total_t, rtol=1e-6, atol=0)) and all(
            torch.allclose(p.grad, q.grad, rtol=2e-6, atol=0) for p, q in zip(ours, theirs))
        named = {}
        for name in ("cpu", "cuda"):
            try:
                fastgrad.clip_grad_norm_(ours, 0.5, backend=name)
                named[name] = None
            except fastgrad.BackendError as exc:
                named[name] = str(exc)
        text = info.render(info.collect())
    print(json.dumps({
        "loaded_at_import": loaded_at_import,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                     and "fastgrad" in str(w.message)],
        "available": fastgrad.available_backends(), "close": close, "named": named,
        "smoke": _ext.build_info()["smoke"], "scan": _scan.describe(), "info": text}))
""")


def _child(env_extra: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_extra)
    env.pop("FASTGRAD_NO_EXT_WARNING", None)
    res = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=600,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@needs_build
def test_a_crashing_build_is_declined_once_and_fastgrad_falls_back(tmp_path):
    env = {_smoke.CACHE_ENV: str(tmp_path / "cache"), _smoke.FAULT_ENV: "SIGSEGV", _smoke.ENV: ""}
    first = _child(env)
    assert first["loaded_at_import"] is False  # import fastgrad stays light: the check waits for the first use
    assert len(first["warnings"]) == 1, first["warnings"]
    warning = first["warnings"][0]
    assert "crashed with SIGSEGV" in warning and "CC=/usr/bin/gcc CXX=/usr/bin/g++" in warning
    assert "cpu" not in first["available"] and "cuda" not in first["available"] and "torch" in first["available"]
    assert first["close"]  # the automatic choice fell back to a backend that gives torch's result
    for name in ("cpu", "cuda"):
        assert first["named"][name] is not None and "crashed with SIGSEGV" in first["named"][name]
    assert first["smoke"]["ok"] is False and first["smoke"]["cached"] is False
    assert "smoke test" in first["scan"] and "declined" in first["scan"]
    assert "CPU tensors: torch (no C++ kernels: the smoke test of fastgrad._C crashed with SIGSEGV" in first["info"]
    assert "smoke test:" in first["info"] and "FAILED" in first["info"]
    # the next process reads the cached result: no child process, the same single warning
    second = _child(env)
    assert second["smoke"]["cached"] is True and len(second["warnings"]) == 1
    assert "cpu" not in second["available"] and second["close"]


@needs_build
def test_a_good_build_loads_after_its_check(tmp_path):
    out = _child({_smoke.CACHE_ENV: str(tmp_path / "cache"), _smoke.ENV: ""})
    assert out["warnings"] == [] and "cpu" in out["available"] and out["close"]
    assert out["smoke"]["ok"] is True and "smoke test:" in out["info"] and "passed" in out["info"]
    assert _child({_smoke.CACHE_ENV: str(tmp_path / "cache"), _smoke.ENV: ""})["smoke"]["cached"] is True
