"""The one-pass list scans (fastgrad/_scan.py, csrc/host.cpp): the compiled helpers agree with the Python
definitions they replace, refuse everything outside the common case, and the public API gives identical
results and identical errors with the fast path on and off."""

from __future__ import annotations

import struct

import pytest
import torch

import fastgrad
from fastgrad import _ext, _inputs, _scan
from fastgrad.backends import acc_dtype

needs_helpers = pytest.mark.skipif(not (_ext.load() is not None and hasattr(_ext.load(), "scan")),
                                   reason=f"fastgrad._C host helpers not usable: {_ext.load_error()}")
BITS = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}


@pytest.fixture
def fast_path():
    prev = _scan.set_enabled(True)
    yield
    _scan.set_enabled(prev)


@pytest.fixture
def slow_path():
    prev = _scan.set_enabled(False)
    yield
    _scan.set_enabled(prev)


def _params(seed=0, dtypes=(torch.float32, torch.bfloat16, torch.float64, torch.float16), with_none=True):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for i, dt in enumerate(dtypes * 3):
        p = torch.nn.Parameter(torch.randn(3 + i, 5, generator=g).to(dt))
        if not (with_none and i % 4 == 1):
            p.grad = torch.randn(p.shape, generator=g).to(dt)
        ps.append(p)
    return ps


# ------------------------------------------------------------------------------------ the helpers
@needs_helpers
def test_grads_of_matches_python(fast_path):
    ps = _params()
    c = _ext.load()
    got = c.grads_of(ps)
    want = [p.grad for p in ps if p.grad is not None]
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))  # the same objects, in order
    assert c.grads_of(tuple(ps)) == got
    assert c.grads_of([]) == []
    assert c.grads_of([torch.nn.Parameter(torch.ones(2))]) == []


@needs_helpers
def test_grads_of_refuses_what_python_must_handle(fast_path):
    c = _ext.load()

    class Sub(torch.Tensor):
        pass

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    assert c.grads_of([p, 3]) is None  # not a tensor: Python raises its own error
    assert c.grads_of([p, torch.ones(2).as_subclass(Sub)]) is None  # a subclass may override .grad
    assert c.grads_of(iter([p])) is None  # only lists and tuples
    assert c.grads_of(p) is None


@needs_helpers
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16, torch.float32), tuple(BITS)])
def test_scan_reports_device_dtypes_contiguity(fast_path, dtypes):
    ts = [torch.randn(4, 3).to(dt) for dt in dtypes]
    dev, mask, contiguous = _ext.load().scan(ts)
    assert dev == torch.device("cpu") and contiguous is True
    assert mask == sum(BITS[dt] for dt in set(dtypes))
    ts.append(torch.randn(5, 6).t())  # dense, not contiguous
    assert _ext.load().scan(ts)[2] is False


@needs_helpers
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("case", ["empty", "int", "bool", "complex", "sparse", "meta_mixed", "subclass",
                                  "neg_view", "nested", "non_tensor", "none"])
def test_scan_refuses_uncommon_lists(fast_path, case):
    class Sub(torch.Tensor):
        pass

    ok = torch.randn(3)
    bad = {
        "empty": lambda: None,
        "int": lambda: torch.ones(3, dtype=torch.int32),
        "bool": lambda: torch.ones(3, dtype=torch.bool),
        "complex": lambda: torch.randn(3, dtype=torch.complex64),
        "sparse": lambda: torch.randn(3, 3).to_sparse(),
        "meta_mixed": lambda: torch.empty(3, device="meta"),
        "subclass": lambda: torch.randn(3).as_subclass(Sub),
        "neg_view": lambda: torch._neg_view(torch.randn(3)),
        "nested": lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
        "non_tensor": lambda: 1.0,
        "none": lambda: None,
    }[case]()
    lst = [] if case == "empty" else [ok, bad]
    assert _ext.load().scan(lst) is None
    assert type(_scan.checked(lst)) is list
    assert _ext.load().plan_key([bad]) is None or case in ("meta_mixed", "empty")


