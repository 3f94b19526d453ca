"""The benchmark harness's own logic: the GPU code paths run without a GPU (a faked CUDA device), interleaved
timing, the spread and the unstable mark, the busy-machine warning, and the host-overhead workloads."""

from __future__ import annotations

import collections
import csv
import importlib
import math
import time

import pytest
import torch

from fastgrad import bench
from fastgrad.benchmark import report, runner, timing
from fastgrad.benchmark import workloads as W


# ------------------------------------------------------------------------------------- a faked CUDA device
class _FakeEvent:
    """torch.cuda.Event stand-in: records host time; counts elapsed_time reads (proof the CUDA-event path
    of the timer ran)."""

    reads = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end: _FakeEvent) -> float:
        type(self).reads += 1
        assert self.t is not None and end.t is not None, "elapsed_time read before both events were recorded"
        return (end.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    """Lets the benchmark take every branch a CUDA run takes, with the tensors on the CPU: the allocations the
    harness makes on the device land on the CPU, and the few torch.cuda calls it makes are recorded."""
    calls = collections.Counter()
    cpu = torch.device("cpu")

    def on_cpu(device):
        return cpu if device is not None and torch.device(device).type == "cuda" else device

    for name in ("empty", "ones"):
        orig = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, device=None, _f=orig, **k: _f(*a, device=on_cpu(device), **k))
    orig_materialize = W.materialize
    monkeypatch.setattr(W, "materialize", lambda w, device, seed=0: orig_materialize(w, on_cpu(device), seed))

    def count(name, ret=None):
        def f(*a, **k):
            calls[name] += 1
            return ret
        return f

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", count("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", count("empty_cache"))
    monkeypatch.setattr(torch.cuda, "set_device", count("set_device"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * 2**30, 16 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "reads", 0)
    monkeypatch.setattr(importlib.import_module("torch._dynamo"), "reset", count("dynamo_reset"))
    # torch.compile on CPU tensors needs a C++ toolchain and minutes: the compiled baseline is the eager one.
    monkeypatch.setattr(runner, "_compiled", lambda fn: (calls.update(["compiled"]), fn)[1])
    # A small L2 flush buffer, filled with ones so the test sees that the timer zeroed it.
    monkeypatch.setattr(timing, "L2_FLUSH_BYTES", 2**20)
    timers = []

    class RecordingTimer(timing.Timer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            if self._flush is not None:
                self._flush.fill_(1)
            timers.append(self)

    monkeypatch.setattr(runner, "Timer", RecordingTimer)
    return calls, timers


@pytest.mark.parametrize("compile_flag,compiled", [("off", False), ("on", True), ("auto", True)])
def test_cuda_code_paths_without_a_gpu(fake_cuda, tmp_path, capsys, compile_flag, compiled):
    """GPU finding 9: `--compile off` on CUDA raised UnboundLocalError at torch.cuda.empty_cache()."""
    calls, timers = fake_cuda
    out = tmp_path / "res"
    rc = bench.main(["--quick", "--device", "cuda", "--compile", compile_flag, "--workloads", "tiny,host-148", "--ops",
                     "norm,clip", "--backends", "torch", "--out", str(out), "--no-progress", "--no-plot",
                     "--budget", "0", "--min-reps", "3", "--max-reps", "3"])
    assert rc == 0
    rows = list(csv.DictReader(line for line in (out / "results.csv").read_text().splitlines()
                               if not line.startswith("#")))
    impls = {r["impl"] for r in rows}
    assert impls == ({"torch eager", "torch.compile", "fastgrad:torch"} if compiled
                     else {"torch eager", "fastgrad:torch"})
    assert all(r["note"] == "" for r in rows), rows
    # tiny runs both ops, host-148 only clip
    assert {(r["workload"], r["op"]) for r in rows} == {("tiny", "norm"), ("tiny", "clip"), ("host-148", "clip")}
    # --compile auto means on for CUDA; dynamo is reset after every workload only when it was used
    assert calls["compiled"] == (3 if compiled else 0)
    assert calls["dynamo_reset"] == (2 if compiled else 0)
    assert calls["empty_cache"] == 2  # once per workload
    # CUDA-event timing was selected (every timed repetition read its events), and the L2 flush ran
    (timer,) = timers
    assert timer.cuda and timer._flush is not None and not timer._flush.any()
    assert _FakeEvent.reads >= sum(int(r["reps"]) for r in rows) > 0
    assert calls["synchronize"] > 0
    assert "Fake GPU" in capsys.readouterr().out


# ------------------------------------------------------------------------------------- timing
def test_spread_is_iqr_over_median():
    xs = [float(x) for x in range(1, 12)]  # median 6, p25 3.5, p75 8.5
    assert timing.spread(xs) == pytest.approx((8.5 - 3.5) / 6)
    # one preempted repetition out of eleven does not make a steady row unstable
    assert timing.spread([10.0] * 10 + [500.0]) == 0.0
    assert timing.spread([5.0, 5.0, 5.0]) == 0.0
    assert math.isnan(timing.spread([1.0]))


def test_interleaved_round_robin_and_failures():
    order = []

    def make(name):
        return lambda: order.append(name)

    def boom():
        order.append("x")
        raise RuntimeError("broken impl")

    t = timing.Timer("cpu", warmup=1, min_reps=4, max_reps=4, budget_s=0)
    res = t.measure_interleaved([make("a"), boom, make("b")])
    assert isinstance(res[1], RuntimeError)
    assert [m.reps for m in (res[0], res[2])] == [4, 4]
    timed = order[3:]  # warm-up: a, x, b
    # every round times each live implementation once, starting one further along each round
    assert timed == ["a", "b", "b", "a", "a", "b", "b", "a"]


def _res(rows, host=()):
    base = {"backend": "", "median_ms": 1.0, "host_ms": 1.0, "unstable": False, "x_eager": float("nan"),
            "x_compile": float("nan"), "note": "", "spread_pct": 1.0, "host_spread_pct": 1.0, "gbps": 1.0,
            "pct_copy": 50.0, "reps": 5}
    meta = {"device": "test", "backends": ["torch", "cpu"], "backends_not_benchmarked": {},
            "workloads": {w: {"host": w in host, "title": w, "tensors": 1, "grad_bytes": 4, "full_grad_bytes": 4,
                              "note": ""} for w in {r["workload"] for r in rows}}}
    return runner.Result([base | r for r in rows], meta)


def test_unstable_rows_never_enter_best_speedups():
    res = _res([
        {"workload": "a", "op": "norm", "impl": "torch eager"},
        {"workload": "a", "op": "norm", "impl": "fastgrad:cpu", "backend": "cpu", "x_eager": 500.0,
         "unstable": True},
        {"workload": "a", "op": "norm", "impl": "fastgrad:torch", "backend": "torch", "x_eager": 1.5},
        {"workload": "b", "op": "norm", "impl": "torch eager", "unstable": True},
        {"workload": "b", "op": "norm", "impl": "fastgrad:cpu", "backend": "cpu", "x_eager": 3.0},
    ])
    best = report.best_speedups(res)
    # the fastest fastgrad row is unstable: no figure, and the slower steady torch row does not stand in
    assert best[("a", "norm")] is None
    assert best[("b", "norm")] is None  # its baseline is unstable: no ratio is quoted
    res.rows[1]["unstable"] = False
    assert report.best_speedups(res)[("a", "norm")] == (500.0, "cpu")
    res.rows[1]["unstable"] = True
    md = report.markdown(res)
    table = md.split("## Best fastgrad speedup")[1].split("##")[0]
    assert "500" not in table and "1.50x" not in table and "unstable" in table
    assert report.console_table(res).count(report.UNSTABLE_MARK) >= 2


def test_busy_warning(monkeypatch):
    monkeypatch.setattr(runner, "cpu_count", lambda: 2)
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (2.5, 1.0, 1.0))
    assert "load average 2.50 over 2 cores" in runner.busy_warning("before")
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (1.9, 1.0, 1.0))
    assert runner.busy_warning("before") is None


