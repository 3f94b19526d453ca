"""The judgement fuzz's budgeted part (``tests/judgement_fuzz.py``): the generator's own checks (a seed replays its
script, every defect shows in its float64 truth, the judge rejects wrong reports) and a sample of the development
part checked by ``python -m fastgrad.check``. Classes check misjudges today are strict xfails naming the class, so
a fixed class flips them; the full run (hundreds of scripts, held-out part included) is
``python -m tests.judgement_fuzz`` (docs/testing.md)."""

import copy

import pytest

from tests import judgement_fuzz as jf
from tests.judgement_fuzz_gen import (DEFECTS, DEV_FAMILIES, DEV_HAND_WRITTEN, HELD_OUT_FAMILIES, HELD_OUT_SEED0,
                                      script_of, spec_of)

# a dev seed whose script shows each defect (found once by searching seeds 0-11; the truth decides, not this list)
MANIFEST_SEED = {d: 0 for d in DEFECTS} | {"exploding_init": 6, "unused_param": 1}

# dev scripts checked in CI: seed -> the class check misjudges there today (None: judged right). From the
# 2026-12-05 full run (benchmarks/results/judgement-fuzz/2026-12-05-before/scripts.csv).
DEV_SAMPLE: dict[int, str | None] = {
    2: None,                         # cnn_bn, Adam: lr far too low -> stall
    7: None,                         # GAN: no zero_grad
    18: None,                        # healthy WGAN critic: its output bias (the loss is invariant to it), a notice
    6: None,                         # a schedule dividing the lr by 10 every step: lr_schedule, its advice in the
                                     # script's own scheduler names
    19: None,                        # NaN batch through BatchNorm under a GradScaler: the buffers named, not "protected"
    0: None,                         # a negated loss: gradient_ascent, not a spike
}


def test_replay_by_seed_gives_the_same_script():
    for seed in (0, 7, 123, HELD_OUT_SEED0 + 5):
        assert script_of(spec_of(seed)) == script_of(spec_of(seed))
    assert script_of(spec_of(3)) != script_of(spec_of(4))


def test_the_split_is_disjoint():
    assert not set(DEV_FAMILIES) & set(HELD_OUT_FAMILIES) and len(DEV_FAMILIES) + len(HELD_OUT_FAMILIES) == 13
    for seed in range(0, 200, 7):
        assert spec_of(seed).family in DEV_FAMILIES and spec_of(seed).part == "dev"
    for seed in range(HELD_OUT_SEED0, HELD_OUT_SEED0 + 100, 7):
        assert spec_of(seed).family in HELD_OUT_FAMILIES and spec_of(seed).part == "held_out"
    # the development part's own hand-written updates: drawn there, never in the held-out part
    dev_opts = {spec_of(seed).opt for seed in range(200)}
    assert set(DEV_HAND_WRITTEN) <= dev_opts
    assert not {spec_of(seed).opt for seed in range(HELD_OUT_SEED0, HELD_OUT_SEED0 + 100)} & set(DEV_HAND_WRITTEN)


def test_the_hand_written_updates_run_and_learn():
    for opt in DEV_HAND_WRITTEN:
        seed = next(s for s in range(200, 2000) if spec_of(s).opt == opt and spec_of(s).defect is None)
        p = jf.prepare(seed, None)
        assert p["spec"].opt == opt and p["manifests"], (opt, p["evidence"])   # healthy: it learns, all finite


def test_every_defect_has_a_class_and_scripts_compile():
    assert set(jf.CLASS_MAP) == set(DEFECTS) and len(DEFECTS) >= 18
    for d, seed in MANIFEST_SEED.items():
        compile(script_of(spec_of(seed, d)), d, "exec")


@pytest.mark.parametrize("defect", DEFECTS)
def test_each_defect_manifests_in_the_truth(defect):
    p = jf.prepare(MANIFEST_SEED[defect], defect)
    assert p["manifests"], p["evidence"]
    # and the healthy twin of the same script does not show it
    if defect not in jf.NEEDS_TWIN:   # the others are measured against the twin itself
        ok, why = jf.manifests(p["spec"], jf.run_truth(jf.twin(p["spec"])), None)
        assert not ok, f"the healthy twin shows {defect}: {why}"


def test_stale_gradients_are_seen_only_without_zeroing():
    bad = jf.prepare(0, "no_zero_grad")
    n_opts = len({s["opt"] for s in bad["truth"]["steps"]})   # each optimizer's first step holds fresh gradients
    assert sum(s["stale"] for s in bad["truth"]["steps"]) == len(bad["truth"]["steps"]) - n_opts
    assert not any(s["stale"] for s in jf.run_truth(jf.twin(bad["spec"]))["steps"])


@pytest.fixture(scope="module")
def healthy_truth():
    return jf.prepare(0, None)


def _report(codes, status=None, rc=None, code_to_add="", summary=()):
    sev = {c: s for c, s in codes}
    worst = max([jf.SEVERITY[s] for s in sev.values()] + [0])
    name = [k for k, v in jf.SEVERITY.items() if v == worst][0]
    return {"findings": [{"code": c, "severity": s} for c, s in codes], "status": status or name,
            "exit_code": rc if rc is not None else int(worst == 3),
            "recommendations": [{"code": c, "text": "", "code_to_add": code_to_add} for c, _ in codes[:1]],
            "summary": list(summary)}


