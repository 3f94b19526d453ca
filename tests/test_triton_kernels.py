"""Kernel-level tests of the Triton backend beyond the shared suite: block/chunk boundaries, table caching,
determinism, long and mixed lists, non-contiguous inputs, the custom ops. On CPU they run under the
Triton interpreter (conftest sets TRITON_INTERPRET=1 when there is no GPU) with tiny tiles, so small
tensors cross BLOCK and CHUNK boundaries."""

from __future__ import annotations

import math

import pytest
import torch

from fastgrad import backends

from . import oracle

triton_backend = backends.get("triton")
_why = triton_backend.unavailable_reason() or triton_backend.supports(
    "norm", [torch.ones(1, device="cuda" if torch.cuda.is_available() else "cpu")], norm_type=2.0)
if _why is not None:
    pytest.skip(f"triton backend unavailable: {_why}", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastgrad import triton_kernels as tk  # noqa: E402
from fastgrad.triton_kernels.multi_tensor import pow_fp64  # noqa: E402
from fastgrad.triton_kernels.norm import clip_coef  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH = backends.get("torch")
INF = float("inf")
# odd sizes around BLOCK=32 / CHUNK=96 (set below), a multi-chunk one, zero-size and >1-D shapes
SIZES = [(1,), (31,), (32,), (33,), (95,), (96,), (97,), (1000,), (0,), (7, 33), (2, 0, 3), (5, 1, 61)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tk.Config, "BLOCK", 32)
    monkeypatch.setattr(tk.Config, "CHUNK", 96)
    monkeypatch.setattr(tk.Config, "SEG_BLOCK", 16)
    monkeypatch.setattr(tk.Config, "PART_BLOCK", 4)
    monkeypatch.setattr(tk.Config, "FLAG_BLOCK", 8)
    # row-wise ops: rows over 64 elements split into CHUNK blocks, shorter ones packed ~96 elements a program
    monkeypatch.setattr(tk.Config, "ROW_MAX", 64)
    monkeypatch.setattr(tk.Config, "ROW_PACK", 96)
    monkeypatch.setattr(tk.Config, "ROW_COLS", 8)  # tiles of 4 rows x 8 columns
    tk.clear_cache()
    yield
    tk.clear_cache()
    tk.release_captured()


def make(sizes, dtypes, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(sizes):
        dt = dtypes[i % len(dtypes)]
        out.append((torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dt).to(DEVICE))
    return out


def rtol_for(acc):
    return 1e-12 if acc == torch.float64 else 1e-6


def bits(t):
    t = t.detach().cpu()
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16)
    return t.view(torch.int32 if t.element_size() == 4 else torch.int64) if t.dtype.is_floating_point else t


@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF, 3.0, 0.5])
@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.float64], [torch.float16, torch.bfloat16],
                                    DTYPES], ids=["fp32", "fp64", "half", "mixed"])
def test_norm_against_fp64_oracle(norm_type, dtypes):
    ts = make(SIZES, dtypes, seed=1)
    total, per = triton_backend.norm(ts, norm_type, per_tensor=True)
    acc = backends.acc_dtype(ts)
    assert total.dtype == acc and per.dtype == acc and per.shape == (len(ts),) and total.dim() == 0
    exp = torch.tensor([oracle.tensor_norm(t, norm_type) for t in ts], dtype=torch.float64)
    # fp64 partials: per-tensor norms are within a few ulps of the exact value
    torch.testing.assert_close(per.cpu().double(), exp, rtol=rtol_for(acc) / 4, atol=0)
    torch.testing.assert_close(total.cpu().double(), torch.tensor(oracle.total_norm(ts, norm_type), dtype=torch.float64),
                               rtol=rtol_for(acc) / 4, atol=0)


@pytest.mark.parametrize("n", [1, 300])
def test_list_lengths_and_single_launch_tables(n):
    sizes = [((i * 37) % 150,) for i in range(n)]
    ts = make(sizes, DTYPES, seed=2)
    total, per = triton_backend.norm(ts, 2.0, per_tensor=True)
    exp = torch.tensor([oracle.tensor_norm(t, 2.0) for t in ts], dtype=torch.float64)
    torch.testing.assert_close(per.cpu().double(), exp, rtol=1e-12, atol=0)
    plan = tk.multi_tensor.get_plan((ts,))
    assert len(plan.groups) == min(n, 4)  # one launch per dtype present, whatever n
    assert plan.nblocks == sum(math.ceil(s[0] / tk.Config.CHUNK) for s in sizes)


def test_plans_used_under_capture_are_kept_and_never_built(monkeypatch):
    # A captured CUDA graph holds raw pointers to its plans' device tables: a plan hit during capture must
    # never be evicted or cleared, and a miss during capture must refuse (building would capture a copy
    # from recycled pinned memory). Simulated on CPU tensors by reporting "capturing".
    from fastgrad.triton_kernels import multi_tensor as mt

    ts = make(SIZES, [torch.float32], seed=4)
    total, _ = triton_backend.norm(ts, 2.0)  # warm-up: builds the plan
    monkeypatch.setattr(mt, "_capturing", lambda device: True)
    again, _ = triton_backend.norm(ts, 2.0)  # hit during "capture"
    assert torch.equal(total, again) and tk.cache_stats()["captured"] == 1
    with pytest.raises(RuntimeError, match="warm-up"):
        triton_backend.norm(ts[:-1], 2.0)  # never seen: refused
    monkeypatch.setattr(mt, "_capturing", lambda device: False)
    tk.clear_cache()
    monkeypatch.setattr(tk.Config, "CACHE_SIZE", 2)
    for k in range(1, 5):  # more lists than the LRU holds
        triton_backend.norm(ts[:-k], 2.0)
    builds = tk.cache_stats()["builds"]
    triton_backend.norm(ts, 2.0)  # the captured plan is still there
    assert tk.cache_stats()["builds"] == builds and tk.cache_stats()["captured"] == 1
    tk.release_captured()
    assert tk.cache_stats()["captured"] == 0


