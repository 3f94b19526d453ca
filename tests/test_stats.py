"""grad_stats (SPEC section 7) on every (backend, device) pair: exact counts, norms vs the oracle."""

from __future__ import annotations

import pytest
import torch

import fastgrad

from . import oracle
from .helpers import DTYPE_IDS, DTYPES, assert_no_worse_than, make_params

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
