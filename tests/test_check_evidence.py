"""``python -m fastgrad.check`` judging by the evidence a run shows (issue 45): a norm above the guide's limits is a
question unless the run shows harm; what never learns is named; a cause comes before its effects; the layers of a
stacked RNN are layers; the advice uses the script's own names; every summary row agrees with the findings.
Each case is a script under tests/check_scripts/ that records its own float64 truth without fastgrad; the
premise asserted first is what makes the case, the verdict after it was written before check ran."""

import math
import statistics

import pytest

from fastgrad.diagnose.thresholds import RANK, RunLimits

from .check_runs import cached_run, checked_run, codes, finding, row

RUNS = {
    "vae": ("vae_summed_loss.py", []),
    "vae_lr": ("vae_summed_loss.py", ["--lr", "0.1"]),
    "reinforce": ("reinforce_learns.py", []),
    "dead_encoder": ("dead_encoder.py", []),
    "no_zero_growth": ("no_zero_grad_growth.py", []),
    "deep_rnn": ("deep_tanh_rnn.py", []),
    "word_lm": ("word_lm_manual_sgd.py", []),
    "word_lm_2000": ("word_lm_manual_sgd.py", ["--lr", "2000"]),
    "frozen": ("frozen_first_layer.py", []),
    "frozen_lr": ("frozen_first_layer.py", ["--lr", "30"]),
}

_cache: dict = {}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("evidence")


def run(name, tmp):
    return cached_run(_cache, RUNS, name, tmp)


def quarters(xs, f=statistics.mean):
    q = len(xs) // 4
    return [f(xs[i * q:(i + 1) * q]) for i in range(4)]


def same_as_truth(r, norm="norm"):
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    assert len(steps) == len(truth)
    for s, t in zip(steps, truth):
        assert math.isclose(s["grad_norm"], t[norm], rel_tol=1e-5), (s["step"], s["grad_norm"], t[norm])
        assert math.isclose(s["loss"], t["loss"], rel_tol=1e-6, abs_tol=1e-9), (s["step"], s["loss"], t["loss"])


def no_row_worse_than_the_findings(r):
    worst = max((f["severity"] for f in r["json"]["findings"]), key=RANK.__getitem__, default="healthy")
    for x in r["json"]["summary"]:
        assert RANK[x["status"]] <= RANK[worst], x


def recommendations(r):
    return " ".join(x["text"] + "\n" + x["code_to_add"] for x in r["json"]["recommendations"])


# ---------------------------------------------------------------------------------------------- judgement
def test_a_loss_summed_over_the_batch_is_not_an_explosion(tmp):
    r = run("vae", tmp)
    t = r["truth"]["steps"]
    losses, norms = [x["loss"] for x in t], [x["norm"] for x in t]
    # the premise: every norm above 1000, the loss falling at every quarter, no update near the weights' size
    assert min(norms) > 1000 and all(b < a for a, b in zip(quarters(losses), quarters(losses)[1:]))
    assert max(x["update"] for x in t) < 0.1
    same_as_truth(r)
    assert not codes(r, "warning") and not codes(r, "critical") and r["rc"] == 0
    f = finding(r, "exploding")
    assert f["severity"] == "notice" and f["evidence"]["harm"] == []
    assert "No harm seen: the loss fell" in f["detail"] and "clip now" not in f["title"]
    assert finding(r, "no_clipping")["severity"] == "notice"
    for metric in ("Total grad norm", "Max grad norm", "Norm trend", "Loss"):
        assert RANK[row(r, metric)["status"]] <= RANK["notice"], row(r, metric)
    assert "lr'] *= 0.1" not in r["md"] and "lower the learning rate" not in recommendations(r).lower()
    no_row_worse_than_the_findings(r)


def test_the_same_vae_at_100x_its_learning_rate_is_critical_with_its_evidence(tmp):
    r = run("vae_lr", tmp)
    t = r["truth"]["steps"]
    # the premise: the first update rewrote the weights, the loss jumped far above its start, the norm with it
    assert t[0]["update"] > 1 and max(x["loss"] for x in t) > 100 * t[0]["loss"] and t[1]["norm"] > 100 * t[0]["norm"]
    same_as_truth(r)
    f = finding(r, "exploding")
    assert f["severity"] == "critical" and r["rc"] == 1
    assert {"rewrite", "loss_jump", "far"} <= set(f["evidence"]["harm"]) and "Harm the run shows" in f["detail"]
    # the rows say what the findings say: the update rewrote the weights, the loss peaked far above its start
    up = row(r, "Update/weight ratio")
    assert up["status"] == "critical" and "rewrote the weights" in up["value"]
    assert row(r, "Loss")["status"] == "critical" and "peak" in row(r, "Loss")["value"]
    # the units the blow-up killed follow from it
    mz = finding(r, "mostly_zero")
    assert mz["evidence"]["follows"] == "exploding"
    no_row_worse_than_the_findings(r)


def test_a_policy_gradient_that_learns_is_not_told_to_lower_its_learning_rate(tmp):
    r = run("reinforce", tmp)
    t = r["truth"]["steps"]
    lengths, norms = [x["length"] for x in t], [x["norm"] for x in t]
    # the premise: the episodes get 3x longer (it learns) and the norm's quarter medians rise 3x with them
    assert quarters(lengths)[3] > 3 * quarters(lengths)[0]
    med = quarters(norms, statistics.median)
    assert all(b > a for a, b in zip(med, med[1:])) and med[3] > 3 * med[0]
    same_as_truth(r)
    assert not codes(r, "warning") and not codes(r, "critical") and r["rc"] == 0
    f = finding(r, "increasing")
    assert f["severity"] == "notice" and f["evidence"]["harm"] == [] and "No harm seen" in f["detail"]
    text = recommendations(r).lower()
    assert "lower the learning rate and clip" not in text and "lr'] *= 0.1" not in text
    no_row_worse_than_the_findings(r)


# ---------------------------------------------------------------------------------------------- never learns
def test_an_encoder_dead_from_the_first_step_is_named_first(tmp):
    r = run("dead_encoder", tmp)
    t = r["truth"]["steps"]
    dead = ["encoder.0.weight", "encoder.0.bias", "encoder.2.weight"]
    assert all(x["zero"] == dead for x in t)  # the premise: these three, exactly zero at every step
    assert max(x["norm"] for x in t) > 100
    same_as_truth(r)
    first = r["json"]["findings"][0]
    assert first["code"] == "never_learns" and first["severity"] == "warning" and first["layers"] == dead
    assert first["evidence"]["zero"] == dead and first["evidence"]["unused"] == []
    issues = r["md"].split("### Issues Detected")[1].split("### Recommendations")[0]
    assert all(n in issues for n in dead)  # named in the text, not only in report.json
    assert finding(r, "exploding")["severity"] == "notice"
    z = row(r, "Zero-gradient parameters")
    assert z["status"] == "warning" and "never learning: encoder.0.weight" in z["value"]
    assert r["json"]["recommendations"][0]["code"] == "never_learns" and r["rc"] == 0
    no_row_worse_than_the_findings(r)


def test_frozen_parameters_are_named_but_not_a_finding(tmp):
    r = run("frozen", tmp)
    assert "never_learns" not in codes(r) and r["rc"] == 0
    fr = row(r, "Frozen parameters")
    assert fr["status"] == "healthy" and "0.weight, 0.bias" in fr["value"]


