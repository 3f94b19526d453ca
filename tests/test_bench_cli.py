"""Smoke test of ``python -m fastgrad.bench`` on a tiny workload, and the workload definitions themselves."""

from __future__ import annotations

import csv
import json
import math

import pytest

from fastgrad import bench
from fastgrad.benchmark import ops as benchmark_ops
from fastgrad.benchmark import report
from fastgrad.benchmark import workloads as benchmark_workloads
from fastgrad.benchmark.runner import usable_backends


@pytest.mark.parametrize("name,params", [
    # Published parameter counts of the architectures the shape lists are derived from.
    ("gpt2-124m", 124_439_808),
    ("resnet50", 25_557_032),
    ("vit-b16", 86_567_656),
    ("llama-1b", 1_235_814_400),
    ("llama-7b", 6_738_415_616),
    ("mixed", 124_439_808),
])
def test_workload_parameter_counts(name, params):
    assert sum(benchmark_workloads.numel(s) for _, s, _ in benchmark_workloads.WORKLOADS[name].build()) == params


def test_small_tensor_workload():
    entries = benchmark_workloads.small_tensors()
    assert len(entries) == 4000
    assert all(1024 <= benchmark_workloads.numel(s) <= 16384 for _, s, _ in entries)


def test_scaling_keeps_tensor_count_and_inner_dims():
    w = benchmark_workloads.prepare("gpt2-124m", 8 * 2**20)
    full = benchmark_workloads.gpt2_small()
    assert w.n_tensors == len(full) and w.note
    assert w.grad_bytes <= 8 * 2**20
    for (_, s, _), (_, f, _) in zip(w.entries, full):
        assert len(s) == len(f) and tuple(s[1:]) == tuple(f[1:])
    # small-4000 is defined by its sizes: never shrunk, only annotated
    s = benchmark_workloads.prepare("small-4000", 2**20)
    assert s.entries == benchmark_workloads.small_tensors() and s.note


