"""docs/guard-paths.md's table "Where the guard works, and what a skip does" stays true: its fused row names the
torch optimizers the guard hands its flag to as ``found_inf``, its non-fused row the families that
tests/test_guard_optimizers.py pins one by one, and every test it cites exists; and docs/guard-reference.md's
Modes table gives every mode with the defaults its declaration has."""

from __future__ import annotations

import ast
import pathlib
import re

import torch

from fastgrad.guard.skip import is_fused

from .test_guard_optimizers import CASES

ROOT = pathlib.Path(__file__).resolve().parent.parent
TITLE = "## Where the guard works, and what a skip does"


def _rows() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "guard-paths.md").read_text()
    assert TITLE in text
    section = text.split(TITLE, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| where") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows[cells[0]] = cells
    return rows


def _names(cell: str) -> set[str]:
    return {n for n in re.findall(r"`(\w+)`", cell) if n[0].isupper()}


def test_the_fused_row_is_every_optimizer_the_guard_treats_as_fused():
    fused = set()
    p = torch.nn.Parameter(torch.zeros(2))
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        try:
            opt = cls([p], fused=True)
        except (TypeError, ValueError, RuntimeError):
            continue
        if is_fused(opt):
            fused.add(name)
    assert fused and _names(_rows()["plain loop, fused"][1]) == fused


def test_the_non_fused_row_is_every_family_tested_one_by_one():
    tested = {type(make([torch.nn.Parameter(torch.zeros(2, 2))])).__name__
              for make, fused in CASES.values() if not fused}
    assert _names(_rows()["plain loop, not fused"][1]) == tested


def test_every_cited_test_exists():
    cited = [c for cells in _rows().values() for c in re.findall(r"`(test_\w+\.py)::(\w+)`", cells[-1])]
    assert len(cited) >= 10
    for file, name in cited:
        tree = ast.parse((ROOT / "tests" / file).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in defined, (file, name)
    assert all(cells[-1] for cells in _rows().values())


def _mode_rows() -> dict[str, str]:
    """docs/guard-reference.md's Modes table: mode -> its defaults cell."""
    text = (ROOT / "docs" / "guard-reference.md").read_text()
    section = text.split("\n## Modes\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r'\| `"([\w-]+)"` \|', line)
        if m:
            rows[m.group(1)] = line.strip().strip("|").split(" | ")[-1]
    return rows


def test_the_modes_table_has_every_mode_with_its_declared_defaults():
    """Each mode has a row whose defaults are its declaration's (options, and max_norm's default)."""
    from fastgrad.guard.modes import MODE_CLASSES

    rows = _mode_rows()
    assert set(rows) == set(MODE_CLASSES)
    for name, cls in MODE_CLASSES.items():
        documented = {k: float(v) for k, v in re.findall(r"`(\w+)=([-\d.e]+)`", rows[name])}
        declared = {o.name: float(o.default) for o in cls.OPTIONS}
        if cls.max_norm_default is not None:
            declared["max_norm"] = cls.max_norm_default
        assert documented == declared, name