@needs_helpers
def test_plan_key_is_ptr_numel_dtype(fast_path):
    ts = [torch.randn(5, 7), torch.randn(0), torch.randn(3).to(torch.bfloat16), torch.randn(2, 2).double()]
    key = _ext.load().plan_key(ts)
    want = b"".join(struct.pack("=qqq", t.data_ptr(), t.numel(), BITS[t.dtype]) for t in ts)
    assert key == want
    assert _ext.load().plan_key([]) == b""


# ------------------------------------------------------------------------------------ the wrappers
@needs_helpers
def test_checked_list_facts(fast_path):
    ts = [torch.randn(4).to(dt) for dt in (torch.bfloat16, torch.float16)]
    c = _scan.checked(ts)
    assert type(c) is _scan.Checked and list(c) == ts
    assert _inputs.promoted_dtype(c) == torch.float32 == _inputs.promoted_dtype(ts)
    assert acc_dtype(c) == torch.float32
    assert _inputs.has_dtype(c, torch.float16) and not _inputs.has_dtype(c, torch.float64)
    assert _inputs.split_by_device(c) == [c]
    assert _inputs.check_tensors(c) is False
    c64 = _scan.checked(ts + [torch.randn(2).double()])
    assert acc_dtype(c64) == torch.float64 == _inputs.promoted_dtype(c64)
    assert _scan.checked(c64) is c64


def test_disabled_means_plain_lists(slow_path):
    ps = _params()
    grads = _inputs.grads_of(ps)
    assert type(grads) is list and grads == [p.grad for p in ps if p.grad is not None]
    assert type(_scan.checked(grads)) is list
    assert _scan.plan_key(grads) is None


def test_compiling_uses_python(fast_path, monkeypatch):
    # Under torch.compile the helpers are opaque to dynamo: the scan must step aside.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _scan.helpers() is None
    assert type(_inputs.grads_of(_params())) is list


# ------------------------------------------------------------------------------------ public API
def _run_all(params, backend):
    out = {}
    out["norm"] = fastgrad.get_total_norm([p.grad for p in params if p.grad is not None], 2.0, backend=backend)
    out["inf"] = fastgrad.multi_tensor_norm([p.grad for p in params if p.grad is not None], float("inf"),
                                            per_tensor=True, backend=backend)
    out["clip"] = fastgrad.clip_grad_norm_(params, 0.5, backend=backend)
    fastgrad.clip_grad_value_(params, 0.01, backend=backend)
    out["grads"] = [p.grad.clone() for p in params if p.grad is not None]
    return out


@needs_helpers
def test_public_api_same_bits_fast_and_slow(bd):
    backend, device = bd
    results = []
    for enabled in (True, False):
        prev = _scan.set_enabled(enabled)
        try:
            ps = [torch.nn.Parameter(p.detach().clone()) for p in _params(seed=3)]
            for p, q in zip(ps, _params(seed=3)):
                p.data = p.data.to(device)
                if q.grad is not None:
                    p.grad = q.grad.to(device)
            results.append(_run_all(ps, backend))
        finally:
            _scan.set_enabled(prev)
    fast, slow = results
    for key in ("norm", "clip"):
        assert fast[key].dtype == slow[key].dtype and torch.equal(fast[key], slow[key]), key
    assert all(torch.equal(a, b) for a, b in zip(fast["inf"], slow["inf"]))
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(fast["grads"], slow["grads"]))


@pytest.mark.parametrize("enabled", [True, False])
def test_errors_identical_fast_and_slow(enabled):
    prev = _scan.set_enabled(enabled)
    try:
        p = torch.nn.Parameter(torch.randn(3))
        p.grad = torch.randn(3)
        before = p.grad.clone()
        with pytest.raises(TypeError, match="must be tensors, got int"):
            fastgrad.get_total_norm([p.grad, 3])
        with pytest.raises(TypeError, match="floating point"):
            fastgrad.multi_tensor_norm([p.grad, torch.ones(3, dtype=torch.int64)])
        q = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
        q.grad = torch.randn(3, dtype=torch.complex64)
        with pytest.raises(fastgrad.BackendError, match="complex"):
            fastgrad.clip_grad_norm_([p, q], 1e-3, backend="cpu")
        with pytest.raises(ValueError, match="max_norm"):
            fastgrad.clip_grad_norm_([p], float("nan"))
        assert torch.equal(p.grad, before)
    finally:
        _scan.set_enabled(prev)


