"""The stuck-loss classes of ``python -m fastgrad.check``: probabilities fed to a cross-entropy that applies its
own softmax, a loss summed over a gradient-accumulation window instead of averaged, and a weight decay that
drags the weights to zero. Each as a small real
script (tests/check_scripts/) that records its float64 truth without fastgrad, and each rule tested against its
nearest wrong variant (the script's clean twin, and hand-built records one step either side of its bounds)."""

import math

import pytest
import torch

from fastgrad.diagnose.collect.loss_inputs import loss_node, probability_rows, softmax_made
from fastgrad.diagnose.collect.steps import StepRecord
from fastgrad.diagnose.rules.accum_not_divided import ACCUM_NOT_DIVIDED, summed_windows
from fastgrad.diagnose.rules.base import RunView
from fastgrad.diagnose.rules.probabilities_ce import PROBABILITIES_INTO_CE, ce_floor
from fastgrad.diagnose.rules.stall import loss_stall
from fastgrad.diagnose.rules.weight_decay import decay_drag
from fastgrad.diagnose.thresholds import RunLimits, Thresholds

from .check_runs import checked_once, codes, finding

_cache: dict = {}


def run(tmp_path_factory, name, *args):
    return checked_once(_cache, tmp_path_factory, name, *args)


# ------------------------------------------------------------------------------ probabilities into a cross-entropy
def test_the_floor_is_the_loss_of_a_one_hot_probability_row():
    for k in (2, 10, 1000):
        probs = torch.zeros(1, k, dtype=torch.float64)
        probs[0, 3 % k] = 1.0
        got = float(torch.nn.functional.cross_entropy(probs, torch.tensor([3 % k])))
        assert ce_floor(k) == pytest.approx(got, rel=1e-12)


def test_probability_rows_sits_between_probabilities_and_their_nearest_wrong_variants():
    tol = RunLimits.prob_row_tol
    p = torch.softmax(torch.randn(8, 5), 1)
    assert bool(probability_rows(p, tol))
    assert bool(probability_rows(p[0], tol))                      # unbatched: classes on dim 0
    assert bool(probability_rows(torch.softmax(torch.randn(4, 3, 6), 1), tol))  # (N, C, d): classes on dim 1
    assert not bool(probability_rows(torch.log_softmax(torch.randn(8, 5), 1), tol))  # log-probabilities
    assert not bool(probability_rows(torch.sigmoid(torch.randn(8, 5)), tol))  # in [0, 1], rows not summing to 1
    off = p.clone()
    off[0] *= 1 + 1.5 * tol                                        # one row off by more than the tolerance
    assert not bool(probability_rows(off, tol))
    off = p.clone()
    off[0] *= 1 + 0.5 * tol
    assert bool(probability_rows(off.clamp(max=1.0), tol))
    assert probability_rows(torch.randn(8, 1), tol) is None        # one class: no row to judge
    assert not bool(probability_rows(torch.tensor([[1.5, -0.5], [0.2, 0.8]]), tol))  # sums to 1, not in [0, 1]
    z = torch.randn(3, 4, requires_grad=True)
    assert softmax_made(torch.nn.Softmax(dim=1)(z)) and softmax_made(torch.softmax(z, 1))
    assert not softmax_made(torch.log_softmax(z, 1)) and not softmax_made(z * 2)


def _ce_view(calls, probs, losses=(), classes=10):
    steps = [StepRecord(step=i + 1, has_loss=True, loss=v, total_norm=0.01) for i, v in enumerate(losses)]
    return RunView(steps=steps, ctx={"ce_inputs": {"calls": calls, "softmax": 0, "probabilities": probs},
                                     "classes": classes})


def test_probabilities_into_ce_needs_half_the_calls():
    share = RunLimits.prob_share
    assert [f.severity for f in PROBABILITIES_INTO_CE.evaluate(_ce_view(10, int(share * 10)))] == ["warning"]
    assert PROBABILITIES_INTO_CE.evaluate(_ce_view(10, int(share * 10) - 1)) == []   # an eval pass on a softmax
    assert PROBABILITIES_INTO_CE.evaluate(_ce_view(0, 0)) == []
    f = PROBABILITIES_INTO_CE.evaluate(_ce_view(8, 8, [2.3, 1.9, 1.6, 1.5, 1.47, 1.465, 1.462, 1.462]))[0]
    assert f.evidence["floor"] == pytest.approx(ce_floor(10)) and f.evidence["last_mean"] == pytest.approx(1.462)
    assert "1.461" in f.detail and "ln(10)" in f.detail


