"""Every Python example of README.md and docs/ runs as written.

Pages: README.md and every ``docs/**/*.md`` (a page added later is found by the glob). Fenced blocks, by the
fence's info string:

* ```python (or ``py``): a complete example. It runs as written, as ``__main__`` in a fresh namespace where
  nothing is defined beforehand, in a temporary directory (files it writes go nowhere), on the CPU: it imports
  what it uses and builds its own tiny model. A block that needs more than that says so in ``# needs:`` lines
  at its top, which readers see too:
    ``# needs: cuda``                  run where a CUDA GPU is visible (the GPU machine's suite); here it is only
                                       compiled, and the test is reported as skipped with that reason
    ``# needs: torchrun N``            saved as a script and run as N processes by ``torch.distributed.run``
                                       (the script picks gloo on the CPU, as the example shows)
    ``# needs: pip install NAME ...``  run when every NAME imports; skipped here, saying so, otherwise
  Any other ``# needs:`` value fails the test (no silent way out).
* ```python fragment: an excerpt shown for reading, never run alone. Its code lines (comments and blank lines
  aside; a ``...`` line marks an elision) must appear, in order, in one complete example of the same page,
  so a fragment cannot drift away from code that runs. Each fragment is its own test, named by page and line
  (``test_fragment_quotes_a_complete_example[docs/PAGE.md:LINE]``), so ``pytest -v`` lists every block read
  as a fragment, as it lists every example run (``test_example_runs[...]``).
* A fence inside a longer fence is that block's content, as CommonMark reads it: the ```python ``Code to
  Add`` of a report quoted in a ````text block is output shown, neither run nor checked.
* Any other info string (bash, text, console, ...): not Python. A fence without one fails: say what it is.

A ``# prints: TEXT`` comment in a complete example is a promise about its output: the test fails unless what
the example printed holds TEXT (several, in the order written), so a comment cannot promise output the
example does not print.
"""

from __future__ import annotations

import io
import linecache
import os
import re
import signal
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))

# An opening fence of three or more backticks (up to three spaces of indentation) and its info string, closed
# by a run of at least as many backticks (so ````text may quote a ```python block, as CommonMark reads it).
_OPEN = re.compile(r"^ {0,3}(`{3,})[ \t]*([^`\n]*)$")
_NEEDS = re.compile(r"^#\s*needs:\s*(.+)$")
TORCHRUN_LIMIT_S = 300


class Block:
    def __init__(self, page: Path, line: int, info: str, code: str):
        self.page, self.line, self.info, self.code = page, line, info, code
        words = info.split()
        self.lang = words[0].lower() if words else ""
        self.flags = [w.lower() for w in words[1:]]

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def is_python(self) -> bool:
        return self.lang in ("python", "py")

    @property
    def is_fragment(self) -> bool:
        return self.is_python and "fragment" in self.flags


def parse_blocks(text: str, page: Path = ROOT / "README.md") -> list[Block]:
    """The top-level fenced blocks of a Markdown page (fences quoted inside a longer fence are content)."""
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        ticks, info = m.group(1), m.group(2).strip()
        close = re.compile(r"^ {0,3}`{%d,}[ \t]*$" % len(ticks))
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            raise AssertionError(f"{page.relative_to(ROOT)}:{i + 1}: fence {ticks}{info} is never closed")
        out.append(Block(page, i + 1, info, "\n".join(lines[i + 1 : j]) + "\n"))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in parse_blocks(page.read_text(), page)]


def needs(code: str) -> list[str]:
    """The ``# needs:`` values of the comment lines that open a block."""
    out = []
    for line in code.splitlines():
        s = line.strip()
        m = _NEEDS.match(s)
        if m:
            out.append(m.group(1).strip())
        elif s and not s.startswith("#"):
            break
    return out