def test_plan_cache_hits_and_keys():
    ts = make(SIZES, [torch.float32], seed=3)
    triton_backend.norm(ts, 2.0)
    before = tk.cache_stats()
    triton_backend.norm(list(ts), 2.0)
    triton_backend.scale_(ts, torch.tensor(0.5, device=DEVICE))  # same list: same tables
    after = tk.cache_stats()
    assert after["builds"] == before["builds"] and after["hits"] >= before["hits"] + 2
    triton_backend.norm(ts[:-1], 2.0)  # a different list builds new tables
    assert tk.cache_stats()["builds"] == after["builds"] + 1


@pytest.mark.parametrize("op", ["norm", "amp_norm", "stats", "agc", "gc"])
def test_bitwise_determinism_20_runs(op, monkeypatch):
    if DEVICE == "cpu":  # fewer, larger programs: the interpreter runs each program in Python
        monkeypatch.setattr(tk.Config, "BLOCK", 128)
        monkeypatch.setattr(tk.Config, "CHUNK", 512)
    sizes = [(2000,), (4, 700), (33,), (0,), (7, 33)] if DEVICE == "cpu" else [(3_000_000,), (512, 4096), (33,), (0,)]
    ts = make(sizes, DTYPES, seed=4)
    params = make(sizes, DTYPES, seed=5)
    results = []
    for _ in range(20):
        if op == "norm":
            r = list(triton_backend.norm(ts, 2.0, per_tensor=True))
        elif op == "amp_norm":
            r = list(triton_backend.amp_norm(ts, torch.tensor(0.25, device=DEVICE), 3.0))
        elif op == "stats":
            r = list(triton_backend.grad_stats(ts).values())
        elif op == "agc":
            gs = [t.clone() for t in ts]
            triton_backend.agc_(params, gs, 0.01, 1e-3, 2.0)
            r = gs
        else:
            gs = [t.clone() for t in ts if t.dim() > 1]
            triton_backend.centralize_(gs)
            r = gs
        results.append([bits(x) for x in r])
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, results[0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_and_clip_value_match_torch_bitwise(dtype):
    ts = make(SIZES, [dtype], seed=6)
    for factor in (torch.tensor(0.3, device=DEVICE), torch.tensor(1.0, device=DEVICE),
                   torch.tensor(0.3, device=DEVICE, dtype=torch.float64)):
        a = [t.clone() for t in ts]
        triton_backend.scale_(a, factor)
        exp = [(t.to(torch.float64 if (dtype == torch.float64 or factor.dtype == torch.float64)
                     else torch.float32) * factor).to(dtype) for t in ts]
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, exp))
    a = [t.clone() for t in ts]
    b = [t.clone() for t in ts]
    triton_backend.clip_value_(a, 0.1)
    for t in b:  # clamp in the op-math type, rounded once
        c = t.double() if dtype == torch.float64 else t.float()
        t.copy_(c.clamp(-0.1 if dtype == torch.float64 else float(torch.tensor(-0.1)),
                        0.1 if dtype == torch.float64 else float(torch.tensor(0.1))))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def test_scale_nan_factor_and_nan_values():
    ts = make([(50,), (7, 9)], [torch.float32, torch.bfloat16], seed=7)
    ts[0][3] = float("nan")
    triton_backend.scale_(ts, torch.tensor(float("nan"), device=DEVICE))
    assert all(torch.isnan(t).all() for t in ts)
    ts = make([(50,)], [torch.float32], seed=7)
    ts[0][3] = float("nan")
    ts[0][4] = float("inf")
    triton_backend.clip_value_(ts, 1.0)
    assert torch.isnan(ts[0][3]) and ts[0][4] == 1.0


def test_amp_norm_found_inf_and_unscaled_norm():
    ts = make(SIZES, [torch.float32, torch.bfloat16], seed=8, scale=1024.0)
    inv = torch.tensor(1 / 1024.0, device=DEVICE)
    total, found = triton_backend.amp_norm(ts, inv, 2.0)
    assert found.dtype == torch.float32 and float(found) == 0.0
    rt, _ = TORCH.amp_norm(ts, inv, 2.0)
    torch.testing.assert_close(total, rt, rtol=1e-6, atol=0)
    for bad in (float("inf"), -float("inf"), float("nan")):
        t2 = [t.clone() for t in ts]
        t2[6][95] = bad  # last element of a chunk
        _, found = triton_backend.amp_norm(t2, inv, 2.0)
        assert float(found) == 1.0


