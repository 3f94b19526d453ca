"""Shared test harness: every public-API test that takes the ``bd`` fixture runs once per usable
(backend, device) pair, so a backend is covered by the whole suite the moment it registers and reports
itself usable. On a machine without CUDA the Triton backend runs on CPU tensors in the interpreter.

With ``CI=true`` a green run must prove what it claims (docs/testing.md, "What a CI run enforces"): a backend
this machine can run but that is unusable stops the run before any test (its cases would otherwise just not be
generated), every test runs under pytest-timeout's limit, and the run's skips must be the ones docs/testing.md
lists, by reason and, for a run of the whole suite, by count."""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import shutil
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Must be set before any Triton kernel is defined (triton.jit reads it at decoration time).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastgrad import backends  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def usable_pairs() -> list[tuple[str, str]]:
    pairs = []
    for name, b in backends.registered().items():
        if b.unavailable_reason() is not None:
            continue
        for dev in DEVICES:
            probe = [torch.ones(3, device=dev)]
            if b.supports("norm", probe, norm_type=2.0) is None:
                pairs.append((name, dev))
    return pairs


BACKEND_DEVICES = usable_pairs()


@pytest.fixture(params=BACKEND_DEVICES, ids=[f"{b}-{d}" for b, d in BACKEND_DEVICES])
def bd(request) -> tuple[str, str]:
    """(backend name, device) for one usable pair."""
    return request.param


@pytest.fixture(autouse=True)
def _clean_backend_state(monkeypatch):
    # Tests choose backends explicitly; a developer's FASTGRAD_BACKEND or a leaked set_backend must not leak in.
    monkeypatch.delenv("FASTGRAD_BACKEND", raising=False)
    backends.set_backend(None)
    yield
    backends.set_backend(None)


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group (``dist.group.WORLD``) for sharded code paths in a single process."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")
SKIPS_DOC = Path(__file__).resolve().parent.parent / "docs" / "testing.md"


def required_backends() -> dict[str, str]:
    """The backends this machine can run, each with the reason: the C++ one wherever a C++ compiler is (the
    install builds it), Triton wherever it is installed (in its interpreter on a machine without a GPU)."""
    need = {}
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx:
        need["cpu"] = f"a C++ compiler is here ({cxx}), so the install builds fastgrad._C"
    if importlib.util.find_spec("triton") is not None:
        need["triton"] = "triton is installed" + ("" if torch.cuda.is_available() else ", and its interpreter runs "
                                                  "the kernels on CPU tensors")
    return need


def missing_backends(pairs, need: dict[str, str]) -> list[str]:
    """One line per required backend that no (backend, device) pair under test uses, with why it is unusable."""
    ran = {b for b, _ in pairs}
    out = []
    for name, why in need.items():
        if name in ran:
            continue
        b = backends.registered().get(name)
        reason = "it is not registered" if b is None else (
            b.unavailable_reason() or f"it serves none of the devices under test ({', '.join(DEVICES)})")
        out.append(f"the {name} backend: {why}, but it is unusable: {reason}")
    return out


def pytest_configure(config):
    if not IN_CI:
        return
    missing = missing_backends(BACKEND_DEVICES, required_backends())
    if missing:
        raise pytest.UsageError(
            "CI=true: a backend this machine can run is missing, so its tests would not even be generated:\n  "
            + "\n  ".join(missing) + "\n(`make test` builds and installs everything; unset CI to run without it)")
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("CI=true: pytest-timeout is not installed, so a hung test would only end with CI's "
                                "own limit (pip install -e '.[test]' installs it)")


def pytest_report_header(config):
    ran = sorted({b for b, _ in BACKEND_DEVICES})
    lines = ["fastgrad backends under test: " + ", ".join(
        f"{b} ({', '.join(d for n, d in BACKEND_DEVICES if n == b)}"
        f"{', interpreter' if b == 'triton' and os.environ.get('TRITON_INTERPRET') == '1' else ''})" for b in ran)]
    idle = {n: b.unavailable_reason() or "serves none of the devices here"
            for n, b in backends.registered().items() if n not in ran}
    if idle:
        lines.append("fastgrad backends not under test: " + "; ".join(f"{n} ({why})" for n, why in idle.items()))
    if IN_CI:
        lines.append("CI=true: required here: " + (", ".join(required_backends()) or "none")
                     + "; skips checked against docs/testing.md")
    return lines


