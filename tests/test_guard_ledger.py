"""The guard's ledger (docs/guard-reference.md, "Reading the guard"): the longest run of skips, the steps on
which the clip engaged, and per read window the share that engaged and the norm's median, p90 and p99, all read
in the one transfer of ``state()``; ``max_consecutive_skips`` checked at that read.

Ground truth is a twin run without fastgrad whose gradient norms a plain hook records in float64; each rule is
then pinned between it and its nearest wrong variant (``>`` against ``>=`` at max_norm, a run of skips one
longer or shorter, across a fold and across a read, the quantile's interpolation, the ring's wrap)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastgrad.guard.counters as counters_mod
import fastgrad.guard.ledger as ledger_mod
from fastgrad import StepGuard
from fastgrad.guard import GuardError
from fastgrad.guard.ledger import QUANTILES, RING, quantiles

from .guard_cases import no_host_reads

NAN, INF = float("nan"), float("inf")
MAX_NORM = 1.0
STEPS = 50
BAD = {4, 9, 10, 11, 30}  # NaN batches: runs of one, three and one
READS = (7, 20, 45)  # state() after these steps, and once after the last
TWIN_OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


# ---------------------------------------------------------------- the twin run and its float64 record
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


def _batch(step):
    gen = torch.Generator().manual_seed(step)
    scale = 0.05 + 2.0 * torch.rand((), generator=gen, dtype=torch.float64)  # norms on both sides of MAX_NORM
    x = torch.randn(16, 6, generator=gen, dtype=torch.float64) * scale
    y = torch.randn(16, 2, generator=gen, dtype=torch.float64) * scale
    if step in BAD:
        x[0, 0] = NAN
    return x, y


def _plain_run(opt_name):
    """Without fastgrad: torch's clip, a non-finite step not taken; the norms as a hook sees them (float64)."""
    model = _model()
    opt = TWIN_OPTIMIZERS[opt_name](list(model.parameters()))
    squares: list[float] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: squares.append(p.grad.double().pow(2).sum().item()))
    norms = []
    for step in range(STEPS):
        squares.clear()
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        norms.append(math.sqrt(math.fsum(squares)) if all(map(math.isfinite, squares)) else NAN)
        if math.isfinite(norms[-1]):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
        opt.zero_grad(set_to_none=True)
    return model, norms


def _guarded_run(opt_name):
    model = _model()
    opt = TWIN_OPTIMIZERS[opt_name](list(model.parameters()))
    guard = StepGuard(opt, MAX_NORM)
    reads = []
    for step in range(STEPS):
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        guard.clip_()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step in READS:
            reads.append(guard.state())
    reads.append(guard.state())
    return model, reads


def _runs(bad: list[bool]) -> list[int]:
    """The run of skips in a row after each step."""
    out, run = [], 0
    for b in bad:
        run = run + 1 if b else 0
        out.append(run)
    return out


def _truth(norms):
    """Each read window's ledger, from the float64 record alone."""
    bad = [not math.isfinite(n) for n in norms]
    runs = _runs(bad)
    bounds = [-1, *READS, STEPS - 1]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        win = norms[a + 1:b + 1]
        finite = [n for n in win if math.isfinite(n)]
        q = np.quantile(finite, [q for _, q in QUANTILES]) if finite else [None] * len(QUANTILES)
        out.append(dict(steps=b + 1, window_steps=len(win), engaged=sum(n > MAX_NORM for n in finite),
                        norm_count=len(finite), quantiles=list(q), window_longest=max(runs[a + 1:b + 1]),
                        longest=max(runs[:b + 1]), skipped=sum(bad[:b + 1]), run=runs[b]))
    return out