def _fastgrad_lines(n: int, fn) -> int:
    """Python lines executed inside the fastgrad package by fn(params) for n tiny tensors."""
    import os
    import sys

    root = os.path.dirname(os.path.abspath(fastgrad.__file__))
    ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(4)
    fn(ps)  # warm caches (backend availability, kernel tables)
    count = [0]

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(root):
            return None
        if event == "line":
            count[0] += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn(ps)
    finally:
        sys.settrace(None)
    return count[0]


def _amp_call(ps):
    opt = torch.optim.SGD(ps, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    scaler.scale(torch.ones(()))  # creates the scale tensor, as a training step would
    fastgrad.scaler_unscale_and_clip(scaler, opt, 1e-3)


HOST_CALLS = {
    "adaptive_clip_grad_": lambda ps: fastgrad.adaptive_clip_grad_(ps, 0.01),
    "scaler_unscale_and_clip": _amp_call,
    "clip_grad_norm_": lambda ps: fastgrad.clip_grad_norm_(ps, 1e-3),
    "clip_grad_value_": lambda ps: fastgrad.clip_grad_value_(ps, 1e-3),
    "get_total_norm": lambda ps: fastgrad.get_total_norm([p.grad for p in ps]),
}


@needs_helpers
@pytest.mark.parametrize("name", sorted(HOST_CALLS))
def test_no_python_work_per_tensor(name):
    # The point of the scan: the host path runs the same Python whatever the list length. With the scan
    # off, the per-tensor Python loops show up (so this test can fail).
    fn = HOST_CALLS[name]
    prev = _scan.set_enabled(True)
    try:
        assert _fastgrad_lines(400, fn) == _fastgrad_lines(20, fn)
        _scan.set_enabled(False)
        assert _fastgrad_lines(400, fn) > _fastgrad_lines(20, fn)
    finally:
        _scan.set_enabled(prev)


# ------------------------------------------------------------ clip_grad_norm_ in one C++ call (cpu)
def _clip_params(seed, dtypes, shapes=((7, 5), (0,), (33,), (3, 4, 5)), transpose=False, special=None):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for i, dt in enumerate(dtypes):
        for j, shape in enumerate(shapes):
            p = torch.nn.Parameter(torch.randn(shape, generator=g).to(dt))
            grad = (torch.randn(shape, generator=g) * 10 ** (i - 1)).to(dt)
            if transpose and grad.dim() == 2:
                grad = grad.t().contiguous().t()  # dense but not contiguous
            if special is not None and i == 0 and j == 0:
                grad.view(-1)[3] = special
            p.grad = grad
            ps.append(p)
    return ps


def _clip_both_ways(monkeypatch, make, **kw):
    """clip_grad_norm_ with the one-call path and with the op-by-op path (same backend) on fresh copies."""
    out = []
    for fast in (True, False):
        ps = make()
        with monkeypatch.context() as m:
            if not fast:
                m.setattr(_scan, "clip_norm_cpu", lambda *a: None)
            calls = []
            real = _scan.clip_norm_cpu
            m.setattr(_scan, "clip_norm_cpu", lambda *a: calls.append(real(*a)) or calls[-1])
            try:
                total = fastgrad.clip_grad_norm_(ps, **kw)
            except RuntimeError as exc:
                total = exc
        out.append((total, [p.grad for p in ps], calls[0] is not None))
    return out


CLIP_DTYPES = [(torch.float32,), (torch.float64,), (torch.float16,), (torch.bfloat16,),
               (torch.float32, torch.bfloat16, torch.float16), (torch.float16, torch.float64)]


@needs_helpers
@pytest.mark.parametrize("dtypes", CLIP_DTYPES, ids=lambda d: "-".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 0.5, 3.0])
@pytest.mark.parametrize("max_norm", [1e-3, 1e9, 0.0, float("inf")])
def test_clip_one_call_same_bits_as_op_by_op(monkeypatch, fast_path, dtypes, norm_type, max_norm):
    (t1, g1, took), (t2, g2, _) = _clip_both_ways(
        monkeypatch, lambda: _clip_params(5, dtypes, transpose=True), max_norm=max_norm, norm_type=norm_type)
    assert took, "the one-call path was not taken"
    assert t1.dtype == t2.dtype and t1.shape == () and torch.equal(t1, t2)
    assert all(a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b) for a, b in zip(g1, g2))


