"""``saturated_at_init``: tanh/sigmoid layers whose outputs sit on their flat tails at the first forward, before any
update (an exploding initialisation of a deep tanh stack). The measurement against a plain forward hook's float64
shares (``tests/check_scripts/tanh_init_scale.py``), and the rule between it and its nearest wrong variants:
half the outputs and not just under, the slope's 2% and not just above, at the initialisation and not later."""

import pytest
import torch

from fastgrad.diagnose.collect.saturation import slope_share
from fastgrad.diagnose.collect.steps import StepRecord
from fastgrad.diagnose.rules.base import RunView
from fastgrad.diagnose.rules.saturation import SATURATED_AT_INIT, saturated
from fastgrad.diagnose.thresholds import RunLimits

from .check_runs import checked_once, codes, finding

_cache: dict = {}


def run(tmp_path_factory, *args):
    return checked_once(_cache, tmp_path_factory, "tanh_init_scale.py", *args)


def test_slope_share_counts_the_flat_tails_of_each_activation():
    lim = RunLimits()
    # tanh: slope 1 - y^2; |y| = 0.99 gives 0.0199 (flat), 0.9899 gives 0.0201 (not)
    y = torch.tensor([0.99, -0.99, 0.9899, -0.9899, 0.0, float("nan")])
    assert float(slope_share(y, "Tanh", lim.saturated_slope)) == pytest.approx(2 / 6)
    # sigmoid: slope 4y(1-y); y = 0.995 or 0.005 gives 0.0199 (flat), 0.9949 gives 0.0203 (not)
    s = torch.tensor([0.995, 0.005, 0.9949, 0.0051, 0.5])
    assert float(slope_share(s, "Sigmoid", lim.saturated_slope)) == pytest.approx(2 / 5)
    # the same values read as tanh outputs are not flat: each activation's own slope
    assert float(slope_share(torch.tensor([0.995, 0.005]), "Tanh", lim.saturated_slope)) == pytest.approx(0.5)


def _view(shares, losses):
    steps = [StepRecord(step=i + 1, has_loss=True, loss=v, total_norm=1.0, lr=0.05) for i, v in enumerate(losses)]
    layers = [{"module": f"body.{i}", "type": "Tanh", "share": s, "calls": 1} for i, s in enumerate(shares)]
    return RunView(steps=steps, lrs=[0.05], ctx={"saturation": layers, "classes": 5})


def _judged(shares, losses):
    """The rules in their order (the stall's verdict first), as the run sees them."""
    from fastgrad.diagnose.rules.registry import evaluate
    from fastgrad.diagnose.rules.stall import STALL
    return [f for f in evaluate(_view(shares, losses), rules=(STALL, SATURATED_AT_INIT))
            if f.code == "saturated_at_init"]


def test_saturated_at_init_sits_at_half_the_outputs_and_rests_its_tier_on_the_stall():
    lim = RunLimits()
    assert [x["module"] for x in saturated([{"module": "a", "share": 0.5}, {"module": "b", "share": 0.4999}],
                                           lim.saturated_share)] == ["a"]
    learns = [2.0 - 0.05 * i for i in range(30)]
    flat = [1.6 + 0.01 * (-1) ** i for i in range(30)]
    back = [1.6 + 0.3 * (i < 8) + 0.01 * (-1) ** i for i in range(30)]   # a fall that only comes back to chance
    assert not _judged([0.4999, 0.1], learns)
    got = _judged([0.5, 0.1], learns)
    assert [(f.severity, f.layers, f.steps) for f in got] == [("notice", ["body.0"], [1])]
    for losses in (flat, back):   # the loss did not improve, as the stall rule judges it: the harm
        got = _judged([0.5, 0.7], losses)
        assert [(f.severity, f.layers) for f in got] == [("warning", ["body.0", "body.1"])]
    assert not _judged([], flat)      # no tanh/sigmoid module: nothing to judge


def test_an_initialisation_that_saturates_a_tanh_stack_is_named_with_the_shares_a_plain_hook_measures(
        tmp_path_factory):
    r = run(tmp_path_factory, "--scale", "6")
    truth = r["truth"]["saturated"]
    assert len(truth) == 8 and min(truth.values()) > 0.5   # the premise, from a plain float64 hook
    f = r["json"]["findings"][0]
    assert f["code"] == "saturated_at_init" and f["steps"] == [1]
    assert f["evidence"]["layers"] == pytest.approx(truth, abs=1e-6)
    def gain(run_):   # the mean loss of the last 5 steps against the first 5's, from the plain hook
        losses = [s["loss"] for s in run_["truth"]["steps"]]
        return 1 - sum(losses[-5:]) / sum(losses[:5])
    # it barely learns: less than half of what its in-range twin learns (on one machine 13% against 61%; the
    # premise once read "its last loss within 10% of its first", which another CPU's floats broke at 12%)
    assert gain(r) < 0.5 * gain(run(tmp_path_factory, "--scale", "1"))
    # its tier is the stall rule's verdict on the same run (whether the loss improved against its noise: on a
    # network this saturated, training is chaotic enough that the thread count can tip it either way)
    stalled = "stall" in codes(r)
    assert f["severity"] == ("warning" if stalled else "notice") and f["evidence"]["stuck"] == stalled
    assert r["rc"] == 0
    rec = {x["code"]: x for x in r["json"]["recommendations"]}
    assert "xavier_uniform_" in rec["saturated_at_init"]["code_to_add"]
    if stalled:   # the stall that follows is not advised as a cause (no learning-rate change for it)
        assert finding(r, "stall")["evidence"]["follows"] == "saturated_at_init"
        assert "raise" not in rec["stall"]["text"]


def test_the_stall_that_saturated_units_explain_follows_from_them():
    """The link on its own (the real run above may or may not stall): a stall and a vanishing across depth
    follow from ``saturated_at_init``; a spike does not."""
    from fastgrad.diagnose.consistency import link_causes
    from fastgrad.diagnose.finding import Finding, place_causes
    sat = Finding("saturated_at_init", "warning", "saturated", "", steps=[1])
    stall = Finding("stall", "notice", "stalled: the learning rate is the first suspect", "", steps=[1, 30],
                    evidence={"series": 0})
    depth = Finding("depth_vanishing", "warning", "vanishing across depth", "")
    spike = Finding("spike", "notice", "spike", "", steps=[9], evidence={"series": 0})
    order = place_causes(link_causes([stall, depth, spike, sat]))
    assert order[0] is sat
    assert stall.evidence["follows"] == depth.evidence["follows"] == "saturated_at_init"
    assert "follows" not in spike.evidence


@pytest.mark.parametrize("args", [("--scale", "1"), ("--scale", "1", "--grow-at", "5"),
                                  ("--scale", "6", "--act", "sigmoid")])
def test_units_in_range_at_the_first_forward_are_not_saturated_at_init(args, tmp_path_factory):
    """In range at the initialisation: a Xavier-scaled stack; the same stack whose weights the script scales up
    after step 5 (saturated later, by the run, not by the initialisation); sigmoids whose flat tails hold under
    half of their outputs at that scale."""
    r = run(tmp_path_factory, *args)
    assert max(r["truth"]["saturated"].values()) < 0.5
    assert "saturated_at_init" not in codes(r)