@pytest.mark.parametrize("opt_name", list(TWIN_OPTIMIZERS))
def test_the_ledger_is_the_plain_runs_record(opt_name):
    plain_model, norms = _plain_run(opt_name)
    model, reads = _guarded_run(opt_name)
    for p, q in zip(plain_model.parameters(), model.parameters()):  # the same run (skips exact, same clip)
        torch.testing.assert_close(q, p, rtol=1e-10, atol=0)
    # no norm sits so near max_norm that rounding could decide the engage rule (its boundary: below)
    assert min(abs(n - MAX_NORM) for n in norms if math.isfinite(n)) > 1e-6
    engaged_total = 0
    for st, want in zip(reads, _truth(norms), strict=True):
        assert 0 < want["engaged"] < want["norm_count"], want  # the window tells engaged from not
        engaged_total += want["engaged"]
        assert st["steps"] == want["steps"] and st["window_steps"] == want["window_steps"]
        assert st["clip_share"] == want["engaged"] / want["window_steps"]
        assert st["engaged_steps"] == engaged_total
        assert st["norm_count"] == want["norm_count"]
        got = [st[k] for k, _ in QUANTILES]
        assert got == pytest.approx(want["quantiles"], rel=1e-12)
        assert st["window_longest_skipped"] == want["window_longest"]
        assert st["longest_consecutive_skipped"] == want["longest"]
        assert st["skipped_steps"] == want["skipped"] and st["consecutive_skipped"] == want["run"]
    assert [st["window_longest_skipped"] for st in reads] == [1, 3, 1, 0]


# ---------------------------------------------------------------- each rule against its nearest wrong variant
def _guard(max_norm=MAX_NORM, fused=False, **kw):
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True) if fused else torch.optim.SGD([p], lr=1e-3)
    return StepGuard(opt, max_norm, **kw)


def _step(guard, norm):
    """One step whose gradient norm is exactly ``norm`` (NaN or inf: a non-finite step)."""
    p = guard.optimizer.param_groups[0]["params"][0]
    p.grad = torch.tensor([norm, 0.0], dtype=torch.float64)
    guard.clip_()
    guard.optimizer.step()


def test_the_clip_engages_strictly_above_max_norm():
    """At max_norm exactly the clip does not engage (``>``, not ``>=``); a hair above it does; a non-finite
    norm is a skip, never a clip (an inf norm is above every max_norm)."""
    g = _guard(max_norm=5.0)
    p = g.optimizer.param_groups[0]["params"][0]
    p.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)  # norm 5, exactly
    g.clip_()
    g.optimizer.step()
    st = g.state()
    assert st["total_norm"] == 5.0 and st["engaged_steps"] == 0 and st["clip_share"] == 0.0
    g2 = _guard(max_norm=math.nextafter(5.0, 0.0))
    p2 = g2.optimizer.param_groups[0]["params"][0]
    p2.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    g2.clip_()
    assert g2.state()["engaged_steps"] == 1
    g3 = _guard(max_norm=1.0)
    for n in (INF, NAN, 2.0):
        _step(g3, n)
    st = g3.state()
    assert st["engaged_steps"] == 1 and st["clip_share"] == 1 / 3 and st["nonfinite_steps"] == 2


@pytest.mark.parametrize("fold", [4, 256])
def test_the_longest_run_is_exact_across_folds(monkeypatch, fold):
    """Runs of 2, then 5 (across a fold when folds are 4 steps), then 3: the longest is 5, not 4 or 6, and the
    current run is the last one's."""
    monkeypatch.setattr(counters_mod, "FOLD", fold)
    g = _guard()
    pattern = [0.5, NAN, NAN, 0.5, 0.5, NAN, NAN, NAN, NAN, NAN, 0.5, NAN, NAN, NAN]
    for n in pattern:
        _step(g, n)
    st = g.state()
    assert st["longest_consecutive_skipped"] == 5 and st["consecutive_skipped"] == 3
    assert st["window_longest_skipped"] == 5
    assert st["longest_consecutive_skipped"] == max(_runs([not math.isfinite(n) for n in pattern]))


def test_a_run_across_a_read_counts_in_full_in_the_next_window():
    g = _guard()
    for n in (0.5, NAN, NAN):
        _step(g, n)
    assert g.state()["window_longest_skipped"] == 2
    _step(g, NAN)
    st = g.state()
    assert st["window_longest_skipped"] == 3 and st["window_steps"] == 1 and st["norm_count"] == 0
    assert st["norm_p50"] is None and st["clip_share"] == 0.0
    _step(g, 0.5)
    st = g.state()
    assert st["window_longest_skipped"] == 0 and st["longest_consecutive_skipped"] == 3
    st = g.state()  # nothing since: an empty window
    assert st["window_steps"] == 0 and st["clip_share"] is None and st["norm_count"] == 0


