"""docs/layout.md leads from every step-guard mode and every finding code to the files behind it, and cannot go
stale: the modes and codes are read from the code, not from the page.

* modes: ``fastgrad.guard.MODES``; the file that defines each is its mode class's module;
* finding codes: the codes of ``RUN_RULES`` (``fastgrad/diagnose/rules/registry.py``; "a/b/c" is three codes),
  defined by the module of the rule object, and every ``Finding("code", ...)`` written anywhere in
  ``fastgrad/diagnose/`` (the step rules, the trends, the monitor's own), defined by that file.

Each must appear, in backticks, in the first cell of a row of a table of docs/layout.md, and the rows that
name it must together name every file that defines it. Such a row also names a test file that mentions the
code (as a string) or mode, unless it says "no test asserts this finding yet" -- which is then checked to be
true, so the page is corrected when a test arrives. Every ``path::name`` on the page names a function, class or
constant that ``path`` defines (tests/test_readme.py checks the plain paths)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "layout.md"
DIAGNOSE = ROOT / "fastgrad" / "diagnose"
NO_TEST = "no test asserts this finding yet"

_TICKED = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^(?:fastgrad|tests|benchmarks|csrc)/[\w./-]+$")
_FINDING = re.compile(r"""Finding\(\s*["'](\w+)["']""")


def _rel(module_name: str) -> str:
    return str(Path(importlib.import_module(module_name).__file__).resolve().relative_to(ROOT))


def defined_codes() -> dict[str, set[str]]:
    """Each finding code -> the files (relative to the repository) that define it."""
    from fastgrad.diagnose.rules.registry import RUN_RULES

    out: dict[str, set[str]] = {}
    for rule in RUN_RULES:
        for code in rule.code.split("/"):
            out.setdefault(code, set()).add(_rel(type(rule).__module__))
    for f in sorted(DIAGNOSE.rglob("*.py")):
        for code in _FINDING.findall(f.read_text()):
            out.setdefault(code, set()).add(str(f.relative_to(ROOT)))
    return out


def defined_modes() -> dict[str, set[str]]:
    from fastgrad.guard import MODES
    from fastgrad.guard.options import MODE_CLASSES

    return {m: {_rel(MODE_CLASSES[m].__module__)} for m in MODES}


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the page's Markdown tables, as lists of cells."""
    rows = []
    for line in text.splitlines():
        s = line.strip()
        if not (s.startswith("|") and s.endswith("|")) or re.fullmatch(r"\|[\s|:-]+\|", s):
            continue
        rows.append([c.strip() for c in s[1:-1].split("|")])
    return rows


def _defines(path: Path, name: str) -> bool:
    return re.search(rf"^\s*(?:def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", path.read_text(),
                     re.M) is not None


def _mentions(path: Path, word: str) -> bool:
    return re.search(rf"""["']{re.escape(word)}["']""", path.read_text()) is not None


def layout_problems(text: str, names: dict[str, set[str]]) -> list[str]:
    """What the page gets wrong about ``names`` (name -> files that define it); empty when nothing."""
    problems = []
    rows = table_rows(text)
    for ticked in _TICKED.findall(text):
        path, sep, name = ticked.partition("::")
        if sep and _PATH.match(path):
            if not (ROOT / path).is_file():
                problems.append(f"`{ticked}`: no file {path}")
            elif not _defines(ROOT / path, name):
                problems.append(f"`{ticked}`: {path} defines no {name}")
    for name, files in sorted(names.items()):
        mine = [r for r in rows if f"`{name}`" in r[0]]
        if not mine:
            problems.append(f"`{name}` has no row (its first cell must name it in backticks)")
            continue
        named = {t.partition("::")[0] for r in mine for t in _TICKED.findall(" ".join(r))}
        missing = sorted(files - named)
        if missing:
            problems.append(f"`{name}`: its rows do not name {missing}, which define it")
        tests = sorted({p for p in named if p.startswith("tests/") and p.endswith(".py") and (ROOT / p).is_file()})
        said_none = any(NO_TEST in " ".join(r) for r in mine)
        mentioned = [p for p in tests if _mentions(ROOT / p, name)]
        all_tests = [p for p in sorted((ROOT / "tests").rglob("*.py")) if _mentions(p, name)]
        if said_none and all_tests:
            problems.append(f"`{name}`: the page says '{NO_TEST}' but {all_tests[0].relative_to(ROOT)} mentions it")
        elif not said_none and not mentioned:
            problems.append(f"`{name}`: its rows name no test file that mentions it (named: {tests})")
    return problems


def test_every_mode_and_finding_code_leads_to_its_files():
    names = {**defined_codes(), **defined_modes()}
    # the discovery itself: a broken import or regex would otherwise pass by finding nothing
    assert {"norm", "zclip", "autoclip", "adagc"} <= set(names)
    assert {"exploding", "loss_diverging", "zero_grads", "depth_vanishing", "clip_zeroes", "nonfinite",
            "guard_skipped", "clip_scaled", "spike", "last_step", "skipped_steps"} <= set(names)
    assert names["exploding"] == {"fastgrad/diagnose/rules/step.py", "fastgrad/diagnose/rules/exploding.py"}
    problems = layout_problems(LAYOUT.read_text(), names)
    assert not problems, "docs/layout.md is out of date:\n" + "\n".join(problems)


def test_the_layout_check_can_fail():
    text = LAYOUT.read_text()
    names = {**defined_codes(), **defined_modes()}
    assert not layout_problems(text, names)
    # a code the page does not know
    assert any("`brand_new` has no row" in p for p in layout_problems(text, {**names, "brand_new": {"x.py"}}))
    # a row that lost its logic file
    cut = text.replace("`fastgrad/guard/modes/zclip.py`", "`fastgrad/guard/core.py`")
    assert any(p.startswith("`zclip`: its rows do not name") for p in layout_problems(cut, names))
    # a reference that does not exist
    cut = text.replace("test_guard_modes.py::_zclip_ref", "test_guard_modes.py::_zclip_reference")
    assert any("defines no _zclip_reference" in p for p in layout_problems(cut, names))
    # a row whose test file never mentions the code
    cut = text.replace("`tests/test_check.py::test_clip_with_max_norm_zero_is_named`", "`tests/test_guard.py`")
    assert any(p.startswith("`clip_zeroes`: its rows name no test file") for p in layout_problems(cut, names))
    # "no test" that has become false
    assert any("mentions it" in p for p in layout_problems(
        "| `clip_zeroes` | `fastgrad/diagnose/rules/clip_zeroes.py` | " + NO_TEST + " |\n",
        {"clip_zeroes": {"fastgrad/diagnose/rules/clip_zeroes.py"}}))
