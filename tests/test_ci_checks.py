"""What a CI run (CI=true) enforces, from tests/conftest.py: a backend the machine can run but cannot use stops
the run with its name, every test has a time limit, and the skips are the ones docs/testing.md lists."""

from __future__ import annotations

import collections
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import conftest

ROOT = Path(__file__).resolve().parent.parent


def test_a_required_backend_that_did_not_run_is_named_with_its_reason():
    need = {"cpu": "a C++ compiler is here", "triton": "triton is installed"}
    assert conftest.missing_backends([("torch", "cpu"), ("cpu", "cpu"), ("triton", "cpu")], need) == []
    out = conftest.missing_backends([("torch", "cpu"), ("triton", "cpu")], need)
    assert len(out) == 1 and out[0].startswith("the cpu backend: a C++ compiler is here, but it is unusable: "), out


def test_skips_are_matched_by_reason_and_counted_for_the_whole_suite():
    documented = {"needs a CUDA device": 2, "torch ...'s fused ... does not take a grad_scale": 1}
    seen = collections.Counter({"needs a CUDA device": 2, "torch 2.9's fused Adam does not take a grad_scale": 1})
    assert conftest.skip_mismatches(seen, documented, whole_suite=True) == []
    seen["needs a CUDA device"] += 1
    assert conftest.skip_mismatches(seen, documented, whole_suite=False) == []  # a part of the suite: reasons only
    assert conftest.skip_mismatches(seen, documented, whole_suite=True) == [
        "`needs a CUDA device`: docs/testing.md says 2 skipped, this run skipped 3"]
    seen["needs a GPU"] = 1
    assert conftest.skip_mismatches(seen, documented, whole_suite=False) == [
        "1 skipped, reason not in docs/testing.md's list: 'needs a GPU'"]


def test_skips_are_counted_per_tier():
    text = ("\n## Skips\n\n| skipped | reason | why |\n|---|---|---|\n| 5 (2 slow) | `needs a CUDA device` | x |\n"
            "| 3 | `needs CUDA` | y |\n\n## Next\n")
    assert conftest.documented_skips(text) == {"needs a CUDA device": 5, "needs CUDA": 3}
    assert conftest.documented_skips(text, "fast") == {"needs a CUDA device": 3, "needs CUDA": 3}
    assert conftest.documented_skips(text, "slow") == {"needs a CUDA device": 2, "needs CUDA": 0}
    # the two tiers together are the whole suite; a skip in the wrong tier is a mismatch
    seen = collections.Counter({"needs a CUDA device": 2})
    assert conftest.skip_mismatches(seen, conftest.documented_skips(text, "slow"), whole_suite=True) == []
    assert conftest.skip_mismatches(seen, conftest.documented_skips(text, "fast"), whole_suite=True) != []
    assert conftest.TIERS == {"": "all", "not slow": "fast", "slow": "slow"}


def test_the_slow_tier_names_existing_tests():
    """A renamed test would silently leave the slow tier (and lengthen `make test`)."""
    for entry in conftest.SLOW_TESTS:
        path, func = entry.split("::")
        assert f"def {func}(" in (ROOT / path).read_text(), entry


def test_the_documented_skip_list_parses():
    documented = conftest.documented_skips((ROOT / "docs" / "testing.md").read_text())
    assert documented and all(n > 0 for n in documented.values()), documented


def test_the_documented_skip_total_is_the_tables_sum():
    """The page's "N in all" (it once said 97 under rows adding up to 100); the rows themselves are checked
    against a whole CI run by the skip check."""
    import re

    text = (ROOT / "docs" / "testing.md").read_text()
    section = text.split("\n## Skips", 1)[1].split("\n## ", 1)[0]
    totals = [int(n) for n in re.findall(r"^(\d+) in all\b", section, re.M)]
    assert totals == [sum(conftest.documented_skips(text).values())], totals


_TESTS = textwrap.dedent("""
    import pytest

    def test_passes():
        pass

    def test_documented_skip():
        pytest.skip("needs a CUDA device")

    def test_undocumented_skip():
        pytest.skip("an undocumented reason")
""")


def _checkout_copy(tmp_path: Path, with_extension: bool) -> Path:
    """The package, the harness and the docs' skip list in a fresh folder, with or without the built extension."""
    dest = tmp_path / ("with" if with_extension else "without")
    # the module keeps its build record: one without it is never loaded (fastgrad/_ext.py)
    ignore = shutil.ignore_patterns("__pycache__", "*.smoke.json",
                                    *(() if with_extension else ("_C*.so", "_build_info.json")))
    shutil.copytree(ROOT / "fastgrad", dest / "fastgrad", ignore=ignore)
    (dest / "tests").mkdir()
    for name in ("__init__.py", "conftest.py"):
        shutil.copy2(ROOT / "tests" / name, dest / "tests" / name)
    (dest / "tests" / "test_probe.py").write_text(_TESTS)
    (dest / "docs").mkdir()
    shutil.copy2(ROOT / "docs" / "testing.md", dest / "docs" / "testing.md")
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _pytest(where: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CI="true", CXX=os.environ.get("CXX") or "c++",
               PYTHONPATH=os.pathsep.join([str(where)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               FASTGRAD_NO_EXT_WARNING="1")
    env.pop("FASTGRAD_BACKEND", None)
    # An editable install of fastgrad finds its own fastgrad._C for any package named fastgrad: its finder is
    # dropped, so the copy has exactly the files it was given.
    boot = ("import sys, pytest; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in "
            "getattr(f, '__module__', '')]; sys.exit(pytest.main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", boot, "-p", "no:cacheprovider", *args],
                          cwd=where, env=env, capture_output=True, text=True, timeout=600)


def test_ci_run_without_the_extension_stops_naming_the_cpu_backend(tmp_path):
    res = _pytest(_checkout_copy(tmp_path, with_extension=False), "tests/test_probe.py")
    out = res.stdout + res.stderr
    assert res.returncode == 4 and "CI=true: a backend this machine can run is missing" in out, out[-3000:]
    assert "the cpu backend: a C++ compiler is here" in out, out[-3000:]


def test_ci_run_with_the_extension_checks_time_limits_and_skips(tmp_path):
    from fastgrad import _ext

    assert _ext.load() is not None, "fastgrad._C is not built in this checkout (make test builds it)"
    where = _checkout_copy(tmp_path, with_extension=True)
    res = _pytest(where, "tests/test_probe.py", "-k", "passes or documented_skip and not undocumented")
    out = res.stdout + res.stderr
    if importlib.util.find_spec("pytest_timeout") is None:
        assert res.returncode == 4 and "pytest-timeout is not installed" in out, out[-3000:]
        return
    assert res.returncode == 0 and "1 passed, 1 skipped" in out, out[-3000:]
    assert "fastgrad backends under test: cpu (cpu)" in out and "timeout: 900.0s" in out, out[-3000:]
    res = _pytest(where, "tests/test_probe.py")
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "reason not in docs/testing.md's list: 'an undocumented reason'" in out, \
        out[-3000:]
    assert out.count("reason not in docs/testing.md's list") == 1, out[-3000:]  # the documented one passes
