"""Classes of run that ``python -m fastgrad.check`` mis-judged on scripts nobody here had used: each as a small
real script (tests/check_scripts/) that records its own float64 truth without fastgrad, and each rule tested
against its nearest wrong variant on hand-built records."""

import math

import pytest
import torch

from fastgrad.diagnose.advice import advise
from fastgrad.diagnose.collect.steps import StepRecord
from fastgrad.diagnose.finding import Finding
from fastgrad.diagnose.rules.base import RunView
from fastgrad.diagnose.rules.evidence import own_level
from fastgrad.diagnose.rules.lr_schedule import LR_SCHEDULE, lr_trouble
from fastgrad.diagnose.thresholds import RunLimits

from .check_runs import checked_once, codes, finding, row

_cache: dict = {}


def run(tmp_path_factory, name, *args):
    return checked_once(_cache, tmp_path_factory, name, *args)


_LR_UP_DOWN = ("lr'] *= ", "lower the learning rate", "raise the learning rate", "raise it", "lower it")


def no_lr_advice_on(r, code):
    """The finding ``code`` follows a cause: neither its title nor its advice tells the user to move the lr."""
    f = finding(r, code)
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == code)
    for text in (f["title"], rec["text"], rec["code_to_add"]):
        assert not any(p in text for p in _LR_UP_DOWN), (code, text)


# ---------------------------------------------------------------------------------------------- lr schedules
def test_lr_trouble_sits_between_its_rule_and_the_nearest_wrong_variants():
    lim = RunLimits()
    kw = dict(collapse=lim.lr_collapse, share=lim.lr_collapse_share)
    n = 40
    # a cosine annealed to 0 at its last step: below 1e-3 of its peak only at its last step or two: not a collapse
    cos = [(i + 1, 0.1 * (1 + math.cos(math.pi * i / (n - 1))) / 2) for i in range(n)]
    assert lr_trouble(cos, **kw) is None
    # the tail below the bound: just a quarter of the steps is a collapse, one step fewer is not
    q = int(lim.lr_collapse_share * n)
    tail = lambda k: [(i + 1, 0.1) for i in range(n - k)] + [(n - k + i + 1, 0.1 * lim.lr_collapse * 0.9)  # noqa: E731
                                                             for i in range(k)]
    assert lr_trouble(tail(q), **kw)["variant"] == "collapse" and lr_trouble(tail(q), **kw)["step"] == n - q + 1
    assert lr_trouble(tail(q - 1), **kw) is None
    # ... and the bound itself: 1.1x the collapse share of the peak is not below it
    up = [(i + 1, 0.1) for i in range(n - q)] + [(n - q + i + 1, 0.1 * lim.lr_collapse * 1.1) for i in range(q)]
    assert lr_trouble(up, **kw) is None
    # a warm-up from 0 has its small values before the peak: not a collapse
    assert lr_trouble([(i + 1, 0.1 * min(1.0, i / 30)) for i in range(n)], **kw) is None
    # negative: one step below 0 is enough, and 0 itself is not negative
    neg = lr_trouble([(1, 0.1), (2, 0.05), (3, -1e-9), (4, 0.05)], **kw)
    assert neg["variant"] == "negative" and neg["step"] == 3 and neg["count"] == 1
    assert lr_trouble([(1, 0.1), (2, 0.05), (3, 0.0), (4, 0.05)], **kw) is None


def _lr_view(lrs):
    steps = [StepRecord(step=i + 1, has_loss=True, loss=1.0, total_norm=1.0, lr=v) for i, v in enumerate(lrs)]
    return RunView(steps=steps, lrs=[lrs[-1]])


def test_lr_schedule_severities():
    neg = LR_SCHEDULE.evaluate(_lr_view([0.1, 0.05, -0.05, -0.1]))
    assert [(f.severity, f.evidence["variant"], f.steps) for f in neg] == [("critical", "negative", [3])]
    col = LR_SCHEDULE.evaluate(_lr_view([0.1 * 0.1 ** i for i in range(12)]))
    assert [(f.severity, f.evidence["variant"], f.steps) for f in col] == [("warning", "collapse", [5])]


def test_a_schedule_that_collapses_the_lr_is_named_and_never_multiplied_up(tmp_path_factory):
    r = run(tmp_path_factory, "lr_schedule_collapse.py")
    truth = r["truth"]["steps"]
    for s, t in zip(r["json"]["steps"], truth):  # the lr each step ran with, as the schedule set it
        assert s["lr"] == pytest.approx(t["lr"], rel=1e-12)
    f = r["json"]["findings"][0]
    first = next(t for t in truth if t["lr"] < 1e-3 * truth[0]["lr"])
    assert f["code"] == "lr_schedule" and f["severity"] == "warning" and f["evidence"]["variant"] == "collapse"
    assert f["steps"] == [first["step"]] and f["evidence"]["lr"] == pytest.approx(first["lr"])
    assert row(r, "Learning rate")["status"] == "warning" and r["rc"] == 0
    assert finding(r, "stall")["evidence"]["follows"] == "lr_schedule"
    no_lr_advice_on(r, "stall")
    assert "*= 100" not in r["md"] and "raise it" not in r["md"]
    # the advice steps the script's own scheduler (``sched``), not a ``scheduler`` the script does not have
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "lr_schedule")
    assert "sched.step()" in rec["code_to_add"] and "scheduler.step()" not in rec["code_to_add"]


def test_a_negative_lr_is_critical_and_the_divergence_names_the_lr_in_force(tmp_path_factory):
    r = run(tmp_path_factory, "lr_schedule_collapse.py", "--negative")
    truth = {t["step"]: t for t in r["truth"]["steps"]}
    f = r["json"]["findings"][0]
    first = min(s for s, t in truth.items() if t["lr"] < 0)
    assert f["code"] == "lr_schedule" and f["severity"] == "critical" and f["steps"] == [first]
    assert r["rc"] == 1 and row(r, "Learning rate")["status"] == "critical"
    # the updates that made the weights NaN are not measured as a ratio: the row says so and is not "healthy"
    bad = min(int(s) for s, t in truth.items() if not math.isfinite(float(t["loss"])))
    up = row(r, "Update/weight ratio")
    assert up["status"] == "critical" and f"not finite from step {bad}" in up["value"]
    d = finding(r, "loss_diverging")
    s1 = d["steps"][0]
    assert f"The learning rate was {truth[s1]['lr']:g} at step {s1}" in d["detail"]  # in force there, not the last
    for code in ("loss_diverging", "exploding", "spike"):
        assert finding(r, code)["evidence"]["follows"] == "lr_schedule"
        no_lr_advice_on(r, code)


# ---------------------------------------------------------------------------------------------- rewrites
def _upd_view(ratios, lr=0.5, losses=None):
    losses = losses or [1.0] * len(ratios)
    steps = [StepRecord(step=i + 1, has_loss=True, loss=v, total_norm=1.0, lr=lr) for i, v in enumerate(losses)]
    ups = [{"step": i + 1, "series": 0, "lr": lr, "ratio": v, "layers": {}} for i, v in enumerate(ratios)]
    return RunView(steps=steps, lrs=[lr], ctx={"updates": ups})


def test_update_rewrote_sits_at_one_weights_size():
    from fastgrad.diagnose.rules.rewrite import UPDATE_REWROTE
    lim = RunLimits()
    assert not UPDATE_REWROTE.evaluate(_upd_view([0.01, lim.blowup_update * 0.999, 0.01]))
    got = UPDATE_REWROTE.evaluate(_upd_view([0.01, lim.blowup_update, 0.01, float("nan")]))
    assert [(f.severity, f.steps, f.evidence["lr"]) for f in got] == [("warning", [2], 0.5)]
    assert got[0].evidence["harm"] == ["no_progress"]   # a flat loss: the run did not learn past it


def _layer_view(layers, ratios, measured=None, losses=None):
    """``layers``: per step, {layer: update/weight ratio}; ``ratios``: the whole model's; ``measured``: the steps
    measured (default: all)."""
    v = _upd_view(ratios, lr=30.0, losses=losses)
    keep = set(measured or range(1, len(ratios) + 1))
    v.ctx["updates"] = [dict(u, layers=layers[i]) for i, u in enumerate(v.ctx["updates"]) if u["step"] in keep]
    return v


def test_a_rewrite_begins_where_an_unbroken_run_of_layer_rewrites_before_it_began():
    """A small head rewritten at 5x while a large body keeps the whole model under 1x: the rewrite that reaches
    the whole model at step 3 began at step 1. Its nearest wrong variants: a layer just under 1x, a gap (an
    update that rewrote no layer, or one not measured), a layer of all-zero weights (inf), a step after."""
    from fastgrad.diagnose.rules.rewrite import UPDATE_REWROTE, layer_rewrite_before
    one = RunLimits().blowup_update
    whole = [0.6, 0.9, 2.0, 0.3]
    big = [{"head": 5.0, "body": 0.2}, {"head": 3.0, "body": 0.5}, {"head": 2.0, "body": 2.0}, {"head": 0.1}]
    assert layer_rewrite_before(_layer_view(big, whole), 0, 3) == (1, "head", 5.0)
    # the finding's first step (what other findings are ordered by) and its lr are the layer's; the whole-model
    # list of steps is unchanged
    f = UPDATE_REWROTE.evaluate(_layer_view(big, whole))[0]
    assert f.evidence["first_step"] == 1 and f.steps == [3] and "It began at step 1" in f.detail
    assert "`head` by 5x" in f.detail and "first at step 3" in f.detail
    at_bound = [{"head": one}, {"head": one}, {"head": 2.0}, {}]
    assert layer_rewrite_before(_layer_view(at_bound, whole), 0, 3) == (1, "head", one)
    under = [{"head": 5.0}, {"head": 0.999 * one, "body": 0.5}, {"head": 2.0}, {}]
    assert layer_rewrite_before(_layer_view(under, whole), 0, 3) is None
    assert UPDATE_REWROTE.evaluate(_layer_view(under, whole))[0].evidence["first_step"] == 3
    # an early blip the next update does not repeat began nothing: only step 2 counts
    blip = [{"head": 5.0}, {"head": 0.5}, {"head": 2.0}, {}]
    assert layer_rewrite_before(_layer_view(blip, whole), 0, 3) is None
    late = [{"head": 0.5}, {"head": 1.5}, {"head": 2.0}, {}]
    assert layer_rewrite_before(_layer_view(late, whole), 0, 3) == (2, "head", 1.5)
    # step 2 not measured: nothing is known of it, so nothing began before step 3
    assert layer_rewrite_before(_layer_view(big, whole, measured=[1, 3, 4]), 0, 3) is None
    zero = [{"head": math.inf}, {"head": math.inf}, {"head": 2.0}, {}]
    assert layer_rewrite_before(_layer_view(zero, whole), 0, 3) is None
    nan = [{"head": 5.0}, {"head": math.nan}, {"head": 2.0}, {}]
    assert layer_rewrite_before(_layer_view(nan, whole), 0, 3) is None


