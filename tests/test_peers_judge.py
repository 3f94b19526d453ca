"""benchmarks/peers.py's judging (the side-by-side of check, gradsnitch and torch-audit on the check corpus), on
findings written here and on the committed runs. The other tools are not installed here: only the judging
runs, never a tool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import peers
from tests.check_corpus.cases import CASES

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "peers" / "2026-12-05"


def f(code, severity):
    return {"code": code, "severity": severity}


def test_a_healthy_run_may_raise_only_the_tools_lowest_level():
    assert peers.judge("gradsnitch", "healthy", None, [f("GS008", "warning")]) == ("clean", [])
    assert peers.judge("gradsnitch", "healthy", None, [f("GS006", "error")]) == ("false alarm", ["GS006"])
    assert peers.judge("check", "healthy", None, [f("hand_written_loop", "notice")]) == ("clean", [])
    assert peers.judge("check", "healthy", None, [f("stall", "warning")]) == ("false alarm", ["stall"])
    assert peers.judge("torch-audit", "healthy", None, [f("TA203", "INFO")]) == ("clean", [])
    assert peers.judge("torch-audit", "healthy", None, [f("TA200", "WARN"), f("TA203", "INFO")]) == (
        "false alarm", ["TA200"])
    # a tool reporting its own failure makes no claim about the run
    assert peers.judge("torch-audit", "healthy", None, [f("TA000", "WARN")]) == ("clean", [])


def test_a_broken_run_needs_an_alarm_of_its_class_at_any_level():
    # gradsnitch's lowest level is its warning: a warning of the right class detects
    assert peers.judge("gradsnitch", "broken", {"lr"}, [f("GS008", "warning")]) == ("detected", ["GS008"])
    # a loud finding of another class is a miss, and the table shows it
    assert peers.judge("gradsnitch", "broken", {"dead"}, [f("GS001", "error")]) == ("missed", ["GS001"])
    assert peers.judge("check", "broken", {"accumulation"},
                       [f("no_zero_grad", "critical"), f("exploding", "critical")]) == ("detected", ["no_zero_grad"])
    assert peers.judge("torch-audit", "broken", {"dead"}, [f("TA103", "INFO")]) == ("detected", ["TA103"])
    assert peers.judge("torch-audit", "broken", {"nonfinite"}, [f("TA200", "WARN")]) == ("missed", ["TA200"])
    assert peers.judge("check", "broken", {"clip"}, []) == ("missed", [])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown tool 'x'"):
        peers.judge("x", "healthy", None, [])
    with pytest.raises(ValueError, match="unknown level 'critical'"):
        peers.judge("gradsnitch", "healthy", None, [f("GS001", "critical")])
    with pytest.raises(ValueError, match="needs the classes"):
        peers.judge("check", "broken", None, [])


def test_the_manifest_decides_what_is_healthy_and_every_broken_case_has_its_classes():
    assert peers.expectation(("healthy", "notice")) == "healthy"
    assert peers.expectation(("warning", "critical")) == "broken"
    assert peers.expectation(("notice", "warning")) == "unscored"
    broken = {n for n, c in CASES.items() if peers.expectation(c.worst) == "broken"}
    assert broken == set(peers.BROKEN)
    # every class a case names is one each tool's table can name (else that case could never be detected by it)
    named = {cls for classes in peers.CODE_CLASSES["check"].values() for cls in classes}
    assert set().union(*peers.BROKEN.values()) <= named


def test_the_committed_table_is_the_judgement_of_the_committed_runs():
    runs = json.loads((RESULTS / "runs.json").read_text())["runs"]
    assert {r["case"] for r in runs} == set(CASES)
    assert {(r["tool"], r["case"]) for r in runs} == {(t, n) for t in peers.TOOLS for n in CASES}
    assert peers.table(runs, CASES) == (RESULTS / "table.md").read_text()
