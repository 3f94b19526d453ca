"""grad_stats (docs/contract.md section 7) on every (backend, device) pair: exact counts, norms vs the oracle."""

from __future__ import annotations

import math

import pytest
import torch

import fastgrad

from . import oracle
from .helpers import DTYPE_IDS, DTYPES, assert_no_worse_than, bits, make_params

STAT_SHAPES = [(7,), (5, 3), (0,), (17, 33), (8, 3, 3, 3), (1025,), (3, 4097)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grad_stats_values(bd, dtype):
    backend, device = bd
    params = make_params(STAT_SHAPES, dtype, device, seed=41, none_every=6)
    g = params[3].grad
    g[0, :5] = 0.0
    g[1, 2] = float("nan")
    g[2, 3] = float("inf")
    g[2, 4] = -float("inf")
    params[1].grad[1] = 0.0
    st = fastgrad.grad_stats(params, backend=backend)
    with_grad = [(str(i), p.grad) for i, p in enumerate(params) if p.grad is not None]
    assert st.names == [n for n, _ in with_grad] and st.no_grad == ["5"]
    ref = fastgrad.grad_stats(params, backend="torch")
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert st.norm.dtype == acc and st.max_abs.dtype == acc and st.nan.dtype == torch.int64
    for k in ("nan", "inf", "zero", "numel"):
        exp = {
            "nan": [int(torch.isnan(x).sum()) for _, x in with_grad],
            "inf": [int(torch.isinf(x).sum()) for _, x in with_grad],
            "zero": [int((x == 0).sum()) for _, x in with_grad],
            "numel": [x.numel() for _, x in with_grad],
        }[k]
        assert getattr(st, k).tolist() == exp, k
        assert getattr(st, k).device.type == device
    finite = [i for i, (_, x) in enumerate(with_grad) if torch.isfinite(x).all()]
    exp_norm = torch.tensor([oracle.tensor_norm(x, 2.0) for _, x in with_grad], dtype=torch.float64)
    exp_max = torch.tensor([oracle.tensor_norm(x, float("inf")) for _, x in with_grad], dtype=torch.float64)
    assert_no_worse_than(st.norm[finite], ref.norm[finite], exp_norm[finite], acc, "norm")
    assert_no_worse_than(st.max_abs[finite], ref.max_abs[finite], exp_max[finite], acc, "max_abs")
    bad = 3  # the (17, 33) tensor holds a NaN: its max |g| and norm are NaN
    assert torch.isnan(st.norm.cpu()[bad]) and torch.isnan(st.max_abs.cpu()[bad])
    assert torch.isnan(st.total_norm.cpu())


def test_grad_stats_module_names_and_to_dict(bd):
    backend, device = bd
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).to(device)
    model[2].bias.requires_grad_(False)
    model(torch.randn(3, 5, device=device)).sum().backward()
    st = fastgrad.grad_stats(model, backend=backend)
    assert st.names == ["0.weight", "0.bias", "2.weight"] and st.no_grad == ["2.bias"]
    d = st.to_dict()
    assert set(d["parameters"]) == set(st.names)
    norms = [float(p.grad.double().norm()) for p in (model[0].weight, model[0].bias, model[2].weight)]
    assert d["total_norm"] == pytest.approx(sum(n * n for n in norms) ** 0.5, rel=1e-6)
    named = fastgrad.grad_stats(list(model.named_parameters()), backend=backend)
    assert named.names == st.names


def test_grad_stats_no_grads():
    st = fastgrad.grad_stats([torch.nn.Parameter(torch.randn(3))])
    assert len(st) == 0 and st.no_grad == ["0"] and float(st.total_norm) == 0.0


def test_grad_stats_rejects_junk():
    with pytest.raises(TypeError, match="grad_stats takes"):
        fastgrad.grad_stats([1, 2])


