"""The first-use build of fastgrad._C (fastgrad/_build.py, fastgrad/_ext.py, fastgrad/_buildplan.py): an installed
extension whose build record names another torch is never loaded; one compiled for the running torch is, from a
cache keyed by torch, ABI and sources, compiled once (a lock across processes), published whole, its failure
recorded and said in one line; FASTGRAD_AUTO_BUILD=0 turns the compile off.

Most tests publish a "build" by copying this checkout's compiled module into the cache (what a compile would
leave there), so they run in seconds; one compiles broken sources through the real child process, torch's
cpp_extension and ninja. The real compile of the real sources is CI's first-use check (`make first-use-check`,
.ci/first_use_check.py), which takes minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from fastgrad import _build, _buildplan, _ext

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.find_spec("fastgrad._C")
needs_build = pytest.mark.skipif(SPEC is None or _ext.load() is None or _ext.build_info()["origin"] != "installed",
                                 reason="fastgrad._C is not built in this checkout")
IDENTITY = _buildplan.torch_identity(torch)


# ------------------------------------------------------------------------------------------- the torch check
def test_a_record_fits_only_the_torch_it_names():
    rec = dict(IDENTITY)
    assert _buildplan.mismatch(rec, IDENTITY) is None
    older = dict(rec, torch="2.12.0+cpu")
    assert _buildplan.mismatch(older, IDENTITY) == (
        f"it was built for torch 2.12.0+cpu, not the running torch {torch.__version__}")
    assert "CUDA 12.8" in _buildplan.mismatch(dict(rec, torch_cuda="12.8"), IDENTITY)
    assert "C++ ABI" in _buildplan.mismatch(dict(rec, cxx11_abi=not rec["cxx11_abi"]), IDENTITY)
    assert "no build record" in _buildplan.mismatch({}, IDENTITY)
    # a record from before the CUDA and ABI entries: its version alone decides
    assert _buildplan.mismatch({"torch": torch.__version__}, IDENTITY) is None


def test_the_sources_hash_changes_with_any_source_and_nothing_else(tmp_path):
    csrc = tmp_path / "csrc"
    (csrc / "cpu").mkdir(parents=True)
    (csrc / "ops.cpp").write_text("int a;\n")
    (csrc / "cpu" / "k.h").write_text("int b;\n")
    first = _buildplan.sources_hash(str(csrc))
    (csrc / "notes.txt").write_text("not a source")
    assert _buildplan.sources_hash(str(csrc)) == first
    (csrc / "cpu" / "k.h").write_text("int c;\n")
    assert _buildplan.sources_hash(str(csrc)) != first


def test_the_checkout_and_the_wheel_have_their_sources_found(tmp_path):
    assert _buildplan.source_dir(str(ROOT / "fastgrad")) == str(ROOT / "csrc")
    pkg = tmp_path / "site" / "fastgrad"
    (pkg / "_csrc").mkdir(parents=True)
    assert _buildplan.source_dir(str(pkg)) is None
    (tmp_path / "site" / "csrc").mkdir()
    (tmp_path / "site" / "csrc" / "ops.cpp").write_text("")
    assert _buildplan.source_dir(str(pkg)) is None  # a csrc/ beside site-packages/fastgrad is not ours
    (pkg / "_csrc" / "ops.cpp").write_text("")
    assert _buildplan.source_dir(str(pkg)) == str(pkg / "_csrc")


def test_the_cache_key_names_torch_abi_python_and_sources():
    t = _build.target(str(ROOT / "fastgrad"))
    assert t.key["torch"] == torch.__version__ and t.key["cxx11_abi"] == IDENTITY["cxx11_abi"]
    assert t.key["python"] == sys.implementation.cache_tag
    assert t.key["sources"] == _buildplan.sources_hash(str(ROOT / "csrc"))
    assert t.tag.startswith(f"torch{torch.__version__}".replace("+", "_"))
    assert t.files == 6 if not t.plan["with_cuda"] else t.files == 10


@needs_build
def test_this_checkouts_build_fits_its_torch():
    path, record, why = _ext.installed()
    assert why is None and path == SPEC.origin and record["torch"] == torch.__version__


# ----------------------------------------------------------------------------- ensure(), with a copied build
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(_build.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_compile(calls: list, delay: float = 0.0):
    """A compile that leaves what a real one leaves (this checkout's module, the log's success mark)."""
    def compile_into(t, folder, log_path, verbose=False):
        calls.append(folder)
        time.sleep(delay)
        shutil.copy2(SPEC.origin, os.path.join(folder, "_C.so"))
        Path(log_path).write_text(f"{_build.OK_MARK} 0.1\n")
        return 0.1
    return compile_into


@needs_build
def test_a_build_is_compiled_once_published_whole_and_found_again(cache, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(_build, "compile_into", _fake_compile(calls))
    t = _build.target(str(ROOT / "fastgrad"))
    assert _build.find(t) is None
    stale = cache / "ext" / f".{t.tag}.999999.tmp"  # what a killed build leaves
    (stale / "src").mkdir(parents=True)
    record = _build.ensure(t, "fastgrad._C is not built for this install")
    err = capsys.readouterr().err
    assert len(calls) == 1 and os.path.isfile(t.module)
    assert record["key"] == t.key and record["made_by"] == "first-use build" and record["torch"] == torch.__version__
    line = [ln for ln in err.splitlines() if "compiling fastgrad's C++ kernels" in ln]
    assert len(line) == 1 and line[0].startswith("fastgrad: fastgrad._C is not built for this install; compiling")
    assert "FASTGRAD_AUTO_BUILD=0 turns this off" in line[0] and f"torch {torch.__version__}" in line[0]
    assert f"compiled the C++ kernels in 0 s into {t.folder}" in err
    # nothing half-built is left beside it, and the next call finds it without compiling
    assert sorted(p.name for p in cache.joinpath("ext").iterdir()) == [t.tag, t.tag + ".lock"]
    assert _build.ensure(t, "x") == record and len(calls) == 1
    # forced: compiled again, replacing it
    _build.ensure(t, "x", force=True)
    assert len(calls) == 2 and _build.find(t) is not None


@needs_build
def test_another_torch_or_other_sources_is_another_build(cache, monkeypatch):
    monkeypatch.setattr(_build, "compile_into", _fake_compile([]))
    t = _build.target(str(ROOT / "fastgrad"))
    _build.ensure(t, "x")
    for key, value in (("torch", "2.12.0+cpu"), ("sources", "0" * 16)):
        other = _build.Target(csrc=t.csrc, plan=t.plan, key=dict(t.key, **{key: value}), tag=t.tag, root=t.root)
        assert _build.find(other) is None, key  # the folder is there, its record names another key


def test_a_failed_build_is_recorded_said_in_one_line_and_not_retried(cache, monkeypatch):
    calls = []

    def broken(t, folder, log_path, verbose=False):
        calls.append(folder)
        Path(log_path).write_text("fastgrad build [1/6 files, 1.0 s] c++ ...\nops.cpp:3:1: error: boom\nFAILED: x\n")
        raise _build.Unavailable(f"its build for this torch failed: {_build.first_error(Path(log_path).read_text())} "
                                 f"(log: {log_path})")

    monkeypatch.setattr(_build, "compile_into", broken)
    t = _build.target(str(ROOT / "fastgrad"))
    with pytest.raises(_build.Unavailable) as first:
        _build.ensure(t, "x")
    kept = str(cache / "ext" / (t.tag + ".failed.log"))
    assert str(first.value) == f"its build for this torch failed: ops.cpp:3:1: error: boom (log: {kept})"
    assert "\n" not in str(first.value) and os.path.isfile(kept)
    assert not any(p.name.endswith(".tmp") for p in (cache / "ext").iterdir())
    with pytest.raises(_build.Unavailable, match="failed .*error: boom.*python -m fastgrad.build tries again"):
        _build.ensure(t, "x")
    assert len(calls) == 1  # the recorded failure answers, no second compile
    with pytest.raises(_build.Unavailable):
        _build.ensure(t, "x", retry=True)
    assert len(calls) == 2


def test_what_is_missing_to_compile_is_named(cache, monkeypatch, tmp_path):
    t = _build.target(str(ROOT / "fastgrad"))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(_build.Unavailable, match=r"no C\+\+ compiler was found \(CXX=/nonexistent/g\+\+"):
        _build.ensure(t, "x")
    monkeypatch.delenv("CXX")
    with pytest.raises(_build.Unavailable, match="no C\\+\\+ sources"):
        _build.target(str(tmp_path))
    # a cache folder that cannot be written (under a file: no user, root included, can make it)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(_build.CACHE_ENV, str(blocker / "cache"))
    with pytest.raises(_build.Unavailable, match=f"the build cache {blocker}/cache/ext is not writable .*set "
                                                 f"{_build.CACHE_ENV} to a writable folder"):
        _build.ensure(_build.target(str(ROOT / "fastgrad")), "x")


def test_the_cache_folder_follows_its_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(_build.CACHE_ENV, str(tmp_path / "c"))
    assert _build.cache_root() == str(tmp_path / "c" / "ext")
    monkeypatch.delenv(_build.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert _build.cache_root() == str(tmp_path / "x" / "fastgrad" / "ext")


@needs_build
def test_threads_that_ask_together_compile_once(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(_build, "compile_into", _fake_compile(calls, delay=1.0))
    t = _build.target(str(ROOT / "fastgrad"))
    out = []
    threads = [threading.Thread(target=lambda: out.append(_build.ensure(t, "x"))) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(calls) == 1 and len(out) == 3 and all(r == out[0] for r in out)


_RACER = textwrap.dedent("""
    import json, os, shutil, sys, time
    from pathlib import Path
    from fastgrad import _build
    so, calls = sys.argv[1], sys.argv[2]

    def compile_into(t, folder, log_path, verbose=False):
        with open(calls, "a") as fh:
            fh.write(f"{os.getpid()}\\n")
        time.sleep(3)
        shutil.copy2(so, os.path.join(folder, "_C.so"))
        Path(log_path).write_text(_build.OK_MARK + " 3\\n")
        return 3.0

    _build.compile_into = compile_into
    t = _build.target(os.path.join(os.getcwd(), "fastgrad"))
    print(json.dumps(_build.ensure(t, "racing")["key"]))
