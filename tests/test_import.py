"""Start-up cost: `import fastgrad` and the command-line entry points must not import torch._dynamo (and through
it sympy and triton, seconds on a small machine) or triton before a call needs them. Each case runs in a fresh
interpreter, since this test process has imported both long ago. Timing itself: benchmarks/import_time.py."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HEAVY = ("torch._dynamo", "triton", "sympy", "matplotlib", "rich")
ROOT = Path(__file__).resolve().parents[1]


def _loaded_after(code: str, env: dict | None = None) -> list[str]:
    probe = code + f"\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("TRITON_INTERPRET", None)
    e.update(env or {})
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=e, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_baseline_torch_does_not_import_them():
    # the premise: if torch itself imported these, fastgrad could not do better
    assert _loaded_after("import torch") == []


def test_import_fastgrad_imports_no_dynamo_or_triton():
    assert _loaded_after("import fastgrad") == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the triton backend's availability imports triton")
def test_cpu_calls_and_cli_entry_points_import_no_dynamo_or_triton():
    code = """
import torch, fastgrad, fastgrad.check, fastgrad.info, fastgrad.diagnose.report
fastgrad.available_backends()
fastgrad.info.render(fastgrad.info.collect())
m = torch.nn.Linear(5, 3)
m(torch.randn(4, 5)).sum().backward()
fastgrad.clip_grad_norm_(m.parameters(), 1.0)
fastgrad.gradient_report(m).to_markdown()
"""
    assert _loaded_after(code) == []


def test_check_usage_error_and_help_import_no_dynamo():
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    for args in (["--help"], []):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "fastgrad.check", *args],
                             capture_output=True, text=True, env=e, timeout=300, cwd=ROOT)
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
        assert "torch._dynamo" not in imported and "triton" not in imported, (args, out.returncode)


def test_marked_constant_without_dynamo_matches_the_public_decorator():
    """fastgrad.backends marks backend availability constant for torch.compile without importing dynamo
    (backends._mark_constant sets what torch.compiler.assume_constant_result sets). If a torch changes what
    the public decorator does, this fails and _mark_constant must follow."""
    from fastgrad import backends

    def f():
        return None

    before = dict(vars(f))
    public = getattr(torch.compiler, "assume_constant_result", None)
    if public is None:
        pytest.skip("this torch has no torch.compiler.assume_constant_result")
    assert public(f) is f
    added = {k: v for k, v in vars(f).items() if k not in before}
    assert added == {"_dynamo_marked_constant": True}
    assert getattr(backends._unavailable, "_dynamo_marked_constant", False) is True


def _info(cuda: bool) -> dict:
    from fastgrad import info

    data = info.collect()
    data["cuda_available"] = cuda
    return data


def test_info_shows_the_per_op_cuda_order_only_where_cuda_is():
    from fastgrad import backends, info

    text = info.render(_info(False))
    assert "MEASURED_ORDER" in text and "on CUDA machines" in text  # one labelled line
    assert not any(line.lstrip().startswith("cuda tensors, per op") for line in text.splitlines())
    assert not any("lists of" in line for line in text.splitlines())
    text = info.render(_info(True))
    per_op = [line for line in text.splitlines() if line.lstrip().startswith("cuda tensors, per op")]
    assert len(per_op) == 1 and all(op in per_op[0] for op in backends.MEASURED_ORDER["cuda"])
    assert "on CUDA machines" not in text


def test_info_triton_version_without_importing_it_on_cpu():
    from fastgrad import info

    line = info._triton_version(False)
    if importlib.util.find_spec("triton") is None:
        assert line == "not installed"
    else:
        assert importlib.metadata.version("triton") in line and "not imported" in line
        imported = info._triton_version(True)
        assert imported == importlib.metadata.version("triton") or imported.startswith("not importable")
