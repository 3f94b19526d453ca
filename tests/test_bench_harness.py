"""The benchmark harness's own logic: the GPU code paths run without a GPU (a faked CUDA device), interleaved
rounds, paired ratios with their intervals and verdicts, the adaptive stop, each op's floor pass and which
floor applies, the busy-machine warning, and the host-overhead workloads."""

from __future__ import annotations

import collections
import csv
import importlib
import json
import math
import time

import pytest
import torch

from fastgrad import bench
from fastgrad.benchmark import ops as benchmark_ops
from fastgrad.benchmark import counting, report, runner, timing
from fastgrad.benchmark import workloads as benchmark_workloads


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
    orig_materialize = benchmark_workloads.materialize
    monkeypatch.setattr(benchmark_workloads, "materialize",
                        lambda w, device, seed=0: orig_materialize(w, on_cpu(device), seed))

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

    # No profiler or sync debug mode without CUDA: the counts of the fake device are fixed, the call real.
    def count_cuda(fn):
        calls["count_cuda"] += 1
        fn()
        return 7, 1

    monkeypatch.setattr(counting, "count_cuda", count_cuda)
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
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    impls = {r["impl"] for r in rows}
    # the tensors are on the CPU, so the automatic choice is the cpu backend; torch (asked for) is a reference
    base = {"torch eager", "fastgrad auto", "fastgrad:torch"}
    assert impls == (base | {"torch.compile"} if compiled else base)
    # three rounds give no interval: the automatic rows say so, nothing failed
    assert all(r["note"] == "" or r["note"].startswith("unsettled after 3 rounds") for r in rows), rows
    # tiny runs both ops, host-148 only clip
    assert {(r["workload"], r["op"]) for r in rows} == {("tiny", "norm"), ("tiny", "clip"), ("host-148", "clip")}
    # --compile auto means on for CUDA; dynamo is reset after every workload only when it was used
    assert calls["compiled"] == (3 if compiled else 0)
    assert calls["dynamo_reset"] == (2 if compiled else 0)
    assert calls["empty_cache"] == 2  # once per workload
    # CUDA-event timing was selected (every timed repetition read its events), and the L2 flush ran
    (timer,) = timers
    assert timer.cuda and timer._flush is not None and not timer._flush.any()
    assert _FakeEvent.reads >= sum(int(r["rounds"]) for r in rows) > 0
    auto = [r for r in rows if r["role"] == "auto"]
    assert len(auto) == 3 and all(r["verdict"] and float(r["speedup"]) > 0 for r in auto)
    # every implementation counted once on the device: kernels and syncs from the (faked) profiler and sync
    # debug mode, operators from the dispatch mode except for the compiled function
    assert calls["count_cuda"] == len(rows)
    for r in rows:
        assert (r["kernels_per_call"], r["syncs_per_call"]) == ("7", "1"), r
        assert (r["ops_per_call"] == "") == (r["impl"] == "torch.compile"), r
    if compiled:
        assert all(r["compile_verdict"] and float(r["vs_compile"]) > 0 for r in auto)
    assert calls["synchronize"] > 0
    assert "Fake GPU" in capsys.readouterr().out


# ------------------------------------------------------------------------------------- timing
def test_spread_is_iqr_over_median():
    xs = [float(x) for x in range(1, 12)]  # median 6, p25 3.5, p75 8.5
    assert timing.spread(xs) == pytest.approx((8.5 - 3.5) / 6)
    assert timing.spread([10.0] * 10 + [500.0]) == 0.0
    assert math.isnan(timing.spread([1.0]))


def _coverage(n: int, k: int) -> float:
    """P(x_(k) <= median <= x_(n+1-k)) for n samples of a continuous distribution, by direct enumeration."""
    return sum(math.comb(n, i) for i in range(k, n - k + 1)) / 2 ** n


@pytest.mark.parametrize("n", [1, 2, 5, 6, 7, 8, 9, 12, 20, 40, 101])
def test_ci_rank_is_the_widest_safe_order_statistic(n):
    k = timing.ci_rank(n, 0.95)
    if n < 6:  # 2 / 2^5 = 6.25% > 5%: no interval from five samples or fewer
        assert k == 0
        return
    assert k >= 1 and _coverage(n, k) >= 0.95
    # one rank further in would no longer cover the median with 95%
    assert k + 1 > n // 2 or _coverage(n, k + 1) < 0.95


