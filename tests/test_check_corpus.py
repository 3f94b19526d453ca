"""``python -m fastgrad.check`` on a corpus of training scripts modelled on public repositories
(tests/check_corpus/, its README says how they were made): each run's report against the manifest
(tests/check_corpus/cases.py) written from the run's own float64 truth before check ran, and the report's
statistics against that truth where they overlap.

A case that today's check gets wrong is an xfail(strict=True) with the reason in the manifest (``today``): when
the rules get it right the test passes, strict xfail turns that into a failure, and the mark must go.
``pytest --runxfail tests/test_check_corpus.py`` counts how many cases the rules get right as they stand."""

import math
import re
from pathlib import Path

import pytest
import torch

from fastgrad.diagnose.thresholds import RANK

from .check_corpus.cases import CASES
from .check_runs import checked_run

CORPUS = Path(__file__).resolve().parent / "check_corpus"
_runs: dict = {}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The corpus's models are tiny: one intra-op thread runs them as fast, and on a loaded machine several
    threads waiting on each other cost ten times the CPU. The truth is recorded in the same runs, so what the
    manifest compares does not depend on it (the manifest's figures come from one-thread runs too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(name, tmp):
    """The checked run of a case (in this process, once per session) and the truth the script recorded."""
    if name not in _runs:
        c = CASES[name]
        _runs[name] = checked_run(str(CORPUS / c.script), list(c.args), tmp / f"{name}.truth.json")
    return _runs[name]


def _params(expect_today):
    out = []
    for name, c in CASES.items():
        marks = [pytest.mark.xfail(strict=True, reason=c.today)] if (expect_today and c.today) else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


# ---------------------------------------------------------------------------------------------- the verdicts
def _any(spec: str, findings, least: str) -> bool:
    """A finding whose code is one of ``spec``'s ("a|b") at ``least`` or above."""
    want = spec.split("|")
    return any(f["code"] in want and RANK[f["severity"]] >= RANK[least] for f in findings)


def verdict_problems(c, r) -> list[str]:
    """Every way the report differs from the manifest's expectation (empty: the report is right)."""
    j, md = r["json"], r["md"]
    fs = j["findings"]
    out = []
    rcs = c.rc if isinstance(c.rc, tuple) else (c.rc,)
    if r["rc"] not in rcs:
        out.append(f"exit code {r['rc']}, expected {c.rc}")
    worst = max((f["severity"] for f in fs), key=RANK.__getitem__, default="healthy")
    lo, hi = c.worst
    if not RANK[lo] <= RANK[worst] <= RANK[hi]:
        out.append(f"worst severity {worst}, expected {lo}..{hi}")
    for spec, least in c.must.items():
        if not _any(spec, fs, least):
            out.append(f"no {spec} at {least} or above")
    for code in c.must_not:
        if _any(code, fs, "warning"):
            out.append(f"{code} at warning or above")
    for pat in c.names:
        if not re.search(pat, md):
            out.append(f"the report never says /{pat}/")
    for pat in c.absent:
        if re.search(pat, md):
            out.append(f"the report says /{pat}/")
    if c.first and (not fs or fs[0]["code"] not in c.first.split("|")):
        out.append(f"first finding {fs[0]['code'] if fs else None}, expected {c.first}")
    for metric, least in c.rows.items():
        got = [x for x in j["summary"] if x["metric"].startswith(metric)]
        if not got or any(RANK[x["status"]] < RANK[least] for x in got):
            out.append(f"summary row {metric!r} is {[x['status'] for x in got]}, expected {least} or above")
    for x in j["summary"]:
        if RANK[x["status"]] > RANK[worst]:
            out.append(f"summary row {x['metric']!r} is {x['status']}, above every finding ({worst})")
    return out


@pytest.mark.parametrize("name", _params(expect_today=True))
def test_report_is_what_the_truth_calls_for(name, tmp):
    c, r = CASES[name], run(name, tmp)
    problems = verdict_problems(c, r)
    summary = [(f["code"], f["severity"]) for f in r["json"]["findings"]]
    assert not problems, f"{name}: {problems}; findings {summary}; expected: {c.why}"


@pytest.mark.parametrize("name", _params(expect_today=False))
def test_premise_holds_in_the_truth(name, tmp):
    """What each expectation rests on, checked on the truth the script recorded in the checked run: a script
    changed so that its run no longer shows what the manifest says fails here, not in the verdict test."""
    c, r = CASES[name], run(name, tmp)
    assert r["truth"] is not None and r["truth"]["steps"], "the script recorded no truth"
    assert c.premise(r["truth"]), f"{name}: the truth no longer shows: {c.why}"


# ---------------------------------------------------------------------------------------------- statistics
def _num(v):
    return float(v)


def _same(a, b, rel):
    a, b = _num(a), _num(b)
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


@pytest.mark.parametrize("name", _params(expect_today=False))
def test_reported_statistics_match_the_float64_truth(name, tmp):
    """Step for step: the norm each update consumed (``total_norm``) and the norm a clip read (``clip_norm``)
    within 1e-6 of the float64 truth (a float32 reduction is ~1e-7 off), the loss the same float (the sum of a
    step's backward() losses, added in the order the script made them), and the steps a GradScaler skipped."""
    r = run(name, tmp)
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    assert len(steps) == len(truth), (len(steps), len(truth))
    for s, t in zip(steps, truth):
        at = f"step {s['step']}"
        assert bool(s["skipped"]) == bool(t.get("skipped")), at
        assert _same(s["loss"], t["loss"], 0.0), (at, s["loss"], t["loss"])
        if t.get("skipped"):
            continue
        assert _same(s["total_norm"], t["norm"], 1e-6), (at, s["total_norm"], t["norm"])
        if "raw" in t and s["clip_norm"] is not None:  # None: check did not read that clip (a scaled one)
            assert _same(s["clip_norm"], t["raw"], 1e-6), (at, s["clip_norm"], t["raw"])
        if "evals" in t:
            assert s["evals"] == t["evals"], at