# ---------------------------------------------------------------------------------------------- cause first
def test_accumulated_gradients_come_before_the_growth_they_cause(tmp):
    r = run("no_zero_growth", tmp)
    t = r["truth"]["steps"]
    own, norms = [x["own"] for x in t], [x["norm"] for x in t]
    # the premise: each batch's own gradient stays level while the accumulated norm grows ~100x past 1000
    assert max(own) < 1.5 * min(own) and norms[-1] > 50 * norms[0] and norms[1] > 1000
    same_as_truth(r)
    found = r["json"]["findings"]
    assert found[0]["code"] == "no_zero_grad" and found[0]["severity"] == "critical" and r["rc"] == 1
    effects = [f for f in found if f["code"] in ("exploding", "increasing", "no_clipping", "spike")]
    assert {f["code"] for f in effects} >= {"exploding", "increasing"}
    for f in effects:
        assert f["evidence"]["follows"] == "no_zero_grad" and "It follows from `no_zero_grad`" in f["detail"]
        assert "summed over the batch" not in f["detail"] and "longer episodes" not in f["detail"]
    recs = r["json"]["recommendations"]
    assert recs[0]["code"] == "no_zero_grad" and "optimizer.zero_grad(set_to_none=True)" in recs[0]["code_to_add"]
    assert all(x["code_to_add"] == "" for x in recs[1:] if x["code"] in ("exploding", "increasing"))


# ---------------------------------------------------------------------------------------------- layers
def test_the_layers_of_a_stacked_rnn_are_layers(tmp):
    r = run("deep_rnn", tmp)
    t = r["truth"]["steps"]
    assert all(x["first"] * 1000 < x["last"] for x in t)  # the premise: 1000x less gradient in the first layer
    same_as_truth(r)
    f = finding(r, "depth_vanishing")
    assert f["severity"] == "warning" and f["layers"][0] == "rnn.l0"
    assert f["evidence"]["units"]["rnn.l0"] == ["rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.bias_ih_l0",
                                                "rnn.bias_hh_l0"]
    text = recommendations(r)
    assert "GRU" in text and "ReLU" not in text and "kaiming" not in text and r["rc"] == 0
    assert "where it started" not in r["md"]
    no_row_worse_than_the_findings(r)


# ---------------------------------------------------------------------------------------------- advice
def test_a_hand_written_update_is_advised_in_its_own_names(tmp):
    r = run("word_lm_2000", tmp)
    t = r["truth"]["steps"]
    assert t[-1]["loss"] > 20 * t[0]["loss"]  # the premise: the loss climbs and stays up
    same_as_truth(r, norm="raw")
    assert finding(r, "loss_diverging")["severity"] == "critical" and r["rc"] == 1
    code = r["md"].split("### Code to Add")[1]
    assert "lr *= 0.1" in code and "optimizer" not in code and "param_groups" not in code
    for name in ("loader", "LeakyReLU", "ReLU"):
        assert name not in r["md"].split("### Recommendations")[1], name
    no_row_worse_than_the_findings(r)


def test_the_same_language_model_at_its_own_learning_rate_is_healthy(tmp):
    r = run("word_lm", tmp)
    t = r["truth"]["steps"]
    assert quarters([x["loss"] for x in t])[3] < 0.97 * quarters([x["loss"] for x in t])[0]  # the premise: it learns
    same_as_truth(r, norm="raw")
    assert codes(r) == ["hand_written_loop"] and r["rc"] == 0


def test_the_update_size_row_and_the_optimizer_variable(tmp):
    r = run("frozen_lr", tmp)
    t = r["truth"]["steps"]
    top = max(range(len(t)), key=lambda i: t[i]["update"])
    assert t[top]["update"] > 5  # the premise: one update rewrote the trained weights several times over
    same_as_truth(r)
    f = finding(r, "loss_diverging")
    assert f["severity"] != "notice" and f["evidence"]["rewrite"][0] == top + 1
    up = row(r, "Update/weight ratio")
    assert up["status"] == f["severity"] and f"at step {top + 1}" in up["value"]
    assert math.isclose(float(up["value"].split("largest ")[1].split(" ")[0]), t[top]["update"], rel_tol=1e-3)
    code = r["md"].split("### Code to Add")[1]
    assert "sgd.param_groups" in code and "optimizer" not in code and "loader" not in code
    assert "criterion" not in code
    assert "0.weight, 0.bias" in row(r, "Frozen parameters")["value"]
    assert finding(r, "dead")["evidence"]["follows"] == "loss_diverging"
    no_row_worse_than_the_findings(r)


# ---------------------------------------------------------------------------------------------- thresholds
# Each rule between itself and its nearest wrong variant, on recorded numbers (a RunView, no script).
def _view(norms, losses=None, *, updates=(), **extra):
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.rules.base import RunView

    losses = losses if losses is not None else [1.0] * len(norms)
    steps = [StepRecord(step=i, total_norm=n, loss=v, has_loss=True, numel=10, **extra)
             for i, (n, v) in enumerate(zip(norms, losses), 1)]
    return RunView(steps=steps, ctx={"updates": [{"step": s, "series": 0, "lr": 0.1, "ratio": r, "layers": {}}
                                                 for s, r in updates]})


def _exploding(view):
    from fastgrad.diagnose.rules.exploding import EXPLODING

    (f,) = EXPLODING.evaluate(view)
    return f


def test_the_guides_limits_alone_are_a_notice_and_harm_makes_the_tier():
    lim = RunLimits()
    flat = [1.0 + 0.01 * (i % 3) for i in range(12)]
    # norms in the thousands from the start, flat loss: the guide's question
    assert _exploding(_view([2000.0] * 12, flat)).severity == "notice"
    assert _exploding(_view([200.0] * 12, flat)).severity == "notice"
    # an update that rewrote the weights is the gravest harm: critical above 100 already; just under 1x: none
    assert _exploding(_view([2000.0] * 12, flat, updates=[(3, lim.blowup_update)])).severity == "critical"
    assert _exploding(_view([200.0] * 12, flat, updates=[(3, lim.blowup_update)])).severity == "critical"
    assert _exploding(_view([2000.0] * 12, flat, updates=[(3, lim.blowup_update * 0.99)])).severity == "notice"
    # ... and that limit is 1x the weights' size, the documented value (not the 2x of a looser variant)
    assert _exploding(_view([2000.0] * 12, flat, updates=[(3, 1.0)])).severity == "critical"
    assert _exploding(_view([2000.0] * 12, flat, updates=[(3, 0.99)])).severity == "notice"
    # a loss that jumped at a step whose norm was the run's usual one (every step at 200) is a hard batch the
    # step absorbed: no damage after it, a notice (as that batch's spike would be)
    f = _exploding(_view([200.0] * 8, flat[:5] + [30.0] + flat[6:8]))
    assert f.severity == "notice" and f.evidence["harm"] == ["hard_batch"] and "hard batch" in f.title
    assert f.evidence["variant"] == "hard_batch" and "but no damage followed" in f.detail
    # a NaN loss from those steps on is harm; one before them is not about them
    assert _exploding(_view([2000.0] * 12, flat[:8] + [math.nan] * 4)).severity == "critical"
    assert _exploding(_view([50.0] * 8 + [200.0] * 4, [math.nan] + flat[1:])).severity == "notice"
    # critical needs the harm at the steps above 1000: harm only at a step between 100 and 1000 is a warning
    # (a loss jump at step 8, after a step at 150 that stood 7.5x above the run's level of 20)
    norms = [20.0] * 4 + [1500.0] + [20.0] + [150.0] + [20.0] * 5
    jump = [1.0] * 7 + [30.0] + [1.0] * 4
    f = _exploding(_view(norms, jump))
    assert f.severity == "warning" and "loss_jump" in f.evidence["harm"]
    # a loss jump at the step after one over the limit (the update it drove) is its harm; at the step itself it
    # is not (that loss was computed before the step's update, and the gradient grew with it: a hard batch, a
    # deeper draw of a dynamic model), nor two steps after
    for at, harmed in ((5, False), (6, True), (7, False)):
        losses = [1.0] * 12
        losses[at - 1] = 30.0
        f = _exploding(_view([50.0] * 4 + [500.0] + [50.0] * 7, losses))
        assert ("loss_jump" in f.evidence["harm"]) is harmed, at
    # ... at the step itself it is the batch the norm came from: an outlier where that norm stood 10x the run's
    # own level (a warning at either tier, never critical), a hard batch just under 10x (a notice)
    f = _exploding(_view([50.0] * 4 + [499.0] + [50.0] * 7, [1.0] * 4 + [30.0] + [1.0] * 7))
    assert f.evidence["harm"] == ["hard_batch"] and f.severity == "notice"
    for norm in (500.0, 5000.0):
        f = _exploding(_view([50.0] * 4 + [norm] + [50.0] * 7, [1.0] * 4 + [30.0] + [1.0] * 7))
        assert "outlier_batch" in f.evidence["harm"] and f.severity == "warning", norm
        assert set(f.evidence["harm"]) <= {"outlier_batch", "far"}
        assert "step 5 itself jumped" in f.detail
        # ... where no clip bounded its update: clipped at 1, no harm to show (a notice); a clip whose bound is
        # above the norm bounded nothing (a warning still)
        view = _view([50.0] * 4 + [norm] + [50.0] * 7, [1.0] * 4 + [30.0] + [1.0] * 7, clipped=True, clip_max=1.0)
        assert "outlier_batch" not in _exploding(view).evidence["harm"]
        loose = _view([50.0] * 4 + [norm] + [50.0] * 7, [1.0] * 4 + [30.0] + [1.0] * 7, clipped=True, clip_max=1e6)
        assert _exploding(loose).severity == "warning"


