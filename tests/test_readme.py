"""README.md stays a short front door whose quick start is what the Makefile and CI do, and every relative link
of README.md and docs/ leads somewhere (docs/testing.md, "The examples of the documentation")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_docs_examples import PAGES, ROOT, parse_blocks

README = ROOT / "README.md"
MAX_LINES = 150

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _unfenced(text: str) -> str:
    """The page with its fenced blocks blanked out (a '# ...' line there is not a heading)."""
    lines = text.split("\n")
    for b in parse_blocks(text):
        n = b.code.count("\n")
        for i in range(b.line - 1, b.line + n + 1):
            lines[i] = ""
    return "\n".join(lines)


def _prose(text: str) -> str:
    """The page without its fenced blocks and inline code, where a [x](y) is not a link."""
    return re.sub(r"`[^`\n]*`", "", _unfenced(text))


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    h = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return h.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _unfenced(page.read_text()).split("\n"):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text())) if not re.match(r"^[a-z]+:", t)]


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines: move detail to docs/ (the README links every page)"


def test_quick_start_is_what_make_and_ci_run():
    blocks = [b for b in parse_blocks(README.read_text(), README) if b.lang == "bash"]
    quick = blocks[0].code
    assert "python3 -m venv .venv && . .venv/bin/activate" in quick
    assert re.search(r"^make bench\b", quick, re.M) and re.search(r"^make test\b", quick, re.M)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test:", makefile, re.M) and re.search(r"^bench:", makefile, re.M)
    assert re.search(r"^\$\(PYTHON\) -m pytest -q tests$", makefile.replace("\t", ""), re.M)
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert "make test" in ci, ".ci/run must run the README's test command"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.split("#")[0]).resolve() for t in links(README)}
    missing = [str(p.relative_to(ROOT)) for p in PAGES if p != README and p.resolve() not in linked]
    assert not missing, f"docs pages the README's table does not list: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no such heading)")
    assert not bad, f"{page.relative_to(ROOT)}: broken links: {bad}"


def test_link_checks_can_fail(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A title, with `code` + more\n\n[ok](#a-title-with-code--more) [bad](nowhere.md) "
                    "`[not](a-link.md)` [web](https://example.org)\n\n```text\n[no](link.md)\n```\n")
    assert anchors(page) == {"a-title-with-code--more"}
    assert links(page) == ["#a-title-with-code--more", "nowhere.md"]


def test_layout_paths_exist():
    # docs/layout.md and the README's Layout section lead from a name to files: each path they give must exist
    readme = README.read_text()
    text = (ROOT / "docs" / "layout.md").read_text() + readme[readme.index("## Layout"):]
    paths = set(re.findall(r"`((?:fastgrad|csrc|tests|benchmarks)/[\w./-]*)`", text))
    # the tables' shorthand: kernels by file name, tests and benchmark scripts beside the first one named
    paths |= {"fastgrad/" + p for p in re.findall(r"`(triton_kernels/\w+\.py)`", text)}
    paths |= {"csrc/cuda/" + p for p in re.findall(r"`(\w+\.cu)`", text)}
    paths |= {"tests/" + p for p in re.findall(r"`(test_\w+\.py)`", text)}
    paths |= {"benchmarks/" + p for p in re.findall(r"`(bench_\w+\.py)`", text)}
    assert len(paths) >= 40
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"paths named in docs/layout.md or the README's Layout that do not exist: {missing}"
