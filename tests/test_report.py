"""GradientReport (docs/contract.md section 7 statuses): small models that really explode, vanish, die or produce NaNs, and
the report must name the right status and layers. Thresholds and texts come from the contract's table."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch
from torch import nn

import fastgrad
from fastgrad.report import Thresholds, loss_progress


def _mlp_stack(depth, width, act, std=None, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        lin = nn.Linear(width, width)
        if std is not None:
            nn.init.normal_(lin.weight, std=std)
            nn.init.zeros_(lin.bias)
        layers += [lin, act()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _one_grad(value: float) -> nn.Parameter:
    """A 1-element fp64 parameter whose gradient norm is exactly ``value`` (the norm of a scalar is exact)."""
    p = nn.Parameter(torch.ones(1, dtype=torch.float64))
    p.grad = torch.tensor([value], dtype=torch.float64)
    return p


# ---------------------------------------------------------------------------------------------- thresholds
@pytest.mark.parametrize("norm, status, code", [
    (0.0, "critical", "no_learning"),
    (5e-4, "warning", "vanishing"),
    (1e-3, "notice", "low"),            # gap 1e-3..0.1: a notice, not a warning
    (0.05, "notice", "low"),
    (0.1, "healthy", None),             # "0.1 to 10" is inclusive
    (1.0, "healthy", None),
    (10.0, "healthy", None),
    (50.0, "notice", "elevated"),       # gap 10..100
    (100.0, "notice", "elevated"),      # "> 100" is strict
    (100.5, "warning", "exploding"),
    (1000.0, "warning", "exploding"),
    (1000.5, "critical", "exploding"),
])
def test_total_norm_statuses(norm, status, code):
    rep = fastgrad.gradient_report([("w", _one_grad(norm))])
    assert rep.total_norm == norm
    assert rep.status == status
    assert rep.codes() == ([] if code is None else [code])
    if code == "exploding":
        f = rep.finding("exploding")
        exp = "exploding: clip now, lower the learning rate" if status == "critical" else \
            "exploding, clip (max_norm=1.0)"
        assert f.title == exp and f.layers == ["w"]


def test_small_but_learning_caveat():
    p = [("w", _one_grad(5e-4))]
    improving = [2.0, 1.5, 1.2, 1.0, 0.8, 0.7, 0.6, 0.5]
    flat = [1.0, 1.01, 0.99, 1.0, 1.0, 1.01, 0.99, 1.0]
    rep = fastgrad.gradient_report(p, loss_history=improving)
    assert rep.loss_progress is True and rep.codes() == ["small_but_learning"] and rep.status == "notice"
    rep = fastgrad.gradient_report(p, loss_history=flat)
    assert rep.loss_progress is False and rep.codes() == ["vanishing"] and rep.status == "warning"
    assert "not improving" in rep.finding("vanishing").detail
    # loss tensors are read in the same sync as the stats
    rep = fastgrad.gradient_report(p, loss_history=[torch.tensor(v) for v in improving])
    assert rep.codes() == ["small_but_learning"]
    rep = fastgrad.gradient_report(p, loss_history=torch.tensor(flat))
    assert rep.codes() == ["vanishing"]


def test_loss_progress_rule():
    assert loss_progress([]) is None and loss_progress([1.0]) is None
    assert loss_progress([1.0, 0.98]) is True        # 2% better: progress
    assert loss_progress([1.0, 0.995]) is False      # 0.5% is within noise
    assert loss_progress([1.0, float("nan"), 0.5]) is True
    assert loss_progress([3, 3, 1, 1, 1, 1, 3, 3]) is False  # last quarter vs first quarter only
    assert loss_progress([3, 3, 3, 3, 1, 1, 1, 3]) is True


# ---------------------------------------------------------------------------------------------- real models
def test_healthy_mlp():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    nn.functional.mse_loss(m(torch.randn(64, 16)), torch.randn(64, 1)).backward()
    rep = fastgrad.gradient_report(m)
    assert 0.1 <= rep.total_norm <= 10
    assert rep.status == "healthy" and rep.healthy and rep.findings == []
    assert [r.name for r in rep.layers] == ["0", "2", "4"]
    assert [r.name for r in rep.params] == [n for n, _ in m.named_parameters()]
    assert "No issues detected" in rep.to_markdown()


def test_deep_tanh_stack_explodes_and_names_early_layers():
    # weights with std 3/sqrt(width): the chaotic regime, where backprop amplifies the gradient per layer
    m = _mlp_stack(30, 64, nn.Tanh, std=3 / 8)
    m(torch.randn(16, 64)).pow(2).mean().backward()
    rep = fastgrad.gradient_report(m)
    assert rep.total_norm > 1000 and rep.status == "critical"
    f = rep.finding("exploding")
    assert f.severity == "critical" and f.layers[0] == "0"  # the largest norms are the earliest layers
    assert "depth_vanishing" not in rep.codes()


def test_huge_learning_rate_explodes():
    torch.manual_seed(0)
    m = nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=5.0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    rep = fastgrad.gradient_report(m, loss_history=losses)
    assert rep.loss_progress is False
    assert rep.status == "critical" and rep.finding("exploding").severity == "critical"
    md = rep.to_markdown()
    assert "clip_grad_norm_(model.parameters(), max_norm=1.0)" in md and "lr" in md


def test_saturated_sigmoid_output_vanishes():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid())
    with torch.no_grad():
        m[2].bias.fill_(12.0)  # the output sigmoid saturates: sigmoid'(12) ~ 6e-6
    nn.functional.mse_loss(m(torch.randn(32, 8)), torch.zeros(32, 1)).backward()
    rep = fastgrad.gradient_report(m)
    assert 0 < rep.total_norm < 1e-3
    assert rep.status == "warning" and rep.codes() == ["vanishing"]
    assert rep.finding("vanishing").title == "vanishing; check architecture and initialisation"
    rep = fastgrad.gradient_report(m, loss_history=[1.0, 0.9, 0.8, 0.7])
    assert rep.status == "notice" and rep.codes() == ["small_but_learning"]


def test_deep_sigmoid_stack_vanishes_across_depth():
    m = _mlp_stack(12, 16, nn.Sigmoid)
    m(torch.randn(32, 16)).pow(2).mean().backward()
    rep = fastgrad.gradient_report(m)
    f = rep.finding("depth_vanishing")
    assert f is not None and f.severity == "warning" and f.title == "vanishing across depth"
    norms = {r.name: r.norm for r in rep.layers}
    late = sum(r.norm for r in rep.layers[-3:]) / 3  # 13 layers: the last quarter is 3 layers
    assert f.layers == [n for n in norms if norms[n] * 1000 < late and n not in ("20", "22", "24")]
    assert f.layers[0] == "0" and "24" not in f.layers


@pytest.mark.parametrize("late, flagged", [(0.999, False), (1.0, False), (1.001, True)])
def test_depth_ratio_is_strictly_over_1000x(late, flagged):
    # two "layers" in registration order; the early one 1e-3: flagged only when late/early > 1000
    rep = fastgrad.gradient_report([("early.w", _one_grad(1e-3)), ("late.w", _one_grad(late))])
    assert ("depth_vanishing" in rep.codes()) == flagged
    if flagged:
        assert rep.finding("depth_vanishing").layers == ["early"]


def test_single_layer_has_no_depth_check():
    # both tensors belong to module "a": one layer, nothing to compare across depth
    rep = fastgrad.gradient_report([("a.w", _one_grad(1e-9)), ("a.b", _one_grad(1.0))])
    assert [r.name for r in rep.layers] == ["a"] and rep.codes() == []


def test_dead_relus():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        m[0].bias.fill_(-100.0)  # every first-layer unit is dead
    nn.functional.mse_loss(m(torch.randn(64, 16)), torch.randn(64, 1)).backward()
    rep = fastgrad.gradient_report(m)
    assert rep.zero / rep.numel > 0.5
    f = rep.finding("dead")
    assert f.severity == "warning" and f.title == "dead parameters"
    assert {"0.weight", "0.bias", "2.weight"} <= set(f.layers) and "4.bias" not in f.layers
    assert rep.status == "warning"
    assert "depth_vanishing" not in rep.codes()  # all-zero layers are dead, not "vanishing"


def test_all_zero_gradients_is_no_learning():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    (m(torch.randn(8, 4)).sum() * 0).backward()
    rep = fastgrad.gradient_report(m)
    assert rep.total_norm == 0 and rep.status == "critical"
    assert rep.codes() == ["no_learning"]  # not also "dead": one finding says it
    assert rep.finding("no_learning").title == "no learning; frozen parameters or dead units"


def test_everything_frozen_is_no_learning():
    m = nn.Linear(3, 2)
    rep = fastgrad.gradient_report(m)  # backward never ran
    assert rep.status == "critical" and rep.codes() == ["no_learning"]
    assert rep.no_grad == ["weight", "bias"] and rep.finding("no_learning").layers == ["weight", "bias"]


def test_frozen_parameters_are_listed_not_flagged():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    m[0].requires_grad_(False)
    nn.functional.mse_loss(m(torch.randn(64, 16)), torch.randn(64, 1)).backward()
    rep = fastgrad.gradient_report(m)
    assert rep.no_grad == ["0.weight", "0.bias"] and [r.name for r in rep.layers] == ["2", "4"]
    assert rep.status == "healthy"
    assert dict(rep._summary_rows())["Tensors with a gradient"] == "4 (without: 2)"


def test_injected_nans_name_the_parameters(bd):
    backend, device = bd
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    m(torch.randn(4, 6, device=device)).sum().backward()
    with torch.no_grad():
        m[2].weight.grad[1, 3] = float("nan")
        m[2].weight.grad[0, 0] = float("nan")
        m[4].bias.grad[0] = float("inf")
    rep = fastgrad.gradient_report(m, backend=backend)
    assert rep.status == "critical"
    f = rep.finding("nonfinite")
    assert f.severity == "critical" and f.layers == ["2.weight", "4.bias"]
    assert "check the loss before backward()" in f.title
    assert (rep.nan, rep.inf) == (2, 1) and math.isnan(rep.total_norm) and math.isnan(rep.max_abs)
    assert "find_nonfinite" in rep.to_markdown()
    assert {r.name: (r.nan, r.inf) for r in rep.layers} == {"0": (0, 0), "2": (2, 0), "4": (0, 1)}


def test_grad_param_ratio(bd):
    backend, device = bd
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(device)
    m(torch.randn(9, 5, device=device)).pow(2).sum().backward()
    rep = fastgrad.gradient_report(m, backend=backend)
    g = [p.grad.double() for p in m.parameters()]
    w = [p.detach().double() for p in m.parameters()]
    gn = math.sqrt(sum(float(t.pow(2).sum()) for t in g))
    wn = math.sqrt(sum(float(t.pow(2).sum()) for t in w))
    rtol = 1e-6  # fp32 accumulation, docs/contract.md section 3
    assert rep.total_norm == pytest.approx(gn, rel=rtol) and rep.param_norm == pytest.approx(wn, rel=rtol)
    assert rep.ratio == pytest.approx(gn / wn, rel=2 * rtol)
    layer0 = rep.layers[0]
    exp = math.sqrt(float(g[0].pow(2).sum() + g[1].pow(2).sum())) / \
        math.sqrt(float(w[0].pow(2).sum() + w[1].pow(2).sum()))
    assert layer0.params == ["0.weight", "0.bias"] and layer0.ratio == pytest.approx(exp, rel=2 * rtol)
    assert rep.max_abs == pytest.approx(max(float(t.abs().max()) for t in g), rel=rtol)
    no_params = fastgrad.gradient_report(m, include_params=False, backend=backend)
    assert no_params.param_norm is None and no_params.ratio is None and no_params.params[0].ratio is None


# ---------------------------------------------------------------------------------------------- rendering
def _nan_report():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    m(torch.randn(8, 4)).sum().backward()
    m[2].weight.grad[0, 1] = float("nan")
    return fastgrad.gradient_report(m, step=7)


def test_markdown_sections():
    md = _nan_report().to_markdown()
    head = md.index("## Summary"), md.index("## Issues Detected"), md.index("## Recommendations")
    assert md.startswith("# Gradient report (step 7)") and head == tuple(sorted(head))
    assert "| Status | CRITICAL |" in md
    assert "| critical |" in md and "| 2.weight |" in md  # severity and affected layer in the issues table
    assert "```python" in md and "## Per-layer gradients" in md
    deep = _mlp_stack(6, 4, nn.ReLU)
    deep(torch.randn(3, 4)).sum().backward()
    many = fastgrad.gradient_report(deep).to_markdown(max_layers=2)
    assert "(5 more layers not shown)" in many


def test_to_dict_is_json_ready():
    rep = _nan_report()
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["status"] == "critical" and d["step"] == 7 and d["nan"] == 1
    assert d["findings"][0]["code"] == "nonfinite" and d["findings"][0]["layers"] == ["2.weight"]
    assert [p["name"] for p in d["params"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    s = rep.scalars()
    assert s["grad/nan"] == 1.0 and s["grad/status_level"] == 3.0 and "grad/norm/2" in s


def test_plain_text_fallback_without_rich(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich", None)  # makes "import rich..." raise ImportError
    monkeypatch.setitem(sys.modules, "rich.console", None)
    rep = _nan_report()
    rep.show()
    out = capsys.readouterr().out
    assert out == rep.to_text() and "[CRITICAL]" in out and "affected: 2.weight" in out
    with pytest.raises(ImportError):
        rep.show(use_rich=True)


def test_rich_rendering():
    pytest.importorskip("rich")
    from rich.console import Console

    buf = io.StringIO()
    _nan_report().show(Console(file=buf, width=120, color_system=None))
    out = buf.getvalue()
    assert "Gradient report" in out and "Issues detected" in out and "2.weight" in out and "critical" in out


def test_custom_thresholds():
    th = Thresholds(healthy_high=1.0, exploding=2.0, critical=3.0)
    assert fastgrad.gradient_report([("w", _one_grad(2.5))], thresholds=th).codes() == ["exploding"]
    assert fastgrad.gradient_report([("w", _one_grad(2.5))]).status == "healthy"


# ---------------------------------------------------------------------------------------------- the loss
def _finite_grads_model():
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    m(torch.randn(8, 4)).pow(2).mean().backward()
    return m


def test_nonfinite_loss_history_is_critical_with_finite_grads():
    m = _finite_grads_model()
    r = fastgrad.gradient_report(m, loss_history=[1.0, 0.9, float("nan")])
    assert r.nan == r.inf == 0 and r.status == "critical" and r.codes() == ["nonfinite_loss"]
    f = r.finding("nonfinite_loss")
    assert f.steps == [3] and "first at step 3" in f.detail
    md = r.to_markdown()
    assert "check the loss before backward()" in md and "clamp" in md and "lr" in md


def test_custom_loss_that_goes_nan_with_finite_gradients():
    # log(pred - y) with pred < y: the loss is NaN, d log(u)/du = 1/u is finite, so are the gradients
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    with torch.no_grad():
        m.bias.fill_(-10.0)
    x, y = torch.randn(16, 3), torch.ones(16, 1)
    loss = torch.log(m(x) - y).mean()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters()) and torch.isnan(loss)
    r = fastgrad.gradient_report(m, loss=loss)
    assert r.status == "critical" and r.codes()[0] == "nonfinite_loss" and math.isnan(r.loss)
    assert "| Loss | nan (NON-FINITE) |" in r.to_markdown()
    assert r.to_dict()["loss"] != r.to_dict()["loss"]  # NaN kept in the dict
    ok = fastgrad.gradient_report(m, loss=torch.tensor(0.25), loss_history=[1.0, 0.5])
    assert "nonfinite_loss" not in ok.codes() and ok.loss == 0.25 and "| Loss | 0.25 |" in ok.to_markdown()
    assert fastgrad.gradient_report(m, loss=float("inf")).codes()[0] == "nonfinite_loss"
    # a multi-element loss counts every element, shown by its first
    assert fastgrad.gradient_report(m, loss=torch.tensor([1.0, float("nan")])).status == "critical"


def test_loss_jump_in_the_history():
    m = _finite_grads_model()
    hist = [2.0 - 0.01 * i for i in range(30)] + [50 * 1.7]
    r = fastgrad.gradient_report(m, loss_history=hist)
    f = r.finding("loss_spike")
    assert f.severity == "warning" and f.steps == [31] and "step 31" in f.title
    assert "loss_spike" not in fastgrad.gradient_report(m, loss_history=hist[:-1]).codes()