def test_the_update_row_is_not_healthy_beside_a_layer_the_update_rewrote():
    """A small head beside a large body: the whole model moved 0.4x, the head 2x its weights. The row says which
    layer was rewritten and is a notice (as far as the findings go), as it is for a whole-model rewrite; the same
    run with every layer under 1x stays healthy."""
    from fastgrad.diagnose.finding import Finding
    from fastgrad.diagnose.result import _summary

    def up_row(layers, ratio=0.4, findings=(Finding("spike", "notice", "t", "d"),)):
        v = _view([1.0] * 10)
        v.ctx["updates"] = [{"step": 3, "series": 0, "lr": 0.5, "ratio": ratio, "layers": layers}]
        return next(r for r in _summary(v, list(findings), ["stable"], None, False)
                    if r[0].startswith("Update/weight"))
    _, text, st = up_row({"body": 0.3, "head": 2.0})
    assert st == "notice" and "layer head moved 2x its weights at step 3" in text
    assert up_row({"body": 0.3, "head": 0.99})[2] == "healthy"
    assert up_row({"body": 0.3, "head": math.inf})[2] == "healthy"     # an all-zero layer: no ratio to judge
    assert up_row({"body": 0.3, "head": 2.0}, findings=())[2] == "healthy"   # no finding to rate it by
    _, text, st = up_row({"body": 0.3, "head": 2.0}, ratio=1.2)
    assert st == "notice" and "that step rewrote the weights" in text and "layer head" not in text


def test_a_far_norm_is_harm_only_beyond_what_its_loss_explains():
    """A squared error's gradient grows with the square root of its loss: a step whose loss is 400x its level
    (a deeper draw of a dynamic model) has a norm 20x its level and nothing else wrong. That norm is not far; a
    norm 20x its level beside a loss 100x its level (sqrt: 10x) is twice what the loss explains, and is."""
    flat = [1.0 + 0.01 * (i % 3) for i in range(12)]

    def harm(norm_ratio, loss_ratio):
        norms = [150.0] * 6 + [150.0 * norm_ratio] + [150.0] * 5
        losses = flat[:6] + [flat[6] * loss_ratio] + flat[7:]
        return _exploding(_view(norms, losses)).evidence["harm"]
    assert "far" not in harm(20.0, 400.0) and "far" not in harm(20.0, 4.1)
    assert "far" in harm(20.0, 3.9) and "far" in harm(20.0, 1.0)


def test_a_loss_jump_is_the_harm_of_a_norm_that_stood_out_of_its_level():
    """Where every step is above the guide's 100 (a loss summed over the batch), a loss jump after a step whose
    norm was the run's usual one is not that gradient's doing: its update was of the usual size. It counts after
    a step whose norm was the spike rule's 3x its level or more (or at the first step, no level yet). A rewrite's
    harm is its update's, whatever the norm."""
    from fastgrad.diagnose.rules.trends import SPIKE_RATIO

    assert SPIKE_RATIO == 3.0

    def judged(ratio, at=8):
        norms = [200.0] * 7 + [200.0 * ratio] + [200.0] * 6
        losses = [1.0 + 0.01 * (i % 3) for i in range(14)]
        losses[at] = 30.0          # the loss of the step after step ``at``
        return _exploding(_view(norms, losses))
    # (the jumped step's own loss is the outlier batch of a step above 100: a warning either way, read as
    # that, not as the damage of the step before it)
    assert "loss_jump" not in judged(1.0).evidence["harm"]
    assert "loss_jump" not in judged(SPIKE_RATIO * 0.99).evidence["harm"]
    assert "loss_jump" in judged(SPIKE_RATIO).evidence["harm"]
    # ... at the run's first step there is no level yet: the jump after it counts
    assert "loss_jump" in _exploding(_view([200.0] * 6, [1.0, 30.0, 1.0, 1.0, 1.0, 1.0])).evidence["harm"]


def test_critical_needs_damage_beside_a_far_norm():
    # the same far norm above 1000 (10x a level of 150): alone a notice (one outlier batch that nothing
    # followed, as a spike with no damage is); with damage at it (a loss jump at the step after, a NaN from it
    # on, an update of 1x the weights) critical
    norms = [150.0] * 5 + [1500.0] + [150.0] * 6
    flat = [1.0] * 12
    alone = _exploding(_view(norms, flat))
    assert alone.severity == "notice" and alone.evidence["harm"] == ["far"]
    assert "no damage seen" in alone.title and "but no damage followed" in alone.detail
    jump = flat[:6] + [30.0] + flat[7:]
    f = _exploding(_view(norms, jump))
    assert f.severity == "critical" and set(f.evidence["harm"]) == {"far", "loss_jump"}
    assert _exploding(_view(norms, flat[:7] + [math.nan] * 5)).severity == "critical"
    assert _exploding(_view(norms, flat, updates=[(6, 1.0)])).severity == "critical"
    # the same far norm above 100 only: alone a notice, with a loss jump after it a warning
    low = [15.0] * 5 + [150.0] + [15.0] * 6
    assert _exploding(_view(low, flat)).severity == "notice"
    assert _exploding(_view(low, jump)).severity == "warning"
    # an outlier batch (its own loss jumped, the next did not, no clip bounded it): a warning at either tier
    own = flat[:5] + [30.0] + flat[6:]
    f = _exploding(_view([15.0] * 5 + [1500.0] + [15.0] * 6, own))
    assert f.severity == "warning" and "outlier_batch" in f.evidence["harm"]
    # the warning's title names the tier the norm reached and does not blame the learning rate
    assert "above 1000" in f.title and "learning rate" not in f.title


@pytest.mark.parametrize("history", [1, 5])
def test_far_above_the_runs_own_level_sits_at_its_ratio(history):
    lim = RunLimits()
    assert lim.far_ratio == 10.0 and lim.far_history == 1
    base = [150.0] * history
    flat = [1.0] * (history + 4)

    def harm(ratio):
        return _exploding(_view(base + [150.0 * ratio] + [150.0] * 3, flat)).evidence["harm"]
    # the ratio decides whether the norm is far (alone a notice either way: no damage to show)
    assert harm(lim.far_ratio) == ["far"] and harm(lim.far_ratio * 0.99) == []
    # the level is the median of the norms before the step, not their mean: one earlier outlier does not move it
    if history == 5:
        out = [150.0, 150.0, 150.0, 150.0, 1e5]
        f = _exploding(_view(out + [1600.0] + [150.0] * 3, flat))
        assert "far" in f.evidence["harm"]


