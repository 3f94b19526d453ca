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
from fastgrad.diagnose.rules.trends import detect_trends

from . import helpers
from . import oracle


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


@pytest.mark.parametrize("case", ["tensor_loss", "float_loss", "no_grads_yet", "subset_stats", "skip_marks",
                                  "monitor_clip", "guard"])
def test_non_logging_steps_lift_no_host_value(case):
    """The CPU side of test_no_sync_on_cuda_non_logging_steps: on a non-logging step fastgrad's code never
    turns a host number into a tensor (``buf[slot] = 0``, ``torch.tensor(x)``): on CUDA each is a synchronizing
    host-to-device copy. Caches built on the first step are allowed; from the second step on, nothing."""
    from .sync_watch import HostValueWatch

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    guard = fastgrad.StepGuard(torch.optim.SGD(m.parameters(), lr=0.01), max_norm=1.0) if case == "guard" else None
    mon = fastgrad.GradientMonitor(m, every=None, guard=guard)
    x = torch.randn(8, 12)
    hits = []
    for step in range(1, 6):
        m.zero_grad()
        loss = m(x).pow(2).mean()
        if not (case == "no_grads_yet" and step == 2):
            loss.backward()
        with HostValueWatch() as w:
            if case == "float_loss":
                mon(float("nan") if step == 3 else 0.5)
            elif case == "subset_stats":
                mon.record(fastgrad.grad_stats(list(m.named_parameters())[:2]), loss)
            elif case == "monitor_clip":
                mon.clip_grad_norm_(0.5, loss=loss)
            elif case == "guard":
                guard.clip_()
                mon(loss)
            else:
                mon(loss)
            if case == "skip_marks":
                mon.record_skip(step % 2 == 0)
                mon.record_skip(torch.tensor(step % 2 == 1))
        if step > 1:
            hits += w.hits
    assert not hits, "a host value lifted into a tensor on a non-logging step:\n" + "\n".join(h for _, h in hits)
    h = mon.history()
    assert h["steps"] == list(range(1, 6))
    if case == "float_loss":
        assert math.isnan(h["loss"][2]) and h["loss"][0] == 0.5
    if case == "skip_marks":
        assert h["skipped"] == [1, 0, 1, 0, 1]


def test_the_host_value_watch_sees_the_cuda_failure_pattern():
    """The watch catches the exact line that synced on the H100 (``b["skipped"][slot] = 0``)."""
    from .sync_watch import HostValueWatch

    from fastgrad.diagnose.collect import history

    buf = torch.zeros(4, dtype=torch.int64)
    with HostValueWatch() as w:
        exec(compile("buf[1] = 0", history.__file__, "exec"), {"buf": buf})  # the old line, run as fastgrad code
    assert len(w.hits) == 1 and "lift_fresh" in w.hits[0][0]
    with HostValueWatch() as w:
        exec(compile("buf[1:2].fill_(0)", history.__file__, "exec"), {"buf": buf})  # what replaced it
    assert not w.hits


def test_a_loss_spike_is_reported_once_not_at_every_logging_step():
    """A loss jump stays in the 200-step window for 200 steps; each logging step reports only the jumps since
    the previous one (the step report's own whole-history loss rule is off in the monitor)."""
    named = [_param()]
    mon = fastgrad.GradientMonitor(named, every=10)
    losses = [1.0 + 0.01 * math.sin(i) for i in range(80)]
    losses[24] = 100.0  # step 25
    reports = _drive(mon, named, [1.0] * 80, losses)
    seen = [(i, r.codes().count("loss_spike")) for i, r in sorted(reports.items())]
    assert seen == [(10, 0), (20, 0), (30, 1), (40, 0), (50, 0), (60, 0), (70, 0), (80, 0)]


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


def test_detect_trends_needs_history_and_warmup():
    assert detect_trends(list(range(1, 6)), [1, 1, 1, 1, 100]) == []  # too few for a baseline
    assert detect_trends(list(range(1, 12)), [1.0] * 10 + [100.0]) == []  # step 11 is inside the warm-up
    assert detect_trends(list(range(1, 27)), [1.0] * 25 + [1.1]) == []  # MAD floor: a wobble is no spike
    assert detect_trends(list(range(1, 27)), [1.0] * 25 + [2.5]) == []  # under the minimum ratio (3x)
    (small,) = detect_trends(list(range(1, 27)), [1.0] * 25 + [4.0])  # 4x: a notice
    assert small.code == "spike" and small.severity == "notice" and small.steps == [26]
    (big,) = detect_trends(list(range(1, 27)), [1.0] * 25 + [20.0])
    assert big.severity == "warning" and "step 26" in big.title and "20x" in big.title