def test_a_divergence_that_crossed_after_a_layer_was_rewritten_follows_the_rewrite():
    """The loss crosses its ratio at step 2, the whole model is rewritten at step 2, the head already at step 1:
    the update of step 1 raised the loss of step 2, so the divergence follows the rewrite. Without the head's
    rewrite at step 1 the divergence came first."""
    from fastgrad.diagnose.consistency import link_causes
    from fastgrad.diagnose.finding import place_causes
    from fastgrad.diagnose.rules.rewrite import UPDATE_REWROTE
    whole = [0.6, 2.0, 1.2, 0.3]
    for layers, first in (([{"head": 5.0}, {"head": 2.0}, {}, {}], "update_rewrote"),
                          ([{"head": 0.9}, {"head": 2.0}, {}, {}], "loss_diverging")):
        rw = UPDATE_REWROTE.evaluate(_layer_view(layers, whole, losses=[1.0, 5.0, 9.0, 9.0]))[0]
        rise = Finding("loss_diverging", "warning", "the loss is rising: the learning rate is the first suspect", "",
                       steps=[2], evidence={"series": 0, "first_step": 2, "rewrite": [2, 2.0]})
        got = place_causes(link_causes([rise, rw]))
        assert got[0].code == first, layers


def test_update_rewrote_is_a_warning_when_it_recurs_or_harms_and_a_notice_for_one_step_the_run_learnt_past():
    """Adam's first step on small weights moves each by about the learning rate (a ratio near 1 once), and the
    run learns on: a notice. A second rewrite, or harm from it on, makes it a warning."""
    from fastgrad.diagnose.rules.rewrite import UPDATE_REWROTE
    n = 24
    falls = [2.0 * 0.93 ** i for i in range(n)]
    once = [1.2] + [0.01] * (n - 1)
    twice = [1.2, 0.01, 1.1] + [0.01] * (n - 3)
    sev = lambda ratios, losses: [f.severity for f in UPDATE_REWROTE.evaluate(_upd_view(ratios, losses=losses))]  # noqa: E731
    assert sev(once, falls) == ["notice"]
    assert sev(twice, falls) == ["warning"]
    assert sev(once, [1.0] * n) == ["warning"]                       # the loss did not improve
    rises = [1.0 + 0.1 * i for i in range(n)]
    assert sev(once, rises) == ["warning"]                           # the loss rose over the run
    nan_after = falls[:5] + [float("nan")] + falls[6:]
    assert sev(once, nan_after) == ["warning"]                       # a NaN from the rewrite on
    # a loss that falls from the blow-up the rewrite began (its quarter means improve) but ends above its value
    # at the rewrite: harm; ending just under the margin (1% of that value: the loss's progress rule) is not
    for end, want in ((1.0 * 1.015, "warning"), (1.0 * 1.005, "notice")):
        up = [1.0, 6.0, 5.0, 4.0, 3.0, 2.5, 2.0] + [end] * (n - 7)
        got = UPDATE_REWROTE.evaluate(_upd_view(once, losses=up))
        assert [f.severity for f in got] == [want], (end, got)
        assert ("not_recovered" in got[0].evidence["harm"]) == (want == "warning")


def test_one_adam_step_that_rewrote_small_weights_is_a_notice_the_run_learnt_past(tmp_path_factory):
    """Adam's first step moves each weight by about the learning rate: on weights a tenth of torch's default
    that is several times their size. The run learns past it (a notice, exit 0); at 10x the learning rate the
    loss blows up from that step and never comes back to its first value (a warning that says so)."""
    r = run(tmp_path_factory, "adam_first_step.py", "--lr", "0.05")
    t = r["truth"]["steps"]
    assert [x["step"] for x in t if x["update"] >= 1] == [1]                      # once, at step 1
    assert sum(x["loss"] for x in t[-15:]) / 15 < 0.5 * t[0]["loss"]              # and it learnt
    f = finding(r, "update_rewrote")
    assert f["severity"] == "notice" and f["evidence"]["harm"] == [] and r["rc"] == 0
    assert not codes(r, "warning") and not codes(r, "critical")
    hi = run(tmp_path_factory, "adam_first_step.py", "--lr", "0.5")
    t = hi["truth"]["steps"]
    assert [x["step"] for x in t if x["update"] >= 1] == [1]
    assert sum(x["loss"] for x in t[-15:]) / 15 > 1.5 * t[0]["loss"]              # ended above its start
    f = finding(hi, "update_rewrote")
    assert f["severity"] == "warning" and "not_recovered" in f["evidence"]["harm"]
    assert row(hi, "Loss (first -> last step)")["status"] != "healthy"


def test_an_update_that_rewrote_the_weights_is_a_finding_with_its_lr(tmp_path_factory):
    r = run(tmp_path_factory, "update_rewrites.py")
    truth = {t["step"]: t for t in r["truth"]["steps"]}
    ups = r["json"]["updates"]
    for u in ups:  # the measured ratios are the truth's, float64 from plain reads
        assert u["ratio"] == pytest.approx(truth[u["step"]]["update"], rel=1e-5)
    want = [u["step"] for u in ups if truth[u["step"]]["update"] >= 1]
    assert want and max(t["loss"] for t in truth.values()) < 10  # the premise: it rewrote, and it did not blow up
    f = finding(r, "update_rewrote")
    assert f["severity"] == "warning" and f["steps"] == want and r["rc"] == 0
    assert f["evidence"]["lr"] == truth[want[0]]["lr"] and f"learning rate of {truth[want[0]]['lr']:g}" in f["detail"]
    assert row(r, "Update/weight ratio")["status"] == "warning"


def test_an_explosion_made_critical_by_a_rewrite_names_the_tier_its_norm_reached():
    """A norm of 150 at step 1 and that step's update 900x the weights (a VAE's summed loss at SGD lr 30), after
    which the loss climbs: critical for the rewrite, and its title says "above 100", never "above 1000" (the norm
    never was)."""
    from fastgrad.diagnose.rules.exploding import EXPLODING
    for norm, tier in ((150.0, "above 100:"), (1500.0, "above 1000:")):
        v = _upd_view([900.0] + [0.01] * 7, lr=30.0, losses=[572.0 + 40.0 * i for i in range(8)])
        v.steps[0].total_norm = norm
        f, = EXPLODING.evaluate(v)
        assert f.severity == "critical" and tier in f.title, (norm, f.title)
        assert ("1000" in f.title) == (norm > 1000)


def _rewrite_and_rise(rewrite_step, rise_step, *, series=(0, 0), quoted=True, rise_sev="critical"):
    rw = Finding("update_rewrote", "warning", "rewrote", "", steps=[rewrite_step],
                 evidence={"series": series[0], "first_step": rewrite_step, "rewrite": [rewrite_step, 2.0]})
    ev = {"series": series[1], "first_step": rise_step} | ({"rewrite": [rewrite_step, 2.0]} if quoted else {})
    return rw, Finding("loss_diverging", rise_sev, "the loss is diverging: the learning rate is the first suspect",
                       "", steps=[rise_step], evidence=ev)


def test_the_first_of_a_rewrite_and_a_divergence_is_the_others_cause():
    """The update of step s is applied after step s's loss: a rewrite at step s can raise only the losses of later
    steps. So a rewrite before the step the loss crossed its divergence ratio is the divergence's cause (first,
    and the divergence drops its guess at the learning rate); a rewrite at that step or after it is the
    divergence's evidence, and follows it."""
    from fastgrad.diagnose.consistency import link_causes
    from fastgrad.diagnose.finding import place_causes
    rw, rise = _rewrite_and_rise(2, 3)
    got = place_causes(link_causes([rise, rw]))
    assert [f.code for f in got] == ["update_rewrote", "loss_diverging"]
    assert rise.evidence["follows"] == "update_rewrote" and "follows" not in rw.evidence
    assert "first suspect" not in rise.title
    for r_step in (3, 4):   # at the crossing step (the nearest wrong variant: <=) and after it
        rw, rise = _rewrite_and_rise(r_step, 3)
        got = place_causes(link_causes([rise, rw]))
        assert [f.code for f in got] == ["loss_diverging", "update_rewrote"], r_step
        assert rw.evidence["follows"] == "loss_diverging" and "follows" not in rise.evidence
    # another optimizer's rewrite, a divergence that quotes none, or the bootstrapped notice: no link either way
    for kw in (dict(series=(0, 1)), dict(quoted=False), dict(rise_sev="notice")):
        rw, rise = _rewrite_and_rise(1, 3, **kw)
        link_causes([rise, rw])
        assert "follows" not in rw.evidence and "follows" not in rise.evidence, kw