def test_no_clipping_is_a_warning_beside_any_damage_of_the_norm():
    """A norm above 100 that nothing followed leaves ``no_clipping`` a notice ("no clip is needed for it");
    a spike with damage after it (its advice: clip) makes it a warning, as a harmful explosion does, so the
    advice never both asks for a clip and says none is needed."""
    from fastgrad.diagnose.rules.red_flags import NO_CLIPPING
    from fastgrad.diagnose.finding import Finding

    view = _view([15.0] * 5 + [150.0] + [15.0] * 6)
    view.findings = [_exploding(view)]
    assert view.findings[0].severity == "notice"
    (nc,) = NO_CLIPPING.evaluate(view)
    assert nc.severity == "notice"
    for code in ("spike", "exploding"):
        view.findings = [Finding(code, "warning", "", evidence={"harm": ["loss_jump"]})]
        (nc,) = NO_CLIPPING.evaluate(view)
        assert nc.severity == "warning" and nc.evidence["harm"] == ["loss_jump"]
    view.findings = [Finding("spike", "notice", "", evidence={"harm": []})]
    assert NO_CLIPPING.evaluate(view)[0].severity == "notice"


def test_the_runs_own_level_is_the_median_of_its_last_50_norms():
    # 30 steps at 1000 then 30 at 150: the last 50 are mostly 150, so 1600 is 10x their median (the whole
    # history's median, 575, would not make it far)
    assert "far" in _exploding(_view([1000.0] * 30 + [150.0] * 30 + [1600.0], [1.0] * 61)).evidence["harm"]
    # ... and not a shorter window: 8 recent steps at 1000 do not set the level of the 50
    assert "far" in _exploding(_view([150.0] * 45 + [1000.0] * 8 + [1600.0], [1.0] * 54)).evidence["harm"]
    # the window's length both ways: 26 at 150 then 24 at 1000 are the last 50 (median 150, far); a window of
    # 48 or less holds as many 1000s as 150s or more (median 575 or 1000, not far) ...
    assert "far" in _exploding(_view([150.0] * 45 + [1000.0] * 24 + [1600.0], [1.0] * 70)).evidence["harm"]
    # ... and 40 at 1000 before 26 at 150: the last 50 are mostly 150 (far); a window of 52 or more is not
    assert "far" in _exploding(_view([1000.0] * 40 + [150.0] * 26 + [1600.0], [1.0] * 67)).evidence["harm"]


def test_a_loss_jump_is_harm_from_its_own_level():
    lim = RunLimits()
    norms = [200.0] * 3 + [600.0] + [200.0] * 4    # step 4 stood 3x above its level: the jump at 5 is its harm

    def harm(jump):
        losses = [2.0] * 4 + [2.0 * jump] + [2.0] * 3
        return _exploding(_view(norms, losses)).evidence["harm"]
    assert "loss_jump" in harm(lim.far_ratio) and harm(lim.far_ratio * 0.99) == []
    # a signed objective has no level to jump from
    assert _exploding(_view(norms, [-1.0, 1.0, -1.0, 1.0, 30.0, -1.0, 1.0, -1.0])).evidence["harm"] == []


def test_a_loss_jump_must_stand_out_of_its_swings_in_ratio():
    """A loss that routinely swings 10-100x between steps (summed over a model whose depth is drawn per step)
    has a linear spread small beside its peaks: a routine peak is not a jump. The bound is ``LOG_Z`` robust
    std of the logarithms above their median: a history alternating 1 / 10 has log-median (0 + ln 10)/2, log
    MAD ln(10)/2, so a jump needs exp(ln(10)/2 x (1 + 3 x 1.4826)), about 529 (the linear test alone: 32)."""
    from fastgrad.diagnose.rules.trends import LOG_Z, LOSS_JUMP, detect_loss_jumps, robust_jumps

    assert LOG_Z == LOSS_JUMP["log_z"] == 3.0
    alt = [1.0 if i % 2 else 10.0 for i in range(40)]
    bound = math.exp(math.log(10) / 2 * (1 + LOG_Z * 1.4826))

    def jumps(v, **kw):
        return robust_jumps(list(range(1, 42)), alt + [v], new_after=0, **(LOSS_JUMP | kw))
    assert jumps(bound * 1.01) and not jumps(bound * 0.99)
    # the nearest wrong variant, the linear test alone, calls a 60x peak of this history a jump
    assert jumps(60.0, log_z=None) and not jumps(60.0)
    # the monitor's loss_spike reads the same rule
    assert not detect_loss_jumps(list(range(1, 42)), alt + [60.0])
    assert detect_loss_jumps(list(range(1, 42)), alt + [bound * 1.01])
    # a steady loss: the log spread is floored at ln 1.05, so the linear rule's 3x minimum still decides
    flat = [2.0] * 40
    assert robust_jumps(list(range(1, 42)), flat + [6.0], new_after=0, **LOSS_JUMP)
    # as harm: a loss spread evenly in ratio over 1 - 100 (median 10): a peak of 160 is 16x the median, past
    # both linear routes (the robust jump and the far ratio), but under 3 log-std; a steady loss's 16x is a jump
    swing = [10 ** ((i % 21) / 10) for i in range(40)]
    norms = [200.0] * 39 + [600.0, 200.0]          # step 40 stood 3x above its level
    assert "loss_jump" not in _exploding(_view(norms, swing + [160.0])).evidence["harm"]
    assert robust_jumps(list(range(1, 42)), swing + [160.0], new_after=0, **(LOSS_JUMP | {"log_z": None}))
    assert "loss_jump" in _exploding(_view(norms, [10.0] * 40 + [160.0])).evidence["harm"]
    # the far route alone (before the robust rule's warm-up of 10 values): the same test in ratio
    short = [1.0, 100.0, 3.0, 30.0, 10.0, 1.0, 100.0]
    over = [50.0] * 6 + [200.0, 50.0]     # the norm over 100 at step 7, the jump at step 8 (its update's)
    assert _exploding(_view(over, short + [160.0])).evidence["harm"] == []
    assert "loss_jump" in _exploding(_view(over, [10.0] * 7 + [160.0])).evidence["harm"]


def test_a_loss_that_rises_beyond_its_noise_is_harm():
    from fastgrad.diagnose.rules.evidence import loss_change

    lim = RunLimits()
    wig = [0.02 if i % 2 else -0.02 for i in range(40)]
    c = loss_change([2.0 + w for w in wig], window=lim.stall_window, z=lim.stall_z, rel=0.01)
    need = c["need"]
    for k, rose in ((1.05, True), (0.95, False)):
        vals = [2.0 + w for w in wig[:30]] + [2.0 + w + k * need for w in wig[30:]]
        assert loss_change(vals, window=lim.stall_window, z=lim.stall_z, rel=0.01)["rose"] is rose
        f = _exploding(_view([200.0] * 40, vals))
        assert ("loss_rose" in f.evidence["harm"]) is rose and f.severity == ("warning" if rose else "notice")


def test_the_loss_noise_is_the_scaled_mad_of_its_differences():
    """The step-to-step noise is 1.4826 x the MAD of the successive differences about their mean, over sqrt(2):
    a loss alternating 2 -/+ 0.02 over 41 values has differences of exactly +-0.04 (mean 0, MAD 0.04), so its
    noise is 1.4826 x 0.04 / sqrt(2), and a rise counts from ``stall_z`` standard errors of it."""
    from fastgrad.diagnose.rules.evidence import loss_change

    lim = RunLimits()
    vals = [2.0 + (0.02 if i % 2 else -0.02) for i in range(41)]
    c = loss_change(vals, window=lim.stall_window, z=lim.stall_z, rel=0.0)
    assert c["noise"] == pytest.approx(1.4826 * 0.04 / math.sqrt(2), rel=1e-9)
    assert c["se"] == pytest.approx(c["noise"] * math.sqrt(2 / 10), rel=1e-9)