def test_cli_tiny(tmp_path, capsys, monkeypatch):
    from fastgrad.benchmark import runner

    monkeypatch.setattr(runner, "MIN_FLOOR_BYTES", 0)  # tiny is under the real threshold; exercise the floor
    out = tmp_path / "res"
    rc = bench.main(["--quick", "--workloads", "tiny", "--out", str(out), "--no-progress", "--device", "cpu",
                     "--budget", "0", "--min-rounds", "6", "--max-rounds", "6"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tiny" in printed and "fastgrad auto vs torch eager:" in printed
    # the printed text never contradicts its tables: no fastgrad backend by name was timed, and the table beside
    # the headline (the own loops, 3 rounds: no interval) says what it holds and nothing else
    assert "no reference rows" not in printed
    heading = next(line for line in printed.splitlines() if line.startswith("For reference only"))
    assert report.SIDE_KINDS["other baseline"] in heading and report.SIDE_KINDS["reference"] not in heading
    assert "3 rounds: no interval" in printed and "too few for an interval" not in printed
    # results.csv is plain CSV: the header on the first line, no comment lines, read as is by csv.reader
    text = (out / "results.csv").read_text()
    assert not any(line.startswith("#") for line in text.splitlines())
    with open(out / "results.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == report.COLUMNS
    assert all(len(row) == len(report.COLUMNS) for row in table[1:])
    rows = [dict(zip(table[0], row)) for row in table[1:]]
    backends, _ = usable_backends(__import__("torch").device("cpu"))
    # the automatic choice on the CPU is the C++ backend when built; --quick times no reference backend
    auto = "cpu" if "cpu" in backends else "torch"
    impls = {"torch eager", "fastgrad auto"}
    # the ops with another torch baseline (the benchmark's own loop) have its row too
    others = {(op, b.impl) for op, spec in benchmark_ops.OPS.items() for b in spec.baselines[1:]}
    assert others == {("agc", "torch: own loop"), ("grad_stats", "torch: own loop")}
    assert {(r["op"], r["impl"]) for r in rows} == {(op, i) for op in benchmark_ops.OPS for i in impls} | others
    for r in rows:
        assert not r["note"].startswith("failed"), r
        assert float(r["median_ms"]) > 0 and int(r["rounds"]) >= 1
        assert math.isfinite(float(r["pct_floor"])) and float(r["floor_ms"]) > 0 and float(r["gbps"]) > 0
        assert r["floor_kind"] in ("cache", "memory")
        spec = benchmark_ops.OPS[r["op"]]
        assert r["baseline"] == (spec.baseline if r["impl"] == "torch eager" else
                                 next((b.what for b in spec.baselines if b.impl == r["impl"]), ""))
        # counted on the CPU: torch operators per call; kernels and syncs are CUDA-only (empty)
        assert int(r["ops_per_call"]) >= 1 and r["kernels_per_call"] == r["syncs_per_call"] == ""
        if r["role"] == "auto":
            assert r["backend"] == auto
            assert (r["vs_other"] != "") == (r["op"] in ("agc", "grad_stats"))
        if r["role"] == "other baseline":
            # --quick: the own loops run 3 rounds, a median without an interval
            assert int(r["rounds"]) == 3 and float(r["speedup"]) > 0 and r["speedup_lo"] == ""
            assert r["verdict"] == "no interval" and r["verdict_why"] == "3 rounds"
        elif r["impl"] != "torch eager":
            assert float(r["speedup"]) > 0 and float(r["speedup_lo"]) <= float(r["speedup_hi"])
            if r["verdict"] == "measurement problem":
                # tiny's "floor" (MIN_FLOOR_BYTES patched to 0) is the floor pass's fixed cost, which a fused op
                # can beat; or its medians disagree with its paired ratio: either way said, never a verdict
                over = r["floor_problem"] == "1" and float(r["pct_floor"]) > runner.OVER_FLOOR_PCT
                assert over or r["verdict_why"].startswith("the medians give"), r
            else:
                assert r["verdict"] in ("faster", "slower", "within noise")
    meta = json.loads((out / "meta.json").read_text())
    assert runner.ONLY_AUTOMATIC_NOTE in meta["notes"]
    assert meta["command"].startswith("python -m fastgrad.bench --quick --workloads tiny")
    for key in ("device", "date", "torch", "triton", "cuda", "git_commit", "load_average", "read_gbps", "rw_gbps"):
        assert key in meta, key
    assert meta["device_type"] == "cpu" and meta["cpu_threads"] == 1  # one thread on the CPU by default
    md = (out / "results.md").read_text()
    assert "## Is fastgrad faster here?" in md and "python -m fastgrad.bench" in md and "SPEC" not in md
    assert "timm" in md and "Gradient-Centralization" in md and "_foreach_norm" in md  # which baseline is which
    pytest.importorskip("matplotlib")
    assert (out / "speedup.png").stat().st_size > 1000 and (out / "pct_floor.png").stat().st_size > 1000


def test_cli_help_shows_every_default_and_points_inside_the_package(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = capsys.readouterr().out
    for action in bench.parser()._actions:
        if action.dest == "help":
            continue
        assert "(default: " in (action.help or ""), action.option_strings
    # what --help points at is printed by the package itself: --explain and --list
    assert "--explain" in text and "--list" in text and "http" not in text
    assert bench.main(["--explain"]) == 0
    explained = capsys.readouterr().out
    assert "% floor" in explained and "| agc | adaptive gradient clipping | P + N | N |" in explained
    assert "timm" in explained
    assert "http" not in explained


def test_cli_no_counts(tmp_path):
    out = tmp_path / "res"
    assert bench.main(["--quick", "--workloads", "tiny", "--ops", "norm", "--out", str(out), "--no-progress",
                       "--no-plot", "--no-counts", "--device", "cpu", "--budget", "0", "--min-rounds", "2",
                       "--max-rounds", "2"]) == 0
    with open(out / "results.csv", newline="") as f:
        assert {r["ops_per_call"] for r in csv.DictReader(f)} == {""}


def test_cli_rejects_unknown_names(tmp_path):
    with pytest.raises(SystemExit, match="unknown workload"):
        bench.main(["--workloads", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown op"):
        bench.main(["--ops", "nope", "--out", str(tmp_path)])


def test_cli_runs_from_an_installed_copy_in_another_directory(tmp_path):
    """`python -m fastgrad.bench` needs nothing outside the package: run it from a copy of the package alone
    (what a non-editable install puts in site-packages), from a directory that is not the repository."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import importlib.util

    import fastgrad

    pkg = Path(fastgrad.__file__).resolve().parent
    if importlib.util.find_spec("setuptools") is not None:
        import setuptools

        # The packaging config ships the benchmark subpackage (pyproject: packages.find include "fastgrad*").
        assert "fastgrad.benchmark" in setuptools.find_packages(str(pkg.parent), include=["fastgrad*"])
    site = tmp_path / "site"
    shutil.copytree(pkg, site / "fastgrad", ignore=shutil.ignore_patterns("__pycache__"))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-m", "fastgrad.bench", "--quick", "--workloads", "tiny", "--ops", "norm,clip",
         "--device", "cpu", "--out", "res", "--no-progress", "--no-plot", "--budget", "0", "--min-reps", "2",
         "--max-reps", "2"], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Legend:" in proc.stdout
    meta = json.loads((cwd / "res" / "meta.json").read_text())
    assert meta["git_commit"] == "unknown (installed package)"  # really the copy, not the checkout
    assert "## All rows" in (cwd / "res" / "results.md").read_text()