def plan(code: str) -> tuple[str, str | int | None]:
    """('run', None) | ('skip', why) | ('torchrun', nprocs), from the block's ``# needs:`` lines."""
    import importlib.util

    nprocs = None
    for need in needs(code):
        words = need.split()
        if words[0] == "cuda":
            if not torch.cuda.is_available():
                return "skip", "needs a CUDA GPU (runs in the GPU machine's suite)"
        elif words[0] == "torchrun" and len(words) == 2 and words[1].isdigit():
            nprocs = int(words[1])
        elif words[:2] == ["pip", "install"] and len(words) > 2:
            for name in words[2:]:
                mod = name.split("[")[0].split("=")[0].split(">")[0].strip(",").replace("-", "_")
                if importlib.util.find_spec(mod) is None:
                    return "skip", f"needs {mod} ({need})"
        else:
            raise AssertionError(f"unknown '# needs: {need}' (tests/test_docs_examples.py lists the markers)")
    return ("torchrun", nprocs) if nprocs else ("run", None)


def code_lines(code: str) -> list[str]:
    """The block's logical content line by line, comments, blank lines and indentation dropped."""
    rows: dict[int, list[str]] = {}
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(code)).readline):
        if tok.type not in skip:
            rows.setdefault(tok.start[0], []).append(tok.string)
    return [" ".join(toks) for _, toks in sorted(rows.items())]


def is_subsequence(part: list[str], whole: list[str]) -> bool:
    it = iter(whole)
    return all(any(line == w for w in it) for line in part)


BLOCKS = all_blocks()
PYTHON = [b for b in BLOCKS if b.is_python and not b.is_fragment]
FRAGMENTS = [b for b in BLOCKS if b.is_fragment]


def test_the_pages_and_their_examples_are_found():
    # guards the discovery itself: a broken glob or fence parser would otherwise pass by running nothing
    assert (ROOT / "README.md") in PAGES and len(PAGES) >= 5
    assert len(PYTHON) >= 15
    assert any(b.page.name == "README.md" for b in PYTHON)


def test_every_fence_says_what_it_holds():
    bare = [b.id for b in BLOCKS if not b.lang]
    assert not bare, f"fences without an info string (```python, ```python fragment, ```bash, ```text): {bare}"
    odd = [f"{b.id} ({b.info})" for b in BLOCKS if b.is_python and b.flags and b.flags != ["fragment"]]
    assert not odd, f"python fences take one flag, 'fragment': {odd}"


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_example_runs(block, tmp_path, monkeypatch, capsys):
    # compiled everywhere, so a block that only a GPU or several processes run still has to be Python;
    # its source is registered with linecache so a traceback shows the page's lines
    linecache.cache[block.id] = (len(block.code), None, block.code.splitlines(True), block.id)
    code = compile(block.code, block.id, "exec")
    how, arg = plan(block.code)
    if how == "skip":
        pytest.skip(str(arg))
    if how == "torchrun":
        _torchrun(block, int(arg), tmp_path)
        return
    monkeypatch.chdir(tmp_path)
    run_as_main(code)
    problem = printed_problem(block.code, capsys.readouterr().out)
    assert problem is None, f"{block.id}: {problem}"


_PRINTS = re.compile(r"#\s*prints:\s*(.+?)\s*$")


def printed_problem(code: str, out: str) -> str | None:
    """A ``# prints: TEXT`` comment promises that the example's output holds TEXT; several are found in the
    order written. None when every promise is kept, else which one is not."""
    at = 0
    for line in code.splitlines():
        m = _PRINTS.search(line)
        if m is None:
            continue
        i = out.find(m.group(1), at)
        if i < 0:
            return f"'# prints: {m.group(1)}' is not what it printed:\n{out}"
        at = i + len(m.group(1))
    return None


def run_as_main(code) -> dict:
    """Runs ``code`` as a script would run: ``__main__``, in an empty namespace."""
    import fastgrad

    ns: dict = {"__name__": "__main__"}
    try:
        exec(code, ns)
    except NameError as exc:
        if hasattr(exc, "add_note"):
            exc.add_note("an example runs as written, with nothing defined beforehand: import and build what it "
                         "uses (a tiny model), or fence an excerpt as ```python fragment (tests/test_docs_examples.py)")
        raise
    finally:  # what a block may change process-wide must not reach the next one
        fastgrad.unpatch_torch()
        fastgrad.set_backend(None)
    return ns


#: printed by every rank once the example's own last line has run (appended by ``_torchrun``)
_DONE = "__example_done__"
#: gloo's teardown can abort a process at exit, under load, after the example has finished on every rank (the
#: same script passes alone, and plain gloo scripts show it too): not the example's failure, rerun once
_TEARDOWN_ABORT = "terminate called without an active exception"