def test_grad_stats_counts():
    ts = make([(100,), (3, 70), (0,), (1,)], [torch.float32, torch.float16], seed=9)
    ts[0][[0, 50, 99]] = 0.0
    ts[0][10] = float("nan")
    ts[1][2, 69] = -float("inf")
    ts[1][0, 0] = 0.0
    s = triton_backend.grad_stats(ts)
    r = TORCH.grad_stats(ts)
    for k in ("nan", "inf", "zero"):
        assert s[k].dtype == torch.int64 and torch.equal(s[k].cpu(), r[k].cpu()), k
    torch.testing.assert_close(s["norm"], r["norm"], rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(s["max_abs"], r["max_abs"], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF])
def test_agc_and_gc_match_torch_backend(norm_type):
    shapes = [(7, 33), (4, 3, 5, 5), (200,), (3, 100), (1,), (2, 0, 3), (0, 4)]
    gs = make(shapes, [torch.float32], seed=10)
    ps = make(shapes, [torch.float32], seed=11, scale=0.05)
    a = [g.clone() for g in gs]
    b = [g.clone() for g in gs]
    triton_backend.agc_(ps, a, 0.01, 1e-3, norm_type)
    TORCH.agc_(ps, b, 0.01, 1e-3, norm_type)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    a = [g.clone() for g in gs if g.dim() > 1]
    b = [g.clone() for g in gs if g.dim() > 1]
    triton_backend.centralize_(a)
    TORCH.centralize_(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_noncontiguous_inputs():
    base = make([(40, 70), (30, 20), (9, 10, 11)], [torch.float32], seed=12)
    views = [base[0].t(), base[1][:, ::2], base[2].permute(2, 0, 1)]  # dense, strided, dense
    total, per = triton_backend.norm(views, 2.0, per_tensor=True)
    exp = torch.tensor([oracle.tensor_norm(v, 2.0) for v in views], dtype=torch.float64)
    torch.testing.assert_close(per.cpu().double(), exp, rtol=1e-6, atol=0)
    ref = [v.clone() for v in views]
    triton_backend.scale_(views, torch.tensor(0.5, device=DEVICE))
    assert all(torch.equal(v, r * 0.5) for v, r in zip(views, ref))
    ref = [v.clone() for v in views]
    triton_backend.centralize_(views)
    TORCH.centralize_(ref)
    for v, r in zip(views, ref):
        torch.testing.assert_close(v, r, rtol=1e-6, atol=1e-6)
    assert base[1][:, 1::2].abs().sum() > 0  # untouched columns of the strided view stay


def test_rowwise_ops_use_channels_last_grads_in_place():
    # channels_last conv grads: each dim-0 row is one dense block (another order inside), so AGC and GC
    # address them where they are: no copy per call, and one table for every call (a copy is a new
    # pointer each call, which rebuilt the table every call and could not be captured in a CUDA graph)
    def cl(ts):
        return [t.to(memory_format=torch.channels_last) for t in ts]

    shapes = [(6, 5, 3, 3), (4, 2, 7, 5)]
    ps = make(shapes, [torch.float32], seed=15, scale=0.05)  # params stay row-major
    gs = cl(make(shapes, [torch.float32], seed=14))
    assert not any(g.is_contiguous() for g in gs)
    flat, copies = tk.multi_tensor.flat_inputs(gs, rowwise=True)
    assert copies == [] and all(a is b for a, b in zip(flat, gs))
    sliced = make([(5, 9)], [torch.float32], seed=16)[0][:, :4]  # rows with gaps between them: copied
    assert len(tk.multi_tensor.flat_inputs([sliced], rowwise=True)[1]) == 1
    builds = None
    for _ in range(2):
        want = [oracle.agc(p, g, 0.01, 1e-3, 2.0) for p, g in zip(ps, gs)]
        triton_backend.agc_(ps, gs, 0.01, 1e-3, 2.0)
        for g, w in zip(gs, want):
            torch.testing.assert_close(g.cpu().double(), torch.tensor(w.astype("float64")), rtol=1e-6, atol=1e-7)
        want = [oracle.centralize(g) for g in gs]
        triton_backend.centralize_(gs)
        for g, w in zip(gs, want):
            torch.testing.assert_close(g.cpu().double(), torch.tensor(w.astype("float64")), rtol=1e-6, atol=1e-6)
        assert not any(g.is_contiguous() for g in gs)
        if builds is None:
            builds = tk.cache_stats()["builds"]
    assert tk.cache_stats()["builds"] == builds  # the second round reused every table


@triton.jit
def _pow_test_kernel(a_ptr, out_ptr, p: tl.float64, N: tl.constexpr):
    p = tl.full([], p, tl.float64)
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, pow_fp64(tl.load(a_ptr + offs), p))


