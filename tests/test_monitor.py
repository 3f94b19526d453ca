"""GradientMonitor: device ring buffers written without host syncs, one sync per logging step, trend detection
(growth, k-sigma spikes, decay to ~0), duck-typed loggers (fakes for TensorBoard and W&B), CSV and PNG."""

from __future__ import annotations

import csv
import io
import logging
import math

import pytest
import torch
from torch import nn

import fastgrad
from fastgrad.monitor import detect_trends


def _param(name="w"):
    # fp64 so that the norms we set are recorded exactly
    return name, nn.Parameter(torch.ones(1, dtype=torch.float64))


def _drive(mon, named, norms, losses=None):
    """Set each step's gradient so that its total norm is norms[i]; return the reports of logging steps."""
    reports = {}
    for i, v in enumerate(norms):
        for _, p in named:
            p.grad = torch.tensor([v], dtype=torch.float64)
        r = mon(None if losses is None else losses[i])
        if r is not None:
            reports[mon.step] = r
    return reports


def test_logs_only_every_n_steps_and_keeps_full_history():
    named = [_param()]
    mon = fastgrad.GradientMonitor(named, every=4, history=8)
    norms = [float(i) for i in range(1, 21)]
    reports = _drive(mon, named, norms, losses=[10.0 - 0.1 * i for i in range(20)])
    assert sorted(reports) == [4, 8, 12, 16, 20] and mon.last_report is reports[20]
    assert reports[8].step == 8 and reports[8].total_norm == 8.0
    h = mon.history()  # 20 steps through an 8-slot ring: each logging step moved its steps to the host
    assert h["steps"] == list(range(1, 21)) and h["total_norm"] == norms
    assert h["loss"] == pytest.approx([10.0 - 0.1 * i for i in range(20)], rel=1e-6)  # stored in fp32
    assert h["nonfinite"] == [0] * 20


def test_ring_buffer_wraps_without_logging():
    named = [_param()]
    mon = fastgrad.GradientMonitor(named, every=None, history=5)
    assert _drive(mon, named, [float(i) for i in range(1, 13)]) == {}
    h = mon.history()  # never logged: only the last 5 steps are still in the ring
    assert h["steps"] == [8, 9, 10, 11, 12] and h["total_norm"] == [8.0, 9.0, 10.0, 11.0, 12.0]
    assert math.isnan(h["loss"][0])
    assert mon.layer_history() == {"w": [8.0, 9.0, 10.0, 11.0, 12.0]}
    r = mon.log()  # an explicit report at any time
    assert r.step == 12 and r.total_norm == 12.0