def test_an_update_that_replaced_the_weights_before_the_loss_rose_is_named_first(tmp_path_factory):
    """SGD at lr=8 under a clip: the first update moves the weights by twice their size, the loss is far up from
    the next step to the end. The first finding is the rewrite, with the lr of its step; the divergence (and the
    explosion after it) follow from it and give no learning-rate advice of their own."""
    r = run(tmp_path_factory, "sgd_rewrite_diverges.py")
    t = r["truth"]["steps"]
    first = int(min(x["step"] for x in t if x["update"] >= 1))
    cross = int(min(x["step"] for x in t if x["loss"] >= 10 * t[0]["loss"]))
    assert first < cross and all(math.isfinite(x["loss"]) for x in t)          # the premise, from plain reads
    assert sorted(x["loss"] for x in t[-10:])[5] > 10 * t[0]["loss"]            # ... and it stayed up
    assert codes(r)[0] == "update_rewrote" and r["rc"] == 1
    f = finding(r, "update_rewrote")
    assert f["evidence"]["first_step"] == first and f["evidence"]["lr"] == t[first - 1]["lr"]
    d = finding(r, "loss_diverging")
    assert d["severity"] == "critical" and d["evidence"]["first_step"] == cross
    assert d["evidence"]["follows"] == "update_rewrote"
    no_lr_advice_on(r, "loss_diverging")
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "update_rewrote")
    assert "lr'] *= 0.1" in rec["code_to_add"]
    ok = run(tmp_path_factory, "sgd_rewrite_diverges.py", "--lr", "0.5")  # the same run at a sane lr
    assert max(x["update"] for x in ok["truth"]["steps"]) < 1
    assert "update_rewrote" not in codes(ok) and not codes(ok, "warning") and ok["rc"] == 0


def _rewrite_then_explosion(rewrite_step, explode_step, *, lr_alone=False, sev="warning", series=(0, 0)):
    rw = Finding("update_rewrote", sev, "rewrote", "", steps=[rewrite_step],
                 evidence={"series": series[0], "first_step": rewrite_step, "rewrite": [rewrite_step, 5.0],
                           "lr_alone": lr_alone})
    ex = Finding("exploding", "critical", "gradient norm above 1000: clip now, lower the learning rate", "",
                 steps=[explode_step], evidence={"series": series[1], "first_step": explode_step})
    return rw, ex


def test_an_explosion_after_an_update_that_rewrote_the_weights_follows_it():
    """Gradients computed on weights an update threw out of range blow up: an explosion whose first step comes
    after the first rewrite follows it. At the rewrite's own step the gradient came first, and it is the
    rewrite's cause unless the learning rate alone made that update (``lr_alone``)."""
    from fastgrad.diagnose.consistency import link_causes
    from fastgrad.diagnose.finding import place_causes
    for kw in (dict(rewrite_step=1, explode_step=2), dict(rewrite_step=2, explode_step=2, lr_alone=True)):
        rw, ex = _rewrite_then_explosion(**kw)
        got = place_causes(link_causes([ex, rw]))
        assert [f.code for f in got] == ["update_rewrote", "exploding"], kw
        assert ex.evidence["follows"] == "update_rewrote" and "learning rate" not in ex.title, kw
    # the nearest wrong variants: the same step with a gradient to blame, a rewrite after the explosion, a rewrite
    # the run learnt past (a notice), another optimizer's
    for kw in (dict(rewrite_step=2, explode_step=2), dict(rewrite_step=3, explode_step=2, lr_alone=True),
               dict(rewrite_step=1, explode_step=2, sev="notice"), dict(rewrite_step=1, explode_step=2,
                                                                       series=(0, 1))):
        rw, ex = _rewrite_then_explosion(**kw)
        got = place_causes(link_causes([ex, rw]))
        assert [f.code for f in got] == ["exploding", "update_rewrote"] and "follows" not in ex.evidence, kw


def test_the_learning_rate_alone_made_an_update_that_a_gradient_within_the_guides_bound_makes_too():
    """``lr_alone``: the update's ratio with the gradient it used scaled down to the guide's bound (100), never
    up: a clipped or ordinary gradient keeps its ratio; an overflowed or unread norm is the gradient's doing."""
    from fastgrad.diagnose.rules.rewrite import lr_alone

    def view(used):
        return RunView(steps=[StepRecord(step=1, has_loss=True, loss=1.0, total_norm=used, lr=30.0)])

    bound, lim = RunView(steps=[]).th.exploding, RunLimits().blowup_update
    assert lr_alone(view(1.0), 0, 1, lim) and not lr_alone(view(1.0), 0, 1, 0.99 * lim)
    assert lr_alone(view(2 * bound), 0, 1, 2 * lim) and not lr_alone(view(2 * bound), 0, 1, 1.98 * lim)
    for used in (math.inf, math.nan, 0.0):
        assert not lr_alone(view(used), 0, 1, 1e9), used


def test_a_nan_born_in_a_module_right_after_an_update_that_rewrote_the_weights_is_the_learning_rates():
    """A module that overflows at the step after an update moved the weights by their own size computes on
    weights thrown out of range: the learning rate's NaN (as one born in the loss there), which follows the
    rewrite. Two steps later, or from the data, it is not."""
    from fastgrad.diagnose.collect.watch import NonFiniteOrigin
    from fastgrad.diagnose.consistency import link_causes
    from fastgrad.diagnose.rules.nonfinite import trace_origin

    def origin(update_step, where="output", ratio=5.0):
        steps = [StepRecord(step=i, has_loss=True, loss=1.0 if i < 3 else math.nan, total_norm=2.0 if i < 3
                            else math.nan, nonfinite=0.0 if i < 3 else 3.0, lr=30.0) for i in (1, 2, 3)]
        view = RunView(steps=steps, ctx={"updates": [{"step": update_step, "series": 0, "lr": 30.0,
                                                      "ratio": ratio, "layers": {}}]})
        view.forward_origin = NonFiniteOrigin("dec.0", "Linear", 2, 0, where)  # step 3, counted from 0
        return trace_origin(view)

    o = origin(2)
    assert o.where == "forward" and o.module == "dec.0" and o.cause == "learning_rate"
    assert "right after the update of step 2" in o.text and "learning rate 30" in o.text
    assert origin(1).cause is None and origin(2, ratio=0.99 * RunLimits().blowup_update).cause is None
    assert origin(2, where="input").where == "input"
    rw = Finding("update_rewrote", "warning", "rewrote", "", steps=[2], evidence={"series": 0, "first_step": 2})
    nan = Finding("nonfinite_loss", "critical", "NaN/Inf loss", "", steps=[3],
                  evidence={"born_at_step": 3, "variant": "learning_rate"})
    link_causes([nan, rw])
    assert nan.evidence["follows"] == "update_rewrote"
    # a NaN traced elsewhere (the data, a log(0)) does not follow an earlier rewrite
    other = Finding("nonfinite_loss", "critical", "NaN/Inf loss", "", steps=[3], evidence={"born_at_step": 3})
    link_causes([other, rw])
    assert "follows" not in other.evidence


def test_a_nan_loss_at_a_skipped_step_is_harm_and_a_skipped_overflow_of_the_gradients_is_not():
    """A GradScaler (or a StepGuard) that skips a step keeps it out of the weights, but a NaN/Inf loss there is
    still harm the run shows: the loss is computed before any loss scale, so the weights or the data made it.
    Gradients that overflowed under the scale, with a finite loss, are the scale's calibration, not harm."""
    from fastgrad.diagnose.rules.evidence import harm_of

    def view(loss, **skip):
        steps = [StepRecord(step=1, has_loss=True, loss=1.0, total_norm=2.0),
                 StepRecord(step=2, has_loss=True, loss=loss, total_norm=math.nan, nonfinite=3.0, **skip),
                 StepRecord(step=3, has_loss=True, loss=1.0, total_norm=2.0)]
        return RunView(steps=steps)

    for skip in (dict(skipped=True), dict(guard_skipped=True)):
        h = harm_of(view(math.nan, **skip), 0)
        assert h.nonfinite == [2] and ("nonfinite", "the loss or the gradients went NaN/Inf at step 2") in \
            h.at([1]), skip
        assert harm_of(view(1.0, **skip), 0).nonfinite == [], skip


def test_skips_protect_a_run_only_if_its_loss_comes_back():
    """A GradScaler or StepGuard that skips NaN-loss steps keeps the weights finite; when the loss is NaN at
    every step to the end (two at least), nothing trains after the first of them, and the run is not called
    protected. A loss that comes back at the last step, or one NaN last step, still is."""
    from fastgrad.diagnose.rules.nonfinite import NONFINITE_LOSS, stuck_from
    from fastgrad.diagnose.rules.skips import GUARD_SKIPPED

    def view(losses, **skip):
        return RunView(steps=[StepRecord(step=i, has_loss=True, loss=v, total_norm=2.0 if math.isfinite(v) else
                                         math.nan, nonfinite=0.0 if math.isfinite(v) else 3.0,
                                         **(skip if not math.isfinite(v) else {}))
                              for i, v in enumerate(losses, 1)])

    nan = math.nan
    for skip in (dict(skipped=True), dict(guard_skipped=True)):
        run = view([1.0, 0.9, nan, nan, nan], **skip)
        assert stuck_from(run) == 3, skip
        f, = NONFINITE_LOSS.evaluate(run)
        assert f.severity == "critical" and not f.evidence["protected"] and f.evidence["stuck_from"] == 3
        assert "protected" not in f.title and "nothing trained" not in f.title and "after step 2" in f.detail
        for losses in ([1.0, 0.9, nan, nan, 0.8], [1.0, 0.9, 0.8, 0.7, nan]):   # came back; one last NaN
            run = view(losses, **skip)
            assert stuck_from(run) is None, (skip, losses)
            f, = NONFINITE_LOSS.evaluate(run)
            assert f.severity == "warning" and f.evidence["protected"] and "protected" in f.title, (skip, losses)
    assert stuck_from(view([1.0, nan, nan])) is None   # steps taken on NaN: not skips that protect anything
    g, = GUARD_SKIPPED.evaluate(view([1.0, nan, nan], guard_skipped=True))
    assert "nothing trained after step 1" in g.detail and "The run is protected" not in g.detail
    g, = GUARD_SKIPPED.evaluate(view([1.0, nan, 1.0], guard_skipped=True))
    assert "The run is protected" in g.detail