@pytest.mark.parametrize("p", [0.5, 2.0, 1 / 3, 2.5, 3.0])
def test_fractional_power_is_accurate_whatever_p_ln_a(p):
    # The p-norm kernels' a ** p (the power sums with p, the root with 1/p). Built as exp2(p * log2 a), the
    # rounding of the product is multiplied by ln2 * |p log2 a| (H100: ~10 ulp on a norm); compiled, it is
    # libdevice's pow, in the interpreter a reduced-argument pow; both must stay within 2 ulp (CUDA's bound
    # for pow) over the whole fp64 range, where the old formula is off by hundreds of ulps.
    import numpy as np

    n = 512
    g = torch.Generator().manual_seed(17)
    lim = int(1000 / max(p, 1.0))  # a ** p stays a normal double
    e = torch.randint(-lim, lim, (n,), generator=g)
    a = torch.ldexp(torch.rand(n, generator=g, dtype=torch.float64) + 0.5, e)
    special = torch.tensor([0.0, INF, math.nan, 1.0, 5e-324, 2.0 ** -1022], dtype=torch.float64)
    a[:special.numel()] = special
    out = torch.empty(n, dtype=torch.float64, device=DEVICE)
    _pow_test_kernel[(1,)](a.to(DEVICE), out, p, N=n)
    out = out.cpu()
    assert out[0] == 0 and out[1] == INF and math.isnan(out[2]) and out[3] == 1
    for x, y in zip(a[4:special.numel()].tolist(), out[4:special.numel()].tolist()):  # subnormal inputs
        assert abs(y - math.pow(x, p)) <= 2 * math.ulp(math.pow(x, p)), (x, y)
    xs = a[special.numel():].tolist()
    ref = [math.pow(x, p) for x in xs]  # glibc's pow: correctly rounded in all but rare cases
    ulps = [abs(y - r) / math.ulp(r) for y, r in zip(out[special.numel():].tolist(), ref)]
    naive = np.exp2(np.log2(np.array(xs)) * p)
    naive_ulps = [abs(y - r) / math.ulp(r) for y, r in zip(naive.tolist(), ref)]
    assert max(naive_ulps) > 8  # the inputs are hard for exp2(p * log2 a)
    assert max(ulps) <= 2, f"p={p}: worst {max(ulps):.2f} ulp at a={xs[ulps.index(max(ulps))]!r}"


def test_custom_ops_registered_and_fake():
    ts = make([(10,), (3, 4)], [torch.float32], seed=13)
    total, per = torch.ops.fastgrad_triton.norm(ts, 2.0)
    torch.testing.assert_close(total, triton_backend.norm(ts, 2.0)[0])
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fts = [mode.from_tensor(t) for t in ts]
        t2, p2 = torch.ops.fastgrad_triton.norm(fts, 2.0)
        assert t2.shape == () and p2.shape == (2,) and t2.dtype == torch.float32
        out = torch.ops.fastgrad_triton.grad_stats(fts)
        assert [o.dtype for o in out] == [torch.float32] * 2 + [torch.int64] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with > 10 GB free")
def test_over_2_pow_31_elements():
    n = 2**31 + 1000
    x = torch.zeros(n, dtype=torch.float16, device="cuda")
    x[-3:] = 2.0
    x[5] = 1.0
    total, _ = triton_backend.norm([x], 2.0)
    # fp16 data: the norm is fp32, so the reference is sqrt(13) rounded once to fp32 (not the double)
    assert total.dtype == torch.float32
    assert float(total) == float(torch.tensor(math.sqrt(13.0), dtype=torch.float32))
    triton_backend.scale_([x], torch.tensor(0.5, device="cuda"))
    assert float(x[-1]) == 1.0 and float(x[5]) == 0.5
    s = triton_backend.grad_stats([x])
    assert int(s["zero"][0]) == n - 4


# ---------------------------------------------------------------------------------------------- norm clip
def unfused_clip(ts, max_norm, norm_type):
    """What clip_grad_norm_ did before the fused primitive: the backend's norm, torch's coefficient on the
    0-dim total, the backend's scale (the reference the fused clip must equal bit for bit)."""
    total, _ = triton_backend.norm(ts, norm_type)
    triton_backend.scale_(ts, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


@pytest.fixture
def launches(monkeypatch):
    """Names of the Triton kernels launched, in order: JITFunction.run (InterpretedFunction.run under the
    interpreter) is what ``kernel[grid](...)`` calls, once per launch."""
    seen = []
    cls = type(tk.clip.scale_kernel)
    real = cls.run

    def run(self, *args, **kwargs):
        seen.append(self.fn.__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "run", run)
    return seen


@triton.jit
def _coef_test_kernel(t_ptr, out_ptr, max_norm: tl.float64, eps: tl.float64, OUT: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, clip_coef(tl.load(t_ptr + offs), max_norm, eps, OUT))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [1.0, 0.3, 7.7, 1e-3, 0.0, 1e39])
def test_clip_coefficient_is_torchs_bit_for_bit(dtype, max_norm):
    # torch evaluates max_norm / (total + 1e-6) as reciprocal(total + 1e-6) * max_norm with both scalars
    # rounded to the total's dtype: a plain division differs in the last bit for ~1 in 5 totals (fp32)
    n = 4096
    g = torch.Generator().manual_seed(18)
    t = torch.rand(n, generator=g, dtype=torch.float64) * torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 6)
    t[:8] = torch.tensor([0.0, INF, math.nan, 1e-6, 1.0, max_norm, 1e-45, 3e38], dtype=torch.float64)
    t = t.to(dtype)
    out = torch.empty(n, dtype=dtype, device=DEVICE)
    _coef_test_kernel[(1,)](t.to(DEVICE), out, max_norm, 1e-6, OUT=tl.float64 if dtype == torch.float64 else tl.float32,
                            N=n)
    want = torch.stack([torch.clamp(max_norm / (x + 1e-6), max=1.0) for x in t])  # 0-dim, as clip.py did
    assert torch.equal(bits(out), bits(want))


