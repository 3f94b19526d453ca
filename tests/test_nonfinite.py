"""find_nonfinite: loss before backward, non-finite gradients, non-finite parameters, named exactly."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fastgrad


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)


def test_clean_model_finds_nothing(bd):
    backend, device = bd
    m = _model(device)
    loss = m(torch.randn(4, 6, device=device)).pow(2).mean()
    loss.backward()
    r = fastgrad.find_nonfinite(m, loss, backend=backend)
    assert not r and r.found is False
    assert r.loss_finite is True and r.loss_value == pytest.approx(loss.item(), rel=1e-6)
    assert r.grads == [] and r.params == [] and (r.checked_grads, r.checked_params) == (6, 6)
    assert "Everything checked is finite" in str(r)


def test_injected_grad_nans_are_named(bd):
    backend, device = bd
    m = _model(device)
    loss = m(torch.randn(4, 6, device=device)).sum()
    loss.backward()
    with torch.no_grad():
        m[2].weight.grad[0, :3] = float("nan")
        m[4].bias.grad[1] = -float("inf")
    r = fastgrad.find_nonfinite(m, loss, backend=backend)
    assert r and r.loss_finite is True
    assert r.grad_names == ["2.weight", "4.bias"] and r.param_names == []
    assert [(e.nan, e.inf, e.numel) for e in r.grads] == [(3, 0, 64), (0, 1, 2)]
    assert "backward() produced" in r.diagnosis


def test_nonfinite_loss_before_backward(bd):
    backend, device = bd
    m = _model(device)
    x = torch.randn(4, 6, device=device)
    x[2, 1] = float("nan")  # a bad input sample
    loss = m(x).sum()
    r = fastgrad.find_nonfinite(m, loss, backend=backend)  # before backward(): no grads yet
    assert r.loss_finite is False and r.checked_grads == 0 and r.params == []
    assert "before backward()" in r.diagnosis
    loss.backward()
    r = fastgrad.find_nonfinite(m, loss, backend=backend)
    assert r.loss_finite is False and r.grad_names  # NaN spread into the gradients too
    assert "before backward()" in r.diagnosis  # the earliest cause comes first


def test_nonfinite_parameter_is_named(bd):
    backend, device = bd
    m = _model(device)
    with torch.no_grad():
        m[0].weight[1, 1] = float("inf")
    m[2].requires_grad_(False)  # frozen parameters are still checked as parameters
    with torch.no_grad():
        m[2].bias[0] = float("nan")
    loss = m(torch.randn(4, 6, device=device)).sum()
    loss.backward()
    r = fastgrad.find_nonfinite(m, loss, backend=backend)
    assert r.param_names == ["0.weight", "2.bias"]
    assert [(e.nan, e.inf) for e in r.params] == [(0, 1), (1, 0)]
    assert "optimizer step" in r.diagnosis
    r = fastgrad.find_nonfinite(m, loss, check_params=False, backend=backend)
    assert r.params == [] and r.checked_params == 0


def test_loss_forms_and_inputs():
    m = _model("cpu")
    assert fastgrad.find_nonfinite(m, float("inf")).loss_finite is False
    assert fastgrad.find_nonfinite(m, 1.5).loss_value == 1.5
    r = fastgrad.find_nonfinite(m, torch.tensor([1.0, float("nan")]))  # unreduced loss: no single value
    assert r.loss_finite is False and r.loss_value is None
    assert fastgrad.find_nonfinite(m).loss_finite is None
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([0.0, float("nan"), 1.0])
    r = fastgrad.find_nonfinite([p])
    assert r.grad_names == ["0"]
    r = fastgrad.find_nonfinite([("emb", p)])
    assert r.grad_names == ["emb"]
    assert json.loads(json.dumps(r.to_dict()))["grads"][0]["nan"] == 1


def test_complex_and_mixed_dtypes_fall_back():
    a = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    a.grad = torch.tensor([1 + 1j, complex(float("nan"), 0)], dtype=torch.complex64)
    b = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    b.grad = torch.tensor([1.0, float("inf"), 0.0], dtype=torch.bfloat16)
    c = nn.Parameter(torch.ones(2, dtype=torch.float64))
    c.grad = torch.zeros(2, dtype=torch.float64)
    r = fastgrad.find_nonfinite([("a", a), ("b", b), ("c", c)])
    assert [(e.name, e.nan, e.inf) for e in r.grads] == [("a", 1, 0), ("b", 0, 1)]


class _LogOf(nn.Module):
    """log of its input: NaN where the input is negative (the forward birth of a NaN)."""

    def forward(self, x):
        return torch.log(x)


def test_watcher_names_where_the_nan_was_born():
    from fastgrad.diagnose.collect.watch import ForwardWatcher

    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), _LogOf(), nn.Linear(8, 2))
    watcher = ForwardWatcher(m)
    try:
        loss = m(torch.randn(5, 6)).pow(2).mean()  # tanh output has negative entries -> log -> NaN
        loss.backward()
        r = fastgrad.find_nonfinite(m, loss, watcher=watcher)
    finally:
        watcher.remove()
    assert r and r.loss_finite is False
    assert r.origin is not None and r.origin.module == "2" and r.origin.module_type == "_LogOf"
    assert "2 (_LogOf)" in r.diagnosis and "first non-finite output: 2 (_LogOf)" in str(r)
    assert json.loads(json.dumps(r.to_dict()))["origin"]["module"] == "2"
    # without the watcher the report has no origin and the loss-based diagnosis
    plain = fastgrad.find_nonfinite(m, loss)
    assert plain.origin is None and "loss is non-finite" in plain.diagnosis


def test_sparse_gradients_counted_like_their_dense_form():
    # an nn.Embedding(sparse=True)-style gradient with duplicates: counts are those of the summed (dense)
    # gradient: +Inf and -Inf on the same element add up to one NaN there
    emb = torch.nn.Parameter(torch.randn(30, 4))
    idx = torch.tensor([[2, 2, 5, 9, 9]])
    vals = torch.randn(5, 4)
    vals[0, 1], vals[1, 1] = float("inf"), -float("inf")
    vals[2, 3] = float("nan")
    vals[3, 0] = float("inf")
    emb.grad = torch.sparse_coo_tensor(idx, vals, (30, 4))
    lin = torch.nn.Parameter(torch.randn(3, 3))
    lin.grad = torch.randn(3, 3)
    dense = emb.grad.to_dense()
    rep = fastgrad.find_nonfinite([("lin", lin), ("emb", emb)])
    assert rep.grad_names == ["emb"]
    (e,) = rep.grads
    assert (e.nan, e.inf, e.numel) == (int(torch.isnan(dense).sum()), int(torch.isinf(dense).sum()), 120)
    assert (e.nan, e.inf) == (2, 1)
    st = fastgrad.grad_stats([("lin", lin), ("emb", emb)])  # the statistics agree
    assert st.nan.tolist() == [0, 2] and st.inf.tolist() == [0, 1]
