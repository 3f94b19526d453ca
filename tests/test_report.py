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
import fastgrad.diagnose.finding
from fastgrad.diagnose.rules.trends import loss_progress
from fastgrad.diagnose.thresholds import Thresholds


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
        m[0].bias.fill_(-100.0)  # every unit of both hidden layers is dead
        m[2].bias.fill_(-100.0)
    nn.functional.mse_loss(m(torch.randn(64, 16)), torch.randn(64, 1)).backward()
    rep = fastgrad.gradient_report(m)
    # ground truth without fastgrad: the tensors whose gradient is entirely zero
    zero = [n for n, p in m.named_parameters() if bool((p.grad == 0).all())]
    assert zero == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight"]
    assert rep.zero_params() == zero
    f = rep.finding("dead")
    assert f.severity == "warning" and f.title == "dead parameters"
    assert f.layers == zero and "5 of 6 parameter tensors" in f.detail
    assert rep.status == "warning"
    assert "depth_vanishing" not in rep.codes()  # all-zero layers are dead, not "vanishing"
    assert dict(rep.summary_rows())["Zero-gradient parameters"] == "5 of 6 tensors entirely zero"


def test_dead_counts_tensors_not_values():
    # Half of the tensors all-zero is not "more than 50%": no dead warning, although most VALUES are zero;
    # the values give a notice that names the mostly-zero tensors.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        m[0].bias.fill_(-100.0)
    nn.functional.mse_loss(m(torch.randn(64, 16)), torch.randn(64, 1)).backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    zero_t = [n for n, g in grads.items() if bool((g == 0).all())]
    zero_v = sum(int((g == 0).sum()) for g in grads.values()) / sum(g.numel() for g in grads.values())
    assert len(zero_t) == 3 and zero_v > 0.5
    rep = fastgrad.gradient_report(m)
    assert "dead" not in rep.codes()
    f = rep.finding("mostly_zero")
    assert f.severity == "notice" and f"{zero_v:.1%}" in f.detail and set(zero_t) <= set(f.layers)


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
    assert dict(rep.summary_rows())["Tensors with a gradient"] == "4 (without: 2)"


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
    rep.show(width=100)
    out = capsys.readouterr().out
    assert out == rep.to_text(width=100) and "[CRITICAL]" in out and "affected: 2.weight" in out
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


# ---------------------------------------------------------------------------------------------- issue 20 items
def _encoder_report():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    m = nn.Sequential()
    m.add_module("transformer_encoder", nn.TransformerEncoder(layer, 4, enable_nested_tensor=False))
    m.add_module("head", nn.Linear(16, 1))
    m(torch.randn(2, 5, 16)).sum().backward()
    return fastgrad.gradient_report(m)