CLIP_SIZES = SIZES + [(191, 1), (192,), (193,)]  # two chunks, exactly and one over


@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF, 0.5])
@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.float64], [torch.float16, torch.bfloat16], DTYPES],
                         ids=["fp32", "fp64", "half", "mixed"])
@pytest.mark.parametrize("clipping", [True, False], ids=["clip", "noclip"])
def test_clip_norm_equals_unfused_clip_bitwise(norm_type, dtypes, clipping):
    ts = make(CLIP_SIZES, dtypes, seed=19)
    exact = oracle.total_norm(ts, norm_type)
    max_norm = exact / 3 if clipping else exact * 3
    a = [t.clone() for t in ts]
    b = [t.clone() for t in ts]
    total = triton_backend.clip_norm_(a, max_norm, norm_type)
    want = unfused_clip(b, max_norm, norm_type)
    assert total.dtype == backends.acc_dtype(ts) and total.dim() == 0
    assert torch.equal(bits(total), bits(want))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))
    if not clipping:
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, ts))
    else:  # the torch backend's composition (same maths, its own norm) agrees within the contract's rtol (docs/contract.md section 3)
        c = [t.clone() for t in ts]
        ref = TORCH.clip_norm_(c, max_norm, norm_type)
        torch.testing.assert_close(total, ref, rtol=rtol_for(total.dtype) * 2, atol=0)
        torch.testing.assert_close(total.double(), torch.tensor(exact, dtype=torch.float64),
                                   rtol=rtol_for(total.dtype), atol=0)


@pytest.mark.parametrize("poison", [math.nan, INF, -INF])
@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_clip_norm_nonfinite_as_torch(poison, norm_type):
    ts = make(SIZES, [torch.float32, torch.bfloat16], seed=20)
    ts[9][3, 32] = poison  # inside a (7, 33) tensor, at a BLOCK boundary
    a = [t.clone() for t in ts]
    b = [t.clone() for t in ts]
    total = triton_backend.clip_norm_(a, 1.0, norm_type)
    want = unfused_clip(b, 1.0, norm_type)
    assert torch.equal(bits(total), bits(want))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))
    if math.isnan(poison):  # NaN total, NaN coefficient: every gradient NaN, as torch
        assert math.isnan(float(total)) and all(torch.isnan(x).all() for x in a)
    else:  # inf total, coefficient 0: finite values zeroed, the infinity itself becomes NaN
        assert float(total) == INF
        assert all(((x == 0) | torch.isnan(x)).all() for x in a) and torch.isnan(a[9][3, 32])


def test_clip_norm_noncontiguous_and_zero_size():
    base = make([(40, 70), (30, 20), (9, 10, 11)], [torch.float32, torch.float16], seed=21)
    views = [base[0].t(), base[1][:, ::2], base[2].permute(2, 0, 1), base[0][:0]]
    ref_base = [t.clone() for t in base]
    ref = [ref_base[0].t(), ref_base[1][:, ::2], ref_base[2].permute(2, 0, 1), ref_base[0][:0]]
    total = triton_backend.clip_norm_(views, 0.5, 2.0)
    want = unfused_clip(ref, 0.5, 2.0)
    assert torch.equal(bits(total), bits(want))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(base, ref_base))  # gaps of the view untouched too
    empty = make([(0,), (3, 0)], [torch.float32], seed=22)
    total = triton_backend.clip_norm_(empty, 1.0, INF)
    assert float(total) == 0.0 and total.dtype == torch.float32


def test_clip_norm_launches(launches):
    # partials (one launch per dtype present), ONE finalize that also computes the coefficient, the scale
    # (one per dtype): nothing else, whatever the list's length
    ts = make(SIZES * 3, [torch.float32], seed=23)
    triton_backend.clip_norm_(ts, 0.1, 2.0)
    assert launches == ["_norm_partial_kernel", "_norm_finalize_kernel", "scale_kernel"]
    launches.clear()
    ts = make(SIZES, [torch.float32, torch.bfloat16], seed=23)
    builds = tk.cache_stats()["builds"]
    fastgrad_clip = __import__("fastgrad").clip_grad_norm_
    params = [torch.nn.Parameter(torch.empty_like(t)) for t in ts]
    for p, t in zip(params, ts):
        p.grad = t
    for _ in range(2):
        fastgrad_clip(params, 0.1, backend="triton")  # the public call: no torch op computes the coefficient
    assert launches == ["_norm_partial_kernel"] * 2 + ["_norm_finalize_kernel"] + ["scale_kernel"] * 2 \
        + ["_norm_partial_kernel"] * 2 + ["_norm_finalize_kernel"] + ["scale_kernel"] * 2
    assert tk.cache_stats()["builds"] == builds + 1  # one table for both passes and both calls
    launches.clear()
    triton_backend.clip_norm_(make([(0,), (2, 0)], [torch.float32], seed=24), 1.0, 2.0)
    assert launches == ["_norm_finalize_kernel"]  # nothing to read or write: the finalize gives 0 and 1