# ---------------------------------------------------------------------------------------------- hand-written loops
def test_a_hand_written_loop_that_drops_its_own_gradients_is_not_a_clip_that_zeroes_them(tmp_path_factory):
    """A loop that clips, updates and then sets ``p.grad = None`` itself leaves no gradient to read after its
    last step: that is not a clip that zeroed them. The same loop clipping at 0 still is."""
    r = run(tmp_path_factory, "manual_sgd.py", "--drop-grads")
    t = r["truth"]["steps"]
    assert any(x["raw"] > 2.0 for x in t) and all(x["norm"] > 0 for x in t)   # the clip acted; nothing was zero
    assert "clip_zeroes" not in codes(r) and r["rc"] == 0, codes(r)
    bad = run(tmp_path_factory, "manual_sgd.py", "--drop-grads", "--max-norm", "0")
    assert finding(bad, "clip_zeroes")["severity"] == "critical" and bad["rc"] == 1


@pytest.mark.parametrize("args", [("--clip-first",), ("--clip-first", "--drop-grads")])
def test_a_hand_written_loops_clip_before_backward_finds_no_gradient_and_is_named(args, tmp_path_factory):
    """zero_grad() (or the update) drops the gradients, then the clip runs, then backward(): the clip finds no
    gradient at every step after the first, by plain reads, and check names it with its bound. The same loop
    clipping after backward() is not flagged."""
    r = run(tmp_path_factory, "manual_sgd.py", *args)
    t = r["truth"]["steps"]
    assert all(x["clip_found"] == 0 for x in t)                       # the premise: nothing to clip, ever
    f = finding(r, "clip_after_step")
    assert codes(r)[0] == "clip_after_step" and f["severity"] == "warning"
    assert f["steps"] == list(range(1, len(t))) and f["evidence"]["max_norm"] == 2.0
    assert "before backward()" in f["title"] and "max_norm=2" in f["detail"]
    ok = run(tmp_path_factory, "manual_sgd.py", *[a for a in args if a != "--clip-first"])
    assert all(x["clip_found"] > 0 for x in ok["truth"]["steps"]) and "clip_after_step" not in codes(ok)
    # a second clip, of a model this loop does not train, finds no gradient at every step while the first finds
    # them: idle, not misplaced
    idle = run(tmp_path_factory, "manual_sgd.py", "--idle-clip", *[a for a in args if a != "--clip-first"])
    assert all(x["clip_found"] > 0 for x in idle["truth"]["steps"]) and "clip_after_step" not in codes(idle)
    assert idle["rc"] == 0


def test_a_hand_written_loop_that_never_zeroes_is_named_and_one_that_zeroes_by_hand_is_not(tmp_path_factory):
    """No zero_grad() call at all: check reads what each backward adds to. Never cleared (every backward adds to
    all the ones before, by plain reads) is ``no_zero_grad``, first; cleared by hand after each update
    (``p.grad.zero_()``) is not; cleared by hand every second backward (a window of two) is not either, though
    half its backwards add to the one before (the optimizer loops' rule alone, half the steps, would name it)."""
    never = run(tmp_path_factory, "manual_sgd.py", "--zero", "never")
    t = never["truth"]["steps"]
    assert t[0]["left"] == 0 and all(x["left"] > 0 for x in t[1:])
    f = finding(never, "no_zero_grad")
    assert codes(never)[0] == "no_zero_grad" and f["severity"] == "critical" and never["rc"] == 1
    assert f["evidence"]["count"] == f["evidence"]["of"] == len(t) - 1
    assert "model.zero_grad(set_to_none=True)" in never["json"]["recommendations"][0]["code_to_add"]
    hand = run(tmp_path_factory, "manual_sgd.py", "--zero", "hand")
    assert all(x["left"] == 0 for x in hand["truth"]["steps"])
    # ... and its clip (max_norm=2) is not a clip that zeroes them: read again at the end, after the update, its
    # gradients are the script's own zeros
    assert "no_zero_grad" not in codes(hand) and "clip_zeroes" not in codes(hand) and hand["rc"] == 0, codes(hand)
    two = run(tmp_path_factory, "manual_sgd.py", "--zero", "every2")
    left = [x["left"] > 0 for x in two["truth"]["steps"]]
    assert sum(left) * 2 >= len(left) - 1 and not all(left[1:])
    assert "no_zero_grad" not in codes(two), codes(two)


def _misplaced(first_step, first_norm, first_ratio, bound=1.0, flagged=(1, 2, 3, 4, 5)):
    clip = Finding("clip_after_step", "warning", "clipping after optimizer.step()", "", steps=list(flagged),
                   evidence={"first_step": flagged[0], "count": len(flagged), "max_norm": bound})
    rw = Finding("update_rewrote", "warning", "an update rewrote the weights", "A step that size replaces what "
                 "the weights had learnt: the learning rate is too high for this model at those steps.",
                 steps=[first_step], evidence={"series": 0, "first_step": first_step, "first_norm": first_norm,
                                               "first_ratio": first_ratio, "rewrite": [first_step, first_ratio]})
    return clip, rw


def test_an_update_that_a_misplaced_clip_would_have_bounded_follows_the_clip():
    """The clip runs after step() (misplaced at step s when it ran after step s-1, or at step 1 when it runs so
    every step), the update's gradient was above its max_norm, and scaled to it the update stays under 1x: the
    rewrite follows the clip, and drops its learning-rate claim. Nearest wrong variants: a norm at the bound, an
    update the learning rate alone makes 1x at the bound, a step the clip was not misplaced at, no bound."""
    from fastgrad.diagnose.consistency import link_causes
    from fastgrad.diagnose.finding import place_causes
    one = RunLimits().blowup_update
    for kw in (dict(first_step=2, first_norm=50.0, first_ratio=2.0), dict(first_step=1, first_norm=50.0,
                                                                          first_ratio=2.0),
               dict(first_step=6, first_norm=50.0, first_ratio=49.0 * one)):
        clip, rw = _misplaced(**kw)
        got = place_causes(link_causes([rw, clip]))
        assert [f.code for f in got] == ["clip_after_step", "update_rewrote"], kw
        assert rw.evidence["follows"] == "clip_after_step" and "learning rate is too high" not in rw.detail, kw
    for kw in (dict(first_step=2, first_norm=1.0, first_ratio=2.0), dict(first_step=2, first_norm=50.0,
                                                                         first_ratio=50.0 * one),
               dict(first_step=7, first_norm=50.0, first_ratio=2.0), dict(first_step=2, first_norm=50.0,
                                                                          first_ratio=2.0, bound=None),
               dict(first_step=1, first_norm=50.0, first_ratio=2.0, flagged=(3, 4))):
        clip, rw = _misplaced(**kw)
        link_causes([rw, clip])
        assert "follows" not in rw.evidence, kw


def test_an_explosion_a_misplaced_clip_would_have_bounded_follows_the_clip():
    """A clip before backward() (or after step()) bounds nothing: the norms above the guide's limit reach the
    updates. Where the clip was misplaced at the explosion's first step and its max_norm is below the peak, the
    explosion follows the clip, comes after it and stops asking for a clip the script has. Nearest wrong
    variants: a bound above the peak, a first step the clip was not misplaced at, an overflow (its own cause)."""
    from fastgrad.diagnose.consistency import link_causes
    from fastgrad.diagnose.finding import place_causes

    def pair(first_step=3, peak=4000.0, bound=0.2, flagged=(1, 2, 3, 4, 5), variant=None):
        clip = Finding("clip_after_step", "warning", "clipping after optimizer.step()", "", steps=list(flagged),
                       evidence={"first_step": flagged[0], "count": len(flagged), "max_norm": bound})
        ex = Finding("exploding", "warning", "gradient norm above 1000: clip (max_norm=1.0)", "The norm ...",
                     steps=[first_step], evidence={"series": 0, "first_step": first_step, "peak": peak,
                                                   "harm": ["far"]} | ({"variant": variant} if variant else {}))
        return clip, ex
    for kw in (dict(), dict(first_step=1)):
        clip, ex = pair(**kw)
        got = place_causes(link_causes([ex, clip]))
        assert [f.code for f in got] == ["clip_after_step", "exploding"], kw
        assert ex.evidence["follows"] == "clip_after_step" and "clip (max_norm" not in ex.title, kw
        assert "would have cut these gradients" in ex.detail
    for kw in (dict(bound=5000.0), dict(first_step=8), dict(variant="overflow"), dict(flagged=(4, 5), first_step=1)):
        clip, ex = pair(**kw)
        link_causes([ex, clip])
        assert "follows" not in ex.evidence and "clip (max_norm=1.0)" in ex.title, kw


@pytest.mark.parametrize("summed", [False, True])
def test_a_clip_before_backward_is_told_as_such_and_explains_the_norms_it_missed(summed, tmp_path_factory):
    """zero_grad(); forward; clip; backward(); step(): the clip finds every gradient None. It is titled as a clip
    before backward() (the script's own order), not after step(); with norms in the hundreds and more (a summed loss),
    the explosion follows it, after it, without asking for a clip. The premise by plain reads: the norms the
    updates used, unclipped."""
    r = run(tmp_path_factory, "clip_before_backward.py", *(("--sum",) if summed else ()))
    t = r["truth"]["steps"]
    f = finding(r, "clip_after_step")
    assert f["title"].startswith("clipping before backward()") and "zero_grad()" in f["detail"]
    assert f["evidence"]["max_norm"] == 0.2 and codes(r)[0] == "clip_after_step"
    for s, x in zip(r["json"]["steps"], t):  # the updates used the unclipped gradients
        assert math.isclose(s["total_norm"], x["norm"], rel_tol=1e-4)
    if summed:
        assert min(x["norm"] for x in t) > 100   # the premise: every norm above the guide's 100, far above the clip's 0.2
        ex = finding(r, "exploding")
        assert ex["evidence"]["follows"] == "clip_after_step" and "clip (max_norm" not in ex["title"]
        rec = next(x for x in r["json"]["recommendations"] if x["code"] == "exploding")
        assert "follows from `clip_after_step`" in rec["text"] and "clip_grad_norm_" not in rec["code_to_add"]
    else:
        assert max(x["norm"] for x in t) < 100 and "exploding" not in codes(r)
    # the nearest wrong reading: a clip after step() with the gradients still there keeps its own title
    after = run(tmp_path_factory, "ho_clip_after_step.py")
    assert finding(after, "clip_after_step")["title"] == "clipping after optimizer.step()"