""")


@needs_build
def test_processes_that_start_together_compile_once(cache):
    calls = cache.parent / "calls.txt"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, SPEC.origin, str(calls)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert len(calls.read_text().split()) == 1, calls.read_text()
    keys = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert keys[0] == keys[1]
    assert sum("waiting for another process that is compiling" in o[1] for o in outs) == 1, [o[1] for o in outs]


def test_broken_sources_fail_through_the_real_compiler_with_the_error_named(cache, tmp_path):
    """The real child process, torch's cpp_extension and ninja, on sources that stop at their first line."""
    pkg = tmp_path / "pkg"
    (pkg / "_csrc" / "cpu").mkdir(parents=True)
    (pkg / "_csrc" / "ops.cpp").write_text("#error fastgrad-test-broken-source\n")
    (pkg / "_csrc" / "host.cpp").write_text("int fastgrad_test_host;\n")
    t = _build.target(str(pkg))
    assert t.plan["cpu_sources"] == ["ops.cpp", "host.cpp"]
    with pytest.raises(_build.Unavailable) as exc:
        _build.ensure(t, "x")
    msg = str(exc.value)
    assert msg.startswith("its build for this torch failed: ") and "#error fastgrad-test-broken-source" in msg, msg
    log = cache / "ext" / (t.tag + ".failed.log")
    assert f"(log: {log})" in msg and "fastgrad-test-broken-source" in log.read_text()
    assert _build.failed(t)["log"] == str(log) and _build.find(t) is None