def _hard_stats_cases(dtype):
    """Gradients built against the shortcuts of the CPU kernel (csrc/cpu/reduce.cpp, stats_fast): it scans a
    256-element block exactly for max |g| only when the block's largest square ties or beats the largest one
    before it, counts zeros only where a square is 0, and NaN/Inf only where the block's sum is not finite.
    Sizes span many blocks, a ragged tail and more than one 32K-element work item."""
    gen = torch.Generator().manual_seed(7)
    tiny = dtype != torch.float16  # fp16 has no values whose float square underflows
    for n in (1, 40, 300, 256 * 40 + 77, 32768 + 300):
        r = torch.randn(n, generator=gen, dtype=torch.float64)
        yield "rising", torch.linspace(0.01, 9.0, n, dtype=torch.float64)  # a new max in every block
        yield "falling", torch.linspace(9.0, 0.01, n, dtype=torch.float64)
        t = r.clone()
        t[-1] = -11.0  # the max last, negative, in the tail
        yield "max-last", t
        t = r.abs()
        t[n // 2] = float(t.max()) * 1.001  # a max that beats the others' squares by little
        yield "close-max", t
        t = r.clone()
        t[:: max(1, n // 9)] = 0.0
        t[n // 3:n // 3 + 300] = -0.0  # a run of negative zeros across a block boundary
        yield "zeros", t
        yield "all-zero", torch.zeros(n, dtype=torch.float64)
        if tiny:
            yield "tiny", r * 1e-30  # every square underflows to 0: ties everywhere, no zeros
            t = torch.full((n,), 1e-30, dtype=torch.float64)
            t[n // 2:] = 1.3e-30
            t[:: max(1, n // 5)] = 0.0
            yield "tiny-rising", t
            yield "huge", r * 1e20  # squares overflow: sum inf, no NaN/Inf counted, max exact
        t = r.clone()
        t[n // 2] = float("inf")
        t[0] = 0.0
        yield "inf", t
        t = r.clone()
        t[n // 3] = float("nan")
        t[n - 1] = -float("inf")
        t[n // 4] = 0.0
        yield "nan-inf", t


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grad_stats_cpu_max_and_counts_exact_on_hard_inputs(dtype):
    for name, x in _hard_stats_cases(dtype):
        g = x.to(dtype)
        p = torch.nn.Parameter(torch.empty_like(g))
        p.grad = g
        st = fastgrad.grad_stats([p], backend="cpu")
        a = g.double().abs()
        exp_max = float("nan") if torch.isnan(a).any() else float(a.max())
        got_max = float(st.max_abs[0])
        assert got_max == exp_max or (exp_max != exp_max and got_max != got_max), (name, g.numel(), got_max, exp_max)
        assert int(st.zero[0]) == int((g == 0).sum()), (name, g.numel())
        assert int(st.nan[0]) == int(torch.isnan(g).sum()), (name, g.numel())
        assert int(st.inf[0]) == int(torch.isinf(g).sum()), (name, g.numel())
        # The sum of squares is the norm kernel's, bit for bit (also where it overflows or is NaN).
        ref = fastgrad.multi_tensor_norm([g], backend="cpu")
        assert bits(st.norm[0].reshape(1)).equal(bits(ref.reshape(1).to(st.norm.dtype))) or (
            bool(torch.isnan(st.norm[0])) and bool(torch.isnan(ref))), (name, g.numel())


# ---------------------------------------------------------------------------------------------- sparse gradients
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_grad_stats_reads_sparse_gradients_like_their_dense_form(dtype):
    g = torch.Generator().manual_seed(5)
    emb = torch.nn.Parameter(torch.randn(50, 7, generator=g).to(dtype))
    idx = torch.tensor([[3, 9, 9, 40, 3, 12]])
    vals = torch.randn(6, 7, generator=g).to(dtype)
    vals[5, 2] = 0.0  # an explicit zero among the stored values
    vals[3, 4] = float("nan")
    vals[1, 0] = float("inf")
    emb.grad = torch.sparse_coo_tensor(idx, vals, (50, 7))  # uncoalesced: rows 3 and 9 twice
    lin = torch.nn.Parameter(torch.randn(4, 3, generator=g).to(dtype))
    lin.grad = torch.randn(4, 3, generator=g).to(dtype)
    empty = torch.nn.Parameter(torch.randn(8, 2).to(dtype))
    empty.grad = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0, 2, dtype=dtype),
                                         (8, 2))
    named = [("lin", lin), ("emb", emb), ("empty", empty)]
    st = fastgrad.grad_stats(named)
    assert st.names == ["lin", "emb", "empty"] and st.row_sparse == ["emb", "empty"]
    dense = [lin.grad, emb.grad.to_dense(), empty.grad.to_dense()]  # the float64 reference, summed duplicates
    assert st.numel.tolist() == [12, 350, 16]
    assert st.zero.tolist() == [int((d == 0).sum()) for d in dense]  # implicit zeros counted
    assert st.nan.tolist() == [int(torch.isnan(d).sum()) for d in dense]
    assert st.inf.tolist() == [int(torch.isinf(d).sum()) for d in dense]
    assert st.norm.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert st.norm[0].item() == pytest.approx(oracle.tensor_norm(dense[0], 2.0), rel=1e-6)
    assert math.isnan(st.norm[1].item()) and math.isnan(st.max_abs[1].item())
    assert st.norm[2].item() == 0.0 and st.max_abs[2].item() == 0.0
    # finite values: norms and max against the float64 oracle
    emb.grad = torch.sparse_coo_tensor(idx, vals.nan_to_num(0.0, 0.0, 0.0), (50, 7))
    st = fastgrad.grad_stats(named)
    d = emb.grad.to_dense()
    assert st.norm[1].item() == pytest.approx(oracle.tensor_norm(d, 2.0), rel=1e-6)
    assert st.max_abs[1].item() == pytest.approx(oracle.tensor_norm(d, float("inf")), rel=1e-6)
    assert st.total_norm.item() == pytest.approx(oracle.total_norm(dense[:1] + [d, dense[2]], 2.0), rel=1e-6)


def test_grad_stats_names_embedding_weights_of_a_module():
    m = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 2), torch.nn.EmbeddingBag(9, 2))
    m[1](m[0](torch.tensor([1, 5]))).sum().backward()
    m[2](torch.tensor([[1, 2]])).sum().backward()
    st = fastgrad.grad_stats(m)
    assert st.row_sparse == ["0.weight", "2.weight"]
    assert fastgrad.stats.row_sparse_names(m, prefix="model.") == ["model.0.weight", "model.2.weight"]
    assert fastgrad.grad_stats(list(m.parameters())).row_sparse == []  # plain parameters: no module to look at