def test_a_rising_norm_is_a_warning_only_with_harm():
    from fastgrad.diagnose.rules.norm_trends import NORM_TRENDS

    norms = [20.0 * (1 + 5 * i / 100) for i in range(100)]
    flat = [1.0 + 0.01 * (i % 2) for i in range(100)]

    def sev(**kw):
        return {f.code: f.severity for f in NORM_TRENDS.evaluate(_view(norms, flat, **kw))}["increasing"]
    assert sev() == "notice"
    assert sev(updates=[(40, RunLimits().blowup_update)]) == "warning"
    # a spike inside the rise is the spike's own finding, not harm of the rise
    spiked = list(norms)
    spiked[60] *= 30
    got = {f.code: f.severity for f in NORM_TRENDS.evaluate(_view(spiked, flat))}
    assert got["spike"] == "notice" and got["increasing"] == "notice"   # and no damage at the spike either


def test_a_spike_is_a_warning_from_the_far_ratio_with_damage_at_it():
    """A spike 10x its recent median is a warning only where the run shows damage at it: the loss jumping at
    the step after, NaN/Inf from it on, a measured update of 1x the weights there. A spike a clip bounded
    (or Adam absorbed) leaves the loss where it was: a notice, as is any spike under 10x."""
    from fastgrad.diagnose.rules.norm_trends import NORM_TRENDS

    lim = RunLimits()

    def spike(ratio, jump_at=None, nan_from=None, rewrite_at=None):
        norms = [1.0] * 40
        norms[30] = ratio                      # step 31
        losses = [1.0 + 0.01 * (i % 3) for i in range(40)]
        if jump_at is not None:
            losses[jump_at - 1] = 30.0
        if nan_from is not None:
            losses[nan_from - 1:] = [math.nan] * (40 - nan_from + 1)
        ups = [(rewrite_at, 1.0)] if rewrite_at is not None else ()
        return next(f for f in NORM_TRENDS.evaluate(_view(norms, losses, updates=ups)) if f.code == "spike")
    assert spike(lim.far_ratio).severity == "notice" and "no damage seen" in spike(lim.far_ratio).title
    for kw in ({"jump_at": 32}, {"nan_from": 33}, {"rewrite_at": 32}):
        f = spike(lim.far_ratio, **kw)
        assert f.severity == "warning" and "Damage the run shows" in f.detail, kw
    # a loss jump at the spike itself (its cause, not its effect), two steps after, a rewrite elsewhere: not
    # the spike's damage
    assert spike(lim.far_ratio, jump_at=31).severity == "notice"
    assert spike(lim.far_ratio, jump_at=33).severity == "notice"
    assert spike(lim.far_ratio, rewrite_at=20).severity == "notice"
    # the ratio still decides first: under 10x with damage is a notice
    assert spike(lim.far_ratio * 0.99, jump_at=32).severity == "notice"


def test_a_spikes_damage_follows_a_spike_of_the_far_ratio_and_raises_the_loss_above_its_own():
    """The damage that makes a spike a warning is the loss jumping after a spike of ``far_ratio`` or more (not
    after one of the many 3-5x spikes a replay-buffer run has), to above the loss of the spike's own step. A
    loss that was already that high at the spike (a hard batch, a PPO batch its next epoch reuses) was high
    before the update: its next value is no damage of it."""
    from fastgrad.diagnose.rules.norm_trends import NORM_TRENDS

    lim = RunLimits()

    def spike(norms, losses):
        return next(f for f in NORM_TRENDS.evaluate(_view(norms, losses)) if f.code == "spike")

    base = [1.0 + 0.01 * (i % 3) for i in range(40)]
    # a 4x spike at step 25 and the loss jumping at step 26; the 12x spike at step 33 leaves the loss alone
    norms = [1.0] * 40
    norms[24], norms[32] = 4.0, 1.2 * lim.far_ratio
    losses = list(base)
    losses[25] = 30.0
    f = spike(norms, losses)
    assert f.steps == [25, 33] and f.severity == "notice" and "no damage seen" in f.title
    # the same jump after the 12x spike is its damage
    losses = list(base)
    losses[33] = 30.0
    assert spike(norms, losses).severity == "warning"
    # a hard batch at the 12x spike (step 33's own loss 30), its next step's loss 25 or 35
    for after, sev in ((25.0, "notice"), (35.0, "warning")):
        losses = list(base)
        losses[32], losses[33] = 30.0, after
        assert spike(norms, losses).severity == sev, after


def test_a_loss_coming_back_from_a_target_networks_hard_copy_shows_no_damage():
    """A DQN's hard copy of its target network every N steps moves the targets under the loss: it jumps at the
    sync and comes back over the following steps, its gradients with it. A loss jump in that return is the
    targets', not the doing of a spike's update; the same jump with no sync before it, or after a sync whose loss
    did not jump (a Polyak average, every step), is damage."""
    from fastgrad.diagnose.rules.base import RunView
    from fastgrad.diagnose.rules.norm_trends import NORM_TRENDS

    lim = RunLimits()
    losses = [0.05 + 0.005 * (i % 3) for i in range(80)]
    norms = [1.0 + 0.05 * (i % 4) for i in range(80)]
    for i in range(40, 60):                       # step 41: the sync's jump, coming back by step 60
        losses[i] = 0.05 + 2.6 * 0.7 ** (i - 40)
    losses[40] += 2.0
    norms[47] = 1.5 * lim.far_ratio               # a 15x spike at step 48 while the loss comes back...
    losses[48] = 5.0                              # ...and a jump at step 49 above step 48's loss

    def spike(syncs):
        v = _view(norms, losses)
        v.ctx["target_syncs"] = list(syncs)
        return next(f for f in NORM_TRENDS.evaluate(v) if f.code == "spike" and 48 in f.steps)
    assert spike([]).severity == "warning"
    assert spike([41]).severity == "notice"
    assert spike([40]).severity == "notice"          # the copy made just before the step that read it
    assert spike([20]).severity == "warning"         # a copy long before, its loss never jumped
    flat = list(losses)
    flat[40:42] = [0.05, 0.05]                     # a sync whose loss did not jump (an average): no transient,
                                                   # whatever the loss does later
    v = _view(norms, flat)
    v.ctx["target_syncs"] = [41]
    assert next(f for f in NORM_TRENDS.evaluate(v) if f.code == "spike" and 48 in f.steps).severity == "warning"


def test_a_spikes_damage_must_top_the_excursion_the_loss_was_in():
    """The loss after a spike is its damage only above every loss of the excursion the spike's step was in (back
    to the last loss at its level): tianshou's DQN loss jumps 49x at a hard copy of its target network and comes
    back over twenty steps; a spike on the way down with a next loss below that peak did no damage. The nearest
    wrong variant, the spike step's own loss alone, reads it as damage."""
    from fastgrad.diagnose.rules.norm_trends import NORM_TRENDS

    lim = RunLimits()
    losses = [0.05 + 0.005 * (i % 3) for i in range(80)]
    norms = [1.0 + 0.05 * (i % 4) for i in range(80)]
    for i in range(40, 60):                       # step 41 jumps, coming back by step 60
        losses[i] = 0.05 + 2.6 * 0.7 ** (i - 40)
    norms[47] = 1.5 * lim.far_ratio               # a 15x spike at step 48 on the way down
    for after, sev in ((losses[47] * 1.5, "notice"), (losses[40] * 1.1, "warning")):
        ls = list(losses)
        ls[48] = after                            # step 49: above step 48's loss; above or below step 41's peak
        f = next(f for f in NORM_TRENDS.evaluate(_view(norms, ls)) if f.code == "spike" and 48 in f.steps)
        assert f.severity == sev, after