def test_noisy_but_healthy_series_raises_nothing():
    # Heavy-tailed noise (log-normal, sigma 0.2) with 2x outliers and a slow drift: a mean + 3 std rule
    # flags several of these; robust baselines with a minimum ratio stay quiet.
    g = torch.Generator().manual_seed(7)
    norms = [0.5 * (1 + 0.001 * t) * math.exp(0.2 * float(v)) for t, v in enumerate(torch.randn(300, generator=g))]
    for t in (40, 95, 170, 260):
        norms[t] *= 2.0
    losses = [2.0 / (1 + 0.01 * t) * math.exp(0.1 * float(v)) for t, v in enumerate(torch.randn(300, generator=g))]
    named = [_param()]
    reports = _drive(fastgrad.GradientMonitor(named, every=30), named, norms, losses)
    assert [(s, r.codes()) for s, r in reports.items() if r.codes()] == []
    assert detect_trends(list(range(1, 301)), norms) == []


def _tiny_transformer_run(spike_at=None, steps=300, every=30):
    """A real (tiny) Transformer trained with AdamW on a reversal task. Two monitors watch the same run:
    ``clean`` sees the gradients as they are; ``spiked`` sees them multiplied by 20 at ``spike_at`` (the
    optimizer still gets the clean ones, so both watch the same healthy training)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add contention on a shared machine
    try:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        model = nn.ModuleDict(dict(emb=nn.Embedding(8, 16), enc=nn.TransformerEncoder(
            layer, 2, enable_nested_tensor=False), head=nn.Linear(16, 8)))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        clean = fastgrad.GradientMonitor(model, every=every)
        spiked = fastgrad.GradientMonitor(model, every=every)
        g = torch.Generator().manual_seed(1)
        out = {"clean": [], "spiked": []}
        for t in range(1, steps + 1):
            x = torch.randint(0, 8, (8, 8), generator=g)
            logits = model["head"](model["enc"](model["emb"](x)))
            loss = nn.functional.cross_entropy(logits.reshape(-1, 8), x.flip(1).reshape(-1))
            opt.zero_grad()
            loss.backward()
            if (r := clean(loss)) is not None:
                out["clean"].append(r)
            grads = [p.grad for p in model.parameters()]
            if t == spike_at:
                saved = [g_.clone() for g_ in grads]
                torch._foreach_mul_(grads, 20.0)
            if (r := spiked(loss)) is not None:
                out["spiked"].append(r)
            if t == spike_at:
                for g_, s_ in zip(grads, saved):
                    g_.copy_(s_)
            opt.step()
        out["loss"] = clean.history()["loss"]
        return out
    finally:
        torch.set_num_threads(threads)


def test_tiny_transformer_healthy_run_is_quiet_and_a_20x_spike_is_flagged():
    out = _tiny_transformer_run(spike_at=150)
    clean, spiked = out["clean"], out["spiked"]
    assert len(clean) == 10 and out["loss"][-1] < out["loss"][0]  # it trains
    assert [(r.step, r.codes()) for r in clean if r.codes()] == []  # no warning, not even a notice
    flagged = [(r.step, r.finding("spike")) for r in spiked if r.finding("spike") is not None]
    assert [s for s, _ in flagged] == [150]  # in its own logging window, and only there
    f = flagged[0][1]
    assert f.severity == "warning" and f.steps == [150] and "step 150" in f.title
    ratio = float(f.title.split(": ")[1].split("x")[0])
    assert 15 < ratio < 25  # its size: 20x the recent median (the median moves a little)
    assert all(r.status == "healthy" for r in spiked if r.step != 150)


def test_loss_jump_of_50x_is_a_warning():
    named = [_param()]
    losses = _noisy(60, seed=4, level=2.0, sigma=0.05)
    losses[44] *= 50  # step 45
    r = _drive(fastgrad.GradientMonitor(named, every=30), named, [1.0] * 60, losses)
    assert r[30].codes() == []
    f = r[60].finding("loss_spike")
    assert f is not None and f.severity == "warning" and f.steps == [45] and "step 45" in f.title
    losses[44] /= 50 / 4  # a 4x jump: only a notice
    r = _drive(fastgrad.GradientMonitor(named, every=30), named, [1.0] * 60, losses)
    assert r[60].finding("loss_spike").severity == "notice"


# ---------------------------------------------------------------------------------------------- non-finite loss
@pytest.mark.parametrize("as_tensor", [True, False])
def test_nonfinite_loss_with_finite_grads_is_critical_at_the_next_logging_step(as_tensor):
    named = [_param()]
    mon = fastgrad.GradientMonitor(named, every=10)
    losses = [1.0] * 20
    losses[3] = float("nan")  # step 4
    losses[6] = float("inf")  # step 7
    losses = [torch.tensor(v) for v in losses] if as_tensor else losses
    reports = _drive(mon, named, [1.0] * 20, losses)
    r = reports[10]
    assert r.status == "critical" and r.codes()[0] == "nonfinite_loss" and r.nan == r.inf == 0
    f = r.finding("nonfinite_loss")
    assert f.steps == [4, 7] and "first at step 4" in f.title and "2 step(s)" in f.detail
    assert "check the loss before backward()" in r.to_markdown()
    assert "clamp" in r.to_markdown() and "lr" in r.to_markdown()  # eps/clamp and learning-rate advice
    assert reports[20].codes() == []  # the flag was cleared after being reported


def _forbid_syncs(monkeypatch):
    """Make every host read of a tensor raise (item, bool, float, int, tolist, cpu/numpy)."""
    def boom(*a, **k):
        raise AssertionError("host sync on a non-logging step")
    for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)


def test_per_step_path_does_no_host_read(monkeypatch):
    torch.manual_seed(0)
    m = nn.Linear(5, 3)
    plain = fastgrad.GradientMonitor(m, every=10)
    clipping = fastgrad.GradientMonitor(m, every=10)
    for t in range(1, 11):
        m.zero_grad()
        loss = m(torch.randn(4, 5)).pow(2).mean()
        loss.backward()
        # step 2: a NaN loss with finite gradients (what log(pred - y) with pred < y does)
        seen = loss.detach() + (float("nan") if t == 2 else 0.0)
        if t < 10:
            with monkeypatch.context() as mp:
                _forbid_syncs(mp)
                assert plain(seen) is None
                clipping.clip_grad_norm_(0.01, loss=seen)
        else:
            reports = [plain(seen), clipping.clip_grad_norm_(0.01, loss=seen) is not None and clipping.last_report]
    for r in reports:  # step 2's NaN came back at step 10 from the device-side flag
        assert r.step == 10 and r.codes()[0] == "nonfinite_loss" and r.finding("nonfinite_loss").steps == [2]
        assert r.nan == r.inf == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nonfinite_loss_flag_is_sync_free_on_cuda():
    m = nn.Linear(16, 4).cuda()
    mon = fastgrad.GradientMonitor(m, every=4)
    x = torch.randn(8, 16, device="cuda")
    reports = []
    for t in range(1, 5):
        m.zero_grad()
        out = m(x)
        loss = out.pow(2).mean()
        loss.backward()
        # a NaN loss whose gradients stay finite (the loss is not a function of the NaN)
        bad = loss.detach() + (torch.tensor(float("nan"), device="cuda") if t == 2 else 0.0)
        if t < 4:
            torch.cuda.set_sync_debug_mode("error")
            try:
                assert mon(bad) is None
                mon.clip_grad_norm_(1.0)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        else:
            reports.append(mon(bad))
    (r,) = reports
    assert r.finding("nonfinite_loss").steps == [2] and r.status == "critical"


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


# ---------------------------------------------------------------------------------------------- clip + monitor
_SHAPES = [(3, 5), (1025,), (7, 1, 9), (0,), (4097,), (2, 3)]


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipping, and a factor of 1 (no write)
@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.float32, torch.bfloat16], [torch.float64]],
                         ids=["fp32", "fp32+bf16", "fp64"])
def test_monitor_clip_matches_clip_grad_norm(bd, dtypes, max_norm):
    backend, device = bd
    params = helpers.make_params(_SHAPES, dtypes, device, seed=3, none_every=4)
    ref, tref = helpers.clone_params(params), helpers.clone_params(params)
    before = [p.grad.clone() if p.grad is not None else None for p in params]
    mon = fastgrad.GradientMonitor(params, every=None, backend=backend)
    total = mon.clip_grad_norm_(max_norm)
    ref_total = fastgrad.clip_grad_norm_(ref, max_norm, backend=backend)
    torch_total = torch.nn.utils.clip_grad_norm_(tref, max_norm)
    assert total.dtype == ref_total.dtype and total.device == ref_total.device and total.shape == ()
    grads = [p.grad for p in params if p.grad is not None]
    true_total, true_grads = oracle.clipped([g for g in before if g is not None], max_norm, 2.0)
    # docs/contract.md section 3: no worse than torch against the oracle (+1 ulp), and close to fastgrad's clip
    helpers.assert_no_worse_than(total, torch_total, true_total, dtypes[-1], "total norm")
    assert float(total) == pytest.approx(float(ref_total), rel=4e-7 if dtypes[-1] != torch.float64 else 1e-15)
    if backend == "torch":  # the same per-tensor norms, combined the same way: the same bits
        assert torch.equal(helpers.bits(total), helpers.bits(ref_total))
    for g, r, t, b in zip(grads, helpers.grads(tref), true_grads, [g for g in before if g is not None]):
        if max_norm == 1e6:
            assert torch.equal(helpers.bits(g), helpers.bits(b))  # not clipping leaves the gradients untouched
        else:
            helpers.assert_no_worse_than(g, r, t, g.dtype, "clipped grad")
    # the step was recorded from the same read: the statistics of the gradients before clipping
    h = mon.history()
    assert h["steps"] == [1] and h["total_norm"][0] == pytest.approx(float(total), rel=1e-6)
    st = mon.last_stats
    assert st.names == [str(i) for i, p in enumerate(params) if p.grad is not None]
    assert st.max_abs.tolist() == pytest.approx([float(b.abs().max()) if b.numel() else 0.0
                                                 for b in before if b is not None], rel=1e-6)


def test_monitor_clip_collects_the_grads_once(monkeypatch):
    # General path (here: the compiled host helpers off): one collection of the gradient list, reused by the
    # statistics pass (a second compiled scan costs ~1 us per tensor, milliseconds on 4,000 tensors).
    from fastgrad import _inputs as inputs
    from fastgrad import _scan

    params = helpers.make_params([(5, 3), (9,), (4, 4)], torch.float32, "cpu", seed=8)
    ref = fastgrad.grad_stats(params)
    mon = fastgrad.GradientMonitor(params, every=None)
    calls = []
    orig = inputs.grads_of
    monkeypatch.setattr(inputs, "grads_of", lambda ps: calls.append(len(ps)) or orig(ps))
    prev = _scan.set_enabled(False)
    try:
        mon.clip_grad_norm_(1e9)
    finally:
        _scan.set_enabled(prev)
    assert calls == [3]
    assert torch.equal(mon.last_stats.norm, ref.norm) and torch.equal(mon.last_stats.zero, ref.zero)


_CLIP_DTYPES = [[torch.float32], [torch.bfloat16], [torch.float16], [torch.float64], [torch.float16, torch.float32],
                [torch.bfloat16, torch.float64]]


@pytest.mark.skipif(not fastgrad._ext.has_cpu_kernels(), reason="needs the compiled cpu kernels")
@pytest.mark.parametrize("dtypes", _CLIP_DTYPES, ids=lambda d: "+".join(str(x)[6:] for x in d))
@pytest.mark.parametrize("max_norm", [1e9, 0.5], ids=["no_clip", "clip"])
def test_monitor_clip_cpu_is_clip_bit_for_bit(monkeypatch, dtypes, max_norm):
    # CPU grads on the cpu backend: statistics, coefficient and scale in one compiled call. The total and the
    # clipped gradients are fastgrad.clip_grad_norm_'s to the bit, the recorded statistics grad_stats' (of the
    # gradients before clipping), and no gradient list is built in Python.
    from fastgrad import _inputs as inputs

    shapes = [(7,), (3, 100), (1 << 15,), ((1 << 15) + 17,), (70, 1000), (0,)]
    params = helpers.make_params(shapes, dtypes, "cpu", seed=12)
    ref, pre = helpers.clone_params(params), helpers.clone_params(params)
    mon = fastgrad.GradientMonitor(params, every=None, backend="cpu")
    calls = []
    orig = inputs.grads_of
    monkeypatch.setattr(inputs, "grads_of", lambda ps: calls.append(len(ps)) or orig(ps))
    total = mon.clip_grad_norm_(max_norm)
    assert calls == []  # the compiled path ran
    monkeypatch.setattr(inputs, "grads_of", orig)
    exp = fastgrad.clip_grad_norm_(ref, max_norm, backend="cpu")
    assert total.dtype == exp.dtype and torch.equal(helpers.bits(total), helpers.bits(exp))
    assert all(torch.equal(helpers.bits(p.grad), helpers.bits(q.grad)) for p, q in zip(params, ref))
    st, want = mon.last_stats, fastgrad.grad_stats(pre, backend="cpu")
    for k in ("norm", "max_abs", "nan", "inf", "zero", "numel"):
        assert torch.equal(getattr(st, k), getattr(want, k)), k
    assert st.names == want.names and st.shapes == want.shapes and st.dtypes == want.dtypes
    assert torch.equal(st.total_norm.to(exp.dtype), exp)
    assert mon.history()["total_norm"] == [float(st.total_norm)]


def test_monitor_clip_nonfinite_and_other_norm_types(bd):
    backend, device = bd
    params = helpers.make_params([(5, 3), (9,)], torch.float32, device, seed=5)
    params[1].grad[2] = float("nan")
    mon = fastgrad.GradientMonitor(params, every=None, backend=backend)
    before = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match="non-finite"):
        mon.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert all(torch.equal(helpers.bits(p.grad), helpers.bits(b)) for p, b in zip(params, before))  # untouched
    total = mon.clip_grad_norm_(1.0)  # a NaN norm makes every gradient NaN, as torch does
    assert math.isnan(float(total)) and all(p.grad.isnan().all() for p in params)
    r = mon.log()
    assert r.finding("nonfinite").layers == ["1"]
    # norm_type != 2: the clip's own norm, then a separate statistics pass of the unclipped gradients
    params = helpers.make_params([(5, 3), (9,)], torch.float32, device, seed=6)
    ref = helpers.clone_params(params)
    mon = fastgrad.GradientMonitor(params, every=None, backend=backend)
    pre = fastgrad.grad_stats(params, backend=backend).total_norm
    total = mon.clip_grad_norm_(0.1, norm_type=1.0)
    assert torch.equal(total, fastgrad.clip_grad_norm_(ref, 0.1, norm_type=1.0, backend=backend))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(params, ref))
    assert torch.equal(mon.last_stats.total_norm, pre)


# ---------------------------------------------------------------------------------------------- clear errors
def test_loggers_are_checked_when_the_monitor_is_built(tmp_path):
    m = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="unsupported logger 42 of type int.*SummaryWriter"):
        fastgrad.GradientMonitor(m, logger=42)
    with pytest.raises(TypeError, match="unsupported logger"):
        fastgrad.GradientMonitor(m, logger=[logging.getLogger("x"), object()])
    with pytest.raises(TypeError, match="unsupported logger"):
        fastgrad.GradientMonitor(m, logger=io.StringIO)  # the class, not a file
    missing = tmp_path / "no_such_dir" / "grads.csv"
    with pytest.raises(ValueError, match="folder of the CSV path .* does not exist.*makedirs"):
        fastgrad.GradientMonitor(m, logger=str(missing))
    with pytest.raises(ValueError, match="is a directory"):
        fastgrad.GradientMonitor(m, logger=tmp_path)

    class NoWrite:
        write = 3

    with pytest.raises(TypeError, match="'write' attribute is not callable"):
        fastgrad.GradientMonitor(m, logger=NoWrite())
    with pytest.raises(ValueError, match="every must be"):
        fastgrad.GradientMonitor(m, every=0)
    # what works is still accepted: a path in an existing folder, files, callables, loggers
    fastgrad.GradientMonitor(m, logger=[tmp_path / "ok.csv", io.StringIO(), lambda d, s: None,
                                        logging.getLogger("y")])
    assert not (tmp_path / "ok.csv").exists()  # checking does not create the file


def _linear_with_grads():
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    m(torch.randn(5, 4)).pow(2).sum().backward()
    return m, [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("call", [
    lambda m: fastgrad.clip_grad_norm_(m.named_parameters(), 1.0),
    lambda m: fastgrad.clip_grad_value_(m.named_parameters(), 0.1),
    lambda m: fastgrad.clip_grads_with_norm_(m.named_parameters(), 1.0, torch.tensor(5.0)),
    lambda m: fastgrad.get_total_norm(m.named_parameters()),
    lambda m: fastgrad.multi_tensor_norm(m.named_parameters()),
    lambda m: fastgrad.adaptive_clip_grad_(m.named_parameters(), 0.01),
    lambda m: fastgrad.centralize_gradient_(m.named_parameters()),
], ids=["clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm", "multi_tensor_norm",
        "adaptive_clip_grad_", "centralize_gradient_"])
def test_named_parameters_where_parameters_are_expected(call):
    m, before = _linear_with_grads()
    with pytest.raises(TypeError, match=r"named_parameters\(\).*pass model.parameters\(\)"):
        call(m)
    assert all(torch.equal(p.grad, b) for p, b in zip(m.parameters(), before))


def test_module_where_parameters_are_expected():
    m, before = _linear_with_grads()
    for arg in (m, nn.Sequential(m)):
        with pytest.raises(TypeError, match=r"got a module .* pass model.parameters\(\)"):
            fastgrad.clip_grad_norm_(arg, 1.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(m.parameters(), before))


def test_swapped_scaler_and_optimizer():
    m, before = _linear_with_grads()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with pytest.raises(TypeError, match=r"swapped; call fastgrad.scaler_unscale_and_clip\(scaler, optimizer"):
        fastgrad.scaler_unscale_and_clip(opt, scaler, 1.0)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        fastgrad.scaler_unscale_and_clip(scaler, m, 1.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(m.parameters(), before))


# ---------------------------------------------------------------------------------------------- issue 20 items
def test_rising_norm_inside_the_healthy_band_while_the_loss_falls_is_not_a_warning():
    # the reported run: norm 1 -> 7 (inside 0.1..10) over 100 steps while the loss fell 14.1 -> 3.4
    norms = [1.0 + 6.0 * t / 99 for t in range(100)]
    losses = [14.1 - 10.7 * t / 99 for t in range(100)]
    named = [_param()]
    r = _drive(fastgrad.GradientMonitor(named, every=100), named, norms, losses)[100]
    f = r.finding("increasing")
    assert f.severity == "notice" and r.status == "notice"
    assert "healthy range" in f.title and "loss fell" in f.detail and "no action" in f.detail
    assert dict(r.summary_rows())["Loss history"] == "improving"
    # the same norms with a flat loss, or rising out of the band while the loss falls: a warning
    named = [_param()]
    r = _drive(fastgrad.GradientMonitor(named, every=100), named, norms, [5.0] * 100)[100]
    assert r.finding("increasing").severity == "warning"
    named = [_param()]
    r = _drive(fastgrad.GradientMonitor(named, every=100), named, [1.0 + 29.0 * t / 99 for t in range(100)],
               losses)[100]
    assert r.finding("increasing").severity == "warning"
    # the rule itself, without losses: unchanged
    assert detect_trends(list(range(1, 101)), norms)[0].severity == "warning"


def test_log_after_zero_grad_set_to_none():
    # log() after optimizer.zero_grad() (set_to_none): the parameter norms follow the recorded statistics by
    # name; they used to be taken from the parameters that had a grad NOW, misaligning the one-sync read
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mon = fastgrad.GradientMonitor(m, every=None, history=1)
    m(torch.randn(3, 5)).sum().backward()
    ref = {n: p.grad.double().norm().item() for n, p in m.named_parameters()}
    pref = {n: p.detach().double().norm().item() for n, p in m.named_parameters()}
    mon()
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    r = mon.log()
    assert [p.name for p in r.params] == list(ref)
    for row in r.params:
        assert row.norm == pytest.approx(ref[row.name], rel=1e-6)
        assert row.param_norm == pytest.approx(pref[row.name], rel=1e-6)
    # every grad None from the start: a report that says so, no exception
    mon2 = fastgrad.GradientMonitor(m, every=1)
    r2 = mon2()
    assert r2.codes() == ["no_learning"] and r2.params == []
    mon2.log()


def test_record_skip_counts_skipped_steps_on_the_device():
    named = [_param()]
    mon = fastgrad.GradientMonitor(named, every=10)
    with pytest.raises(RuntimeError, match="after monitor"):
        mon.record_skip(torch.tensor(True))
    skipped = {3, 4, 9, 10}
    reports = {}
    for step in range(1, 21):
        named[0][1].grad = torch.tensor([1.0], dtype=torch.float64)
        r = mon(2.0 - step * 0.01)
        flag = torch.tensor(step in skipped)  # a 0-dim device flag, as a step guard keeps it
        if step == 4:
            mon.record_skip(torch.tensor(0.0))  # replaced by the next call for the same step
        mon.record_skip(flag if step != 9 else torch.tensor(1, dtype=torch.int32))
        if r is not None:
            reports[step] = r
    # the usual order (monitor, then the guard's flag): a logging step's own mark goes to the next report
    assert reports[10].skipped_steps == 3 and reports[10].finding("skipped_steps").steps == [3, 4, 9]
    assert reports[10].finding("skipped_steps").severity == "notice"
    assert "3 of 9 step(s) skipped, steps 1 to 9" == reports[10].finding("skipped_steps").title
    assert reports[20].skipped_steps == 1 and reports[20].finding("skipped_steps").steps == [10]
    r = mon.log()  # covers step 20 (marked by now, not skipped)
    assert r.skipped_steps == 0 and r.finding("skipped_steps") is None
    h = mon.history()
    assert [s for s, v in zip(h["steps"], h["skipped"]) if v] == sorted(skipped)
    assert "Skipped steps" in dict(reports[10].summary_rows())
    assert reports[10].scalars()["grad/skipped_steps"] == 3.0
    with pytest.raises(ValueError, match="one-element"):
        mon.record_skip(torch.tensor([1, 0]))
    with pytest.raises(TypeError, match="0-dim tensor or a bool"):
        mon.record_skip("yes")
    # a monitor that never heard of skips says nothing about them
    named = [_param()]
    plain = _drive(fastgrad.GradientMonitor(named, every=5), named, [1.0] * 5)[5]
    assert plain.skipped_steps is None and "Skipped steps" not in dict(plain.summary_rows())


def test_record_skip_mostly_skipped_is_a_warning():
    named = [_param()]
    mon = fastgrad.GradientMonitor(named, every=4)
    for step in range(1, 4):
        named[0][1].grad = torch.tensor([1.0], dtype=torch.float64)
        mon()
        mon.record_skip(step != 2)
    named[0][1].grad = torch.tensor([1.0], dtype=torch.float64)
    r = mon()  # step 4 logs before its own mark: steps 1 and 3 of 1-3 were skipped
    assert r.skipped_steps == 2 and r.finding("skipped_steps").severity == "warning"
    mon.record_skip(True)
    r = mon.log()  # step 4 alone, skipped
    assert r.skipped_steps == 1 and r.finding("skipped_steps").steps == [4]
    assert mon.history()["skipped"] == [1, 0, 1, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_record_skip_cuda_flag_without_sync():
    named = [("w", nn.Parameter(torch.ones(3, device="cuda")))]
    mon = fastgrad.GradientMonitor(named, every=None)
    named[0][1].grad = torch.ones(3, device="cuda")
    mon()
    flag = torch.isinf(named[0][1].grad).any()  # a device flag
    torch.cuda.set_sync_debug_mode("error")
    try:
        mon.record_skip(flag)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert mon.history()["skipped"] == [0]


def test_monitor_reads_sparse_embedding_and_leaves_it_out_of_depth():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(300, 8, sparse=True), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 300))
    mon = fastgrad.GradientMonitor(m, every=None)
    x = torch.randint(0, 300, (40,))
    nn.functional.cross_entropy(m[1:](m[0](x) * 1e-4), x).backward()
    g = m[0].weight.grad
    assert g.is_sparse
    dense_ref = g.to_dense().double()
    ref_total = math.sqrt(sum(float(p.grad.to_dense().double().pow(2).sum()) for p in m.parameters()))
    # (torch's clip_grad_norm_, which fastgrad's delegates sparse gradients to, cannot take them: monitor only)
    mon()
    r = mon.log()
    assert r.total_norm == pytest.approx(ref_total, rel=1e-5)
    row = next(p for p in r.params if p.name == "0.weight")
    assert row.norm == pytest.approx(dense_ref.norm().item(), rel=1e-5)
    assert row.zero == int((dense_ref == 0).sum())
    assert [x.touched for x in r.row_sparse] == [int(x.unique().numel())]
    assert "depth_vanishing" not in r.codes()


def test_monitor_clip_to_zero_is_named():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    mon = fastgrad.GradientMonitor(m, every=1)
    m(torch.randn(16, 4)).pow(2).mean().backward()
    mon.clip_grad_norm_(0.0)
    r = mon.last_report
    assert all(bool((p.grad == 0).all()) for p in m.parameters())
    assert "clipped_to_zero" in r.codes() and "no_learning" not in r.codes()
    r2 = mon()  # a plain step after it: the clip is not remembered for it
    assert r2.codes() == ["no_learning"]


def test_monitor_leaves_a_dense_embedding_out_of_depth():
    # nn.Embedding (dense gradient): the monitor finds it in the model it was given
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(2000, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2000))
    x = torch.randint(0, 2000, (256,))
    nn.functional.cross_entropy(m[1:](m[0](x) * 1e-3), x).backward()
    emb, head = m[0].weight.grad.double().norm().item(), m[3].weight.grad.double().norm().item()
    assert head / emb > 1000  # ground truth: the plain depth rule would fire
    r = fastgrad.GradientMonitor(m, every=1)()
    assert "depth_vanishing" not in r.codes()
    assert [(x_.name, x_.touched, x_.excluded) for x_ in r.row_sparse] == [("0.weight", int(x.unique().numel()), True)]
    named = fastgrad.GradientMonitor(list(m.named_parameters()), every=1)()  # no module: nothing to find
    assert "depth_vanishing" in named.codes()
    told = fastgrad.GradientMonitor(list(m.named_parameters()), every=1, row_sparse=["0.weight"])()
    assert "depth_vanishing" not in told.codes()


@pytest.mark.parametrize("clip_first", [False, True])
def test_monitor_counts_a_step_guards_skips_in_either_loop_order(clip_first):
    """GradientMonitor(guard=): the steps a StepGuard skipped (NaN and spike batches) are the ones the
    monitor's history marks, whether the loop calls monitor(...) before or after guard.clip_()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = fastgrad.StepGuard(opt, 1.0, skip_factor=10.0, warmup_steps=3)
    mon = fastgrad.GradientMonitor(model, every=None, guard=guard)
    bad = {5: "nan", 9: "spike", 10: "nan"}
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(1, 15):
        loss = torch.nn.functional.mse_loss(model(x), y)
        kind = bad.get(step)
        if kind == "spike":
            loss = loss * 1000.0
        loss.backward()
        if kind == "nan":
            model[0].weight.grad[0, 0] = float("nan")
        if clip_first:
            guard.clip_()
            mon(loss)
        else:
            mon(loss)
            guard.clip_()
        opt.step()
        opt.zero_grad()
    mon(loss)  # one more record: in monitor-first order it marks step 14 from its clip_
    h = mon.history()
    marked = {s for s, k in zip(h["steps"], h["skipped"]) if k}
    assert marked == set(bad), (marked, h["skipped"])
    assert guard.state()["skipped_steps"] == 3
    rep = mon.log()
    assert rep.skipped_steps == 3


def test_monitor_guard_must_be_a_step_guard():
    model = torch.nn.Linear(3, 3)
    with pytest.raises(TypeError, match="StepGuard"):
        fastgrad.GradientMonitor(model, guard=object())