def test_the_judge_rejects_wrong_reports(healthy_truth):
    p = healthy_truth
    spec, t, script = p["spec"], p["truth"], script_of(p["spec"])
    assert jf.judge(spec, t, _report([]), "", script)["right"]
    assert jf.judge(spec, t, _report([("low", "notice")]), "", script)["right"]
    assert not jf.judge(spec, t, _report([("stall", "warning")]), "", script)["right"]
    assert not jf.judge(spec, t, _report([], rc=1), "", script)["right"]
    assert not jf.judge(spec, t, None, "", script)["right"]
    # a defect's first finding must name it; a later right finding does not count
    d = spec_of(0, "clip_before_unscale")
    script = script_of(d)   # a supervised loop: its optimizer is `opt`
    assert "opt = torch.optim" in script
    assert jf.judge(d, t, _report([("clip_scaled", "critical")]), "", script)["right"]
    assert not jf.judge(d, t, _report([("exploding", "critical"), ("clip_scaled", "critical")]), "", script)["right"]
    # advice in names the script does not have; contradictions; a harmful value rated healthy
    bad = _report([("clip_scaled", "critical")], code_to_add="optimizer.step()\noptimizer.zero_grad()")
    assert "optimizer" in " ".join(jf.judge(d, t, bad, "", script)["why"])
    ok = _report([("clip_scaled", "critical")], code_to_add="opt.step()\nopt.zero_grad(set_to_none=True)")
    assert jf.judge(d, t, ok, "", script)["right"]
    assert not jf.judge(d, t, _report([("clip_scaled", "critical")], rc=0), "", script)["right"]
    assert not jf.judge(d, t, _report([("clip_scaled", "critical")], status="warning"), "", script)["right"]
    nan_row = [{"metric": "Total grad norm (last step)", "value": "nan", "status": "healthy"}]
    assert not jf.judge(d, t, _report([("clip_scaled", "critical")], summary=nan_row), "", script)["right"]
    neg = copy.deepcopy(t)
    neg["steps"][5]["lr"] = [-0.01]
    lr_row = [{"metric": "Learning rate", "value": "0.05", "status": "healthy"}]
    assert not jf.judge(d, neg, _report([("clip_scaled", "critical")], summary=lr_row), "", script)["right"]
    assert jf.judge(d, t, _report([("clip_scaled", "critical")], summary=lr_row), "", script)["right"]
    # two optimizers, one collapsed: its row must say so; the other's healthy row is no lie
    two = copy.deepcopy(neg)
    for s in two["steps"]:
        s["opt"] = 0
    two["steps"].append(dict(two["steps"][0], opt=1, lr=[0.003]))
    rows = [{"metric": "Learning rate [Adam #1 (opt_c)]", "value": "0.05 -> -0.01", "status": "critical"},
            {"metric": "Learning rate [Adam #2 (opt_a)]", "value": "0.003", "status": "healthy"}]
    assert jf.judge(d, two, _report([("clip_scaled", "critical")], summary=rows), "", script)["right"]
    rows[0]["status"] = "healthy"
    assert not jf.judge(d, two, _report([("clip_scaled", "critical")], summary=rows), "", script)["right"]
    buf = dict(t, buffers_nonfinite=["model.body.1.running_mean"])
    assert not jf.judge(d, buf, _report([("clip_scaled", "critical")]), "the run is protected", script)["right"]


def test_script_crashed_is_right_exactly_when_the_truth_run_crashed_the_same_way(healthy_truth):
    d = spec_of(56, "log_zero")
    script = script_of(d)
    crashed = dict(healthy_truth["truth"], error="IndexError: list index out of range")
    rep = _report([("script_crashed", "critical"), ("not_checked", "warning")], rc=3)
    rep["findings"][0]["detail"] = "IndexError: list index out of range"
    assert jf.judge(d, crashed, rep, "", script)["first_right"]
    # the same report where the script runs clean without fastgrad: check made the crash
    assert not jf.judge(d, healthy_truth["truth"], rep, "", script)["first_right"]
    # a crash of another kind than the script's own
    other = dict(crashed, error="ValueError: Expected parameter logits")
    assert not jf.judge(d, other, rep, "", script)["first_right"]
    # and script_crashed not first: the class map decides as before
    late = _report([("exploding", "critical"), ("script_crashed", "critical")], rc=3)
    late["findings"][1]["detail"] = "IndexError: list index out of range"
    assert not jf.judge(d, crashed, late, "", script)["first_right"]


def test_a_contradiction_of_lr_advice_is_seen():
    rep = _report([("stall", "warning")])
    rep["recommendations"] = [{"code": "a", "text": "lower the learning rate", "code_to_add": ""},
                              {"code": "b", "text": "raise the learning rate", "code_to_add": ""}]
    assert jf.contradictions(rep)


@pytest.mark.parametrize("seed", sorted(DEV_SAMPLE))
def test_dev_sample_is_judged_right(seed, tmp_path, request):
    cls = DEV_SAMPLE[seed]
    if cls is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"check misjudges {cls} today"))
    p = jf.prepare(seed)
    assert p["manifests"], p["evidence"]
    path = tmp_path / f"{p['spec'].name}.py"
    path.write_text(script_of(p["spec"]))
    rep, md, rc = jf.run_check(path, tmp_path / "out")
    v = jf.judge(p["spec"], p["truth"], rep, md, path.read_text())
    assert v["right"], v["why"]


def test_the_class_map_takes_a_new_code_that_names_the_cause_and_no_effect():
    assert jf.in_class("softmax_ce", "softmax_into_cross_entropy") and jf.in_class("sched_negative", "lr_negative")
    assert not jf.in_class("sign_flip", "loss_diverging") and not jf.in_class("sched_collapse", "stall")
    assert not jf.in_class("lr_low", "exploding") and jf.in_class("no_zero_grad", "no_zero_grad")
