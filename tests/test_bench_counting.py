"""The benchmark's counters (fastgrad.benchmark.counting): torch operators of a known function counted exactly,
the reset left out of the count, and the CUDA counts' parsing of profiler rows and sync warnings (the profiler
and the sync debug mode themselves need a GPU; the next GPU run exercises them)."""

from __future__ import annotations

import collections
import warnings
from types import SimpleNamespace

import torch

from fastgrad.benchmark import counting


def test_counts_the_operators_of_a_known_function():
    x = torch.randn(10)
    counts = counting.count_ops(lambda: (x + 1).mul_(2).sum())
    assert counts == collections.Counter({"aten.add.Tensor": 1, "aten.mul_.Tensor": 1, "aten.sum.default": 1})


def test_counts_a_python_loop_per_iteration():
    xs = [torch.randn(3) for _ in range(7)]

    def loop():
        for t in xs:
            t.mul_(1.5)

    def foreach():
        torch._foreach_mul_(xs, 1.5)

    assert sum(counting.count_ops(loop).values()) == 7
    assert counting.count_ops(foreach) == collections.Counter({"aten._foreach_mul_.Scalar": 1})


def test_count_call_leaves_the_reset_out_and_counts_no_cuda_on_the_cpu():
    x = torch.randn(10)
    resets = []

    def reset():
        resets.append(1)
        x.fill_(1.0)  # an operator, not the call's: not counted

    c = counting.count_call(lambda: x.add_(1.0), torch.device("cpu"), reset)
    assert c == counting.Counts(ops=1, kernels=None, syncs=None) and resets == [1]
    assert counting.count_call(lambda: x.add_(1.0), torch.device("cpu"), ops=False) == counting.Counts()
    row = c.as_row()
    assert row["ops_per_call"] == 1 and row["kernels_per_call"] != row["kernels_per_call"]  # NaN: not counted


def test_launches_are_the_cuda_rows_without_kinetos_own():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(device_type=cuda, name="void multi_tensor_apply_kernel<...>"),
              SimpleNamespace(device_type=cuda, name="Memset (Device)"),
              SimpleNamespace(device_type=cuda, name="Activity Buffer Request"),
              SimpleNamespace(device_type=cpu, name="aten::_foreach_norm"),
              SimpleNamespace(device_type=cpu, name="cudaLaunchKernel"),
              SimpleNamespace(device_type=cuda, name="reduce_kernel")]
    assert counting.launches(events) == 3


def test_syncs_are_the_sync_debug_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("called a synchronizing CUDA operation", UserWarning)
        warnings.warn("something else", UserWarning)
        warnings.warn("Called a synchronizing CUDA operation (item)", UserWarning)
    assert counting.sync_warnings(caught) == 2