def test_clip_norm_custom_op_and_fake():
    ts = make([(10,), (3, 40)], [torch.float32], seed=25)
    a = [t.clone() for t in ts]
    total = torch.ops.fastgrad_triton.clip_norm_(a, 0.5, 2.0)
    b = [t.clone() for t in ts]
    assert torch.equal(bits(total), bits(unfused_clip(b, 0.5, 2.0)))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))
    from torch._subclasses.fake_tensor import FakeTensorMode

    doubles = [t.double() for t in ts]
    with FakeTensorMode() as mode:
        out = torch.ops.fastgrad_triton.clip_norm_([mode.from_tensor(t) for t in doubles], 0.5, 2.0)
        assert out.shape == () and out.dtype == torch.float64


# ---------------------------------------------------------------------------------------------- AMP clip
def unfused_amp_clip(ts, inv, max_norm, norm_type, write=True):
    """What scaler_unscale_and_clip ran before amp_clip_: amp_norm, torch's coefficient and the multiply by
    inv_scale as torch ops, scale_ (the reference the fused primitive must equal bit for bit)."""
    total, found = triton_backend.amp_norm(ts, inv, norm_type)
    factor = inv.to(total.dtype) * torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if write:
        triton_backend.scale_(ts, factor)
    return total, found, factor


@pytest.mark.parametrize("norm_type", [2.0, INF, 1.0])
@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.bfloat16, torch.float32], DTYPES[1:]],
                         ids=["fp32", "bf16+fp32", "mixed64"])  # fp64-only lists: tests/test_amp.py
@pytest.mark.parametrize("clipping", [True, False], ids=["clip", "noclip"])
def test_amp_clip_equals_unfused_bitwise(norm_type, dtypes, clipping):
    # tiny tiles: grads cross BLOCK and CHUNK, the finalize loops over several SEG/PART/FLAG blocks; a scale
    # that is not a power of two, so inv_scale * coef is rounded
    ts = [t * 3000.0 for t in make(CLIP_SIZES, dtypes, seed=26)]
    if norm_type != 2.0:  # overflow cases: an inf (L1) or a NaN (max) in the second chunk of a grad
        ts[-2][150] = INF if norm_type == 1.0 else math.nan
    inv = torch.tensor(3000.0, device=DEVICE).double().reciprocal().float()
    exact = oracle.total_norm([t.double() / 3000.0 for t in ts], norm_type)
    max_norm = exact / 3 if clipping else exact * 3
    for write in (True, False):
        a, b = [t.clone() for t in ts], [t.clone() for t in ts]
        got = triton_backend.amp_clip_(a, inv, max_norm, norm_type, write)
        want = unfused_amp_clip(b, inv, max_norm, norm_type, write)
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(got, want)), (got, want)
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, ts)) == (not write)


def test_amp_clip_launches(launches):
    # partials (one per dtype), ONE finalize computing total, found_inf and the factor, the scale (one per
    # dtype); no scale with write=False; the public call is exactly that, with one table for all of it
    inv = torch.tensor(1.0 / 1024.0, device=DEVICE)
    ts = make(SIZES * 3, [torch.float32], seed=27)
    triton_backend.amp_clip_(ts, inv, 0.1, 2.0)
    assert launches == ["_norm_partial_kernel", "_norm_finalize_kernel", "scale_kernel"]
    launches.clear()
    triton_backend.amp_clip_(ts, inv, 0.1, 2.0, False)
    assert launches == ["_norm_partial_kernel", "_norm_finalize_kernel"]
    launches.clear()
    ts = make(SIZES, [torch.float32, torch.bfloat16], seed=28, scale=1024.0)
    params = [torch.nn.Parameter(torch.empty_like(t)) for t in ts]
    for p, t in zip(params, ts):
        p.grad = t
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler(DEVICE, init_scale=1024.0)
    builds = tk.cache_stats()["builds"]
    for _ in range(2):
        scaler.scale(torch.ones((), device=DEVICE))  # initialises the scale on the first pass
        __import__("fastgrad").scaler_unscale_and_clip(scaler, opt, 0.1, backend="triton")
        scaler._per_optimizer_states.clear()  # as update() does: the next call is a fresh step
    assert launches == (["_norm_partial_kernel"] * 2 + ["_norm_finalize_kernel"] + ["scale_kernel"] * 2) * 2
    assert tk.cache_stats()["builds"] == builds + 1
    launches.clear()
    triton_backend.amp_clip_(make([(0,), (2, 0)], [torch.float32], seed=29), inv, 1.0, 2.0)
    assert launches == ["_norm_finalize_kernel"]  # nothing to read or write


def test_amp_clip_custom_op_and_fake():
    ts = make([(10,), (3, 40)], [torch.float32, torch.bfloat16], seed=30, scale=3000.0)
    inv = torch.tensor(3000.0, device=DEVICE).double().reciprocal().float()
    a, b = [t.clone() for t in ts], [t.clone() for t in ts]
    got = torch.ops.fastgrad_triton.amp_clip_(a, inv, 0.5, 2.0, True)
    want = unfused_amp_clip(b, inv, 0.5, 2.0)
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(got, want))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))
    from torch._subclasses.fake_tensor import FakeTensorMode

    doubles = [t.double() for t in ts]
    with FakeTensorMode() as mode:
        out = torch.ops.fastgrad_triton.amp_clip_([mode.from_tensor(t) for t in doubles], mode.from_tensor(inv),
                                                  0.5, 2.0, False)
        assert [(o.shape, o.dtype) for o in out] == [((), torch.float64), ((), torch.float32), ((), torch.float64)]