def test_the_quantiles_interpolate_linearly():
    """numpy's default (linear, type 7): at p90 of 1..4 that is 3.7, where lower, higher, nearest and
    midpoint give 3, 4, 4 and 3.5."""
    g = _guard(max_norm=100.0)
    for n in (4.0, 1.0, 3.0, 2.0):
        _step(g, n)
    st = g.state()
    assert (st["norm_p50"], st["norm_p90"]) == (2.5, pytest.approx(3.7, rel=1e-15))
    assert st["norm_p99"] == pytest.approx(3.97, rel=1e-15) and st["norm_count"] == 4
    for method in ("lower", "higher", "nearest", "midpoint"):
        assert np.quantile([1.0, 2.0, 3.0, 4.0], 0.9, method=method) != pytest.approx(3.7)
    gen = torch.Generator().manual_seed(3)
    for n in (2, 7, 50):
        v = torch.rand(n, generator=gen, dtype=torch.float64) * 10
        v[::3] = NAN  # non-finite entries are not values
        got, count = quantiles(v, [0.0, 0.37, 0.5, 0.9, 0.99, 1.0])
        finite = v[torch.isfinite(v)].numpy()
        assert int(count) == finite.size
        want = np.quantile(finite, [0.0, 0.37, 0.5, 0.9, 0.99, 1.0])
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-14, atol=0)
    got, count = quantiles(torch.full((5,), NAN, dtype=torch.float64), [0.5])
    assert int(count) == 0 and torch.isnan(got).all()


@pytest.mark.parametrize("fold", [3, 20])
@pytest.mark.parametrize("steps", [5, 8, 13, 21])
def test_the_ring_keeps_the_last_norms_of_the_window(monkeypatch, steps, fold):
    """A ring of 8 (RING in production): a window longer than the ring has its quantiles over its last RING
    norms (wrapping round the ring's end), its engaged share over all its steps; also when one fold holds
    more steps than the ring."""
    monkeypatch.setattr(ledger_mod, "RING", 8)
    monkeypatch.setattr(counters_mod, "FOLD", fold)
    g = _guard(max_norm=10.0)
    for n in range(1, 4):  # a first window, so the next one starts mid-ring
        _step(g, float(n))
    g.state()
    norms = [float((7 * i) % 23) + 0.5 for i in range(steps)]
    for n in norms:
        _step(g, n)
    st = g.state()
    kept = norms[-8:]
    assert st["norm_count"] == len(kept) and st["window_steps"] == steps
    assert [st[k] for k, _ in QUANTILES] == pytest.approx(list(np.quantile(kept, [0.5, 0.9, 0.99])), rel=1e-14)
    assert st["clip_share"] == sum(n > 10.0 for n in norms) / steps


def test_the_ring_size_is_the_documented_one():
    from pathlib import Path

    assert RING == 1024
    text = (Path(__file__).resolve().parents[1] / "docs" / "guard-reference.md").read_text()
    assert f"last {RING:,}" in text


# ---------------------------------------------------------------- max_consecutive_skips at the read
@pytest.mark.parametrize("fold", [3, 256])
def test_the_read_raises_for_a_run_at_the_limit_that_a_step_ended(monkeypatch, fold):
    """Checked at the read: a run of ``limit`` (not ``limit - 1``) that a step taken ended since the previous
    read raises, as on a GPU where the next clip_'s check may not have seen that run (stood in for here by
    switching that check off); also when the step that ends it is the first of a fold."""
    monkeypatch.setattr(counters_mod.Counters, "check_consecutive", lambda self, limit: None)
    monkeypatch.setattr(counters_mod, "FOLD", fold)
    g = _guard(max_consecutive_skips=3)
    for n in (0.5, NAN, NAN, 0.5):
        _step(g, n)
    assert g.state()["window_longest_skipped"] == 2  # below the limit: no error
    for n in (NAN, NAN, NAN, 0.5):
        _step(g, n)
    with pytest.raises(GuardError, match=r"skipped 3 steps in a row since the previous state\(\) read, then "
                                         r"took a step \(max_consecutive_skips=3\); 0 in a row now") as e:
        g.state()
    assert e.value.state["longest_consecutive_skipped"] == 3 and e.value.state["steps"] == 8
    assert g.state()["window_steps"] == 0  # that window was read: the next read does not raise again