def test_a_spike_of_one_of_several_optimizers_is_named_by_the_runs_step_number():
    """Every finding and the report's table number steps across all optimizers. A spike of the second of two
    interleaved optimizers is named by that number (its 31st step is the run's step 62), in its steps and its
    words, and the warm-up still counts that optimizer's own first 20 steps (a spike at its 15th step, the run's
    30th, is not judged)."""
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.rules.base import RunView
    from fastgrad.diagnose.rules.norm_trends import NORM_TRENDS

    def run(at):
        steps = []
        for i in range(40):
            for k in range(2):
                n = 10.0 if (k == 1 and i == at) else 1.0
                steps.append(StepRecord(step=len(steps) + 1, series=k, total_norm=n, loss=1.0 + 0.01 * (i % 3),
                                        has_loss=True, numel=10))
        return [f for f in NORM_TRENDS.evaluate(RunView(steps=steps, names=["a", "b"])) if f.code == "spike"]
    (f,) = run(30)
    assert f.steps == [62] and "step 62: norm 10" in f.detail and "step 62" in f.title and f.detail.startswith("b: ")
    assert "step 31" not in f.detail
    assert run(14) == []
    # an optimizer none of whose steps was read has no trend, and costs the other its none
    only_a = [StepRecord(step=i + 1, series=0, total_norm=10.0 if i == 30 else 1.0, loss=1.0, has_loss=True,
                         numel=10) for i in range(40)]
    (f,) = [f for f in NORM_TRENDS.evaluate(RunView(steps=only_a, names=["a", "b"])) if f.code == "spike"]
    assert f.steps == [31] and f.evidence["series"] == 0


def test_the_spike_spread_is_the_scaled_mad():
    """The robust spread behind a spike is 1.4826 x the median absolute deviation from the median (the std of
    normal noise): a history alternating 0.5 / 1.5 has median 1, MAD 0.5, spread 0.741, so with z = 6 a spike
    needs 1 + 6 x 0.741 = 5.448 (above the 3x minimum ratio)."""
    from fastgrad.diagnose.rules.trends import detect_trends

    alt = [0.5 if i % 2 else 1.5 for i in range(40)]
    bound = 1.0 + 6.0 * 1.4826 * 0.5

    def spikes(v):
        return [f for f in detect_trends(list(range(1, 42)), alt + [v]) if f.code == "spike"]
    assert spikes(bound * 1.005) and not spikes(bound * 0.995)
    # the spread is floored at 5% of the median (a constant history is not spread 0): it decides where the
    # minimum ratio does not, e.g. a monitor asked for spikes from 1x (1 + 6 x 0.05 = 1.3)
    flat = [1.0] * 40

    def low(v):
        return [f for f in detect_trends(list(range(1, 42)), flat + [v], spike_ratio=1.0) if f.code == "spike"]
    assert low(1.31) and not low(1.29)


def test_mostly_zero_counts_the_dense_gradients_only():
    """mostly_zero is over the dense gradients: an embedding (row-sparse, whether or not every row was looked
    up) is left out of the share, in both directions."""
    import torch

    import fastgrad

    def report(rows_touched, dense_zero):
        emb = torch.nn.Embedding(1000, 8)
        lin = torch.nn.Linear(10, 10)
        emb.weight.grad = torch.zeros(1000, 8)
        emb.weight.grad[:rows_touched] = 1.0
        lin.weight.grad = torch.ones(10, 10)
        lin.weight.grad.view(-1)[:dense_zero] = 0
        lin.bias.grad = torch.ones(10)
        named = [("emb.weight", emb.weight), ("lin.weight", lin.weight), ("lin.bias", lin.bias)]
        return fastgrad.gradient_report(named, row_sparse=["emb.weight"])
    # an embedding with few rows looked up: mostly zero, but not dense: the dense share (50%) stays under 75%
    assert "mostly_zero" not in report(10, 55).codes()
    # an embedding every row of which was looked up (all nonzero) does not dilute a dense share of 91%
    assert "mostly_zero" in report(1000, 100).codes()


def _losses_view(losses):
    return _view([1.0 + 0.01 * (i % 3) for i in range(len(losses))], losses)


def test_the_loss_starts_at_the_smaller_of_its_first_value_and_first_three_median():
    from fastgrad.diagnose.rules.loss_diverging import LOSS_DIVERGING

    def sev(losses):
        got = LOSS_DIVERGING.evaluate(_losses_view(losses))
        return got[0].severity if got else None
    # one odd first batch (high): the start is the median of the first three, 1.2, so 12.5 is 10x it
    assert sev([3.0, 1.2, 1.1] + [12.5] * 9) == "critical"
    # a low first loss: the start is that first value, 1.0, so 10.5 is 10x it (the median of three, 5, is not)
    assert sev([1.0, 5.0, 5.0] + [10.5] * 9) == "critical"
    # the median of three, not of five: 1.2 -> 11.5 is under 10x (rising, a warning); from 1.1 it would be over
    assert sev([3.0, 1.2, 1.0, 1.1, 1.1] + [11.5] * 9) == "warning"


def test_a_loss_that_blows_up_in_the_last_quarter_and_ends_there_is_diverging():
    from fastgrad.diagnose.rules.loss_diverging import LOSS_DIVERGING

    def found(losses):
        return LOSS_DIVERGING.evaluate(_losses_view(losses))
    # 3.5e4 for most of the run, then up at every step to the end: the last quarter's median alone misses it
    (f,) = found([3.5e4] * 30 + [1e6, 1e9, 9.3e15])
    assert f.severity == "critical" and f.evidence["first_step"] == 31 and "to the end of the run" in f.detail
    assert f.evidence.get("variant") is None  # a sudden late blow-up is not a bootstrapped climb
    # two steps up at the end are enough (the rule's hold), one is not; a rise that came back down is not it
    assert found([3.5e4] * 30 + [1e6, 1e9])[0].severity == "critical"
    assert found([3.5e4] * 31 + [1e9]) == []
    assert found([3.5e4] * 30 + [1e6, 1e9, 3e4]) == []
    # the level it rose from is the run's before it, not its first value alone: a noisy loss (a TD critic's,
    # 0.002 - 0.06) whose first value was low by chance, ending on three values above 3x that first value but
    # under 3x the median before them, is not rising; the same three from a steady level of 0.005 are
    noisy = [0.0012, 0.0079, 0.0035, 0.0022, 0.007, 0.0093, 0.0049, 0.007, 0.0081, 0.0058, 0.0636, 0.0316, 0.0297,
             0.0504, 0.0247, 0.0041, 0.0032, 0.0037, 0.02, 0.003, 0.0165, 0.0271, 0.0138, 0.0108, 0.0094, 0.002,
             0.0013, 0.0072, 0.0071, 0.0053, 0.0011, 0.0034, 0.0056, 0.0021, 0.0021, 0.0007, 0.0006]
    end = [0.0076, 0.005, 0.0166]
    def worst(losses):
        return max((f.severity for f in found(losses)), key=["notice", "warning", "critical"].index, default=None)
    assert worst(noisy + end) in (None, "notice")
    assert worst(noisy + [0.0166, 0.017, 0.0176]) in (None, "notice")   # under 3x the median before (0.0058)
    assert worst(noisy + [0.018, 0.019, 0.02]) == "warning"
    assert worst([0.0012] + [0.001] * 36 + end) == "warning"