# ---------------------------------------------------------------------------------------------- effect, not cause
@pytest.mark.parametrize("script, cause, effects", [
    ("dead_layer_stall.py", "never_learns", ["stall", "dead"]),  # tensors that never learn: the loss cannot move
    ("ho_never_zero.py", "no_zero_grad", ["stall"]),             # gradients summed over the run
    ("no_zero_grad_growth.py", "no_zero_grad", ["exploding", "increasing"]),
])
def test_an_effect_is_never_advised_as_a_cause(script, cause, effects, tmp_path_factory):
    r = run(tmp_path_factory, script)
    t = r["truth"]["steps"]
    if script == "dead_layer_stall.py":  # the premise: the same three tensors zero at every step
        assert all(x["zero"] == ["0.weight", "0.bias", "2.weight"] for x in t)
    got = codes(r)
    assert got.index(cause) < min(got.index(e) for e in effects)
    for e in effects:
        assert finding(r, e)["evidence"]["follows"] == cause
        no_lr_advice_on(r, e)
    st = next((f for f in r["json"]["findings"] if f["code"] == "stall"), None)
    if st is not None:
        assert "the learning rate is too" not in st["detail"]


# ---------------------------------------------------------------------------------------------- invariant tensors
def test_a_bias_the_loss_is_invariant_to_is_not_a_dead_unit(tmp_path_factory):
    r = run(tmp_path_factory, "wgan_critic_bias.py")
    t = r["truth"]["steps"]
    assert all("4.bias" in x["zero"] for x in t) and len(t) == 60  # the premise: zero by construction at every step
    assert all(any(n not in x["zero"] for x in t) for n in ("0.bias", "2.bias"))  # ... the others are not
    f = finding(r, "never_learns")
    assert f["severity"] == "notice" and f["evidence"]["variant"] == "invariant" and r["rc"] == 0
    assert [n.split(":")[-1] for n in f["layers"]] == ["4.bias"] and f["evidence"]["zero"] == []
    assert "invariant" in f["detail"] and "ReLU" not in f["detail"]
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "never_learns")
    assert not any(w in rec["text"] + rec["code_to_add"] for w in ("initialis", "LeakyReLU", "ReLU"))
    assert "dead" not in codes(r) and r["json"]["status"] == "notice"


def test_the_summary_and_the_advice_tell_the_invariant_bias_and_its_model_as_the_finding_does(tmp_path_factory):
    r = run(tmp_path_factory, "wgan_critic_bias.py")
    # the summary lists the bias as zero by construction, not as never learning
    v = row(r, "Zero-gradient parameters")["value"]
    assert "zero by construction" in v and "4.bias" in v and "never learning" not in v
    # advice about a model's tensors names that model: the critic, not the generator that ran first
    names = r["res"].context["names"]
    assert names["models"] == {"": "gen", "Sequential:": "critic"}
    dead = Finding("never_learns", "warning", "t", layers=["Sequential:0.weight"],
                   evidence={"zero": ["Sequential:0.weight"], "unused": [], "invariant": []})
    (_, _, snippet), = advise([dead], {"names": names, "modules": ["Linear"]})
    assert "critic.named_parameters()" in snippet and "gen" not in snippet
    first = Finding("never_learns", "warning", "t", layers=["0.weight"],
                    evidence={"zero": ["0.weight"], "unused": [], "invariant": []})
    assert "gen.named_parameters()" in advise([first], {"names": names, "modules": ["Linear"]})[0][2]


def test_a_dead_layers_bias_is_not_invariant(tmp_path_factory):
    # its weight's gradient is zero too: a unit that never fires, a warning with the ReLU advice
    f = finding(run(tmp_path_factory, "dead_layer_stall.py"), "never_learns")
    assert f["severity"] == "warning" and f["evidence"]["invariant"] == [] and "0.bias" in f["evidence"]["zero"]


@pytest.mark.parametrize("whole", [False, True])
def test_the_reverse_half_of_a_bidirectional_rnn_read_at_its_last_step_is_told_as_such(whole, tmp_path_factory):
    """Read at the last time step, the reverse direction has taken one step from its zero state: its recurrent
    weight's gradient is zero by plain reads at every step. That is named as what it is (not a dead ReLU), with
    advice in the model's own names that reads h_n; read from h_n, nothing is zero and there is no finding."""
    r = run(tmp_path_factory, "birnn_last_step.py", *(("--whole",) if whole else ()))
    t = r["truth"]["steps"]
    if whole:
        assert all(x["zero"] == [] for x in t)
        assert "never_learns" not in codes(r)
        return
    assert all(x["zero"] == ["lstm.weight_hh_l0_reverse"] for x in t) and len(t) == 30  # the premise
    f = finding(r, "never_learns")
    assert f["severity"] == "warning" and f["evidence"]["variant"] == "reverse_last_step"
    assert f["evidence"]["zero"] == ["lstm.weight_hh_l0_reverse"]
    assert "reverse direction" in f["detail"] and "ReLU" not in f["detail"]
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "never_learns")
    assert "net.lstm(" in rec["code_to_add"] and "h_n[-2], h_n[-1]" in rec["code_to_add"]
    assert "ReLU" not in rec["text"] + rec["code_to_add"]


def test_a_zero_recurrent_weight_is_the_reverse_half_only_when_its_input_weight_learns():
    """The nearest wrong readings: a forward direction's recurrent weight, or a reverse one whose input weight is
    zero too (the whole direction dead), keep the plain never_learns text."""
    from fastgrad.diagnose.rules.never_learns import NEVER_LEARNS
    from fastgrad.diagnose.rules.base import RunView
    from fastgrad.diagnose.collect.steps import StepRecord

    def judged(zero, frozen=()):
        names = ["rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.weight_ih_l0_reverse", "rnn.weight_hh_l0_reverse"]
        live = {n: (0, 30, True, n not in zero) for n in names if n not in frozen}
        steps = [StepRecord(step=i, total_norm=1.0, loss=1.0, has_loss=True, numel=10) for i in range(1, 31)]
        (f,) = NEVER_LEARNS.evaluate(RunView(steps=steps, ctx={"live": live}))
        return f
    told = judged(["rnn.weight_hh_l0_reverse"])
    assert told.evidence.get("variant") == "reverse_last_step" and "reverse direction" in told.detail
    for f in (judged(["rnn.weight_hh_l0"]), judged(["rnn.weight_hh_l0_reverse", "rnn.weight_ih_l0_reverse"]),
              judged(["rnn.weight_hh_l0_reverse", "rnn.weight_hh_l0"]),
              # its input weight frozen: nothing shows the reverse direction learns at all
              judged(["rnn.weight_hh_l0_reverse"], frozen=["rnn.weight_ih_l0_reverse"])):
        assert "variant" not in f.evidence and "reverse direction" not in f.detail and "ReLU" in f.detail


# ---------------------------------------------------------------------------------------------- cut off from the loss
@pytest.mark.parametrize("args, cut, unused", [
    (("--detach",), True, False), (("--no-grad",), True, False), (("--unused",), False, True),
    (("--detach", "--unused"), True, True)])
def test_a_module_that_ran_but_gets_no_gradient_is_cut_off_and_one_never_called_is_unused(args, cut, unused,
                                                                                         tmp_path_factory):
    """The body runs at every step but its output reaches the loss through .detach() (or under no_grad): its
    tensors are cut off from the loss, with the advice to find the cut. A layer built and never called is never
    used, with the advice to call or drop it. The premise, by plain reads: which tensors had no gradient at every
    step, and that the body ran at each."""
    r = run(tmp_path_factory, "cut_off_body.py", *args)
    t = r["truth"]["steps"]
    body = ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"]
    assert all(x["body_ran"] for x in t)
    assert all(set(x["no_grad"]) == set(body * cut + ["aux.weight", "aux.bias"] * unused) for x in t)
    f = finding(r, "never_learns")
    assert f["severity"] == "warning" and f["evidence"]["zero"] == []
    assert f["evidence"]["cut"] == (body if cut else [])
    assert f["evidence"]["unused"] == (["aux.weight", "aux.bias"] if unused else [])
    assert ("no gradient comes back from the loss" in f["title"]) == cut
    if cut and unused:  # the cut tensors lead, the unused ones are counted after them, once
        assert f["title"] == ("4 tensor(s) never learn: their modules run, but no gradient comes back from the "
                              "loss, and 2 are never used")
    assert ("never uses them" in f["title"] or "are never used" in f["title"]) == unused
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "never_learns")["text"]
    assert (".detach()" in rec) == cut and ("call the module that owns them" in rec) == unused
    ok = run(tmp_path_factory, "cut_off_body.py")
    assert "never_learns" not in codes(ok) and ok["rc"] == 0


def _live_view(live, ran, findings=(), updates=None):
    v = RunView(steps=[StepRecord(step=i + 1, has_loss=True, loss=1.0, total_norm=1.0, lr=0.1) for i in range(4)],
                ctx={"live": live, "ran": ran, "updates": updates or []})
    v.findings = list(findings)
    return v