@pytest.mark.slow   # real scripts of 40-100 steps under check
def test_probabilities_fed_to_cross_entropy_are_named_not_low(tmp_path_factory):
    r = run(tmp_path_factory, "softmax_into_ce.py")
    truth = r["truth"]
    floor = truth["floor"]
    losses = [s["loss"] for s in truth["steps"]]
    assert min(losses) >= floor - 1e-6                        # the truth: stuck above the floor ...
    assert truth["steps"][-1]["norm"] < 0.1 * max(s["norm"] for s in truth["steps"])  # ... gradients shrinking
    f = r["json"]["findings"][0]
    assert (f["code"], f["severity"]) == ("probabilities_into_ce", "warning")
    assert f["evidence"]["floor"] == pytest.approx(floor, rel=1e-12)
    q = len(losses) // 4
    assert f["evidence"]["last_mean"] == pytest.approx(sum(losses[-q:]) / q, rel=1e-5)
    assert not {"low", "spike", "stall", "increasing"} & set(codes(r))   # effects of this cause
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "probabilities_into_ce")
    assert "F.cross_entropy(logits, y)" in rec["code_to_add"] and "lr" not in rec["code_to_add"]


@pytest.mark.slow   # real scripts of 40-100 steps under check
def test_probabilities_made_by_hand_are_read_off_the_rows(tmp_path_factory):
    r = run(tmp_path_factory, "softmax_into_ce.py", "--by-hand")   # exp / sum: no softmax node to read
    assert codes(r)[0] == "probabilities_into_ce"
    assert finding(r, "probabilities_into_ce")["evidence"]["softmax"] == 0


@pytest.mark.slow   # real scripts of 40-100 steps under check
@pytest.mark.parametrize("variant", ["--logits", "--log-probs"])
def test_logits_and_log_probabilities_stay_clean(tmp_path_factory, variant):
    r = run(tmp_path_factory, "softmax_into_ce.py", variant)
    assert "probabilities_into_ce" not in codes(r)
    ce = r["res"].context["ce_inputs"]
    assert ce["calls"] == len(r["truth"]["steps"]) and ce["probabilities"] == ce["softmax"] == 0
    assert r["truth"]["steps"][-1]["loss"] < 0.5 * r["truth"]["floor"]   # the clean twin goes below the floor


# ------------------------------------------------------------------------------------ a loss not divided over a window
def test_loss_node_is_a_loss_functions_output_as_returned():
    F = torch.nn.functional
    z = torch.randn(8, 3, requires_grad=True)
    y = torch.randint(0, 3, (8,))
    assert loss_node(F.cross_entropy(z, y)).startswith("NllLoss")
    assert loss_node(F.mse_loss(z, torch.zeros(8, 3))).startswith("MseLoss")
    assert loss_node(F.binary_cross_entropy_with_logits(z, torch.ones(8, 3))).startswith("BinaryCrossEntropy")
    assert loss_node(F.cross_entropy(z, y) / 2) is None                 # divided over the window
    assert loss_node(2 * F.mse_loss(z, torch.zeros(8, 3))) is None
    assert loss_node(z.sum()) is None and loss_node(torch.ones(())) is None


def test_summed_windows_sits_between_a_summed_window_and_its_nearest_wrong_variants():
    steps = {1, 2, 3}
    nll = "NllLossBackward0"
    assert summed_windows([(s, 2, 2, nll) for s in steps], steps) == (2, nll, 3)
    assert summed_windows([(s, 2, 1, nll) for s in steps], steps) is None       # one of the two divided
    assert summed_windows([(s, 1, 1, nll) for s in steps], steps) is None       # no window: one backward a step
    assert summed_windows([(s, 2, 2, "mixed") for s in steps], steps) is None   # two different losses
    assert summed_windows([(s, 0, 0, None) for s in steps], steps) is None      # a closure's evaluations
    assert summed_windows([(s, 4, 4, nll) for s in steps], {9}) is None         # another optimizer's steps


def _accum_view(windows, n=10, names=("opt",)):
    steps = [StepRecord(step=i + 1, has_loss=True, loss=1.0 - 0.01 * i, total_norm=1.0) for i in range(n)]
    return RunView(steps=steps, names=list(names), ctx={"windows": windows})


def test_accum_not_divided_needs_most_steps_and_one_optimizer():
    share = RunLimits.accum_share
    n = 10
    hit = math.ceil(share * n)
    w = [(i + 1, 4, 4 if i < hit else 1, "MseLossBackward0") for i in range(n)]
    got = ACCUM_NOT_DIVIDED.evaluate(_accum_view(w, n))
    assert [(f.severity, f.evidence["window"], f.evidence["steps"]) for f in got] == [("notice", 4, hit)]
    w = [(i + 1, 4, 4 if i < hit - 1 else 1, "MseLossBackward0") for i in range(n)]
    assert ACCUM_NOT_DIVIDED.evaluate(_accum_view(w, n)) == []
    w = [(i + 1, 2, 2, "NllLossBackward0") for i in range(n)]
    assert ACCUM_NOT_DIVIDED.evaluate(_accum_view(w, n, names=("opt_d", "opt_g"))) == []   # a GAN's two halves
    # harm from the first step on makes it a warning: the loss went NaN at step 6
    view = _accum_view(w, n)
    view.steps[5].loss = math.nan
    got = ACCUM_NOT_DIVIDED.evaluate(view)
    assert [(f.severity, f.evidence["harm"]) for f in got] == [("warning", ["nonfinite"])]