def test_no_host_reads_on_non_logging_steps(monkeypatch):
    """CPU proxy for the CUDA sync test: every Python-level device read raises between logging steps."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    mon = fastgrad.GradientMonitor(m, every=3, backend="torch")
    x = torch.randn(8, 4)
    real = {k: getattr(torch.Tensor, k) for k in ("item", "tolist", "__bool__", "__float__", "__int__")}

    def forbid(name):
        def f(*a, **k):
            raise AssertionError(f"host read ({name}) on a non-logging step")
        return f

    for step in range(1, 7):
        m.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        if step >= 5:
            m[2].bias.grad = None  # a tracked parameter without grad: the index_copy_ path
        if step % 3:
            for k in real:
                monkeypatch.setattr(torch.Tensor, k, forbid(k))
        try:
            r = mon(loss)
        finally:
            for k, f in real.items():
                monkeypatch.setattr(torch.Tensor, k, f)
        assert (r is None) == bool(step % 3)
    lh = mon.layer_history()
    assert math.isnan(lh["2.bias"][-1]) and not math.isnan(lh["2.bias"][-3])
    assert lh["0.weight"][-1] == pytest.approx(float(m[0].weight.grad.norm()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_sync_on_cuda_non_logging_steps():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    m[2].bias.requires_grad_(False)
    mon = fastgrad.GradientMonitor(m, every=5)
    x = torch.randn(16, 32, device="cuda")
    for step in range(1, 11):
        m.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        if step % 5:
            torch.cuda.set_sync_debug_mode("error")
        try:
            r = mon(loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert (r is None) == bool(step % 5)
    assert mon.history()["steps"] == list(range(1, 11))


# ---------------------------------------------------------------------------------------------- trends
def _noisy(n, seed=0, level=1.0, sigma=0.05):
    g = torch.Generator().manual_seed(seed)
    return [level * math.exp(sigma * float(v)) for v in torch.randn(n, generator=g)]


def test_spike_detected_once_at_its_step():
    named = [_param()]
    mon = fastgrad.GradientMonitor(named, every=10)
    norms = _noisy(40)
    norms[32] = 50.0  # step 33
    reports = _drive(mon, named, norms)
    assert all(reports[s].finding("spike") is None for s in (10, 20, 30))
    f = reports[40].finding("spike")
    assert f is not None and f.severity == "warning" and f.steps == [33]
    assert "step 33" in reports[40].to_markdown()


def test_stationary_noise_has_no_trend():
    named = [_param()]
    mon = fastgrad.GradientMonitor(named, every=50)
    r = _drive(mon, named, _noisy(100, seed=3, sigma=0.1))[100]
    assert r.codes() == [] and r.status == "healthy"


def test_steady_growth_is_flagged():
    named = [_param()]
    mon = fastgrad.GradientMonitor(named, every=40)
    r = _drive(mon, named, [0.5 * 1.05 ** t for t in range(40)])[40]
    assert "increasing" in r.codes() and r.finding("increasing").severity == "warning"
    assert r.status == "warning"


def test_decay_to_zero_and_the_learning_caveat():
    named = [_param()]
    norms = [0.7 ** t for t in range(40)]
    r = _drive(fastgrad.GradientMonitor(named, every=40), named, norms)[40]
    assert r.finding("decaying").severity == "warning"
    assert r.finding("vanishing").severity == "warning"  # current norm 1e-6, no loss history
    flat = [1.0] * 40
    r = _drive(fastgrad.GradientMonitor(named, every=40), named, norms, losses=flat)[40]
    assert r.loss_progress is False and r.finding("decaying").severity == "warning"
    falling = [1.0 / (t + 1) for t in range(40)]
    r = _drive(fastgrad.GradientMonitor(named, every=40), named, norms, losses=falling)[40]
    assert r.loss_progress is True
    assert r.finding("decaying").severity == "notice" and r.codes()[0] == "small_but_learning"


def test_detect_trends_needs_history():
    assert detect_trends(list(range(1, 6)), [1, 1, 1, 1, 100]) == []  # 4 points: too few for a baseline
    assert detect_trends(list(range(1, 13)), [1.0] * 11 + [1.1]) == []  # std floor: a 10% wobble is no spike
    (small,) = detect_trends(list(range(1, 13)), [1.0] * 11 + [1.5])  # over 3 sigma, under 2x the mean
    assert small.code == "spike" and small.severity == "notice" and small.steps == [12]


def test_huge_lr_training_is_flagged_by_the_monitor():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=3.0)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True) * 3
    mon = fastgrad.GradientMonitor(m, every=12, min_history=4)
    reports = []
    for _ in range(12):
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        if (r := mon(loss)) is not None:
            reports.append(r)
        opt.step()
    (r,) = reports
    assert r.status in ("warning", "critical") and r.loss_progress is not True
    assert set(r.codes()) & {"exploding", "increasing", "spike", "nonfinite", "elevated"}


def test_nonfinite_steps_between_logs_are_reported():
    named = [_param()]
    norms = [1.0] * 10
    norms[2] = float("nan")  # step 3, e.g. an AMP overflow the scaler skipped
    r = _drive(fastgrad.GradientMonitor(named, every=10), named, norms)[10]
    f = r.finding("nonfinite_seen")
    assert f.steps == [3] and r.status == "warning" and r.finding("nonfinite") is None
    r = _drive(fastgrad.GradientMonitor(named, every=10), named, [1.0] * 9 + [float("inf")])[10]
    assert r.codes() == ["nonfinite"]  # the current step is reported once, as critical


# ---------------------------------------------------------------------------------------------- loggers
class FakeWriter:
    """The part of torch.utils.tensorboard.SummaryWriter the monitor uses."""

    def __init__(self):
        self.scalars, self.texts = [], []

    def add_scalar(self, tag, value, global_step=None):
        self.scalars.append((tag, value, global_step))

    def add_text(self, tag, text, global_step=None):
        self.texts.append((tag, text, global_step))


class FakeRun:
    """The part of a wandb run the monitor uses."""

    def __init__(self):
        self.logged = []

    def log(self, data, step=None, commit=None):
        self.logged.append(dict(data))


def test_tensorboard_and_wandb_fakes():
    named = [("enc.w", nn.Parameter(torch.ones(1, dtype=torch.float64)))]
    tb, run = FakeWriter(), FakeRun()
    mon = fastgrad.GradientMonitor(named, every=3, logger=[tb, run])
    _drive(mon, named, [1.0, 2.0, 3.0, 4.0, 5.0, 500.0])
    norm_curve = [(v, s) for t, v, s in tb.scalars if t == "grad/total_norm"]
    assert norm_curve == [(1.0, 1), (2.0, 2), (3.0, 3), (4.0, 4), (5.0, 5), (500.0, 6)]  # every step
    assert ("grad/norm/enc", 3.0, 3) in tb.scalars and ("grad/nan", 0.0, 6) in tb.scalars
    assert [s for _, _, s in tb.texts] == [6] and "## Issues Detected" in tb.texts[0][1]  # only when unhealthy
    assert [d["grad/step"] for d in run.logged] == [3, 6]
    assert run.logged[1]["grad/total_norm"] == 500.0 and run.logged[1]["grad/status"] == "warning"


def test_csv_path_file_callable_and_logging(tmp_path, caplog):
    named = [_param()]
    path = tmp_path / "grads.csv"
    buf = io.StringIO()
    calls = []
    log = logging.getLogger("fastgrad-test-monitor")
    mon = fastgrad.GradientMonitor(named, every=2, logger=[str(path), buf, lambda d, s: calls.append((s, d)), log])
    with caplog.at_level(logging.INFO, logger=log.name):
        _drive(mon, named, [1.0, 2.0, 3.0, 2000.0], losses=[4.0, 3.0, 2.0, 1.0])
    mon.close()
    rows = list(csv.DictReader(path.open()))
    assert [r["step"] for r in rows] == ["2", "4"]
    assert float(rows[1]["total_norm"]) == 2000.0 and rows[1]["status"] == "critical"
    assert rows[1]["findings"] == "exploding" and float(rows[1]["loss"]) == 1.0
    assert list(csv.DictReader(io.StringIO(buf.getvalue()))) == rows
    assert [s for s, _ in calls] == [2, 4] and calls[1][1]["grad/total_norm"] == 2000.0
    assert any("critical" in rec.getMessage() and rec.levelno == logging.ERROR for rec in caplog.records)
    with pytest.raises(TypeError, match="unsupported logger"):
        fastgrad.GradientMonitor(named, every=1, logger=object())(None)


def test_plot_png(tmp_path):
    pytest.importorskip("matplotlib")
    named = [_param()]
    mon = fastgrad.GradientMonitor(named, every=None)
    norms = _noisy(30)
    norms[25] = 40.0
    norms[10] = float("nan")
    _drive(mon, named, norms)
    out = mon.plot(tmp_path / "norms.png")
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_rejects_bad_every():
    with pytest.raises(ValueError, match="every"):
        fastgrad.GradientMonitor([_param()], every=0)
