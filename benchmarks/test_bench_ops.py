"""pytest-benchmark cases for the main ops, so regressions show in its comparison tool:

    python -m pytest benchmarks --benchmark-only --benchmark-autosave      # then later
    python -m pytest benchmarks --benchmark-only --benchmark-compare

Not part of the ``tests/`` run (pyproject's testpaths). Each case benchmarks fastgrad on every backend usable
on the device and the torch baseline, on a real model's shapes (scaled to ``FASTGRAD_BENCH_MAX_MB`` MiB of
gradients, default 16 on the CPU and unscaled on CUDA) and on the 4000-small-tensor workload. Gradients are
restored before every round (untimed), so ops that write them always see the same data.

Without pytest-benchmark installed, a stand-in ``benchmark`` fixture calls each case once (no timing), so the
cases' correctness checks still run: ``python -m pytest benchmarks``.
"""

from __future__ import annotations

import os

import pytest
import torch

from fastgrad.benchmark import ops as benchmark_ops
from fastgrad.benchmark import workloads as benchmark_workloads
from fastgrad.benchmark.runner import usable_backends

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_MB = float(os.environ.get("FASTGRAD_BENCH_MAX_MB", "16" if DEVICE.type == "cpu" else "0"))
BACKENDS, _ = usable_backends(DEVICE)
WORKLOADS = ("resnet50", "gpt2-124m", "small-4000")
OPS = ("norm", "clip", "clip_trig", "clip_value", "amp_clip", "agc", "gc", "grad_stats")

_states: dict[str, benchmark_ops.OpState] = {}

try:
    import pytest_benchmark  # noqa: F401 - the plugin provides the real `benchmark` fixture
except ImportError:
    class _Once:
        """The part of pytest-benchmark's fixture these cases use; runs the case once, untimed."""

        def __init__(self):
            self.extra_info: dict = {}
            self.group = None

        def pedantic(self, fn, setup=None, rounds=1, iterations=1, warmup_rounds=0):
            if setup is not None:
                setup()
            return fn()

    @pytest.fixture
    def benchmark():
        return _Once()


def _state(workload: str) -> benchmark_ops.OpState:
    if workload not in _states:
        _states.clear()  # one materialized workload at a time
        w = benchmark_workloads.prepare(workload, int(MAX_MB * 2**20) if MAX_MB > 0 else None)
        st = benchmark_ops.OpState(benchmark_workloads.materialize(w, DEVICE))
        st.save()
        _states[workload] = st
    return _states[workload]


def _synced(fn):
    if DEVICE.type != "cuda":
        return fn

    def call():
        out = fn()
        torch.cuda.synchronize()
        return out

    return call


def _run(benchmark, st: benchmark_ops.OpState, op: str, fn) -> None:
    spec = benchmark_ops.OPS[op]
    benchmark.extra_info.update(op=op, device=str(DEVICE), grad_mb=sum(g.numel() * g.element_size()
                                                                         for g in st.grads) / 2**20)

    def setup():
        st.restore()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    rounds = 5 if DEVICE.type == "cpu" else 20
    benchmark.pedantic(_synced(fn), setup=setup if spec.mutates else None, rounds=rounds, iterations=1,
                       warmup_rounds=1)


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", ["torch-eager"] + [f"fastgrad-{b}" for b in BACKENDS])
def test_bench(benchmark, workload, op, impl):
    st = _state(workload)
    benchmark.group = f"{workload}:{op}"
    if impl == "torch-eager":
        fn = benchmark_ops.torch_fn(op, st)
    else:
        fn = benchmark_ops.fastgrad_fn(op, st, impl.removeprefix("fastgrad-"))
    _run(benchmark, st, op, fn)
    # The benchmarked call must also be the right call. docs/contract.md section 3's accuracy rule: against a float64
    # oracle, fastgrad's clipped gradients are no further off than torch's own (plus 1 ulp).
    if op == "clip_trig" and impl != "torch-eager":
        st.restore()
        fn()
        mine = [g.clone() for g in st.grads]
        st.restore()
        benchmark_ops.torch_fn(op, st)()
        theirs = [g.clone() for g in st.grads]
        st.restore()
        orig = [g.double() for g in st.grads]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in orig]))
        coef = torch.clamp(st.max_norm_trig / (norm + 1e-6), max=1.0)
        for a, b, g in zip(mine, theirs, orig):
            ref = g * coef
            ulp = torch.finfo(a.dtype).eps * ref.abs().max()
            assert (a.double() - ref).abs().max() <= (b.double() - ref).abs().max() + ulp