def test_paired_ratio_cancels_a_drifting_machine():
    # The machine slows down 3x halfway through; fastgrad is 2x faster in every round.
    base = [10.0, 10.2, 9.9, 10.1, 30.0, 30.5, 29.8, 30.2]
    cand = [5.0, 5.1, 4.95, 5.05, 15.0, 15.25, 14.9, 15.1]
    r = timing.paired_ratio(base, cand)
    assert r.n == 8 and r.median == pytest.approx(2.0) and r.lo == pytest.approx(2.0) and r.hi == pytest.approx(2.0)
    # unpaired medians would have spread over 3x; rounds where one side is missing are skipped
    r = timing.paired_ratio(base + [None], cand + [7.0])
    assert r.n == 8


def _ratio(values):
    return timing.paired_ratio(list(values), [1.0] * len(values))


def test_verdict_clearly_faster_clearly_slower():
    v, why = timing.verdict(_ratio([1.9, 2.1, 2.0, 1.95, 2.05, 2.2, 1.8, 2.0]))
    assert (v, why) == (timing.FASTER, "")
    v, why = timing.verdict(_ratio([0.5, 0.52, 0.48, 0.51, 0.49, 0.5, 0.53, 0.47]))
    assert (v, why) == (timing.SLOWER, "")


def test_verdict_noisy_is_within_noise_and_says_why():
    # a noisy machine: half the rounds one way, half the other
    v, why = timing.verdict(_ratio([0.7, 1.4, 0.9, 1.3, 0.8, 1.5, 1.1, 0.6]))
    assert v == timing.NOISE and why == "interval straddles 1"
    # steady, but only 3% faster: a shared machine does not repeat a difference that small
    v, why = timing.verdict(_ratio([1.03, 1.031, 1.029, 1.032, 1.028, 1.03, 1.033, 1.027]))
    assert v == timing.NOISE and why == "within +-5%"
    v, why = timing.verdict(_ratio([0.97, 0.971, 0.969, 0.972, 0.968, 0.97]))
    assert v == timing.NOISE and why == "within +-5%"
    # too few rounds for an interval: never a verdict either way, however large the ratio
    v, why = timing.verdict(_ratio([3.0, 3.1, 2.9]))
    assert (v, why) == (timing.NO_INTERVAL, "3 rounds")
    # one bad round among many moves neither the median nor (with enough rounds) the interval
    v, _ = timing.verdict(_ratio([2.0] * 19 + [0.1]))
    assert v == timing.FASTER


def test_settled():
    assert timing.settled(_ratio([2.0, 2.1, 1.9, 2.0, 2.2, 1.8]))  # clear of every threshold
    assert timing.settled(_ratio([1.0, 1.01, 0.99, 1.0, 1.02, 0.98]))  # inside the +-5% band
    assert not timing.settled(_ratio([0.8, 1.3, 1.0, 1.2, 0.9, 1.1]))  # straddles the thresholds, wide
    assert not timing.settled(_ratio([2.0, 2.0, 2.0]))  # no interval yet


def _sleeper(ms):
    return lambda: time.sleep(ms / 1e3)


def test_rounds_interleave_and_stop_when_settled():
    order = []

    def make(name, ms):
        def f():
            order.append(name)
            time.sleep(ms / 1e3)
        return f

    t = timing.Timer("cpu", warmup=1)
    # b is 4x faster than a: settled as soon as there is an interval (6 rounds), long before the budget
    rr = t.rounds([make("a", 8), make("b", 2)], pairs=[(0, 1)], min_rounds=6, max_rounds=500, budget_s=30)
    assert rr.stopped == "settled" and rr.n_rounds == 6
    assert order[2:] == ["a", "b", "b", "a"] * 3  # after the warm-up: the starting one rotates
    r = timing.paired_ratio(rr.dev_ms[0], rr.dev_ms[1])
    assert timing.verdict(r)[0] == timing.FASTER


