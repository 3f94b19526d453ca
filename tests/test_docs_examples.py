"""Every ```python block of README.md and docs/*.md runs (new pages under docs/ are picked up automatically).

Conventions for documentation authors:

* A block may be a fragment of a training loop. Each block runs in a fresh namespace that already holds the
  usual names, defined by PRELUDE below: ``torch``, ``fastgrad``, ``contextlib``, a small CPU ``model``,
  ``optimizer`` (SGD), ``scaler`` (``torch.amp.GradScaler("cpu")``, after one scaled backward, so the
  gradients exist), ``loader`` (three ``(x, y)`` batches), ``x``, ``y``, ``criterion`` / ``loss_fn`` (MSE),
  ``loss`` (computed, not yet backpropagated), ``recent_losses``, ``max_norm``, ``scheduler``, ``writer``
  (a CSV path). A block that defines these itself simply overwrites them. The block runs in a temporary
  directory, so files it writes go nowhere.
* A block that cannot run on a CPU-only machine says so, visibly, in a comment line at its top:
  ``# needs: cuda``                 runs only where a CUDA GPU is visible;
  ``# needs: processes (...)``      several processes (torchrun, DDP): never run by this test;
  ``# needs: pip install NAME ...`` skipped unless every NAME is importable (shown to readers as the command
  that installs the extra dependency).
  Several ``# needs:`` lines may follow each other.
* Only blocks fenced as ```python run; ```bash, ```text and others are not Python.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

PRELUDE = '''
import contextlib
import torch
import fastgrad

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
criterion = loss_fn = torch.nn.MSELoss()
loader = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(3)]
x, y = loader[0]
scaler = torch.amp.GradScaler("cpu")
scaler.scale(criterion(model(x), y)).backward()
loss = criterion(model(x), y)
recent_losses = [1.0, 0.9, 0.8]
max_norm = 1.0
writer = "grad_health.csv"
'''

# a fence of three or more backticks, closed by the same run (so ````text may quote a ```python block)
_FENCE = re.compile(r"^(`{3,})(\w*)[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)
_NEEDS = re.compile(r"^#\s*needs:\s*(.+)$")


def _blocks():
    for path in DOCS:
        text = path.read_text()
        for m in _FENCE.finditer(text):
            if m.group(2) not in ("python", "py"):
                continue
            line = text[: m.start()].count("\n") + 1
            yield pytest.param(m.group(3), id=f"{path.relative_to(ROOT)}:{line}")


def _needs(code: str) -> list[str]:
    out = []
    for line in code.splitlines():
        m = _NEEDS.match(line.strip())
        if m:
            out.append(m.group(1).strip())
        elif line.strip() and not line.strip().startswith("#"):
            break
    return out


def _skip_reason(needs: list[str]) -> str | None:
    import importlib.util

    for need in needs:
        if need.startswith("cuda"):
            if not torch.cuda.is_available():
                return "needs a CUDA GPU"
        elif need.startswith("processes"):
            return "needs several processes"
        elif need.startswith("pip install"):
            for name in need.split()[2:]:
                name = name.split("[")[0].strip(",")
                if importlib.util.find_spec(name.replace("-", "_")) is None:
                    return f"needs {name} ({need})"
        else:
            raise AssertionError(f"unknown '# needs:' marker {need!r} (see tests/test_docs_examples.py)")
    return None


def test_docs_have_python_examples():
    # guards the extraction itself: a broken fence regex would otherwise skip everything quietly
    assert len(list(_blocks())) >= 10


@pytest.mark.parametrize("code", list(_blocks()))
def test_example_runs(code, tmp_path, monkeypatch):
    why = _skip_reason(_needs(code))
    if why:
        pytest.skip(why)
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__docs_example__"}
    exec(compile(PRELUDE, "<prelude>", "exec"), ns)
    fastgrad = ns["fastgrad"]
    try:
        exec(compile(code, "<docs example>", "exec"), ns)
    finally:
        fastgrad.unpatch_torch()  # a block that patches torch must not leak into the next test