def test_first_error_picks_the_compiler_error():
    log = ("fastgrad build [1/6 files, 2.0 s] c++ -Werror=foo -c x.cpp\nIn file included from x.cpp:1:\n"
           "/src/ops.cpp:12:5: error: 'foo' was not declared in this scope\nFAILED: ops.o\nninja: build stopped\n")
    assert _build.first_error(log) == "/src/ops.cpp:12:5: error: 'foo' was not declared in this scope"
    assert _build.first_error("just one line\n") == "just one line"
    assert _build.first_error("") == "no output"


# -------------------------------------------------------------------- the loader, in fresh processes on a copy
def _copy(tmp_path: Path, recorded_torch: str | None) -> Path:
    """This checkout's package, csrc/ and setup.py in a fresh folder, its build record naming ``recorded_torch``
    (None: the module without its record)."""
    dest = tmp_path / "checkout"
    shutil.copytree(ROOT / "fastgrad", dest / "fastgrad",
                    ignore=shutil.ignore_patterns("__pycache__", "*.smoke.json", "_csrc"))
    shutil.copytree(ROOT / "csrc", dest / "csrc")
    shutil.copy2(ROOT / "setup.py", dest / "setup.py")
    info = dest / "fastgrad" / _buildplan.INFO_NAME
    if recorded_torch is None:
        info.unlink()
    else:
        info.write_text(json.dumps(dict(json.loads(info.read_text()), torch=recorded_torch)))
    return dest