def test_rounds_budget_references_and_failures():
    calls = collections.Counter()

    def counted(name, ms):
        def f():
            calls[name] += 1
            time.sleep(ms / 1e3)
        return f

    def boom():
        raise RuntimeError("broken impl")

    t = timing.Timer("cpu", warmup=1)
    # a pair that cannot settle (the same function twice, each round's ratio near 1 but noisy) stops on the
    # budget; the reference runs in the first 3 rounds only; the failing one leaves at its warm-up
    fns = [counted("a", 1), counted("b", 1), counted("ref", 1), boom]
    rr = t.rounds(fns, pairs=[], min_rounds=4, max_rounds=10_000, budget_s=0.15, ref=(2,), ref_rounds=3)
    assert rr.stopped == "budget" and rr.n_rounds >= 4
    assert isinstance(rr.errors[3], RuntimeError)
    assert calls["ref"] == 1 + 3 and sum(x is not None for x in rr.dev_ms[2]) == 3
    assert calls["a"] == 1 + rr.n_rounds
    rr = t.rounds(fns[:2], pairs=[], min_rounds=2, max_rounds=5, budget_s=60)
    assert rr.stopped == "max_rounds" and rr.n_rounds == 5


# ------------------------------------------------------------------------------------- floors
def test_floor_model_bytes_per_op():
    """The floor model, per op, in bytes read and written (N gradient bytes, P parameter bytes)."""
    n, p = 1000, 300
    expected = {  # op: (bytes read, bytes written)
        "norm": (n, 0),
        "clip": (n, 0),                    # the norm only: nothing is scaled
        "clip_trig": (2 * n, n),           # the norm's read, then a read+write scaling pass
        "clip_value": (n, n),
        "amp_clip": (2 * n, n),            # the unscaled norm + inf check, then unscale and clip in one pass
        "agc": (p + n, n),                 # params and grads read once, grads written once
        "gc": (n, n),
        "grad_stats": (n, 0),
    }
    assert set(expected) == set(benchmark_ops.OPS)
    for op, (read, written) in expected.items():
        f = benchmark_ops.OPS[op].floor
        assert (f.bytes_read(n, p), f.bytes_written(n, p)) == (read, written), op
        assert f.bytes_moved(n, p) == read + written
        # priced by kind of pass: the read-only passes' bytes, and the read+write passes' (read + written)
        assert f.read_only_bytes(n, p) + f.rw_bytes(n, p) == read + written, op
        assert f.working_set(n, p) == n + (p if op == "agc" else 0), op
    assert benchmark_ops.OPS["clip_trig"].floor.text() == "read 2N, write N"
    assert benchmark_ops.OPS["agc"].floor.text() == "read P + N, write N"
    s = benchmark_ops.OPS["clip_trig"]
    assert s.floor_s(n, p, read_gbps=1.0, rw_gbps=4.0) == pytest.approx(n / 1e9 + 2 * n / 4e9)


@pytest.mark.parametrize("op", list(benchmark_ops.OPS))
def test_floor_pass_does_the_ops_passes_and_changes_no_byte(op):
    f = benchmark_ops.OPS[op].floor
    gen = torch.Generator().manual_seed(1)
    g = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    # every bit pattern a float32 view can hold, NaNs included: a read+write pass must leave them as they are
    g[:8] = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F, 0x01, 0x00, 0x80, 0xFF], dtype=torch.uint8)
    pbuf = torch.randint(0, 256, (1024,), dtype=torch.uint8, generator=gen)
    g0, p0 = g.clone(), pbuf.clone()
    calls = counting.count_ops(lambda: f.run(g, pbuf if f.param_reads else None))
    # (views and detaches of the buffers move no bytes)
    passes = collections.Counter({k: v for k, v in calls.items() if not k.startswith(("aten.view", "aten.detach"))})
    want = collections.Counter()
    if f.param_reads + f.grad_reads - f.grad_writes:
        want["aten.sum.default"] = f.param_reads + f.grad_reads - f.grad_writes
    if f.grad_writes:
        want["aten.bitwise_or_.Scalar"] = f.grad_writes
    assert passes == want, (op, calls)
    assert torch.equal(g, g0) and torch.equal(pbuf, p0)


