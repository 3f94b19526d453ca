"""The source distribution holds what a wheel build needs and nothing a user's install does not (MANIFEST.in):
the file list setuptools computes for the sdist, read from a throwaway egg-info. `make wheel-check` builds the
real sdist and a wheel from it (docs/install.md, "Building a wheel")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sdist_files(tmp_path: Path) -> set[str]:
    env = dict(os.environ, FASTGRAD_BUILD_EXT="0")  # the file list only: no extension plan, no torch import
    res = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return set((tmp_path / "fastgrad.egg-info" / "SOURCES.txt").read_text().split())


def test_the_sdist_has_every_build_input_and_no_tests(tmp_path):
    files = sdist_files(tmp_path)
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    assert {"csrc/cpu/kernels.h", "csrc/round_odd.h", "csrc/cuda/common.cuh"} <= sources
    assert not sources - files, f"csrc files the sdist lacks: {sorted(sources - files)}"
    package = {p.relative_to(ROOT).as_posix() for p in (ROOT / "fastgrad").rglob("*.py")}
    assert not package - files, f"package files the sdist lacks: {sorted(package - files)}"
    assert {"README.md", "pyproject.toml", "setup.py"} <= files
    leaked = sorted(f for f in files if f.startswith(("tests/", "benchmarks/", "build/")) or f.endswith((".so", ".o"))
                    or f.endswith(("_build_info.json", ".smoke.json")))
    assert not leaked, f"the sdist would ship: {leaked}"


def test_a_wheel_without_the_extension_carries_the_sources_to_build_it(tmp_path):
    """What an isolated build (plain `pip install .`, no torch) makes: a pure-Python wheel whose package holds
    every C++/CUDA source and header as fastgrad/_csrc, for the first-use build (fastgrad/_build.py)."""
    import zipfile

    env = dict(os.environ, FASTGRAD_BUILD_EXT="0")  # what the isolated build does: no torch, no compile
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path), str(ROOT)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = tmp_path.glob("fastgrad-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {"fastgrad/_csrc/" + p.relative_to(ROOT / "csrc").as_posix()
               for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    assert sources and not sources - names, f"sources the wheel lacks: {sorted(sources - names)}"
    assert not [n for n in names if n.endswith((".so", ".pyd", "_build_info.json"))]