_LOADER = textwrap.dedent("""
    import json, sys, warnings
    # an editable install's finder would hand out its own fastgrad._C for any package named fastgrad
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import torch
        import fastgrad
        from fastgrad import _ext, info
        ps = [torch.nn.Parameter(torch.randn(33)) for _ in range(3)]
        for p in ps:
            p.grad = torch.randn(33)
        fastgrad.clip_grad_norm_(ps, 1.0)
        text = info.render(info.collect())
    b = _ext.build_info()
    print(json.dumps({"warnings": [str(w.message) for w in caught if "fastgrad" in str(w.message)],
                      "available": fastgrad.available_backends(), "origin": b["origin"], "path": b["path"],
                      "loaded": "fastgrad._C" in sys.modules, "module": getattr(sys.modules.get("fastgrad._C"),
                      "__file__", None), "not_used": b["installed_not_used"], "info": text}))
""")


def _load_in_child(where: Path, cache_dir: Path, **env_extra) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=str(where), **{_build.CACHE_ENV: str(cache_dir)}, **env_extra)
    for var in ("FASTGRAD_NO_EXT_WARNING", "FASTGRAD_BACKEND", "FASTGRAD_EXT_SMOKE"):
        env.pop(var, None)
    res = subprocess.run([sys.executable, "-c", _LOADER], cwd=where.parent, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def _publish_copy(where: Path, cache_dir: Path) -> _build.Target:
    """What a first-use compile for the copy at ``where`` leaves in ``cache_dir`` (the module copied, not compiled)."""
    old = os.environ.get(_build.CACHE_ENV)
    os.environ[_build.CACHE_ENV] = str(cache_dir)
    try:
        t = _build.target(str(where / "fastgrad"))
    finally:
        if old is None:
            del os.environ[_build.CACHE_ENV]
        else:
            os.environ[_build.CACHE_ENV] = old
    os.makedirs(t.folder)
    shutil.copy2(SPEC.origin, t.module)
    (Path(t.folder) / _buildplan.INFO_NAME).write_text(json.dumps(dict(t.plan["record"], key=t.key, seconds=1.5,
                                                                       made_by="first-use build")))
    return t


@needs_build
def test_a_build_for_another_torch_is_never_loaded(tmp_path):
    where = _copy(tmp_path, "2.12.0+cpu")
    out, err = _load_in_child(where, tmp_path / "cache", FASTGRAD_AUTO_BUILD="0")
    assert out["loaded"] is False and out["origin"] is None  # never imported, not even to look at it
    assert "cpu" not in out["available"] and "torch" in out["available"]
    assert len(out["warnings"]) == 1, out["warnings"]
    assert (f"the installed fastgrad._C was built for torch 2.12.0+cpu, not the running torch {torch.__version__}; "
            f"python -m fastgrad.build builds it for torch {torch.__version__} (FASTGRAD_AUTO_BUILD=0") \
        in out["warnings"][0]
    assert "CPU tensors: torch (no C++ kernels: the installed fastgrad._C was built for torch 2.12.0+cpu" in out["info"]
    assert "compiling" not in err


@needs_build
def test_a_module_without_its_build_record_is_not_loaded(tmp_path):
    out, _ = _load_in_child(_copy(tmp_path, None), tmp_path / "cache", FASTGRAD_AUTO_BUILD="0")
    assert out["loaded"] is False and "cpu" not in out["available"]
    assert "the installed fastgrad._C has no build record naming the torch it was built for" in out["warnings"][0]


@needs_build
def test_the_cached_build_for_this_torch_is_loaded_instead(tmp_path):
    where = _copy(tmp_path, "2.12.0+cpu")
    t = _publish_copy(where, tmp_path / "cache")
    out, err = _load_in_child(where, tmp_path / "cache")
    assert out["warnings"] == [] and "cpu" in out["available"] and "compiling" not in err
    assert out["origin"] == "first-use build" and out["module"] == t.module == out["path"]
    assert out["not_used"] == f"the installed fastgrad._C was built for torch 2.12.0+cpu, not the running torch " \
                              f"{torch.__version__}"
    assert "CPU tensors: C++ kernels (compiled for this torch at first use, loaded from the build cache)" in out["info"]
    assert "first-use build took (s):  1.5" in out["info"] and "built from these sources:  True" in out["info"]
    # FASTGRAD_AUTO_BUILD=0 turns off compiling, not loading what is compiled already
    again, _ = _load_in_child(where, tmp_path / "cache", FASTGRAD_AUTO_BUILD="0")
    assert again["origin"] == "first-use build" and "cpu" in again["available"]


@needs_build
def test_a_failed_build_leaves_one_warning_and_the_other_backends(tmp_path):
    where = _copy(tmp_path, "2.12.0+cpu")
    out, err = _load_in_child(where, tmp_path / "cache", CXX="/nonexistent/g++")
    assert out["loaded"] is False and "cpu" not in out["available"] and "torch" in out["available"]
    assert len(out["warnings"]) == 1
    assert ("no build for torch " + torch.__version__ + " can be made: no C++ compiler was found") in out["warnings"][0]
    assert "FASTGRAD_NO_EXT_WARNING=1" in out["warnings"][0]


@needs_build
def test_python_m_fastgrad_build(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{_build.CACHE_ENV: str(tmp_path / "cache")})
    res = subprocess.run([sys.executable, "-m", "fastgrad.build"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"was built for this torch ({torch.__version__}): nothing to compile" in res.stdout
    assert "fastgrad uses C++ kernels from" in res.stdout and "(installed; smoke test passed)" in res.stdout
    # a copy built for another torch, its build already in the cache: found, and said where
    where = _copy(tmp_path, "2.12.0+cpu")
    t = _publish_copy(where, tmp_path / "cache")
    boot = ("import sys, runpy; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in "
            "getattr(f, '__module__', '')]; sys.argv[0] = 'fastgrad.build'; runpy.run_module('fastgrad.build', "
            "run_name='__main__')")
    env["PYTHONPATH"] = str(where)
    res = subprocess.run([sys.executable, "-c", boot, "--where"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == t.folder, res.stderr[-2000:]
    res = subprocess.run([sys.executable, "-c", boot], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"fastgrad uses C++ kernels from {t.module} (first-use build" in res.stdout
    assert f"{t.module} (in the cache already, compiled in 1.5 s)" in res.stdout and "compiling" not in res.stderr
    # nothing to build from and nothing built: exit 1 with the reason
    env["CXX"] = "/nonexistent/g++"
    env[_build.CACHE_ENV] = str(tmp_path / "other-cache")
    res = subprocess.run([sys.executable, "-c", boot], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 1 and "no C++ compiler was found" in res.stderr, res.stderr[-2000:]


_KILLED_PARENT = textwrap.dedent("""
    import os, sys
    from fastgrad import _build
    t = _build.target(sys.argv[1])
    os.makedirs(sys.argv[2])
    _build.compile_into(t, sys.argv[2], os.path.join(sys.argv[2], "build.log"))
""")


def _processes_naming(text: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(f"{pid}: {cmd[:200]}")
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_caller_leaves_no_compiler_running(tmp_path):
    """The caller is SIGKILLed while the compiler runs (a training job killed during its first use): the build
    child, ninja and the compiler end with it."""
    pkg = tmp_path / "pkg"
    (pkg / "_csrc" / "cpu").mkdir(parents=True)
    # torch's headers: tens of seconds of compiling, long enough to kill the caller in the middle
    (pkg / "_csrc" / "ops.cpp").write_text("#include <torch/extension.h>\\nint fastgrad_test_slow;\\n")
    (pkg / "_csrc" / "host.cpp").write_text("#include <torch/extension.h>\\nint fastgrad_test_slow2;\\n")
    folder = tmp_path / "build-here"
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{_build.CACHE_ENV: str(tmp_path / "cache")})
    caller = subprocess.Popen([sys.executable, "-c", _KILLED_PARENT, str(pkg), str(folder)], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not [p for p in _processes_naming(str(folder)) if "cc1plus" in p]:
            time.sleep(0.5)
        assert [p for p in _processes_naming(str(folder)) if "cc1plus" in p], "the compiler never started"
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _processes_naming(str(folder)):
        time.sleep(0.5)
    assert _processes_naming(str(folder)) == []