def test_floor_buffers_have_the_ops_bytes():
    w = benchmark_workloads.prepare("tiny", None)
    st = benchmark_ops.OpState(benchmark_workloads.materialize(w, "cpu"))
    gbuf, pbuf = st.floor_buffers(benchmark_ops.OPS["norm"].floor)
    assert pbuf is None and gbuf.numel() == st.grad_bytes - st.grad_bytes % 4
    gbuf, pbuf = st.floor_buffers(benchmark_ops.OPS["agc"].floor)
    assert pbuf is not None and pbuf.numel() == st.param_bytes - st.param_bytes % 4
    # the saved gradients live in the buffer the pass streams over (no second N-byte allocation) ...
    assert all(s.untyped_storage().data_ptr() == gbuf.untyped_storage().data_ptr() for s in st._saved)
    # ... and restore them exactly
    orig = [g.clone() for g in st.grads]
    with torch.no_grad():
        for g in st.grads:
            g.mul_(3.0)
    st.restore()
    assert all(torch.equal(a, b) for a, b in zip(st.grads, orig))
    st.release_floor()
    assert st._param_buf is None


def test_which_floor_applies():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    llc = 32 << 20
    assert runner.floor_kind(cpu, 24 << 20, llc) == runner.CACHE_FLOOR
    assert runner.floor_kind(cpu, llc, llc) == runner.CACHE_FLOOR
    assert runner.floor_kind(cpu, llc + 1, llc) == runner.MEMORY_FLOOR
    assert runner.floor_kind(cpu, 1 << 20, 0) == runner.MEMORY_FLOOR  # cache size unknown
    assert runner.floor_kind(cuda, 1 << 20, llc) == runner.MEMORY_FLOOR  # L2 flushed before every call


def test_pct_floor_is_the_paired_floor_pass_over_the_op(monkeypatch, tmp_path):
    """% of the floor = median over rounds of (floor pass time / implementation time), the floor pass timed in
    the same rounds: a floor pass of ~10 ms against an op of ~20 ms reads about 50%."""
    monkeypatch.setattr(runner, "MIN_FLOOR_BYTES", 0)
    monkeypatch.setattr(runner, "last_level_cache_bytes", lambda: 2**30)
    monkeypatch.setattr(benchmark_ops.OpState, "floor_fn", lambda self, floor: (lambda: time.sleep(0.010), None))
    monkeypatch.setattr(benchmark_ops, "fastgrad_fn", lambda op, st, backend: lambda: time.sleep(0.020))
    rc = bench.main(["--quick", "--device", "cpu", "--workloads", "tiny", "--ops", "norm", "--backends", "cpu",
                     "--out", str(tmp_path), "--no-progress", "--no-plot", "--no-counts", "--budget", "0",
                     "--min-rounds", "6", "--max-rounds", "6"])
    assert rc == 0
    with open(tmp_path / "results.csv", newline="") as f:
        rows = {r["impl"]: r for r in csv.DictReader(f)}
    auto = rows["fastgrad auto"]
    assert float(auto["pct_floor"]) == pytest.approx(50, rel=0.25)
    assert float(auto["floor_ms"]) == pytest.approx(10, rel=0.5)
    assert auto["floor_kind"] == "cache"  # tiny fits in the (patched) 1 GiB cache
    assert report._pct({"pct_floor": 50.0, "floor_kind": "cache"}) == "50%c"
    assert report._pct({"pct_floor": 80.0, "floor_kind": "memory"}) == "80%"
    # over the floor: no figure, the mark (the runner decides, tests/test_bench_consistency.py)
    assert report._pct({"pct_floor": 120.0, "floor_kind": "memory", "floor_problem": True}) == report.OVER_CELL
    # below MIN_FLOOR_BYTES no floor figure: the pass's fixed cost would be the "floor"
    monkeypatch.setattr(runner, "MIN_FLOOR_BYTES", 1 << 20)
    bench.main(["--quick", "--device", "cpu", "--workloads", "tiny", "--ops", "norm", "--out", str(tmp_path),
                "--no-progress", "--no-plot", "--no-counts", "--budget", "0", "--min-rounds", "2",
                "--max-rounds", "2"])
    with open(tmp_path / "results.csv", newline="") as f:
        assert {(r["pct_floor"], r["floor_kind"]) for r in csv.DictReader(f)} == {("", "")}