def test_never_learns_needs_two_steps_and_tells_zero_from_unused():
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.rules.base import RunView
    from fastgrad.diagnose.rules.never_learns import NEVER_LEARNS

    lim = RunLimits()
    assert lim.never_learns_steps == 2

    def run_(live):
        return RunView(steps=[StepRecord(step=1, total_norm=1.0, numel=10)], ctx={"live": live})
    n = 2
    live = {"a.weight": (0, n, n, 0), "b.weight": (0, n, 0, 0), "c.weight": (0, n, n, 1)}
    (f,) = NEVER_LEARNS.evaluate(run_(live))
    assert f.severity == "warning" and f.evidence["zero"] == ["a.weight"] and f.evidence["unused"] == ["b.weight"]
    assert f.layers == ["a.weight", "b.weight"]
    (g,) = NEVER_LEARNS.evaluate(run_({"b.weight": (0, n, 0, 0)}))
    assert g.severity == "warning" and "never uses" in g.title and g.evidence["zero"] == []
    assert NEVER_LEARNS.evaluate(run_({"a.weight": (0, n - 1, n - 1, 0)})) == []


def test_layers_of_depth():
    from fastgrad.diagnose.collect.snapshot import depth_of

    assert depth_of("rnn.weight_ih_l0") == depth_of("rnn.bias_hh_l0_reverse") == "rnn.l0"
    assert depth_of("lstm.weight_hr_l3") == "lstm.l3" and depth_of("weight_ih_l2") == "l2"
    assert depth_of("encoder.layers.3.self_attn.in_proj_weight") == "encoder.layers.3"
    assert depth_of("blocks.0.mlp.0.weight") == "blocks.0" and depth_of("0.weight") == "0"
    assert depth_of("head.proj.weight") == "head.proj" and depth_of("start") == "start"


def test_a_nan_gradient_is_not_a_zero_one(tmp_path):
    """never_learns counts a gradient as nonzero when its norm is not 0: a NaN gradient (the NaN findings' to
    report) is not "zero at every step"; a zero one is."""
    script = tmp_path / "nan_grad.py"
    script.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.0)\n"
        "for step in range(4):\n"
        "    opt.zero_grad()\n"
        "    net(torch.randn(8, 4)).pow(2).mean().backward()\n"
        "    net[0].weight.grad.fill_(float('nan'))\n"
        "    net[0].bias.grad.zero_()\n"
        "    opt.step()\n")
    r = checked_run(str(script), [], tmp_path / "t.json")
    assert finding(r, "never_learns")["evidence"]["zero"] == ["0.bias"]
    assert "nonfinite" in codes(r) or "nonfinite_history" in codes(r)


def test_the_cause_comes_first_whatever_its_rank():
    """A cause moves before the first finding that follows from it, in the report and in its advice, even when
    the effect is more severe or earlier (an accumulation's growth flagged at step 1, its cause from step 2)."""
    from fastgrad.diagnose.advice import advise
    from fastgrad.diagnose.consistency import link_causes
    from fastgrad.diagnose.finding import Finding, place_causes

    effect = Finding("exploding", "critical", "above 1000", "", steps=[1], evidence={"series": 0, "harm": ["far"]})
    other = Finding("lr_zero", "critical", "lr 0", "", steps=[1])
    cause = Finding("no_zero_grad", "warning", "never zeroed", "", steps=[2])
    found = place_causes(link_causes([effect, other, cause]))
    assert [f.code for f in found] == ["no_zero_grad", "exploding", "lr_zero"]
    assert effect.evidence["follows"] == "no_zero_grad" and "follows from `no_zero_grad`" in effect.detail
    assert [c for c, _, _ in advise(found)] == ["no_zero_grad", "exploding", "lr_zero"]
    # a never-learning tensor before a dead finding about it (the last step's, evaluated first)
    dead = Finding("dead", "warning", "dead", "", ["0.weight"])
    never = Finding("never_learns", "warning", "never", "", ["0.weight"], evidence={"zero": ["0.weight"]})
    assert [f.code for f in place_causes(link_causes([dead, never]))] == ["never_learns", "dead"]


def _rollouts_view(*, env="gymnasium", calls=500, every=2, at=(3, 3), outlier=None, to=12.0, episodes=False):
    """An on-policy agent's critic: 6 rollouts, each fitted for 40 steps. A rollout brings returns the critic has
    not fitted (its first batches' losses stand 5x above the fit to the rollout before, and its norms with
    them); within it the loss comes back down. ``every``: the calls of a model before every step (the update's
    own forwards: an actor and a critic); ``calls``: those of the rollout, more before each rollout's first step
    (0: a DQN, acting as often before each step); ``episodes``: the calls before each step vary, 20 to 79 (a
    policy gradient updating once per episode, of that many steps). At
    ``at`` (rollout, step within it) a norm 5x its level, and at the next step a loss 12x the fit to the
    rollout before (``to``), above every loss of the rollout so far. ``outlier``: (rollout, step) of a batch whose loss is
    100x the fit to the rollout before and whose norm is 30x its level (an extreme batch)."""
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.rules.base import RunView

    steps = []
    for p in range(6):
        base = 1.0 + 0.2 * p
        for j in range(40):
            loss = base * (1.0 + 4.0 * math.exp(-j / 4)) * (1.0 + 0.05 * (j % 3))
            norm = 20.0 * math.sqrt(loss / base) * (1.0 + 0.05 * (j % 4))
            if (p, j) == at:
                norm *= 5.0
            if (p, j - 1) == at:
                loss = to * base
            if (p, j) == outlier:
                loss, norm = 100.0 * base, 600.0
            steps.append(StepRecord(step=len(steps) + 1, total_norm=norm, loss=loss, has_loss=True, numel=10,
                                    calls=(20 + (37 * len(steps)) % 60 if episodes else
                                           every + (calls if j == 0 else 0))))
    return RunView(steps=steps, ctx={"updates": [], "environment": env})


def test_an_on_policy_agents_loss_is_judged_against_its_own_rollout():
    """DRL-Pytorch's PPO fits its critic to each new rollout's returns: the first batches of a rollout are new
    to it, and their losses and norms stand far above its fit to the rollout before. A loss that jumps there
    after a standing-out norm is the new data's, not that update's damage: each loss is compared with the losses
    since the rollout began, not the level before it. A rollout is a burst of calls of a model before a step (with
    gradients on or off), in a run that steps an environment and most of whose steps follow the same number of
    calls. The nearest wrong variants keep the harm: no environment, a model called as often before every step
    (a DQN), a burst one call short, calls that vary from step to step (a policy gradient updating once per
    episode), and a jump late in the rollout, on data the critic has fitted, above every loss of the rollout before it
    (one below the highest of its first pass is a minibatch of the rollout's rare states)."""
    from fastgrad.diagnose.rules.evidence import data_refreshes, harm_of

    lim = RunLimits()
    view = _rollouts_view()
    assert data_refreshes(view, 0) == [1, 41, 81, 121, 161, 201]
    assert data_refreshes(_rollouts_view(calls=lim.refresh_calls), 0) == [1, 41, 81, 121, 161, 201]
    # the shortest rollout read as one: 16 calls (a vector environment's shortest usual one is some hundreds)
    assert data_refreshes(_rollouts_view(calls=16), 0) and not data_refreshes(_rollouts_view(calls=15), 0)
    assert "loss_jump" not in {k for k, _ in harm_of(view, 0).at([124], usual_ok=False)}
    assert _exploding(_rollouts_view()).severity == "notice"
    wrong = {"no environment": _rollouts_view(env=None), "a model called as often before every step": _rollouts_view(calls=0),
             "one call short": _rollouts_view(calls=lim.refresh_calls - 1),
             "calls that vary from step to step": _rollouts_view(episodes=True),
             "late in its rollout": _rollouts_view(at=(3, 25))}
    for what, v in wrong.items():
        s = 121 + (25 if what == "late in its rollout" else 3)
        assert "loss_jump" in {k for k, _ in harm_of(v, 0).at([s], usual_ok=False)}, what
        assert _exploding(v).severity == "warning", what
    assert data_refreshes(_rollouts_view(calls=0), 0) == [] and data_refreshes(_rollouts_view(env=None), 0) == []
    assert data_refreshes(_rollouts_view(episodes=True), 0) == []
    # the update's own forwards are the usual count, whatever it is: none, or several models
    assert data_refreshes(_rollouts_view(every=0), 0) == data_refreshes(_rollouts_view(every=20), 0) == \
        [1, 41, 81, 121, 161, 201]
    # late in a rollout, a loss 4x the rollout's level but below its first pass's highest is the data's
    late = _rollouts_view(at=(3, 25), to=4.5)
    assert 147 not in harm_of(late, 0).jumps and 147 in harm_of(_rollouts_view(at=(3, 25), to=6.0), 0).jumps
    assert 147 in harm_of(_rollouts_view(at=(3, 25), to=4.5, env=None), 0).jumps
    assert _exploding(late).severity == "notice"
    # an extreme batch among a rollout's first ten has no level on its data to stand out of; later it has
    assert 126 not in harm_of(_rollouts_view(outlier=(3, 5)), 0).jumps
    assert 136 in harm_of(_rollouts_view(outlier=(3, 15)), 0).jumps