@pytest.mark.slow   # real scripts of 40-100 steps under check
def test_a_loss_summed_over_the_window_is_named_with_its_window(tmp_path_factory):
    r = run(tmp_path_factory, "accum_not_divided.py")
    d = run(tmp_path_factory, "accum_not_divided.py", "--divided")
    # the truth: the same first window, its gradient 4x the divided one's
    assert r["truth"]["steps"][0]["norm"] == pytest.approx(4 * d["truth"]["steps"][0]["norm"], rel=1e-6)
    f = r["json"]["findings"][0]
    assert f["code"] == "accum_not_divided" and f["evidence"]["window"] == 4
    assert f["evidence"]["steps"] == len(r["truth"]["steps"])
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "accum_not_divided")
    assert "loss = loss / 4" in rec["code_to_add"]
    assert "accum_not_divided" not in codes(d)


# ------------------------------------------------------------------------------------ a weight decay that drags
def test_decay_drag_needs_both_the_pull_and_the_fall():
    lim = RunLimits()
    kw = dict(least_pull=lim.decay_pull, fall=lim.decay_fall)
    fell = [(1, 4.0), (8, 3.0), (24, 4.0 * lim.decay_fall)]
    assert decay_drag(lim.decay_pull, fell, **kw)["share"] == pytest.approx(lim.decay_fall)
    assert decay_drag(0.99 * lim.decay_pull, fell, **kw) is None          # the usual decay: the weights fell anyway
    assert decay_drag(lim.decay_pull, [(1, 4.0), (24, 4.0 * lim.decay_fall * 1.01)], **kw) is None  # held up
    assert decay_drag(1.0, [(1, 4.0)], **kw) is None                       # one measured step: no fall to read
    assert decay_drag(1.0, [(1, 4.0), (8, math.nan), (24, 1.0)], **kw)["last"] == (24, 1.0)


@pytest.mark.slow   # real scripts of 60 steps under check
def test_a_weight_decay_that_drags_the_weights_is_named(tmp_path_factory):
    r = run(tmp_path_factory, "weight_decay_drag.py")
    u = run(tmp_path_factory, "weight_decay_drag.py", "--usual")
    w = {s["step"]: s["weights"] for s in r["truth"]["steps"]}
    assert w[max(w)] < 0.1 * w[0]                              # the truth: the weights dragged to zero ...
    assert u["truth"]["steps"][-1]["weights"] > w[0]           # ... and held up by the usual decay
    f = r["json"]["findings"][0]
    assert (f["code"], f["severity"]) == ("weight_decay_drag", "warning")
    assert f["evidence"]["pull"] == pytest.approx(2e-3 * 100.0)
    for step, norm in (f["evidence"]["first"], f["evidence"]["last"]):   # measured before that step's update
        assert norm == pytest.approx(w[step - 1], rel=1e-5)
    assert "stall" not in codes(r)
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "weight_decay_drag")
    assert "group['weight_decay'] = 0.05" in rec["code_to_add"] and "opt.param_groups" in rec["code_to_add"]
    assert "weight_decay_drag" not in codes(u)


# ------------------------------------------------------------------------------- labels that do not depend on input
def test_a_fall_that_ends_at_chance_is_a_stall_and_one_below_it_is_not():
    lim = RunLimits()
    kw = dict(window=lim.stall_window, z=lim.stall_z, rel=Thresholds().loss_progress, chance_share=lim.stall_chance)
    c = math.log(4)
    wig = [0.01 if i % 2 else -0.01 for i in range(40)]
    fall = lambda end: [1.3 * c + (end - 1.3 * c) * min(1.0, i / 20) + w for i, w in enumerate(wig)]  # noqa: E731
    at = loss_stall(fall(c), chance=c, **kw)
    assert at is not None and at["improved"] and at["to_chance"] and not at["back"]
    need = at["need"]
    assert loss_stall(fall(c - 0.9 * need), chance=c, **kw)["to_chance"]     # below chance by less than counts
    assert loss_stall(fall(c - 1.5 * need), chance=c, **kw) is None          # below it by more: it learns
    assert loss_stall(fall(c), chance=None, **kw) is None                    # no cross-entropy: no chance level


@pytest.mark.slow   # real scripts of 80 steps under check
def test_random_labels_that_fall_only_to_chance_are_a_stall(tmp_path_factory):
    r = run(tmp_path_factory, "random_labels_to_chance.py")
    ok = run(tmp_path_factory, "random_labels_to_chance.py", "--learnable")
    chance = r["truth"]["chance"]
    losses = [s["loss"] for s in r["truth"]["steps"]]
    q = len(losses) // 4
    assert sum(losses[:q]) / q > 1.1 * chance                  # the truth: it fell from above chance ...
    assert abs(sum(losses[-q:]) / q - chance) < 0.05 * chance  # ... to chance
    f = r["json"]["findings"][0]
    assert f["code"] == "stall" and f["evidence"]["at_chance"] and f["evidence"]["to_chance"]
    assert "stall" not in codes(ok) and ok["truth"]["steps"][-1]["loss"] < 0.5 * chance