# ------------------------------------------------------------------------------------- the run
def test_busy_warning(monkeypatch):
    monkeypatch.setattr(runner, "cpu_count", lambda: 2)
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (2.5, 1.0, 1.0))
    assert "load average 2.50 over 2 cores" in runner.busy_warning("before")
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (1.9, 1.0, 1.0))
    assert runner.busy_warning("before") is None


def test_busy_warning_printed_once_on_its_own_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(runner, "busy_warning", lambda when: f"machine busy {when} the run: test")
    rc = bench.main(["--quick", "--device", "cpu", "--workloads", "host-148", "--out", str(tmp_path),
                     "--budget", "0", "--min-rounds", "1", "--max-rounds", "1", "--no-plot"])
    assert rc == 0
    err = capsys.readouterr().err
    assert err.count("machine busy") == 1
    assert "warning: machine busy before the run: test\n" in err
    assert any(line == "warning: machine busy before the run: test" for line in err.splitlines())
    notes = json.loads((tmp_path / "meta.json").read_text())["notes"]
    assert "machine busy before the run: test" in notes and "machine busy after the run: test" in notes
    # busy only after the run: warned once, at the end
    monkeypatch.setattr(runner, "busy_warning", lambda when: None if when == "before" else "machine busy after")
    bench.main(["--quick", "--device", "cpu", "--workloads", "host-148", "--out", str(tmp_path), "--no-progress",
                "--budget", "0", "--min-rounds", "1", "--max-rounds", "1", "--no-plot"])
    assert capsys.readouterr().err.count("machine busy") == 1