def test_a_run_still_going_is_the_next_clips_to_stop():
    """At the read a run of ``limit`` still going does not raise (the guard stays readable); the next clip_
    raises before it writes anything."""
    g = _guard(max_consecutive_skips=3)
    for n in (0.5, NAN, NAN, NAN):
        _step(g, n)
    st = g.state()
    assert st["consecutive_skipped"] == 3 and st["window_longest_skipped"] == 3
    with pytest.raises(GuardError, match="skipped 3 steps in a row"):
        _step(g, 0.5)


def test_without_the_option_the_read_never_raises():
    g = _guard()
    for _ in range(5):
        _step(g, NAN)
    assert g.state()["window_longest_skipped"] == 5


# ---------------------------------------------------------------- no host read in the step; one at the read
def test_the_step_reads_nothing_and_the_read_reads_once(monkeypatch):
    monkeypatch.setattr(counters_mod, "FOLD", 4)
    # a fused optimizer, its state made: every other path reads the flag in the step (docs/guard-paths.md)
    g = _guard(fused=True, max_consecutive_skips=50)
    _step(g, 0.5)
    with no_host_reads():  # steps across several folds (the ring and the longest run are written there)
        for i in range(10):
            _step(g, NAN if i in (3, 4) else 0.5 + i)
        g.counters()
    reads = []

    def counted(name):
        saved = getattr(torch.Tensor, name)

        def f(self, *a, **k):
            reads.append(name)
            return saved(self, *a, **k)
        return f

    for name in ("item", "__bool__", "tolist", "__float__", "__int__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    out = g.state()
    assert reads == ["tolist"]  # the counters, the last step and the window in one transfer
    assert out["norm_count"] == 9 and out["longest_consecutive_skipped"] == 2


# ---------------------------------------------------------------- checkpoints
def test_state_dict_keeps_the_ledger_mid_window():
    a, b = _guard(), _guard()
    for n in (0.5, 2.0, NAN, NAN, 3.0):
        _step(a, n)
    a.state()
    for n in (NAN, 1.5, 0.25):  # a window not read yet, records not folded yet
        _step(a, n)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    assert b.state() == a.state()
    for g in (a, b):
        for n in (NAN, NAN, NAN, 4.0, 0.1):
            _step(g, n)
    sa, sb = a.state(), b.state()
    assert sa == sb and sa["longest_consecutive_skipped"] == 3 and sa["engaged_steps"] == 4


def test_an_older_checkpoint_loads_with_an_empty_window():
    a = _guard()
    for n in (0.5, NAN, NAN, 3.0):
        _step(a, n)
    sd = a.state_dict()
    sd["counts"] = sd["counts"][:6]  # the six counters of an older fastgrad, no ledger
    del sd["ledger"], sd["read_at"]
    b = _guard()
    b.load_state_dict(sd)
    st = b.state()
    assert st["steps"] == 4 and st["window_steps"] == 0 and st["longest_consecutive_skipped"] == 0
    _step(b, 5.0)
    st = b.state()
    assert st["window_steps"] == 1 and st["clip_share"] == 1.0 and st["norm_p50"] == 5.0


def test_a_spike_skip_above_max_norm_engaged_the_clip():
    """Whether the clip engages does not depend on the skip: a spike skipped (its gradients clipped all the
    same) counts, so the share describes the norms the clip saw, taken or not."""
    g = _guard(max_norm=1.0, skip_factor=5.0, warmup_steps=2)
    for n in (0.5, 0.5, 0.5, 50.0, 0.5):
        _step(g, n)
    st = g.state()
    assert st["spike_steps"] == 1 and st["skipped_steps"] == 1 and st["engaged_steps"] == 1
    assert st["clip_share"] == 0.2 and st["norm_count"] == 5


def test_the_callbacks_log_the_ledger():
    """What both framework callbacks log at each logging step (one state() read): the ledger's window with
    the counters; a value that has none yet (no finite norm in the window) is left out."""
    from fastgrad.integrations._common import counters

    g = _guard(max_norm=1.0)
    for n in (0.5, 2.0, NAN, 3.0):
        _step(g, n)
    logged = counters(g, "guard/")
    assert logged["guard/clip_share"] == 0.5 and logged["guard/norm_p50"] == 2.0
    assert logged["guard/longest_consecutive_skipped"] == 1 and logged["guard/steps"] == 4
    _step(g, NAN)
    logged = counters(g, "guard/")
    assert "guard/norm_p50" not in logged and logged["guard/clip_share"] == 0.0