# ---------------------------------------------------------------------------------------------- AGC, GC rows
# With the tiles above: row tiles of 4 rows x 8 columns, rows up to ROW_MAX = 64 elements packed ~96
# elements (ROW_PACK, at least 4 rows) a program, longer rows split into 96-element (CHUNK) blocks. Row lengths
# 1, 2, 7, 8/9 (one column tile or two), 31/32/33 (BLOCK), 48/49 (ROW_PACK // 2), 63/64/65 (packed or split),
# a 3-chunk and a 6-chunk row, 1-D units on both sides of ROW_MAX, many rows per program and fewer rows than
# a tile. (tests/test_agc.py and tests/test_centralize.py run the default 16 x 128 tiles.)
ROW_SHAPES = [(5, 1), (6, 2), (9, 7), (4, 8), (4, 9), (2, 31), (1, 32), (2, 33), (5, 48), (5, 49), (3, 63),
              (3, 64), (2, 65), (3, 200), (1, 500), (97,), (30,), (40, 7), (3, 4, 3)]
NAN_AT = {2: (1, 3), 13: (1, 150)}  # a NaN in a packed row and in a split row
ZERO_GRAD_ROW = (12, 0)  # a zero gradient row (split path), and a zero parameter row (packed path):
ZERO_PARAM_ROW = (3, 2)


def _keep_rows(p, g, clip_factor, norm_type):
    """Oracle's "no clipping" mask per element (where the gradient must stay bit for bit)."""
    import numpy as np

    w, gn = oracle.unit_norm(p, norm_type), oracle.unit_norm(g, norm_type)
    with np.errstate(invalid="ignore"):
        keep = gn < np.maximum(w, 1e-3) * clip_factor
    return np.broadcast_to(keep, tuple(g.shape))


AGC_DTYPES = {"fp32": ([torch.float32], [torch.float32]), "fp64": ([torch.float64], [torch.float64]),
              "half": ([torch.float16, torch.bfloat16], [torch.float16, torch.bfloat16]),
              "mixed": ([torch.float32, torch.float64], [torch.bfloat16, torch.float32])}


@pytest.mark.parametrize("norm_type,dtypes", [
    pytest.param(nt, AGC_DTYPES[k], id=f"{nt}-{k}") for nt in (2.0, INF) for k in AGC_DTYPES
] + [pytest.param(3.0, AGC_DTYPES["mixed"], id="3.0-mixed")])  # (p=3 is slow in the interpreter)
@pytest.mark.parametrize("clip_factor", [0.01, 20.0])
def test_agc_rows_packed_and_split(norm_type, dtypes, clip_factor):
    from .helpers import assert_max_error_within, assert_no_worse_than

    ps = make(ROW_SHAPES, dtypes[0], seed=26, scale=0.05)
    gs = make(ROW_SHAPES, dtypes[1], seed=27)
    for i, at in NAN_AT.items():
        gs[i][at] = math.nan
    gs[ZERO_GRAD_ROW[0]][ZERO_GRAD_ROW[1]] = 0.0
    ps[ZERO_PARAM_ROW[0]][ZERO_PARAM_ROW[1]] = 0.0
    want = [oracle.agc(p, g, clip_factor, 1e-3, norm_type) for p, g in zip(ps, gs)]
    keep = [_keep_rows(p, g, clip_factor, norm_type) for p, g in zip(ps, gs)]
    ref = [g.clone() for g in gs]
    TORCH.agc_(ps, ref, clip_factor, 1e-3, norm_type)
    ours = [g.clone() for g in gs]
    triton_backend.agc_(ps, ours, clip_factor, 1e-3, norm_type)
    for o, r, w, k, g in zip(ours, ref, want, keep, gs):
        what = f"agc {tuple(g.shape)} {g.dtype}"
        if g.dtype == torch.float64:  # no wider type to work in: the contract's AGC rule (as tests/test_agc.py)
            assert_max_error_within(o, r, w, g.dtype, what)
        else:  # fp64 norms, ratio and product: rounded once, never worse than the reference + 1 ulp
            assert_no_worse_than(o, r, w, g.dtype, what)
        kept = torch.from_numpy(k.copy())
        assert torch.equal(bits(o)[kept], bits(g)[kept]), f"{what}: an unclipped row was written"
    assert torch.isnan(ours[2][1]).all() and torch.isfinite(ours[2][[0, 2]]).all()
    assert torch.isnan(ours[13][1]).all() and torch.isfinite(ours[13][[0, 2]]).all()
    assert (ours[ZERO_GRAD_ROW[0]][ZERO_GRAD_ROW[1]] == 0).all()


@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.float64], [torch.float16, torch.bfloat16], DTYPES],
                         ids=["fp32", "fp64", "half", "mixed"])