def test_run_marks_rows_and_warns_when_busy(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(runner, "busy_warning", lambda when: f"machine busy {when} the run: test")
    rc = bench.main(["--quick", "--device", "cpu", "--workloads", "host-4000", "--out", str(tmp_path),
                     "--no-progress", "--no-plot", "--budget", "0", "--min-reps", "1", "--max-reps", "1"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "machine busy before the run" in captured.err and "machine busy after the run" in captured.err
    assert "Legend:" in captured.out and "Host time per call" in captured.out
    lines = (tmp_path / "results.csv").read_text().splitlines()
    assert "# note: machine busy before the run: test" in lines
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert {r["op"] for r in rows} == {"clip"} and len(rows) >= 2
    for r in rows:
        # one repetition shows no spread: unstable; host workloads have no bandwidth figure
        assert r["unstable"] == "1" and r["spread_pct"] == "nan" and r["gbps"] == "nan"
        assert int(r["tensors"]) == 4000 and float(r["host_ms"]) > 0
    assert "UNSTABLE" in (tmp_path / "results.md").read_text()


def test_host_workloads():
    assert [s for _, s, _ in W.one_element()] == [(1,)] * 4000
    entries = W.gpt2_count_small()
    assert len(entries) == len(W.gpt2_small()) == 148
    assert W.nbytes(entries) < 2**20
    assert runner.ops_for("host-148", ["norm", "clip", "gc"]) == ["clip"]
    assert runner.ops_for("gpt2-124m", ["norm", "clip"]) == ["norm", "clip"]