def test_never_learning_tells_zero_cut_and_unused_apart():
    """Absent while its module ran: cut; absent and not run: unused; present and zero: zero, whether its module
    ran or not. A run that cannot tell (a log: ``ran`` None) calls every absent tensor unused."""
    from fastgrad.diagnose.rules.never_learns import NEVER_LEARNS, never_learning
    n = RunLimits().never_learns_steps
    live = {"a.weight": (0, n, n, 0), "b.weight": (0, n, 0, 0), "c.weight": (0, n, 0, 0), "d.weight": (0, n, n, 1)}
    assert never_learning(_live_view(live, ["a.weight", "b.weight"])) == (["a.weight"], ["b.weight"], ["c.weight"])
    assert never_learning(_live_view(live, None)) == (["a.weight"], [], ["b.weight", "c.weight"])
    assert never_learning(_live_view(live, []), covered={0}) == ([], [], [])
    (f,) = NEVER_LEARNS.evaluate(_live_view({"b.weight": (0, n, 0, 0)}, ["b.weight"]))
    assert f.evidence["cut"] == ["b.weight"] and f.evidence["unused"] == [] and "no gradient comes back" in f.title
    (h,) = NEVER_LEARNS.evaluate(_live_view(live, ["a.weight", "b.weight"]))  # all three kinds: the first leads
    assert h.title == ("1 tensor(s) never learn: their gradient is zero at every step, and 1 are cut off, and 1 "
                       "are never used")
    (g,) = NEVER_LEARNS.evaluate(_live_view({"b.weight": (0, n, 0, 0)}, []))
    assert g.evidence["cut"] == [] and g.evidence["unused"] == ["b.weight"] and "never uses" in g.title


def test_tensors_cut_off_from_the_loss_explain_a_flat_loss_and_never_called_ones_do_not():
    """A loss that did not improve is the harm of one rewrite only when nothing in the model's computation
    never learns: tensors cut off (or zero) explain it, in the same optimizer; a layer never called, or another
    optimizer's tensors, do not. The stall follows tensors cut off, as it follows zero ones."""
    from fastgrad.diagnose.consistency import link_causes
    from fastgrad.diagnose.rules.rewrite import UPDATE_REWROTE
    n = RunLimits().never_learns_steps
    ups = [{"step": i + 1, "series": 0, "lr": 0.1, "ratio": r, "layers": {}} for i, r in enumerate([0.1, 1.2, 0.1])]
    for live, ran, sev in (({"b.weight": (0, n, 0, 0)}, ["b.weight"], "notice"),
                           ({"b.weight": (0, n, n, 0)}, [], "notice"),
                           ({"b.weight": (0, n, 0, 0)}, [], "warning"),
                           ({"b.weight": (1, n, 0, 0)}, ["b.weight"], "warning")):
        (f,) = UPDATE_REWROTE.evaluate(_live_view(live, ran, updates=ups))
        assert f.severity == sev and (f.evidence["harm"] == ["no_progress"]) == (sev == "warning"), (live, ran)
        assert ("that is theirs, not this update's" in f.detail) == (sev == "notice"), (live, ran)
    for ev, follows in (({"zero": [], "cut": ["b.weight"], "unused": []}, True),
                        ({"zero": [], "cut": [], "unused": ["b.weight"]}, False)):
        never = Finding("never_learns", "warning", "t", "", ["b.weight"], evidence=ev)
        stall = Finding("stall", "warning", "stall", "", evidence={"series": 0, "first_step": 1})
        link_causes([stall, never])
        assert (stall.evidence.get("follows") == "never_learns") == follows, ev


# ---------------------------------------------------------------------------------------------- frozen tensors
@pytest.mark.parametrize("args,held", [((), False), (("--all-params",), True),
                                       (("--all-params", "--unfreeze", "20"), False)])
def test_frozen_tensors_handed_to_the_optimizer_are_a_notice(args, held, tmp_path_factory):
    r = run(tmp_path_factory, "frozen_first_layer.py", *args)
    t = r["truth"]["steps"]
    frozen_always = all({"0.weight", "0.bias"} <= set(x["no_grad"]) for x in t)   # the premise, by plain reads
    assert frozen_always == (not args or held)
    if held:
        f = finding(r, "frozen_in_optimizer")
        assert f["severity"] == "notice" and sorted(f["layers"]) == ["0.bias", "0.weight"] and r["rc"] == 0
        assert row(r, "Frozen parameters")["status"] == "notice"
        rec = next(x for x in r["json"]["recommendations"] if x["code"] == "frozen_in_optimizer")
        assert "net.named_parameters()" in rec["code_to_add"]
    else:
        # left out of the optimizer (a deliberate freeze), or trained later: not a finding
        assert "frozen_in_optimizer" not in codes(r)


# ---------------------------------------------------------------------------------------------- bootstrapped losses
class _Roots:
    """The watcher's side of ``MovingTargets``: the root modules it found, in order."""

    def __init__(self, *mods):
        import weakref
        self._roots = [weakref.ref(m) for m in mods]


def _targets(*mods, opts=(), loose=()):
    import weakref

    from fastgrad.diagnose.collect.targets import MovingTargets
    t = MovingTargets()
    t._targets_init()
    t.watcher = _Roots(*mods)
    t.watcher._loose = [weakref.ref(m) for m in loose]
    t._opt_refs = [weakref.ref(o) for o in opts]
    t.errors, t.steps_done = [], 1
    return t


def test_moving_targets_are_models_rewritten_in_place_that_no_optimizer_trains():
    import copy

    import torch
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    polyak, copied, frozen, by_hand = (copy.deepcopy(critic) for _ in range(4))
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    t = _targets(critic, polyak, copied, frozen, by_hand, opts=[opt])
    x = torch.randn(16, 4)
    for step in range(3):
        t._note_targets()
        opt.zero_grad()
        critic(x).pow(2).mean().backward()
        opt.step()                                              # held by an optimizer: trained, not a target
        by_hand(x).pow(2).mean().backward()
        with torch.no_grad():
            for p in by_hand.parameters():
                p -= 0.1 * p.grad                               # trained by hand: it has gradients
            for pt, pc in zip(polyak.parameters(), critic.parameters()):
                pt.mul_(0.9).add_(pc, alpha=0.1)                # a Polyak-averaged target network
        if step == 1:
            copied.load_state_dict(critic.state_dict())         # a target network copied now and then
        frozen(x)                                               # a frozen teacher: forwarded, never rewritten
    t._note_targets()
    assert t.targets_moved == ["Sequential", "Sequential"]
    # judged once each, in order; the model trained by hand is forgotten once judged; the critic an optimizer
    # holds is no candidate at all
    assert [e.ref() for e in t._watched] == [polyak, copied, frozen]
    assert [e.state for e in t._watched] == ["moving", "moving", "watching"]
    # the nearest wrong variant: a copy made before the first step is the starting point, not a move
    late = copy.deepcopy(critic)
    t2 = _targets(late)
    late.load_state_dict(critic.state_dict())
    t2._note_targets()
    t2._note_targets()
    assert t2.targets_moved == []
    # a failure to read a module never reaches the script's step: a checker error, and no judgement from it
    class Unreadable(torch.nn.Linear):
        def parameters(self, recurse=True):
            raise RuntimeError("sharded away")
    odd = Unreadable(2, 2)   # held here: the note keeps only a weak reference
    t3 = _targets(odd)
    t3._note_targets()
    assert t3.targets_moved == [] and len(t3.errors) == 1 and "target networks" in t3.errors[0]


def test_a_targets_copies_are_recorded_at_the_steps_they_happened():
    """Each rewrite of a target is a sync at the step boundary that first sees it, as long as the rewrites are
    copies now and then: a hard copy every 10 steps gives those steps. An average every step, or every 5th step
    (the nearest wrong reading: each of its moves an event; REDQ's, whose five optimizers share the step count),
    gives none; the critic an optimizer trains gives none."""
    import copy

    import torch
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    hard, polyak = copy.deepcopy(critic), copy.deepcopy(critic)
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    x = torch.randn(16, 4)

    def run(target, every, steps=40):
        t = _targets(critic, target, opts=[opt])
        for step in range(1, steps + 1):
            t.steps_done = step
            t._note_targets()
            opt.zero_grad()
            critic(x).pow(2).mean().backward()
            opt.step()
            if step % every == 3 % every:
                with torch.no_grad():
                    for pt, pc in zip(target.parameters(), critic.parameters()):
                        pt.mul_(0.5).add_(pc, alpha=0.5)
        t.steps_done = steps + 1
        t._note_targets()
        t._read_targets()
        return t.target_syncs
    assert run(hard, 10) == [4, 14, 24, 34]
    assert run(polyak, 1) == []
    assert run(copy.deepcopy(critic), 5) == []
    assert run(copy.deepcopy(critic), 9, steps=90) == []      # the rule's line: one move in ten steps at most
    # an agent that keeps its target beside its online network in one module (the root the forward reaches):
    # the part no optimizer holds is the candidate, not the root the optimizer trains
    agent = torch.nn.ModuleDict({"q": torch.nn.Linear(4, 2), "q_target": torch.nn.Linear(4, 2)})
    opt2 = torch.optim.Adam(agent["q"].parameters(), lr=1e-3)
    t = _targets(agent, opts=[opt2])
    for step in range(1, 30):
        t.steps_done = step
        t._note_targets()
        opt2.zero_grad()
        agent["q"](x).pow(2).mean().backward()
        opt2.step()
        if step % 10 == 0:
            agent["q_target"].load_state_dict(agent["q"].state_dict())
    t._read_targets()
    assert t.targets_moved == ["Linear"] and t.target_syncs == [11, 21]


def test_targets_written_through_data_are_seen_by_their_values():
    """``target.data.copy_(...)`` bumps no version counter: the values tell, compared on the device with those of
    the step before at every step, and read once after the run. A hard copy through ``.data`` every 10 steps (as
    tianshou and cleanrl copy) gives its syncs; a Polyak average through ``.data`` is a target with none. Beside
    them, the nearest wrong readings: a model trained by hand through ``.data`` (it has gradients), and one
    forwarded and never written."""
    import copy

    import torch
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    polyak, hard, by_hand, still = (copy.deepcopy(critic) for _ in range(4))
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    t = _targets(critic, polyak, hard, by_hand, still, opts=[opt])
    x = torch.randn(16, 4)
    for step in range(1, 42):
        t.steps_done = step
        t._note_targets()
        opt.zero_grad()
        critic(x).pow(2).mean().backward()
        opt.step()
        by_hand(x).pow(2).mean().backward()
        for p in by_hand.parameters():
            p.data.add_(p.grad, alpha=-0.1)                     # a hand-written update through .data
        for pt, pc in zip(polyak.parameters(), critic.parameters()):
            pt.data.copy_(0.9 * pt.data + 0.1 * pc.data)        # Polyak averaging, the cleanrl way
        if step % 10 == 0:
            for pt, pc in zip(hard.parameters(), critic.parameters()):
                pt.data.copy_(pc.data)                          # a hard copy now and then
        still(x)
    assert t.targets_moved == []                                # nothing bumped a version of a target
    t._read_targets()
    assert t.targets_moved == ["Sequential", "Sequential"]
    assert [e.ref() for e in t._watched if e.state == "moving"] == [polyak, hard]
    assert t.target_syncs == [11, 21, 31, 41]                   # the copies made after steps 10, 20, ...
    assert t.errors == []
    # a model on the meta device holds no values to compare: none taken, and nothing to read after the run
    from fastgrad.diagnose.collect.targets import _values
    assert _values(list(torch.nn.Linear(2, 2, device="meta").parameters())) is None