def test_gc_rows_packed_and_split(dtypes):
    from .helpers import assert_max_error_within, assert_no_worse_than

    gs = [g for g in make(ROW_SHAPES, dtypes, seed=28, scale=3.0) if g.dim() > 1]
    gs[2][1, 3] = math.nan
    gs[13][1, 150] = math.nan
    want = [oracle.centralize(g) for g in gs]
    ref = [g.clone() for g in gs]
    TORCH.centralize_(ref)
    ours = [g.clone() for g in gs]
    triton_backend.centralize_(ours)
    for o, r, w, g in zip(ours, ref, want, gs):
        check = assert_max_error_within if g.dtype == torch.float64 else assert_no_worse_than
        check(o, r, w, g.dtype, f"gc {tuple(g.shape)} {g.dtype}")
    assert torch.isnan(ours[2][1]).all() and torch.isfinite(ours[2][[0, 2]]).all()
    assert torch.isnan(ours[13][1]).all() and torch.isfinite(ours[13][[0, 2]]).all()


def test_agc_gc_rows_noncontiguous():
    from .helpers import randn

    gen = torch.Generator().manual_seed(29)
    shapes = [(5, 7), (3, 70), (4, 3, 3)]
    gs = [randn(s, torch.float32, DEVICE, gen, noncontig=True) for s in shapes]  # strided: copied
    gs.append(randn((6, 2, 5, 5), torch.float32, DEVICE, gen).to(memory_format=torch.channels_last))
    ps = [randn(g.shape, torch.float32, DEVICE, gen, scale=0.05) for g in gs]
    strides = [g.stride() for g in gs]
    want = [oracle.agc(p, g, 0.01, 1e-3, 2.0) for p, g in zip(ps, gs)]
    ref = [g.clone() for g in gs]
    TORCH.agc_(ps, ref, 0.01, 1e-3, 2.0)
    triton_backend.agc_(ps, gs, 0.01, 1e-3, 2.0)
    from .helpers import assert_no_worse_than

    for o, r, w, s in zip(gs, ref, want, strides):
        assert o.stride() == s
        assert_no_worse_than(o, r, w, torch.float32, "agc noncontig")
    want = [oracle.centralize(g) for g in gs]
    ref = [g.clone() for g in gs]
    TORCH.centralize_(ref)
    triton_backend.centralize_(gs)
    for o, r, w in zip(gs, ref, want):
        assert_no_worse_than(o, r, w, torch.float32, "gc noncontig")


def test_agc_gc_launches_and_tables(launches):
    # rows up to ROW_MAX: one launch per dtype group does everything; a split row adds its finalize and
    # one second pass per dtype group over the split blocks only
    short = [(9, 7), (3, 64), (40, 2), (30,)]
    gs = make(short, [torch.float32], seed=30)
    ps = make(short, [torch.float32], seed=31, scale=0.05)
    triton_backend.agc_(ps, gs, 0.01, 1e-3, 2.0)
    triton_backend.centralize_(gs[:3])
    assert launches == ["_agc_rows_kernel", "_gc_rows_kernel"]
    launches.clear()
    gs = make(short + [(2, 65)], [torch.float32, torch.bfloat16], seed=30)
    ps = make(short + [(2, 65)], [torch.float32, torch.bfloat16], seed=31, scale=0.05)
    builds = tk.cache_stats()["builds"]
    for _ in range(2):
        triton_backend.agc_(ps, gs, 0.01, 1e-3, 2.0)
    assert launches == (["_agc_rows_kernel"] * 2 + ["_agc_coef_kernel", "scale_kernel"]) * 2
    launches.clear()
    for _ in range(2):
        triton_backend.centralize_([g for g in gs if g.dim() > 1])
    assert launches == (["_gc_rows_kernel"] * 2 + ["_gc_mean_kernel", "_gc_apply_kernel"]) * 2
    assert tk.cache_stats()["builds"] == builds + 2  # one table per op, reused by the second call


def test_row_plan_blocks_cover_every_row_once():
    # every element of every unit in exactly one block; packed blocks hold whole rows of one tensor and at
    # most max(ROW_PACK, one row) elements; split rows' blocks are consecutive and listed in split_segs
    ts = make(ROW_SHAPES + [(0, 4), (4, 0)], DTYPES, seed=32)
    rows = tk.multi_tensor.rows_of(ts)
    plan = tk.multi_tensor.get_plan((ts,), rows, packed=True)
    blk = plan.blk[:4 * plan.nblocks].view(-1, 4).cpu()
    seg = plan.seg[:3 * plan.nsegs].view(-1, 3).cpu()
    covered = [torch.zeros(t.numel(), dtype=torch.int64) for t in ts]
    for t, s, e, sg in blk.tolist():
        covered[t][s:e] += 1
        length = int(seg[sg, 2])
        if length > tk.Config.ROW_MAX:
            assert e - s <= tk.Config.CHUNK and s // length == (e - 1) // length
        else:
            rows_per_tile = tk.Config.BLOCK // tk.Config.ROW_COLS
            assert s % length == 0 and e % length == 0
            assert e - s <= max(tk.Config.ROW_PACK, rows_per_tile * length)
    assert all((c == 1).all() for c in covered)
    split = sorted(plan.split_segs[:plan.nsplit].tolist())
    assert split == [i for i in range(plan.nsegs) if int(seg[i, 2]) > tk.Config.ROW_MAX]
    assert sum(g.nsplit for g in plan.groups) == sum(int(seg[i, 1]) for i in split)