@needs_helpers
@pytest.mark.parametrize("special", [float("nan"), float("inf")])
@pytest.mark.parametrize("error_if_nonfinite", [False, True])
def test_clip_one_call_nonfinite(monkeypatch, fast_path, special, error_if_nonfinite):
    make = lambda: _clip_params(6, (torch.float32, torch.float16), special=special)  # noqa: E731
    (t1, g1, took), (t2, g2, _) = _clip_both_ways(monkeypatch, make, max_norm=1e-3,
                                                    error_if_nonfinite=error_if_nonfinite)
    assert took
    fresh = [p.grad for p in make()]
    if error_if_nonfinite:
        assert isinstance(t1, RuntimeError) and str(t1) == str(t2)
        # raised before writing: the grads are the fresh ones, NaN for NaN
        assert all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(g1, fresh))
        assert all(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) for a, b in zip(g1, fresh))
    else:
        assert torch.equal(t1, t2) or (t1.isnan() and t2.isnan())
        assert all(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) for a, b in zip(g1, g2))
        assert all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(g1, g2))


@needs_helpers
def test_clip_one_call_repeated_grad_and_none(fast_path, monkeypatch):
    # The same grad object twice counts (and is scaled) twice, as in torch and the op-by-op path; params
    # without a grad are skipped.
    def make():
        a = torch.nn.Parameter(torch.randn(6))
        a.grad = torch.randn(6, generator=torch.Generator().manual_seed(1))
        b = torch.nn.Parameter(torch.randn(2))
        return [a, b, a]
    (t1, g1, took), (t2, g2, _) = _clip_both_ways(monkeypatch, make, max_norm=0.1)
    assert took and torch.equal(t1, t2)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g1, g2))


def _slice_grad():
    p = torch.nn.Parameter(torch.randn(4, 6))
    p.grad = torch.randn(4, 12)[:, ::2]  # not dense: the kernels need a copy, the general path does it
    return [p]


def _inference_grad():
    p = torch.nn.Parameter(torch.randn(5))
    with torch.inference_mode():
        p.grad = torch.randn(5)
    return [p]


@needs_helpers
@pytest.mark.parametrize("case", ["non_dense", "inference", "dispatch_mode", "torch_backend", "p0", "empty",
                                  "int_grad", "meta"])
def test_clip_one_call_declines(fast_path, case):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    params, backend, norm_type = [p], None, 2.0
    if case == "non_dense":
        params = _slice_grad()
    elif case == "inference":
        params = _inference_grad()
    elif case == "torch_backend":
        backend = "torch"
    elif case == "p0":
        norm_type = 0.0
    elif case == "empty":
        params = [torch.nn.Parameter(torch.randn(2))]
    elif case == "int_grad":
        params = [torch.ones(3, dtype=torch.int64)]
    elif case == "meta":
        m = torch.nn.Parameter(torch.randn(3, device="meta"))
        m.grad = torch.randn(3, device="meta")
        params = [m]
    before = [q.grad.clone() if q.grad is not None else None for q in params]
    if case == "dispatch_mode":
        with Seen():
            assert _scan.clip_norm_cpu(params, 1e-3, norm_type, False, backend) is None
    else:
        assert _scan.clip_norm_cpu(params, 1e-3, norm_type, False, backend) is None
    for q, b in zip(params, before):
        if case != "meta":
            assert (q.grad is None and b is None) or torch.equal(q.grad, b)  # nothing written
