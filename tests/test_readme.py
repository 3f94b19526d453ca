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
    # the fast tier, then the slow one: together the whole suite
    assert re.search(r'^\$\(PYTHON\) -m pytest -q -m "not slow" tests$', makefile.replace("\t", ""), re.M)
    assert re.search(r"^\$\(PYTHON\) -m pytest -q -m slow tests$", makefile.replace("\t", ""), re.M)
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert "make test" in ci, ".ci/run must run the README's test command"
    assert ci.index("make test-slow") > ci.index("make test"), ".ci/run must run the slow tier too"


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


# ------------------------------------------------------------------ the one-line swap: what is the same as torch
# The README's figures (section "The one-line swap") and docs/api.md's accuracy table: measured on 3,000 random
# lists (seed 20261128) and pinned here on other ones.
NORM_ULP, GRAD_ULP, EXACT_ULP, TORCH_ULP, BIG_TORCH_ULP = 5, 8, 1, 5, 340


def _readme_swap() -> str:
    text = README.read_text()
    return " ".join(text[text.index("## The one-line swap"):text.index("## The step guard")].split())


def test_the_readmes_figures_are_the_ones_pinned_here():
    swap = _readme_swap()
    assert (f"on lists of up to 39 tensors of up to 20k elements: within {NORM_ULP} ulp of torch's (clipped "
            f"gradients within {GRAD_ULP}), fastgrad within {EXACT_ULP} ulp of the exact norm, torch within "
            f"{TORCH_ULP}; torch drifts on larger tensors ({BIG_TORCH_ULP} ulp at 2M elements)") in swap
    api = " ".join((ROOT / "docs" / "api.md").read_text().split())
    assert f"The norm within {NORM_ULP} ulp of torch's, the clipped gradients within {GRAD_ULP}" in api
    assert f"torch's up to {BIG_TORCH_ULP} ulp off" in api