def test_host_workload_rows_and_env_backend_ignored(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FASTGRAD_BACKEND", "torch")
    rc = bench.main(["--quick", "--device", "cpu", "--workloads", "host-4000", "--out", str(tmp_path),
                     "--backends", "all", "--no-progress", "--no-plot", "--budget", "0", "--min-rounds", "1",
                     "--max-rounds", "1"])
    assert rc == 0
    import os

    assert os.environ["FASTGRAD_BACKEND"] == "torch"  # restored after the run
    captured = capsys.readouterr()
    assert "Legend:" in captured.out and "For reference only" in captured.out
    # one round each: no interval, said as such on every such row (never "within noise")
    assert "1 round: no interval" in captured.out and "within noise (" not in captured.out
    with open(tmp_path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["op"] for r in rows} == {"clip"}
    auto = next(r for r in rows if r["role"] == "auto")
    assert auto["backend"] == "cpu"  # the automatic choice, not FASTGRAD_BACKEND's torch
    for r in rows:
        # host workloads have no floor; one round gives no interval, so no verdict either way
        assert r["pct_floor"] == "" and int(r["tensors"]) == 4000 and float(r["host_ms"]) > 0
        if r["role"] != "baseline":
            assert r["verdict"] == "no interval" and r["verdict_why"] == "1 round"
    notes = json.loads((tmp_path / "meta.json").read_text())["notes"]
    assert any("FASTGRAD_BACKEND=torch was ignored" in n for n in notes)


def test_host_workloads():
    assert [s for _, s, _ in benchmark_workloads.one_element()] == [(1,)] * 4000
    entries = benchmark_workloads.gpt2_count_small()
    assert len(entries) == len(benchmark_workloads.gpt2_small()) == 148
    assert benchmark_workloads.nbytes(entries) < 2**20
    assert runner.ops_for("host-148", ["norm", "clip", "gc"]) == ["clip"]
    assert runner.ops_for("gpt2-124m", ["norm", "clip"]) == ["norm", "clip"]


def _res(rows):
    base = runner._row("a", "norm", "x", "auto", "cpu", benchmark_workloads.prepare("tiny", None))
    meta = {"device": "test", "date": "d", "torch": "t", "backends": ["torch", "cpu"],
            "backends_not_benchmarked": {}, "confidence": 0.95, "noise_band": 0.05,
            "workloads": {w: {"host": False, "title": w, "tensors": 1, "grad_bytes": 4, "full_grad_bytes": 4,
                              "note": ""} for w in {r["workload"] for r in rows}}}
    return runner.Result([base | r for r in rows], meta)


def test_report_main_table_holds_only_the_automatic_choice():
    res = _res([
        {"workload": "a", "op": "norm", "impl": "torch eager", "role": "baseline", "median_ms": 2.0},
        {"workload": "a", "op": "norm", "impl": "fastgrad auto", "role": "auto", "median_ms": 1.0, "speedup": 2.0,
         "speedup_lo": 1.9, "speedup_hi": 2.1, "verdict": "faster"},
        {"workload": "a", "op": "norm", "impl": "fastgrad:torch", "role": "reference", "backend": "torch",
         "median_ms": 20.0, "speedup": 0.1, "speedup_lo": 0.09, "speedup_hi": 0.11, "verdict": "slower"},
    ])
    text = report.console_table(res)
    main, ref = text.split("For reference only")
    assert "2.00x [1.90-2.10]" in main and "faster" in main
    assert "0.10x" not in main and "fastgrad:torch" not in main  # the reference backend is not the answer
    assert "0.10x [0.09-0.11]" in ref
    assert "1 faster, 0 slower, 0 within noise" in main
    assert "SPEC" not in text and "SPEC" not in report.markdown(res)


def _side(role, impl, speedup, rounds):
    """A row beside the headline with the verdict the harness gives its per-round ratios."""
    ratio = timing.paired_ratio([speedup] * rounds, [1.0] * rounds)
    v, why = timing.verdict(ratio)
    return {"workload": "a", "op": "norm", "impl": impl, "role": role, "median_ms": 1.0 / speedup,
            "speedup": ratio.median, "speedup_lo": ratio.lo, "speedup_hi": ratio.hi, "verdict": v,
            "verdict_why": why, "rounds": rounds}


def _headline(**kw):
    return [{"workload": "a", "op": "norm", "impl": "torch eager", "role": "baseline", "median_ms": 2.0},
            {"workload": "a", "op": "norm", "impl": "fastgrad auto", "role": "auto", "median_ms": 1.0,
             "speedup": 2.0, "speedup_lo": 1.9, "speedup_hi": 2.1, "verdict": "faster"} | kw]


def test_a_ratio_without_an_interval_is_printed_as_such_never_within_noise():
    res = _res(_headline() + [_side("compile", "torch.compile", 0.30, 3), _side("reference", "fastgrad:torch", 0.47, 3),
                              _side("reference", "fastgrad:triton", 0.9, 1)])
    for text in (report.console_table(res), report.markdown(res)):
        rows = [line for line in text.splitlines() if "0.30x" in line or "0.47x" in line or "0.90x" in line]
        assert len(rows) >= 3 and all("no interval" in line and "within noise" not in line for line in rows), rows
        assert "0.30x [no interval]" in text and "3 rounds: no interval" in text and "1 round: no interval" in text
    # the headline's own count keeps them apart too
    res = _res(_headline(speedup=3.0, speedup_lo=float("nan"), speedup_hi=float("nan"), verdict="no interval",
                         verdict_why="3 rounds"))
    text = report.console_table(res)
    assert "0 faster, 0 slower, 0 within noise, 1 with no interval (too few rounds) (of 1 cases)" in text
    assert "3 rounds: no interval" in text
    # enough rounds for an interval: a verdict again (the rule's boundary, from the sign-test rank)
    n = next(n for n in range(1, 20) if timing.ci_rank(n) > 0)
    assert timing.verdict(timing.paired_ratio([0.3] * (n - 1), [1.0] * (n - 1)))[0] == timing.NO_INTERVAL
    assert timing.verdict(timing.paired_ratio([0.3] * n, [1.0] * n))[0] == timing.SLOWER
    assert timing.verdict(timing.Ratio(float("nan"), float("nan"), float("nan"), 0)) == (timing.NOT_MEASURED, "")


def _names_only_what_it_holds(text: str, roles: set[str]) -> None:
    for role, what in report.SIDE_KINDS.items():
        assert (what in text) == (role in roles), (role, what, roles)


@pytest.mark.parametrize("roles", [{"compile", "other baseline"}, {"reference"}, {"compile"},
                                   {"reference", "compile", "other baseline"}, set()])
def test_the_text_never_states_what_its_tables_contradict(roles):
    """The run's note for the automatic choice alone, beside tables that hold torch.compile and the own loops (the
    14 rows a CPU run printed under "no reference rows"): every line names only kinds of rows that are there."""
    side = [_side(role, {"compile": "torch.compile", "other baseline": "torch: own loop",
                         "reference": "fastgrad:torch"}[role], 0.5, 3) for role in sorted(roles)]
    res = _res(_headline() + side)
    if "reference" not in roles:
        res.notes.append(runner.ONLY_AUTOMATIC_NOTE)
    text = report.console_table(res)
    main, _, rest = text.partition("For reference only")
    assert bool(rest) == bool(roles)
    _names_only_what_it_holds(text.split("Legend:")[0], roles)
    _names_only_what_it_holds(report.markdown(res).split("## How to read")[0], roles)
    assert "no reference rows" not in text and "no reference rows" not in report.markdown(res)
    if "reference" not in roles:
        # what the note denies (other fastgrad backends) is what no table holds
        assert "fastgrad backends benchmarked" in "\n".join(report.meta_lines(res))
        assert "fastgrad:" not in text


def test_rounds_keep_the_fastest_of_back_to_back_calls():
    """A round calls each implementation `inner` times and keeps its fastest call: a call interrupted by
    the rest of the machine (here: every other call sleeps 30 ms longer) never sets the round's time."""
    count = collections.Counter()

    def flaky():
        count["f"] += 1
        time.sleep(0.032 if count["f"] % 2 else 0.002)

    t = timing.Timer("cpu", warmup=1)
    rr = t.rounds([flaky], pairs=[], min_rounds=4, max_rounds=4, budget_s=0, inner=2)
    assert rr.inner == 2 and count["f"] == 1 + 4 * 2
    assert all(x < 0.025 * 1e3 for x in rr.dev_ms[0]), rr.dev_ms
    # chosen automatically: several calls for short functions, one for long ones
    assert t.rounds([lambda: None], pairs=[], min_rounds=1, max_rounds=1, budget_s=0, inner=None).inner == \
        timing.INNER
    slow = t.rounds([lambda: time.sleep(timing.INNER_BELOW_S * 1.5)], pairs=[], min_rounds=1, max_rounds=1,
                    budget_s=0, inner=None)
    assert slow.inner == 1


def test_rounds_stop_when_a_pair_loses_its_baseline():
    calls = collections.Counter()

    def ok():
        calls["ok"] += 1

    def boom():
        raise RuntimeError("baseline broken")

    t = timing.Timer("cpu", warmup=1)
    rr = t.rounds([boom, ok], pairs=[(0, 1)], min_rounds=3, max_rounds=10_000, budget_s=60)
    assert rr.stopped == "failed" and rr.n_rounds == 3 and calls["ok"] == 1 + 3


def test_gpu_goals_table_says_met_and_host_bound():
    res = _res([
        {"workload": "gpt2-124m", "op": "norm", "impl": "fastgrad auto", "role": "auto", "median_ms": 0.10,
         "host_ms": 0.09, "pct_floor": 55.0, "kernels_per_call": 3},
        {"workload": "gpt2-124m", "op": "gc", "impl": "fastgrad auto", "role": "auto", "median_ms": 0.30,
         "host_ms": 0.02, "pct_floor": 61.0, "kernels_per_call": 1},
    ])
    assert report.goals_table(res) == []  # not a GPU run: the goals do not apply
    res.meta["device_type"] = "cuda"
    table = report.goals_table(res)
    assert table[2].startswith("| gpt2-124m | norm | 60% | 55% | no | 0.100 | 0.090 | 0.90 host-bound | 3 |")
    assert table[3].startswith("| gpt2-124m | gc | 60% | 61% | yes | 0.300 | 0.020 | 0.07 | 1 |")
    assert "## % of the floor against the GPU goals" in report.markdown(res)


def test_rounds_of_limits_named_functions_to_their_first_rounds():
    count = collections.Counter()

    def make(name):
        def f():
            count[name] += 1
        return f

    t = timing.Timer("cpu", warmup=1)
    rr = t.rounds([make("a"), make("b"), make("c")], pairs=[], min_rounds=8, max_rounds=8, budget_s=60,
                  ref=(2,), ref_rounds=5, rounds_of={1: 3})
    assert rr.n_rounds == 8
    assert count == {"a": 1 + 8, "b": 1 + 3, "c": 1 + 5}  # warm-up call + rounds
    assert [x is None for x in rr.dev_ms[1]] == [False] * 3 + [True] * 5