def _layer_cells(out: str) -> list[str]:
    """The Layer column of the per-layer table of a plain or rich rendering."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if "Grad norm" in ln and "Layer" in ln)
    cells = []
    for ln in lines[start + 1:]:
        if not ln.strip() or ln.startswith("("):
            break
        if ln[0] in "┡└┏├":
            continue
        cells.append(ln.split("│")[1].strip() if "│" in ln else ln.split()[0])
    return cells


def _check_80(out: str, rep) -> None:
    assert max(len(ln) for ln in out.splitlines()) <= 80
    cells = _layer_cells(out)
    assert len(cells) == len(rep.layers) and len(set(cells)) == len(cells), cells  # all told apart
    for name, cell in zip([r.name for r in rep.layers], cells):
        parts = name.split(".")
        idx = next((p for p in parts[1:-1] if p.isdigit()), None)
        assert idx is None or f".{idx}." in f".{cell}.", (name, cell)  # the layer index stays
        assert cell.endswith(parts[-1]), (name, cell)  # and so does the module's own name


def test_show_fits_80_columns_plain_text_keeps_the_distinguishing_part():
    rep = _encoder_report()
    assert any(len(r.name) > 40 for r in rep.layers)  # transformer_encoder.layers.3.self_attn.out_proj
    buf = io.StringIO()
    rep.show(buf, use_rich=False, width=80)
    out = buf.getvalue()
    _check_80(out, rep)
    assert "left out to fit 80 columns" in out
    assert "transformer_encoder.layers.3.self_attn.out_proj" in rep.to_text()  # no width: full names


def test_show_fits_80_columns_with_rich():
    pytest.importorskip("rich")
    from rich.console import Console

    rep = _encoder_report()
    buf = io.StringIO()
    rep.show(Console(file=buf, width=80, color_system=None))
    out = buf.getvalue()
    _check_80(out, rep)
    assert "0.layers.…" not in out


def test_abbrev_from_the_middle():
    from fastgrad.diagnose.render.step_text import abbrev as _abbrev

    assert _abbrev("a.b", 10) == "a.b"
    assert _abbrev("0.layers.11.self_attn.out_proj", 22) == "0.….11.….out_proj"
    assert _abbrev("0.layers.11.self_attn.out_proj", 26) == "0.….11.self_attn.out_proj"
    short = _abbrev("encoder.layers.11.self_attn.out_proj", 20)
    assert len(short) <= 20 and ".11." in short and short.endswith("out_proj")
    tiny = _abbrev("encoder.layers.11.self_attn.out_proj", 9)
    assert len(tiny) == 9 and tiny.endswith("proj")


def _emb_lm_run(steps=30, seed=0):
    """A healthy language model (embedding -> MLP -> vocabulary) trained with AdamW. The embedding output is
    scaled down (as some models do), so its gradient norm is far below the head's: every batch touches a few
    hundred of its 3000 rows, each with 1/N of the loss. AdamW normalises per coordinate, so the embedding
    learns anyway. Returns the model, the last batch's tokens, the losses and the embedding before training."""
    torch.manual_seed(seed)
    V, D, N = 3000, 16, 384
    m = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, 64), nn.Tanh(), nn.Linear(64, V))
    nn.init.uniform_(m[0].weight, -0.1, 0.1)
    opt = torch.optim.AdamW(m.parameters(), 1e-2)
    w0 = m[0].weight.detach().clone()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, V, (N,), generator=g)
        loss = nn.functional.cross_entropy(m[1:](m[0](x) * 0.003), x % 50)
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        if len(losses) < steps:
            opt.step()
    return m, x, losses, w0


def test_no_false_depth_vanishing_on_a_healthy_embedding_lm():
    from fastgrad import GradientReport

    m, x, losses, w0 = _emb_lm_run()
    # ground truth without fastgrad
    emb_norm = m[0].weight.grad.double().norm().item()
    head_norm = torch.cat([m[3].weight.grad.double().flatten(), m[3].bias.grad.double().flatten()]).norm().item()
    touched = int(x.unique().numel())
    assert head_norm / emb_norm > 1000  # the old rule's trigger: first layer 1000x below the last
    assert losses[-1] < losses[0] - 1.0 and (m[0].weight - w0).norm() / w0.norm() > 0.1  # it learns
    rep = fastgrad.gradient_report(m, loss_history=losses)
    assert "depth_vanishing" not in rep.codes() and "dead" not in rep.codes()
    (row,) = rep.row_sparse
    assert row.name == "0.weight" and row.rows == 3000 and row.touched == touched and row.excluded
    assert row.norm == pytest.approx(emb_norm, rel=1e-5)
    assert row.per_row == pytest.approx(emb_norm / touched ** 0.5, rel=1e-5)
    assert f"{touched:,} of 3,000 rows touched" in rep.to_text()
    # the same statistics without the embedding hint: the depth rule fires (what the fix prevents)
    st = fastgrad.grad_stats([(n, p) for n, p in m.named_parameters()])
    assert st.row_sparse == []
    assert "depth_vanishing" in GradientReport.from_stats(st).codes()
    # told by name (a caller holding parameters, not the module): same answer
    assert "depth_vanishing" not in GradientReport.from_stats(st, row_sparse=["0.weight"]).codes()