def _torchrun(block: Block, nprocs: int, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.code + f"\nprint({_DONE!r}, flush=True)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}", str(script)]
    for attempt in (1, 2):
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=TORCHRUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: a hung collective must not hang the suite
            out, _ = proc.communicate()
            pytest.fail(f"{block.id}: {nprocs} processes did not finish in {TORCHRUN_LIMIT_S} s\n{out[-4000:]}")
        finished = out.count(_DONE) == nprocs
        if proc.returncode == 0 or attempt == 2 or not (finished and _TEARDOWN_ABORT in out):
            break
    assert proc.returncode == 0, f"{block.id}: torchrun exited with {proc.returncode}\n{out[-4000:]}"
    assert finished, f"{block.id}: {out.count(_DONE)} of {nprocs} ranks reached the example's end\n{out[-4000:]}"


def fragment_problem(block: Block) -> str | None:
    """Why a ```python fragment is not an excerpt of a complete example of its page (None: it is)."""
    try:
        part = [line for line in code_lines(block.code) if line != "..."]
    except (tokenize.TokenError, IndentationError, SyntaxError) as exc:
        return f"{block.id}: a python fragment must still be Python: {exc}"
    if not part:
        return f"{block.id}: empty fragment"
    whole = [code_lines(b.code) for b in PYTHON if b.page == block.page]
    if not any(is_subsequence(part, w) for w in whole):
        return (f"{block.id}: these lines do not appear, in this order, in any complete ```python example of "
                f"{block.page.relative_to(ROOT)}:\n" + "\n".join(part))
    return None


@pytest.mark.parametrize("block", FRAGMENTS, ids=lambda b: b.id)
def test_fragment_quotes_a_complete_example(block):
    problem = fragment_problem(block)
    assert problem is None, problem


# The checks above must be able to fail: each is run once on a made-up page that breaks it.

def test_the_checks_catch_what_they_are_for(tmp_path):
    page = textwrap.dedent('''
        ```python
        import torch
        x = torch.ones(3)
        ```

        ````text
        ```python
        this is quoted output, not an example
        ```
        ````

        ```python fragment
        x = torch.ones(3)   # a comment that differs
        ...
        ```

        ```python fragment
        y = torch.zeros(3)
        ```

        ```
        no info string
        ```
        ''')
    blocks = parse_blocks(page, ROOT / "README.md")
    assert [(b.lang, b.flags) for b in blocks] == [
        ("python", []), ("text", []), ("python", ["fragment"]), ("python", ["fragment"]), ("", [])]
    whole = code_lines(blocks[0].code)
    assert is_subsequence([s for s in code_lines(blocks[2].code) if s != "..."], whole)
    assert not is_subsequence(code_lines(blocks[3].code), whole)
    # nothing is defined for an example: one that leans on names from elsewhere fails, as does one that raises
    with pytest.raises(NameError, match="optimizer"):
        run_as_main("import torch\noptimizer.step()\n")
    with pytest.raises(ValueError):
        run_as_main("import fastgrad, torch\nfastgrad.clip_grad_norm_([torch.ones(1, requires_grad=True)], float('nan'))\n")
    assert run_as_main("if __name__ == '__main__':\n    ran = True\n")["ran"]
    assert plan("# needs: cuda\nimport torch\n")[0] == ("run" if torch.cuda.is_available() else "skip")
    assert plan("# needs: torchrun 2\nimport torch\n") == ("torchrun", 2)
    assert plan("# needs: pip install no-such-package-xyz\n")[0] == "skip"
    with pytest.raises(AssertionError, match="unknown"):
        plan("# needs: processes\n")
    # a printed-output comment is compared with what the example printed, in order
    assert printed_problem("print(1)  # prints: [1]\nprint(2)  # prints: 2\n", "[1]\n2\n") is None
    assert "is not what it printed" in printed_problem("print(x)  # prints: output\n", "input\n")
    assert printed_problem("a  # prints: 2\nb  # prints: 1\n", "1\n2\n") is not None
    with pytest.raises(AssertionError, match="never closed"):
        parse_blocks("```python\nx = 1\n", ROOT / "README.md")