# ---------------------------------------------------------------- the slow tier
#: The test functions (all their parameters) of the slow tier, marked `slow` here: `make test` runs the rest
#: (`-m "not slow"`), `make test-slow` these, and CI both (docs/testing.md, "Tiers"). Chosen from a measured run of
#: the whole suite (`--durations`, the costliest functions first) until the rest fits in the README's 12 minutes on
#: a 2-core machine. A test can also carry `@pytest.mark.slow` itself.
SLOW_TESTS = frozenset({
    "tests/test_triton_compile.py::test_every_kernel_compiles_for_sm80_and_sm90",
    "tests/test_layout_fuzz.py::test_layouts_count_every_element_once",
    "tests/test_bench_harness.py::test_pct_floor_is_the_paired_floor_pass_over_the_op",
    "tests/test_amp.py::test_amp_clip_primitive_same_bits_as_the_composition",
    "tests/test_ext.py::test_cuda_source_compiles",
    "tests/test_check_corpus.py::test_report_is_what_the_truth_calls_for",
    "tests/test_triton_kernels.py::test_amp_clip_equals_unfused_bitwise",
    "tests/test_triton_kernels.py::test_clip_norm_equals_unfused_clip_bitwise",
    "tests/test_agc.py::test_agc_matches_timm_and_oracle",
    "tests/test_agc.py::test_cuda_row_plan_host_check",
    "tests/test_triton_kernels.py::test_bitwise_determinism_20_runs",
    "tests/test_triton_kernels.py::test_agc_rows_packed_and_split",
    "tests/test_exact_distributed.py::test_exact_across_ranks_and_layouts",
    "tests/test_distributed_meshes.py::test_global_norm_any_sharding",
    "tests/test_check_distributed.py::test_correct_scripts_raise_no_alarm",
    "tests/test_distributed.py::test_dtensor_1d_mesh",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[", 1)[0] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


# ---------------------------------------------------------------- skips: only the documented ones
#: The runs whose skips are counted, by their -m expression: the whole suite, or one of its two tiers.
TIERS = {"": "all", "not slow": "fast", "slow": "slow"}


def documented_skips(text: str, tier: str = "all") -> dict[str, int]:
    """docs/testing.md's skip table: reason pattern (`...` stands for any text) -> count in a CI run of ``tier``
    ("all", "fast" or "slow"). A count cell reads `N`, or `N (M slow)` when M of the N are in the slow tier."""
    section = text.split("\n## Skips", 1)[1].split("\n## ", 1)[0]
    out = {}
    for m in re.finditer(r"^\| *(\d+)(?: *\((\d+) slow\))? *\| *`([^`]+)` *\|", section, re.M):
        total, slow = int(m.group(1)), int(m.group(2) or 0)
        out[m.group(3)] = {"all": total, "fast": total - slow, "slow": slow}[tier]
    return out


def skip_mismatches(seen: collections.Counter, documented: dict[str, int], whole_suite: bool) -> list[str]:
    """What differs between the run's skip reasons and the documented ones: a reason no pattern matches; for a
    run of the whole suite, also a pattern whose count differs."""
    rx = {p: re.compile(".*".join(re.escape(part) for part in p.split("...")), re.S) for p in documented}
    counts = collections.Counter()
    out = []
    for reason, n in sorted(seen.items()):
        hit = next((p for p, r in rx.items() if r.fullmatch(reason)), None)
        if hit is None:
            out.append(f"{n} skipped, reason not in docs/testing.md's list: {reason!r}")
        else:
            counts[hit] += n
    if whole_suite:
        out += [f"`{p}`: docs/testing.md says {want} skipped, this run skipped {counts[p]}"
                for p, want in documented.items() if counts[p] != want]
    return out


_SKIPPED: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
        _SKIPPED[report.longrepr[2].removeprefix("Skipped: ")] += 1


def _tier(session) -> str | None:
    """Which whole tier ran ("all", "fast", "slow"), or None for any other part of the suite."""
    opt = session.config.option
    tests = Path(__file__).resolve().parent
    args = [Path(a.split("::")[0]).resolve() for a in session.config.args]
    whole = (args == [tests] and not opt.keyword and not getattr(opt, "deselect", None)
             and not session.shouldstop and not session.shouldfail)
    return TIERS.get(" ".join((opt.markexpr or "").split())) if whole else None


_SKIP_PROBLEMS: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    if not IN_CI or exitstatus not in (0, 1) or session.config.option.collectonly:
        return
    tier = _tier(session)
    _SKIP_PROBLEMS[:] = skip_mismatches(_SKIPPED, documented_skips(SKIPS_DOC.read_text(), tier or "all"),
                                        tier is not None)
    if _SKIP_PROBLEMS:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _SKIP_PROBLEMS:
        terminalreporter.section("skips that docs/testing.md does not list (CI=true)", red=True)
        for line in _SKIP_PROBLEMS:
            terminalreporter.line(line, red=True)