def test_depth_rule_still_fires_on_dense_layers_next_to_an_embedding():
    # the embedding is left out, not the rule: a vanishing dense stack still warns, and the detail names
    # what was left out
    named = [("emb.weight", _emb_grad()), ("a.weight", _one_grad(1e-6)), ("b.weight", _one_grad(1e-6)),
             ("c.weight", _one_grad(1.0)), ("d.weight", _one_grad(1.0))]
    from fastgrad import GradientReport

    rep = GradientReport.from_stats(fastgrad.grad_stats(named), row_sparse=["emb.weight"])
    f = rep.finding("depth_vanishing")
    assert f is not None and f.layers == ["a", "b"] and "emb.weight (2 of 10 rows touched" in f.detail


def _emb_grad():
    p = torch.nn.Parameter(torch.randn(10, 4))
    g = torch.zeros(10, 4)
    g[3] = torch.randn(4)
    g[7] = torch.randn(4)
    p.grad = g * 1e-9
    return p


def test_clip_to_zero_is_not_blamed_on_frozen_parameters():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    m(torch.randn(16, 4)).pow(2).mean().backward()
    pre = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in m.parameters()]).double()).item()
    assert pre > 0
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.0)
    assert all(bool((p.grad == 0).all()) for p in m.parameters())
    plain = fastgrad.gradient_report(m)
    assert plain.codes() == ["no_learning"]  # nothing tells it about the clip
    for kw in ({"clip_max_norm": 0.0}, {"pre_clip_norm": pre}, {"pre_clip_norm": torch.tensor(pre)}):
        rep = fastgrad.gradient_report(m, **kw)
        assert rep.codes() == ["clipped_to_zero"] and rep.status == "critical", kw
        f = rep.finding("clipped_to_zero")
        assert "frozen" not in f.title and "not frozen parameters or dead units" in f.detail
        if "pre_clip_norm" in kw:
            assert rep.pre_clip_norm == pytest.approx(pre, rel=1e-6) and fastgrad.diagnose.finding.fmt(pre) in f.detail
        assert "max_norm=1.0" in rep.to_text()
    # statistics read BEFORE a clip to 0 (nonzero total): the clip is still named
    m.zero_grad()
    m(torch.randn(16, 4)).pow(2).mean().backward()
    assert "clipped_to_zero" in fastgrad.gradient_report(m, clip_max_norm=0).codes()
    assert "clipped_to_zero" not in fastgrad.gradient_report(m, clip_max_norm=1.0).codes()


def test_sparse_embedding_gradient_is_read():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Embedding(40, 6), nn.Linear(6, 3))
    sparse = nn.Sequential(nn.Embedding(40, 6, sparse=True), nn.Linear(6, 3))
    sparse.load_state_dict(dense.state_dict())
    idx = torch.tensor([[1, 2, 2, 7], [39, 1, 0, 7]])
    for m in (dense, sparse):
        m(idx).pow(2).sum().backward()
    assert sparse[0].weight.grad.is_sparse
    rs, rd = fastgrad.gradient_report(sparse), fastgrad.gradient_report(dense)
    ref = dense[0].weight.grad.double()
    (row,) = [r for r in rs.params if r.name == "0.weight"]
    assert row.norm == pytest.approx(ref.norm().item(), rel=1e-6)
    assert row.zero == int((ref == 0).sum()) and row.numel == 240 and row.max_abs == pytest.approx(
        ref.abs().max().item(), rel=1e-6)
    assert rs.total_norm == pytest.approx(rd.total_norm, rel=1e-6) and rs.codes() == rd.codes()
    assert [r.touched for r in rs.row_sparse] == [5]