def test_a_target_passed_to_a_policys_forward_is_a_candidate():
    """tianshou keeps its target network beside the policy, not in it, and passes it to the policy's forward
    (``policy(batch, model=self.model_old)``): a module that ran inside a root's forward but is no part of it.
    The watcher records it; the largest such module no optimizer holds is the candidate (its wrapper, not each of
    its layers), and its copies through ``.data`` are its syncs. The nearest wrong variant, roots only, sees no
    target at all."""
    import copy

    import torch

    from fastgrad.diagnose.collect.watch import ForwardWatcher

    class Lagged(torch.nn.Module):          # a wrapper that keeps the target in eval mode
        def __init__(self, m):
            super().__init__()
            self.module = m

        def forward(self, x):
            return self.module(x)

    class Policy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

        def forward(self, x, model=None):
            return (self.model if model is None else model)(x)

    torch.manual_seed(0)
    policy = Policy()
    lagged = Lagged(copy.deepcopy(policy.model))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    x, r = torch.randn(16, 4), torch.randn(16)
    w = ForwardWatcher()
    try:
        t = _targets(opts=[opt])
        t.watcher = w
        for step in range(1, 32):
            if step % 10 == 0:
                for pt, ps in zip(lagged.parameters(), policy.model.parameters()):
                    pt.data.copy_(ps.data)                      # tianshou's full_parameter_update
            with torch.no_grad():
                target = r + 0.9 * policy(x, model=lagged).max(1).values
            loss = (policy(x).max(1).values - target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            t.steps_done = step                                 # the checker's step boundary
            t._note_targets()
    finally:
        w.remove()
    assert [e.ref() for e in t._watched] == [lagged]
    # a target gone before the run's end (a test function's agent, freed as the next test starts) is still read
    import gc
    del lagged, target
    gc.collect()
    assert t._watched[0].ref() is None
    t.steps_done = 32
    t._note_targets()
    t._read_targets()
    assert t.targets_moved == ["Lagged"] and t.target_syncs == [10, 20, 30]
    w._loose = []                                               # roots only: no candidate
    t2 = _targets(policy, opts=[opt])
    t2._note_targets()
    assert t2._watched == []


def _rise_view(targets=(), far_at=None, rewrite=False, jump=True):
    from fastgrad.diagnose.collect.steps import StepRecord
    # a TD loss that starts near 0 and passes 10x its start at its second step, its norm growing 40x with it
    loss = [6e-4, 9e-3] + [0.01 * (1 + i / 4) for i in range(38)]
    norm = [3.0 * (1 + i) for i in range(40)]   # up to 120: above the modest bound
    if far_at is not None:   # just past the far rule's bound, beyond what the loss's own rise there explains
        rise = loss[far_at] / own_level(loss, far_at, RunLimits.far_history)
        norm[far_at] = RunLimits.far_ratio * 1.01 * rise ** 0.5 * own_level(norm, far_at, RunLimits.far_history)
        if jump:   # ... and the loss jumping at the next step: damage after it
            loss[far_at + 1] = 20.0 * loss[far_at]
    steps = [StepRecord(step=i + 1, has_loss=True, loss=v, total_norm=n) for i, (v, n) in enumerate(zip(loss, norm))]
    ups = [{"step": 20, "series": 0, "lr": 0.01, "ratio": 1.5, "layers": {}}] if rewrite else []
    return RunView(steps=steps, ctx={"moving_targets": list(targets), "updates": ups})


def test_a_rise_against_moving_targets_with_no_other_harm_is_a_notice():
    from fastgrad.diagnose.rules.loss_diverging import LOSS_DIVERGING
    f, = LOSS_DIVERGING.evaluate(_rise_view(["Sequential"]))
    assert f.severity == "notice" and f.evidence["variant"] == "bootstrapped"
    assert f.evidence["targets"] == ["Sequential"] and "grew with it" in f.detail
    assert "Sequential is forwarded" in f.detail and "(a target network)" in f.detail
    f, = LOSS_DIVERGING.evaluate(_rise_view(["Actor", "QNetwork"]))    # TD3: a target actor and critic
    assert "Actor, QNetwork are forwarded" in f.detail and "(a target network each)" in f.detail
    # nearest wrong variants: no target the run moves (an early jump: a divergence), a norm far above its own
    # level with a loss jump after it, an update that rewrote the weights
    assert LOSS_DIVERGING.evaluate(_rise_view())[0].severity == "critical"
    assert LOSS_DIVERGING.evaluate(_rise_view(["Sequential"], far_at=30))[0].severity == "critical"
    near = _rise_view(["Sequential"], far_at=30)
    near.steps[30].total_norm *= 0.97 / 1.01                            # just under the bound: no harm
    assert LOSS_DIVERGING.evaluate(near)[0].severity == "notice"
    # the same far norm with nothing after it (DDPG's critic, 15x its early level while it learns): no damage,
    # as `exploding` reads such a norm
    assert LOSS_DIVERGING.evaluate(_rise_view(["Sequential"], far_at=30, jump=False))[0].severity == "notice"
    assert LOSS_DIVERGING.evaluate(_rise_view(["Sequential"], rewrite=True))[0].severity == "critical"


def test_a_critic_whose_first_td_error_was_near_zero_grows_its_norm_with_its_loss():
    """A norm 10x its level at the step its loss rose 74x (a critic whose first TD error was near 0: a squared
    error's gradient grows with the loss's square root) is the loss's own scale, not harm beside a rise against
    moving targets; the same norm where the loss did not rise is."""
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.rules.evidence import harm_of
    from fastgrad.diagnose.rules.loss_diverging import LOSS_DIVERGING

    def view(second_loss):
        loss = [2.6e-4, second_loss] + [0.005 + 0.01 * (i % 3) for i in range(38)]
        norm = [0.047, 0.48] + [0.03 + 0.01 * (i % 4) for i in range(38)]
        steps = [StepRecord(step=i + 1, has_loss=True, loss=v, total_norm=n) for i, (v, n) in enumerate(zip(loss, norm))]
        return RunView(steps=steps, ctx={"moving_targets": ["Sequential"], "updates": []})
    rose = view(0.0193)
    h = harm_of(rose, 0)
    assert h.far(2) is not None and not h.far_for_its_loss(2)   # 10x its level, 8.6x of it the loss's rise
    f, = LOSS_DIVERGING.evaluate(rose)
    assert f.severity == "notice" and f.evidence["variant"] == "bootstrapped"
    flat = view(2.7e-4)   # the loss did not rise at that step: the norm's jump is its own
    assert harm_of(flat, 0).far_for_its_loss(2)


def test_a_rise_is_no_harm_to_an_explosion_in_a_run_that_moves_its_targets():
    """TD3's critic (cleanrl, Pendulum): norms above 100 from the first step, and its TD loss 1.2x higher in the
    last quarter than the first, as its targets grow with the returns. In a run that moves its own targets that
    rise is no harm to the explosion (a notice); without targets it is (a warning); with targets a loss jump
    after a norm that stood out still is."""
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.rules.exploding import EXPLODING

    def view(targets, jump=False):
        loss = [2.0 + 0.5 * i / 79 + 0.01 * (i % 3) for i in range(80)]
        norm = [120.0 + (i % 5) for i in range(80)]
        if jump:
            norm[49], loss[50] = 900.0, 40.0
        steps = [StepRecord(step=i + 1, has_loss=True, loss=v, total_norm=n) for i, (v, n) in enumerate(zip(loss, norm))]
        return RunView(steps=steps, ctx={"moving_targets": list(targets), "updates": []})
    (f,) = EXPLODING.evaluate(view(["QNetwork"]))
    assert f.severity == "notice" and f.evidence["harm"] == []
    (f,) = EXPLODING.evaluate(view([]))
    assert f.severity == "warning" and f.evidence["harm"] == ["loss_rose"]
    (f,) = EXPLODING.evaluate(view(["QNetwork"], jump=True))
    assert f.severity == "warning" and "loss_jump" in f.evidence["harm"] and "loss_rose" not in f.evidence["harm"]


def test_a_run_that_steps_an_environment_learns_from_its_own_returns():
    """An agent that steps a gym/gymnasium environment trains against its own returns (PPO's value loss on
    unnormalised returns, a policy loss weighted by them): its loss rises as its episodes lengthen, target network
    or not. In such a run the rise is no harm to an explosion and a divergence of that shape is the bootstrapped
    notice; the same run without an environment keeps its warning and its critical."""
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.collect.targets import environment_module
    from fastgrad.diagnose.rules.exploding import EXPLODING
    from fastgrad.diagnose.rules.loss_diverging import LOSS_DIVERGING

    assert environment_module({"torch": 1, "gymnasium": 1}) == "gymnasium"
    assert environment_module({"gym": 1}) == "gym" and environment_module({"torch": 1, "numpy": 1}) is None

    def view(env):
        loss = [2.0 + 0.5 * i / 79 + 0.01 * (i % 3) for i in range(80)]
        norm = [120.0 + (i % 5) for i in range(80)]
        steps = [StepRecord(step=i + 1, has_loss=True, loss=v, total_norm=n) for i, (v, n) in enumerate(zip(loss, norm))]
        return RunView(steps=steps, ctx={"environment": env, "updates": []})
    (f,) = EXPLODING.evaluate(view("gymnasium"))
    assert f.severity == "notice" and f.evidence["harm"] == []
    assert "No harm seen: the loss rose (" in f.detail and "did not rise" not in f.detail
    (f,) = EXPLODING.evaluate(view(None))
    assert f.severity == "warning" and f.evidence["harm"] == ["loss_rose"]
    rise = _rise_view()
    rise.ctx["environment"] = "gym"
    f, = LOSS_DIVERGING.evaluate(rise)
    assert f.severity == "notice" and f.evidence["variant"] == "bootstrapped" and f.evidence["environment"] == "gym"
    assert "steps an RL environment (gym)" in f.detail
    assert LOSS_DIVERGING.evaluate(_rise_view())[0].severity == "critical"
    far = _rise_view(far_at=30)
    far.ctx["environment"] = "gym"
    assert LOSS_DIVERGING.evaluate(far)[0].severity == "critical"     # harm beyond the rise still counts
    quiet = _rise_view(far_at=30, jump=False)
    quiet.ctx["environment"] = "gym"
    assert LOSS_DIVERGING.evaluate(quiet)[0].severity == "notice"     # a far norm nothing followed is none


def test_a_loss_jump_after_a_clipped_update_is_not_that_gradients_doing():
    """``exploding`` counts a loss jump as harm only after a step whose update stood out. A clip that bounded
    every update to the same size (max_norm 0.5 under norms of 100 and more) made the 10x gradient's update the
    run's usual one: the jump after it is not its doing. Unclipped, the same jump is harm."""
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.rules.exploding import EXPLODING

    def view(clip):
        loss = [2.0 + 0.01 * (i % 3) for i in range(80)]
        norm = [120.0 + (i % 5) for i in range(80)]
        norm[49], loss[50] = 1200.0, 40.0
        steps = [StepRecord(step=i + 1, has_loss=True, loss=v, total_norm=min(n, clip) if clip else n,
                            clip_norm=n if clip else None, clip_read=bool(clip))
                 for i, (v, n) in enumerate(zip(loss, norm))]
        return RunView(steps=steps, ctx={"updates": []})
    (f,) = EXPLODING.evaluate(view(None))
    assert "loss_jump" in f.evidence["harm"]
    (f,) = EXPLODING.evaluate(view(0.5))
    assert "loss_jump" not in f.evidence["harm"]


def test_a_bootstrapped_rise_is_not_harm_to_the_findings_beside_it():
    from fastgrad.diagnose.consistency import reconcile
    from fastgrad.diagnose.thresholds import Thresholds

    def judged(harm, series=0):
        boot = Finding("loss_diverging", "notice", "rose", evidence={"series": 0, "variant": "bootstrapped"})
        inc = Finding("increasing", "warning", "gradient norm steadily increasing, with harm", "d",
                      evidence={"series": series, "harm": list(harm)})
        return reconcile([boot, inc], [], Thresholds())[1]
    f = judged(["loss_rose", "loss_jump"])
    assert f.severity == "notice" and f.evidence["harm"] == [] and "with harm" not in f.title
    assert judged(["loss_rose"], series=None).severity == "notice"      # a run-wide finding
    assert judged(["loss_rose", "far"]).severity == "warning"            # harm beyond the rise
    assert judged(["rewrite"]).severity == "warning"
    assert judged(["loss_rose"], series=1).severity == "warning"        # another optimizer's loss


@pytest.mark.parametrize("copy", ["state_dict", "data", "polyak-data"])
def test_a_value_loss_rising_with_its_target_network_is_not_a_divergence(tmp_path_factory, copy):
    # the target copied by load_state_dict, or written through .data (no version counter moves: only its values)
    r = run(tmp_path_factory, "td_value_rising.py", "--copy", copy)
    truth = r["truth"]["steps"]
    assert truth[-1]["loss"] > 50 * truth[0]["loss"]                   # the premise: the loss rose 120x
    assert max(t["update"] for t in truth) < 1.0 and all(math.isfinite(t["loss"]) for t in truth)
    f = finding(r, "loss_diverging")
    assert f["severity"] == "notice" and f["evidence"]["variant"] == "bootstrapped"
    assert f["evidence"]["targets"] == ["Sequential"]
    assert codes(r, "warning") == [] and codes(r, "critical") == [] and r["rc"] == 0


# ---------------------------------------------------------------------------------------------- tiny updates
def _tiny_view(ratios, losses=None, series=2):
    from fastgrad.diagnose.collect.steps import StepRecord
    n = len(ratios)
    losses = losses or [1.0 + 0.001 * (-1) ** i for i in range(n)]
    steps = [StepRecord(step=2 * i + s + 1, series=s, has_loss=True, loss=losses[i], total_norm=1.0, lr=1e-9)
             for i in range(n) for s in range(series)]
    ups = [{"step": 2 * i + 2, "series": series - 1, "lr": 1e-9, "ratio": v, "layers": {}}
           for i, v in enumerate(ratios)]
    return RunView(steps=steps, names=[f"opt{s}" for s in range(series)], ctx={"updates": ups})


def test_update_tiny_sits_between_its_rule_and_the_nearest_wrong_variants():
    from fastgrad.diagnose.rules.rewrite import UPDATE_TINY
    lim = RunLimits()
    below, at = 0.99 * lim.stall_tiny_update, lim.stall_tiny_update
    f, = UPDATE_TINY.evaluate(_tiny_view([below] * 8))
    assert f.severity == "warning" and f.evidence["series"] == 1 and f.evidence["stuck"]
    assert UPDATE_TINY.evaluate(_tiny_view([at] * 8)) == []
    assert UPDATE_TINY.evaluate(_tiny_view([below] * 8, series=1)) == []          # one optimizer: stall's
    n = lim.tiny_update_steps
    assert len(UPDATE_TINY.evaluate(_tiny_view([below] * n))) == 1
    assert UPDATE_TINY.evaluate(_tiny_view([below] * (n - 1))) == []
    falling = [2.0 - 0.05 * i for i in range(20)]                                 # the loss improves anyway
    assert UPDATE_TINY.evaluate(_tiny_view([below] * 20, losses=falling))[0].severity == "notice"


def test_an_optimizer_whose_updates_cannot_move_its_weights_is_named_among_several(tmp_path_factory):
    r = run(tmp_path_factory, "two_opts_tiny_lr.py", "--tiny")
    t = r["truth"]["steps"]
    ups = sorted(x["update2"] for x in t)
    assert ups[len(ups) // 2] < 1e-6 and sorted(x["update1"] for x in t)[len(t) // 2] > 1e-4   # the premise
    f = r["json"]["findings"][0]
    assert f["code"] == "update_tiny" and f["severity"] == "warning" and f["evidence"]["series"] == 1
    assert f["evidence"]["update_ratio"] == pytest.approx(ups[len(ups) // 2], rel=0.5)
    assert codes(r).count("update_tiny") == 1
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "update_tiny")
    assert "opt_second.param_groups" in rec["code_to_add"]
    clean = run(tmp_path_factory, "two_opts_tiny_lr.py")
    assert "update_tiny" not in codes(clean) and clean["rc"] == 0


@pytest.mark.parametrize("what", ["loss", "detached"])
def test_a_clip_handed_the_loss_is_named_with_its_call_not_as_a_misplaced_clip(what, tmp_path_factory):
    """``clip_grad_norm_(loss, 0.1)`` after backward(): the tensor it is handed holds no gradient at any step (by
    plain reads), so every update used the unclipped norm. check names the call (its own line) and the tensor,
    once per run, with the script's bound in the code to add; it is not a clip after step() or before backward().
    The nearest wrong readings: the same loop handing the parameters, and one handing a frozen head's parameters
    (a parameter, which may hold a gradient another step uses), are not this finding."""
    r = run(tmp_path_factory, "clip_handed_loss.py", "--what", what)
    t = r["truth"]["steps"]
    assert not any(x["held"] for x in t) and min(x["norm"] for x in t) > 0.1   # the premise: nothing was bounded
    f = finding(r, "clip_not_params")
    assert f["severity"] == "warning" and f["steps"] == list(range(1, len(t) + 1)) and f["evidence"]["count"] == 30
    assert "clip_after_step" not in codes(r) and "no_clipping" not in codes(r)
    assert "clip_grad_norm_(handed[0] if len(handed) == 1 else handed, 0.1)" in f["detail"]
    assert "clip_handed_loss.py:" in f["detail"]
    assert ("a loss" in f["detail"]) == (what == "loss") and ("requires no gradient" in f["detail"]) == (what != "loss")
    for s, x in zip(r["json"]["steps"], t):  # the updates used the unclipped gradients, and none is marked clipped
        assert math.isclose(s["total_norm"], x["norm"], rel_tol=1e-4) and not s["clipped"]
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "clip_not_params")
    assert "net.parameters(), max_norm=0.1" in rec["code_to_add"]
    assert row(r, "Gradient clipping") == {"metric": "Gradient clipping", "value": "30 call(s)", "status": "warning"}
    assert r["rc"] == 0
    for ok in ("params", "frozen"):
        good = run(tmp_path_factory, "clip_handed_loss.py", "--what", ok)
        assert "clip_not_params" not in codes(good), ok
        assert any(x["held"] for x in good["truth"]["steps"]) == (ok == "params")


def test_which_tensors_a_clip_can_bound():
    """The rule behind ``clip_not_params``, between its nearest wrong variants: a loss, an activation and a
    detached copy hold no gradient an update uses; a parameter (frozen or not) and a hand-made leaf that
    requires grad (a loop without nn.Module) may; an empty list is no call to judge."""
    from fastgrad.diagnose.collect.interceptors import _no_parameter

    w = torch.randn(3, 2, requires_grad=True)
    loss = (w ** 2).sum()
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    for bad in ([loss], [w @ torch.ones(2)], [loss.detach()], [w.detach()], [loss, w.detach()]):
        assert _no_parameter(bad)
    for good in ([w], [frozen], [torch.nn.Parameter(torch.randn(2))], [loss, w], []):
        assert not _no_parameter(good)