def test_an_agents_outlier_transition_is_no_corrupt_batch():
    """Lizhi-sjtu's one-step A2C updates its critic on each transition: at an episode's end the TD target stops
    bootstrapping and that transition's loss stands 100x and more above the others, its norm with it. In a run
    that steps an environment such a step, with no damage after it, is a hard state (a notice), not an unclipped
    outlier batch (a warning). Without an environment the same step is an outlier batch, a target the run moves
    (an EMA teacher of a supervised run) or not; and with one, a loss that jumps at the next step keeps its
    damage."""
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.rules.base import RunView

    def view(env, damage=False, targets=()):
        loss = [0.5 + 0.05 * (i % 3) for i in range(80)]
        norm = [5.0 + 0.5 * (i % 4) for i in range(80)]
        loss[49], norm[49] = 90.0, 200.0                 # step 50: an episode's end
        if damage:
            loss[50] = 120.0                              # step 51: the loss after its update
        steps = [StepRecord(step=i + 1, total_norm=n, loss=v, has_loss=True, numel=10)
                 for i, (v, n) in enumerate(zip(loss, norm))]
        return RunView(steps=steps, ctx={"updates": [], "environment": env, "moving_targets": list(targets)})
    f = _exploding(view("gym"))
    assert f.severity == "notice" and f.evidence["harm"] == ["hard_batch"], f.detail
    for targets in ((), ("Teacher",)):
        f = _exploding(view(None, targets=targets))
        assert f.severity == "warning" and f.evidence["harm"] == ["outlier_batch"], f.detail
    f = _exploding(view("gym", damage=True))
    assert f.severity == "warning" and "loss_jump" in f.evidence["harm"], f.detail


def _tailed(every: int, n: int = 120):
    """Losses near 1 with a high one (60 to 400, in turn) every ``every`` steps, their norms 40-60 (a mixture: an
    agent's terminal transitions); other norms near 10. Every 6: each quarter of the run holds the same highs."""
    losses = [1.0 + 0.05 * (i % 5) for i in range(n)]
    norms = [10.0 + 0.3 * (i % 4) for i in range(n)]
    for k, i in enumerate(range(3, n, every)):
        losses[i] = (60.0, 400.0, 150.0, 250.0, 90.0)[k % 5]
        norms[i] = 40.0 + (i % 20)
    return norms, losses


def test_a_loss_whose_tail_is_routine_is_judged_against_its_tail():
    """Where more than a tenth of the last 50 losses stand 60-400x the median (an A2C's terminal transitions), a
    loss inside that tail after a norm of 150 is no jump: no harm to read. The nearest wrong variants keep it: the same tail under a tenth of the window, fewer than 50 losses before the jump, and a loss
    min_ratio times above the tail's level. The loss_spike rule reads the same bar."""
    from fastgrad.diagnose.rules.evidence import harm_of
    from fastgrad.diagnose.rules.trends import LOSS_JUMP, TAIL_SHARE, detect_loss_jumps

    def case(every, at=100, to=None, scale=None):
        norms, losses = _tailed(every)
        base = losses[max(0, at - 50):at]               # the (up to) 50 losses before step at + 1
        tail = statistics.median(sorted(base)[-(int(len(base) * TAIL_SHARE) + 1):])   # the top tenth and one
        norms[at - 1] = 150.0
        losses[at] = to if to is not None else scale * LOSS_JUMP["min_ratio"] * tail
        return _view(norms, losses), at + 1, base, tail

    def jumped(v, s):  # the harm read at the spike's step: a loss jump after it
        return s in harm_of(v, 0).jumps and "loss_jump" in {k for k, _ in harm_of(v, 0).at([s - 1], usual_ok=False)}

    v, s, base, tail = case(6, scale=0.95)
    assert sum(x >= 60 for x in base) > 5 and tail > 40       # the premise: over a tenth of the window is the tail
    assert not jumped(v, s) and not jumped(*case(6, to=485.0)[:2])
    wrong = {"a tail under a tenth": case(13, to=485.0), "a short history": case(6, at=40, to=485.0),
             "above the tail": case(6, scale=1.05)}
    for what, (v, s, base, tail) in wrong.items():
        assert jumped(v, s), what
    # the monitor's loss_spike: the routine highs are jumps only until a full window has read the tail
    norms, losses = _tailed(6)
    late = [s for f in detect_loss_jumps(range(1, 121), losses) for s in f.steps if s > 53]
    assert late == []
    norms, losses = _tailed(13)
    assert [s for f in detect_loss_jumps(range(1, 121), losses) for s in f.steps if s > 53]


def test_one_rewrite_the_run_learnt_past_is_no_damage_to_an_explosion():
    """patrickloeber's linear regression: targets in the hundreds, SGD at lr 0.01 from a near-zero weight. Its first
    norm is 141 and its first update moves the weight 1.5x its size; the loss then falls from 5000 to 410 (its
    noise floor). update_rewrote calls that one step a notice; exploding must not take it for the gravest harm.
    The nearest wrong variants keep it as harm, in both rules: the rewrite recurs, the loss never comes back below
    its value at the rewrite, the loss does not improve, the loss jumps after it."""
    from fastgrad.diagnose.rules.rewrite import UPDATE_REWROTE

    n = 100
    falling = [5000.0 * 0.975 ** i + 400.0 + 3.0 * (i % 3) for i in range(n)]
    norms = [141.0 * 0.98 ** i + 5.0 for i in range(n)]
    cases = {
        "learnt past": (falling, [(1, 1.5)], "notice"),
        "recurs": (falling, [(1, 1.5), (2, 1.2)], "critical"),
        "not recovered": ([3000.0] + [5000.0 * 0.975 ** i + 4000.0 for i in range(1, n)], [(1, 1.5)], "critical"),
        "flat": ([5000.0 + 30.0 * (i % 3) for i in range(n)], [(1, 1.5)], "critical"),
    }
    for what, (losses, ups, sev) in cases.items():
        v = _view(norms, losses, updates=ups)
        ex = _exploding(v)
        assert ex.severity == sev, (what, ex.detail)
        assert ("rewrite" in ex.evidence["harm"]) == (sev == "critical"), what
        if sev == "notice":   # its no-harm text says what the rewrite was, never that there was none
            assert "the one update that rewrote the weights (1.5x, step 1) the run learnt past" in ex.detail
            assert "no update rewrote" not in ex.detail
        (rw,) = UPDATE_REWROTE.evaluate(_view(norms, losses, updates=ups))
        assert rw.severity == ("notice" if sev == "notice" else "warning"), what
    jumped = list(falling)
    jumped[1] = 40.0 * falling[0]                   # the loss at step 2, after the rewrite's update
    v = _view(norms, jumped, updates=[(1, 1.5)])
    assert _exploding(v).severity == "critical" and "rewrite" in _exploding(v).evidence["harm"]
    assert UPDATE_REWROTE.evaluate(v)[0].severity == "warning"