def test_the_signature_is_torchs_plus_keyword_only_arguments():
    import inspect

    import torch

    import fastgrad

    for name in ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_"):
        ours = list(inspect.signature(getattr(fastgrad, name)).parameters.values())
        theirs = list(inspect.signature(getattr(torch.nn.utils, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == \
            [(p.name, p.kind, p.default) for p in theirs], name
        assert all(p.kind is p.KEYWORD_ONLY for p in ours[len(theirs):]), name


def _grads(values, dtype=None):
    import torch

    if dtype is None:
        p = torch.nn.Parameter(torch.zeros(len(values)))
        p.grad = torch.tensor(values)
    else:  # integer "gradients": a leaf of that dtype (a Parameter must be floating point)
        p = torch.zeros(len(values), dtype=dtype)
        p.grad = torch.tensor(values, dtype=dtype)
    return [p]


def _refusals():
    """Inputs torch's clip_grad_norm_ refuses: (name, call with the function and fresh parameters)."""
    import torch

    nan, inf = float("nan"), float("inf")
    return [
        ("a NaN norm, error_if_nonfinite", lambda f: f(_grads([1.0, nan]), 1.0, error_if_nonfinite=True)),
        ("an inf norm, error_if_nonfinite", lambda f: f(_grads([1.0, inf]), 1.0, error_if_nonfinite=True)),
        ("norm_type 'abc'", lambda f: f(_grads([1.0]), 1.0, norm_type="abc")),
        ("norm_type None", lambda f: f(_grads([1.0]), 1.0, norm_type=None)),
        ("max_norm 'abc'", lambda f: f(_grads([1.0]), "abc")),
        ("max_norm None", lambda f: f(_grads([1.0]), None)),
        ("parameters None", lambda f: f(None, 1.0)),
        ("parameters an int", lambda f: f(3, 1.0)),
        ("integer gradients", lambda f: f(_grads([1, 2], torch.int64), 1.0)),
        ("an unknown keyword", lambda f: f(_grads([1.0]), 1.0, bogus=1)),
    ]


@pytest.mark.parametrize("case", range(len(_refusals())), ids=[n for n, _ in _refusals()])
def test_every_input_torch_refuses_is_refused_with_torchs_exception_type(case):
    import torch

    import fastgrad

    name, call = _refusals()[case]
    with pytest.raises(Exception) as theirs:
        call(torch.nn.utils.clip_grad_norm_)
    seen = []

    def ours_with(params, *a, **k):
        if isinstance(params, list):
            seen.append((params, [p.grad.clone() for p in params]))
        return fastgrad.clip_grad_norm_(params, *a, **k)

    with pytest.raises(type(theirs.value)) as ours:  # an instance of torch's exception type (or a subclass)
        call(ours_with)
    if "error_if_nonfinite" in name:
        assert str(ours.value) == str(theirs.value)  # torch's text
    for params, before in seen:  # refused before any gradient was touched
        assert all(torch.equal(p.grad.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
                   for p, b in zip(params, before)), name


def test_fastgrad_refuses_more_than_torch_before_touching_a_gradient():
    import torch

    import fastgrad

    for max_norm in (-1.0, float("nan")):
        params = _grads([3.0, 4.0])
        torch.nn.utils.clip_grad_norm_(_grads([3.0, 4.0]), max_norm)  # torch takes it
        with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
            fastgrad.clip_grad_norm_(params, max_norm)
        assert params[0].grad.tolist() == [3.0, 4.0]


def _ulps(a, b):
    """Distance in float32 steps of two finite float32 tensors of one sign (elementwise)."""
    import torch

    return (a.view(torch.int32).to(torch.int64) - b.view(torch.int32).to(torch.int64)).abs()


def _random_lists(seed: int, n: int, max_tensors: int, max_numel: int, dtype=None):
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        k = int(torch.randint(1, max_tensors + 1, (1,), generator=g))
        ts = [torch.randn(int(torch.randint(1, max_numel + 1, (1,), generator=g)), generator=g)
              * float(torch.exp(torch.randn((), generator=g) * 3)) for _ in range(k)]
        yield ts if dtype is None else [t.to(dtype) for t in ts]


def _clip_both(ts, max_norm, backend, **kw):
    import torch

    import fastgrad

    ours, theirs = [torch.nn.Parameter(torch.empty_like(t)) for t in ts], [torch.nn.Parameter(torch.empty_like(t))
                                                                           for t in ts]
    for p, q, t in zip(ours, theirs, ts):
        p.grad, q.grad = t.clone(), t.clone()
    a = fastgrad.clip_grad_norm_(ours, max_norm, backend=backend, **kw)
    b = torch.nn.utils.clip_grad_norm_(theirs, max_norm, **kw)
    return a, b, ours, theirs


def _correctly_rounded(ts):
    import torch

    return torch.stack([t.double().norm() for t in ts]).norm().float()


def _needs_cpu_kernels():
    from fastgrad import _ext

    if not _ext.has_cpu_kernels():
        pytest.skip(f"the figures are the C++ kernels' and fastgrad._C is not usable: {_ext.load_error()}")


def test_float32_two_norms_within_the_readmes_ulp_of_torchs():
    _needs_cpu_kernels()
    import torch

    worst = {"norm": 0, "grads": 0, "exact": 0, "torch": 0}
    for ts in _random_lists(seed=5150, n=200, max_tensors=39, max_numel=19_999):
        a, b, ours, theirs = _clip_both(ts, 1.0, "cpu")
        exact = _correctly_rounded(ts)
        worst["norm"] = max(worst["norm"], int(_ulps(a, b)))
        worst["grads"] = max(worst["grads"], max(int(_ulps(p.grad, q.grad).max()) for p, q in zip(ours, theirs)))
        worst["exact"] = max(worst["exact"], int(_ulps(a, exact)))
        worst["torch"] = max(worst["torch"], int(_ulps(b, exact)))
    assert worst["norm"] <= NORM_ULP and worst["grads"] <= GRAD_ULP, worst
    assert worst["exact"] <= EXACT_ULP and worst["torch"] <= TORCH_ULP, worst
    assert worst["norm"] > 0 and worst["torch"] > 0  # another order indeed: the bound is not vacuous


def test_torch_drifts_on_large_tensors_and_fastgrad_does_not():
    _needs_cpu_kernels()
    torch_off = 0
    for ts in _random_lists(seed=77, n=3, max_tensors=4, max_numel=2_000_000):
        ts = [t for t in ts] + [ts[0].flip(0).repeat(2_000_000 // ts[0].numel() + 1)[:2_000_000]]
        a, b, _, _ = _clip_both(ts, 1.0, "cpu")
        exact = _correctly_rounded(ts)
        assert int(_ulps(a, exact)) <= EXACT_ULP
        torch_off = max(torch_off, int(_ulps(b, exact)))
    assert TORCH_ULP < torch_off <= 2 * BIG_TORCH_ULP, torch_off


def _same(a, b):
    import torch

    return all(torch.equal(p.grad, q.grad) for p, q in zip(a, b))


def test_the_cases_that_give_torchs_bits():
    import torch

    import fastgrad

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for ts in _random_lists(seed=31, n=25, max_tensors=29, max_numel=4_999, dtype=dtype):
            a, b, ours, theirs = _clip_both(ts, 0.5, None, norm_type="inf")
            assert torch.equal(a, b), dtype
            if dtype == torch.float32:
                assert _same(ours, theirs)
            ours = [torch.nn.Parameter(torch.empty_like(t)) for t in ts]
            theirs = [torch.nn.Parameter(torch.empty_like(t)) for t in ts]
            for p, q, t in zip(ours, theirs, ts):
                p.grad, q.grad = t.clone(), t.clone()
            fastgrad.clip_grad_value_(ours, 0.3)
            torch.nn.utils.clip_grad_value_(theirs, 0.3)
            assert _same(ours, theirs), dtype
            if dtype != torch.float16:  # torch's float16 norm can overflow and then clip everything to zero
                _, _, ours, theirs = _clip_both(ts, 1e30, None)
                assert _same(ours, theirs), dtype
    for ts in _random_lists(seed=32, n=25, max_tensors=29, max_numel=4_999):
        for p in (2.0, 1.0):
            a, b, ours, theirs = _clip_both(ts, 0.5, "torch", norm_type=p)
            assert torch.equal(a, b) and _same(ours, theirs)


def test_low_precision_gradients_do_not_get_torchs_bits():
    _needs_cpu_kernels()
    import torch

    same = 0
    for ts in _random_lists(seed=33, n=20, max_tensors=29, max_numel=4_999, dtype=torch.bfloat16):
        _, _, ours, theirs = _clip_both(ts, 0.5, "cpu")
        same += _same(ours, theirs)
        # fastgrad's: each element rounded once from float32, T(float(g) * coef)
    assert same <= 5, same


# ---------------------------------------------------------------------------------- host syncs
_READS = ("_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "equal")


def _host_reads(call) -> list[str]:
    """The values ``call()`` reads back to Python (what is a host sync on CUDA tensors), on CPU tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        hits: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in _READS:
                self.hits.append(func.__name__)
            return func(*args, **(kwargs or {}))

    w = Watch()
    w.hits = []
    with w:
        call()
    return w.hits


def _model():
    import torch

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    m(torch.randn(8, 16)).square().mean().backward()
    return m


@pytest.mark.parametrize("backend", [None, "cpu", "torch"])
def test_the_default_paths_read_nothing_back_and_each_exception_once(backend):
    """docs/api.md, "Host syncs": no value is read back on the default paths; error_if_nonfinite=True and a
    max_norm given as a tensor read one each (a stand-in on CPU tensors for the GPU runs'
    set_sync_debug_mode("error") tests)."""
    import torch

    import fastgrad

    if backend == "cpu":
        _needs_cpu_kernels()
    grads = lambda m: [p.grad for p in m.parameters()]  # noqa: E731
    default = {
        "clip_grad_norm_": lambda m: fastgrad.clip_grad_norm_(m.parameters(), 0.1, backend=backend),
        "clip_grad_norm_ inf": lambda m: fastgrad.clip_grad_norm_(m.parameters(), 0.1, "inf", backend=backend),
        "get_total_norm": lambda m: fastgrad.get_total_norm(grads(m), backend=backend),
        "clip_grad_value_": lambda m: fastgrad.clip_grad_value_(m.parameters(), 0.01, backend=backend),
        "multi_tensor_norm": lambda m: fastgrad.multi_tensor_norm(grads(m), per_tensor=True, backend=backend),
        "adaptive_clip_grad_": lambda m: fastgrad.adaptive_clip_grad_(m.parameters(), backend=backend),
        "centralize_gradient_": lambda m: fastgrad.centralize_gradient_(m.parameters(), backend=backend),
        "grad_stats": lambda m: fastgrad.grad_stats(m, backend=backend),
    }
    once = {
        "error_if_nonfinite=True": lambda m: fastgrad.clip_grad_norm_(m.parameters(), 0.1, error_if_nonfinite=True,
                                                                      backend=backend),
        "max_norm as a tensor": lambda m: fastgrad.clip_grad_norm_(m.parameters(), torch.tensor(0.1),
                                                                   backend=backend),
    }
    for name, call in {**default, **once}.items():
        m = _model()
        call(m)  # the first call on the list
        hits = _host_reads(lambda: call(m))
        assert len(hits) == (1 if name in once else 0), (name, hits)
    # the fused AMP call
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    assert _host_reads(lambda: fastgrad.scaler_unscale_and_clip(scaler, opt, 1.0, backend=backend)) == []
