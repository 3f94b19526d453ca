"""The Makefile's environment fingerprint (ENV_ID, written into the install stamps): one torch and one fastgrad,
those the venv's Python imports, whatever the working directory holds. A `pip install .` in the clone leaves
fastgrad.egg-info there and swaps make's editable install for a plain one of the same source; neither may
change the fingerprint, or the next `make test` recompiles the extension (minutes).

Run against a throwaway venv (no pip, no torch: only the distributions' metadata the fingerprint reads), through
make itself, so the test reads the Makefile's own command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

_PRINT = "print-env-id:\n\t@echo '$(ENV_ID)'\n"


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    d = tmp_path_factory.mktemp("stamp")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d / "venv")], check=True)
    py = d / "venv" / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (d / "print.mk").write_text(_PRINT)
    return d, py, site


def _dist(site: Path, name: str, version: str, url: str | None = None, editable: bool = True) -> None:
    for old in site.glob(f"{name}-*.dist-info"):
        shutil.rmtree(old)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if url is not None:
        (info / "direct_url.json").write_text(json.dumps({"url": url, "dir_info": {"editable": True} if editable
                                                          else {}}))


def _env_id(venv, cwd: Path, **env) -> str:
    d, py, _ = venv
    out = subprocess.run(["make", "-s", "--no-print-directory", "-f", str(ROOT / "Makefile"), "-f",
                          str(d / "print.mk"), f"PYTHON={py}", "print-env-id"], cwd=cwd, check=True,
                         capture_output=True, text=True, env=os.environ | env).stdout.strip()
    assert len(out) == 40, out  # a sha1: the fingerprint ran
    return out


def test_the_fingerprint_is_the_venvs_fastgrad_not_the_working_directorys(venv, tmp_path):
    _, _, site = venv
    clone = tmp_path / "clone"
    _dist(site, "torch", "2.13.0")
    _dist(site, "fastgrad", "0.1.0", url=clone.as_uri())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    base = _env_id(venv, elsewhere)
    # the clone after `pip install .`: the build's leftover egg-info (another version, as a stale one would be)
    # and the package itself in the working directory, and on PYTHONPATH
    (clone / "fastgrad.egg-info").mkdir(parents=True)
    (clone / "fastgrad.egg-info" / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: fastgrad\nVersion: 0.0.9\n")
    (clone / "fastgrad").mkdir()
    (clone / "fastgrad" / "__init__.py").write_text("")
    assert _env_id(venv, clone) == base
    assert _env_id(venv, clone, PYTHONPATH=str(clone)) == base
    # the same clone installed by `pip install .` instead of editable: the same source, the same fingerprint
    _dist(site, "fastgrad", "0.1.0", url=clone.as_uri(), editable=False)
    assert _env_id(venv, clone) == base


@pytest.mark.parametrize("change", ["torch", "fastgrad version", "fastgrad source", "no fastgrad"])
def test_what_the_build_depends_on_changes_the_fingerprint(venv, tmp_path, change):
    _, _, site = venv
    _dist(site, "torch", "2.13.0")
    _dist(site, "fastgrad", "0.1.0", url="file:///src/fastgrad")
    base = _env_id(venv, tmp_path)
    if change == "torch":
        _dist(site, "torch", "2.12.0")
    elif change == "fastgrad version":
        _dist(site, "fastgrad", "0.2.0", url="file:///src/fastgrad")
    elif change == "fastgrad source":
        _dist(site, "fastgrad", "0.1.0", url="file:///another/clone")
    else:
        shutil.rmtree(next(site.glob("fastgrad-*.dist-info")))
    assert _env_id(venv, tmp_path) != base
