"""Every call that may start the first-use build is named in docs/install.md ("The first-use build"), and
`import fastgrad` is not one of them. One child process, with no installed extension and an empty cache as far as
the loader can tell, and the compile itself replaced by a recorder: each entry point is called on a fresh loader,
and whether it asked for the build is read back. (That the build announces itself before compiling, whoever
asked: tests/test_first_use_build.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "docs" / "install.md"

# entry point -> how docs/install.md names it
NAMED = {
    "clip": "a clip",
    "exact": "a norm",
    "available_backends": "`fastgrad.available_backends()`",
    "set_backend": '`fastgrad.set_backend("cpu")`',
    "info": "`python -m fastgrad.info`",
    "bench": "`python -m fastgrad.bench`",
}

_CHILD = textwrap.dedent("""
    import json, warnings
    import torch
    import fastgrad
    from fastgrad import _build, _ext, backends, info
    from fastgrad.benchmark.runner import usable_backends

    warnings.simplefilter("ignore")
    asked = []

    def ensure(target, why, **kw):  # the compile, replaced: record who asked, then fail as a real build can
        asked.append(why)
        raise _build.Unavailable("not compiled in this test")

    _build.ensure, _build.find, _build.enabled = ensure, (lambda target: None), (lambda: True)
    _ext.installed = lambda: (None, {}, "fastgrad._C is not built for this install")
    fresh = dict(_ext._state)
    out = {"import": _ext._state["done"]}

    def params():
        ps = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
        for p in ps:
            p.grad = torch.randn(5)
        return ps

    def set_cpu():
        try:
            fastgrad.set_backend("cpu")
        except fastgrad.BackendError:
            pass

    entries = {
        "clip": lambda: fastgrad.clip_grad_norm_(params(), 1.0),
        "exact": lambda: fastgrad.get_total_norm([p.grad for p in params()], exact=True),
        "available_backends": fastgrad.available_backends,
        "set_backend": set_cpu,
        "info": lambda: info.render(info.collect()),
        "bench": lambda: usable_backends(torch.device("cpu")),
    }
    for name, call in entries.items():
        _ext._state.clear()
        _ext._state.update(fresh)
        for b in backends.registered().values():
            if b.name in ("cpu", "cuda"):  # the two backends of the extension ask the loader once, then keep it
                b._checked = False
        del asked[:]
        call()
        out[name] = len(asked)
    print(json.dumps(out))
""")


def test_every_call_that_may_start_the_build_is_named_in_install_md():
    env = {k: v for k, v in os.environ.items()
           if k not in ("FASTGRAD_BACKEND", "FASTGRAD_AUTO_BUILD", "FASTGRAD_NO_EXT_WARNING")}
    res = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out.pop("import") is False  # importing fastgrad loads nothing, so it starts no build
    assert out == {name: 1 for name in NAMED}, out  # each asks once (a failed build is not asked for again)
    text = " ".join(INSTALL.read_text().split("## The first-use build", 1)[1].split("\n## ", 1)[0].split())
    for name, words in NAMED.items():
        assert words in text, f"docs/install.md's first-use build does not name {words} ({name})"
    assert "`import fastgrad` alone compiles nothing" in text
