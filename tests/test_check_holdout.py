"""A hold-out for ``python -m fastgrad.check``: scripts written after the rules were (tests/check_scripts/ho_*.py),
each recording its own float64 truth with plain hooks and no fastgrad, on the kinds of run users bring: AMP
whose GradScaler overflows early, NaN in the data, NaN born in backward, a learning rate far too high with and
without a clip, a noisy flat loss, a critic whose loss rises then falls, an optimizer whose branch is cut off,
LayerScale's small-by-construction parameters, and the red flags of a training loop. Besides each case's own
verdict, every run is checked for the report's internal agreement (``_consistent``): exit code, status,
summary, trend and advice never contradict the findings."""

import json
import math
import os
import re
from pathlib import Path

import pytest

from fastgrad.diagnose.thresholds import RANK, RunLimits

from .check_runs import cached_run, codes, finding, row


RUNS = {
    "amp_overflow": ("ho_amp_scaler_overflow.py", []),
    "nan_input": ("ho_nan_input.py", []),
    "backward_nan": ("ho_backward_nan.py", []),
    "diverge_noclip": ("ho_diverge_noclip.py", ["3"]),
    "lr0": ("ho_diverge_noclip.py", ["0"]),
    "ce_lr_too_high": ("ho_ce_lr_too_high.py", []),
    "noisy_flat": ("ho_noisy_flat.py", []),
    "critic_rise_fall": ("ho_critic_rise_fall.py", []),
    "detached": ("ho_detached_encoder.py", []),
    "detached_zeros": ("ho_detached_encoder.py", ["--zeros"]),
    "layerscale": ("ho_layerscale.py", []),
    "accum_clip": ("ho_accum_clip_inside.py", []),
    "clip_after_step": ("ho_clip_after_step.py", []),
    "never_zero": ("ho_never_zero.py", []),
    "huge_bound": ("ho_clip_huge_bound.py", []),
    "overflow_noclip": ("ho_overflow_noclip.py", []),
}

_cache: dict = {}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("holdout")


def run(name, tmp):
    """The checked run (in this process) and the script's own truth."""
    return cached_run(_cache, RUNS, name, tmp)


def num(v):
    return float(v) if not isinstance(v, str) else float(v)  # "nan"/"inf" strings from the truth file


def close(a, b, rel=1e-5):
    a, b = num(a), num(b)
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= rel * max(abs(b), 1e-12)


# ---------------------------------------------------------------------------------------------- agreement
_RAISE_LR = re.compile(r"higher learning rate|10 \* lr|raise (the|its|a) learning rate|increase the learning rate",
                       re.I)


def _consistent(r):
    """What every report must keep: the documented exit code for its findings, a status that is their worst
    severity, summary rows never more severe than the findings, a trend that says nothing is wrong only where no
    finding of that series says otherwise, no advice to raise a learning rate while the run diverges, and the
    advice in the findings' order."""
    j, res = r["json"], r["res"]
    sevs = [f["severity"] for f in j["findings"]]
    worst = max(sevs, key=RANK.__getitem__, default="healthy")
    assert j["status"] == worst
    expect = 3 if res.crashed else (1 if worst == "critical" else 0)
    assert r["rc"] == expect == j["exit_code"], (r["rc"], expect)
    for x in j["summary"]:
        assert RANK[x["status"]] <= RANK[worst], f"summary row {x} is more severe than every finding"
    diverging = any(f["code"] in ("nonfinite", "nonfinite_history", "nonfinite_loss")
                    or (f["code"] in ("exploding", "loss_diverging") and f["severity"] != "notice")
                    for f in j["findings"])
    recs = j["recommendations"]
    if diverging:
        for rec in recs:
            assert not _RAISE_LR.search(rec["text"] + rec["code_to_add"]), rec
    # one recommendation per code, in the order of the findings that have one
    order = [c for c in dict.fromkeys(f["code"] for f in j["findings"])]
    got = [rec["code"] for rec in recs]
    assert len(got) == len(set(got)) and got == [c for c in order if c in got]
    # a series called "stable" has no finding about its norm or loss
    for k, name in enumerate(j["series"] or ["steps"]):
        label = row(r, "Norm trend" + (f" [{name}]" if len(j["series"]) > 1 else ""))["value"]
        if label == "stable":
            mine = [f for f in j["findings"] if f["evidence"].get("series", k) == k
                    and f["code"] in ("exploding", "zero_grads", "nonfinite", "nonfinite_history")
                    or (f["code"] == "loss_diverging" and f["severity"] != "notice"
                        and f["evidence"].get("series") == k)]
            assert not mine, (name, mine)
    assert "**" + j["status"].upper() + "**" in r["md"]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_report_agrees_with_itself(name, tmp):
    _consistent(run(name, tmp))


# ---------------------------------------------------------------------------------------------- the cases
def test_amp_scaler_overflow_is_not_an_explosion(tmp):
    r = run("amp_overflow", tmp)
    truth = r["truth"]["steps"]
    skipped = [t for t in truth if t["finite"] == 0]
    assert len(skipped) >= 5  # the premise: the scaler overflowed at the start
    assert r["rc"] == 0 and codes(r) == ["amp_skipped"]
    assert finding(r, "amp_skipped")["evidence"]["count"] == len(skipped)
    steps = r["json"]["steps"]
    assert [s["skipped"] for s in steps] == [t["finite"] == 0 for t in truth]
    for s, t in zip(steps, truth):  # the unscaled norm before the clip, where the step was taken
        if t["finite"] == 1:
            assert close(s["clip_norm"], t["norm"])
    assert row(r, "Norm trend")["value"] == "stable"


def test_nan_in_the_data_is_named_as_the_input(tmp):
    r = run("nan_input", tmp)
    assert r["truth"]["steps"][0]["input_finite"] == 0 and r["truth"]["steps"][0]["loss"] == "nan"
    born = r["json"]["nan_born"]
    assert born["where"] == "input" and born["step"] == 1 and born["module"] is None
    assert r["json"]["first_nonfinite_output"] == "input of Sequential (Sequential) at step 1"
    assert "already in the data" in finding(r, "nonfinite_loss")["detail"]
    assert row(r, "NaN/Inf born in")["value"] == "input at step 1"
    # the advice is about the data, said once; not the hand-written-loss fixes
    recs = r["json"]["recommendations"]
    assert sum("model's input" in x["text"] for x in recs) == 1
    assert "clamp_min" not in r["md"] and "nan_to_num" in r["md"]
    assert r["rc"] == 1


def test_nan_born_in_backward(tmp):
    r = run("backward_nan", tmp)
    t0 = r["truth"]["steps"][0]
    assert t0["loss_finite"] == 1 and t0["grads_finite"] == 0  # the premise
    born = r["json"]["nan_born"]
    assert born["where"] == "backward" and born["step"] == 1
    assert close(r["json"]["steps"][0]["loss"], t0["loss"])
    assert r["rc"] == 1


def test_diverging_without_a_clip_leads_with_the_loss(tmp):
    r = run("diverge_noclip", tmp)
    truth = r["truth"]["steps"]
    for s, t in zip(r["json"]["steps"], truth):
        assert close(s["loss"], t["loss"]) and close(s["grad_norm"], t["norm"], 1e-4)
    # Adam's first step at lr 3 moved the weights by 35x their size, before the loss crossed 10x at step 2: that
    # update leads, with its lr, and the critical divergence follows from it
    first, d = r["json"]["findings"][0], finding(r, "loss_diverging")
    assert first["code"] == "update_rewrote" and first["evidence"]["first_step"] == 1 and first["evidence"]["lr"] == 3
    assert d["severity"] == "critical" and d["evidence"]["follows"] == "update_rewrote"
    assert {"exploding", "no_clipping"} <= set(codes(r))
    assert r["json"]["recommendations"][0]["code"] == "update_rewrote"
    assert "group['lr'] *= 0.1" in r["json"]["recommendations"][0]["code_to_add"]
    assert r["rc"] == 1


def test_a_jump_that_never_comes_back_is_reported(tmp):
    r = run("ce_lr_too_high", tmp)
    losses = [t["loss"] for t in r["truth"]["steps"]]
    start = min(losses[0], sorted(losses[:3])[1])
    q = len(losses) // 4
    assert max(losses) >= 10 * start and sorted(losses[-q:])[q // 2] >= 1.5 * start  # the premise
    # the first update moved the weights by 6x their size: it leads, and the jump that never came back follows it
    assert r["json"]["findings"][0]["code"] == "update_rewrote"
    f = finding(r, "loss_diverging")
    assert f["severity"] == "warning" and f["evidence"]["follows"] == "update_rewrote"
    assert f["evidence"]["variant"] == "unrecovered" and "never came back" in f["title"]
    rec = r["json"]["recommendations"][0]
    assert "lower the learning rate" in rec["text"] and "group['lr'] *= 0.1" in rec["code_to_add"]
    assert row(r, "Norm trend")["value"].startswith("loss jumped")
    assert r["rc"] == 0


def test_noisy_flat_loss_is_not_diverging(tmp):
    r = run("noisy_flat", tmp)
    assert "loss_diverging" not in codes(r)
    assert not codes(r, "warning") and not codes(r, "critical") and r["rc"] == 0


def test_critic_loss_that_rises_then_falls_is_not_diverging(tmp):
    r = run("critic_rise_fall", tmp)
    crit = [t["loss"] for t in r["truth"]["steps"] if t["opt"] == "critic"]
    assert max(crit) >= 10 * crit[0] and crit[-1] < crit[0]  # the premise: up 10x, then back below the start
    assert not [f for f in r["json"]["findings"] if f["code"] == "loss_diverging" and f["severity"] != "notice"]
    assert r["rc"] == 0


@pytest.mark.parametrize("name", ["detached", "detached_zeros"])
def test_cut_off_optimizer_is_named_and_the_other_is_left_alone(name, tmp):
    r = run(name, tmp)
    truth = r["truth"]["steps"]
    assert all(t["norm"] == 0 for t in truth if t["opt"] == "encoder")  # the premise
    assert all(t["norm"] > 0 for t in truth if t["opt"] == "head")
    zs = [f for f in r["json"]["findings"] if f["code"] == "zero_grads"]
    assert len(zs) == 1 and zs[0]["severity"] == "critical" and zs[0]["title"].startswith("Adam #1 (enc_opt)")
    assert zs[0]["evidence"]["first_step"] == 1
    assert ("no gradient reaches" in zs[0]["title"]) == (name == "detached")
    head = [x for x in r["json"]["summary"] if x["metric"].endswith("[SGD #2 (head_opt)]")]
    assert head and all(x["status"] != "critical" for x in head), head
    assert row(r, "Zero-gradient parameters")["status"] != "critical"
    # one backward() fed both optimizers: the head's steps carry that loss too
    assert row(r, "Loss (first -> last step) [SGD #2")["value"].startswith(
        f"{float(truth[1]['loss']):.4g}")
    assert r["rc"] == 1


def test_layerscale_parameters_are_not_vanishing_depth(tmp):
    r = run("layerscale", tmp)
    t0 = r["truth"]["steps"][0]
    assert t0["first_branch"] * 1e4 < t0["head"]  # the premise: the branch is tiny by construction
    assert "depth_vanishing" not in codes(r) and r["rc"] == 0
    assert not codes(r, "warning") and not codes(r, "critical")


def test_clip_inside_the_accumulation_window(tmp):
    r = run("accum_clip", tmp)
    truth = r["truth"]["steps"]
    f = finding(r, "clip_partial")
    assert f["severity"] == "warning" and f["steps"] == list(range(1, len(truth) + 1))
    for s, t in zip(r["json"]["steps"], truth):  # what the update used (after the last micro-batch's clip)
        assert close(s["total_norm"], t["norm"])
    assert r["rc"] == 0


def test_clip_after_the_step(tmp):
    r = run("clip_after_step", tmp)
    f = finding(r, "clip_after_step")
    assert f["severity"] == "warning" and f["steps"] == list(range(1, 16))
    assert f["evidence"]["max_norm"] == 1.0 and "max_norm=1)" in f["detail"]  # the script's own bound
    for s, t in zip(r["json"]["steps"], r["truth"]["steps"]):  # the step used the unclipped gradients
        assert close(s["total_norm"], t["norm"])
    assert r["rc"] == 0


def test_never_zeroed(tmp):
    r = run("never_zero", tmp)
    f = finding(r, "no_zero_grad")
    assert f["severity"] == "critical" and f["steps"] == list(range(2, 21))
    for s, t in zip(r["json"]["steps"], r["truth"]["steps"]):  # the accumulated sums the steps used
        assert close(s["total_norm"], t["norm"])
    assert r["rc"] == 1


def test_a_clip_that_never_acts_is_not_called_a_bound(tmp):
    r = run("huge_bound", tmp)
    truth = r["truth"]["steps"]
    assert 100 < max(t["norm"] for t in truth) < 1e6  # the premise
    f = finding(r, "exploding")
    # the norm is the targets' own scale (~400) and the run shows no harm from it: the guide's question, a
    # notice (issue 45); the clip that never acts is still said
    assert f["severity"] == "notice" and f["evidence"]["harm"] == [] and f["evidence"]["variant"] == "loose_clip"
    assert f["evidence"]["max_norm"] == 1e6 and "max_norm=1.000e+06" in f["detail"]
    assert "bounded" not in r["md"] and "clip (max_norm=1.0)" not in f["title"]
    assert f["detail"].count(f"step {f['evidence']['peak_step']} ") <= 1  # each step named once
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "exploding")
    assert "never acts" in rec["text"] and "lower the learning rate" not in rec["text"].lower()
    assert r["rc"] == 0


def test_overflow_without_a_clip_is_the_first_finding(tmp):
    r = run("overflow_noclip", tmp)
    truth = r["truth"]["steps"]
    assert truth[1]["norm"] > 1.8e19 and truth[1]["finite_grads"] == 1  # the premise
    # the update of step 1 (lr 1e5 x a norm of 1.5) rewrote the weights before the norm overflowed: the cause
    # first, the largest explosion right after it
    cause, first = r["json"]["findings"][:2]
    assert cause["code"] == "update_rewrote" and cause["evidence"]["first_step"] == 1
    assert first["code"] == "exploding" and first["evidence"]["variant"] == "overflow"
    assert first["evidence"]["overflow_steps"] == [2] and first["evidence"]["follows"] == "update_rewrote"
    nc = finding(r, "no_clipping")
    assert nc["evidence"]["peak"] == math.inf and 2 in nc["steps"]
    assert row(r, "Gradient clipping")["status"] == "warning"
    assert "follows the gradient explosion of step 2" in finding(r, "nonfinite_loss")["detail"]
    assert r["rc"] == 1


# ---------------------------------------------------------------------------------------------- start-up
@pytest.mark.skipif(not __import__("torch").distributed.is_available(), reason="torch without torch.distributed")
def test_scaler_subclass_imported_by_the_script_is_intercepted_without_importing_fsdp_first(tmp_path):
    """The checker no longer imports torch.distributed.fsdp at start (seconds of every run) to find
    ShardedGradScaler: a GradScaler subclass that the script imports, or defines, while it runs is intercepted
    as its class is created. A fresh process, so nothing imported fsdp before."""
    import subprocess
    import sys

    script = tmp_path / "sub_scaler.py"
    script.write_text(
        "import sys\n"
        "assert 'torch.distributed.fsdp' not in sys.modules, 'the checker imported fsdp'\n"
        "import torch\n"
        "class MyScaler(torch.amp.GradScaler):\n"
        "    def unscale_(self, optimizer):  # overrides without calling the base class's\n"
        "        return torch.amp.GradScaler.unscale_(self, optimizer)\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(8, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=1e-3)\n"
        "scaler = MyScaler('cpu')\n"
        "for step in range(4):\n"
        "    opt.zero_grad()\n"
        "    loss = model(torch.randn(16, 8)).pow(2).mean()\n"
        "    scaler.scale(loss).backward()\n"
        "    if step >= 2:\n"
        "        scaler.unscale_(opt)\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # still scaled at steps 1 and 2\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c",
                        "import sys, json\nfrom fastgrad import check as C\n"
                        f"r = C.run_script({str(script)!r}, [])\n"
                        "import torch\n"
                        "left = '__init_subclass__' in vars(torch.amp.GradScaler)\n"
                        "print(json.dumps([r.crashed, r.crash_text, r.flags['clip_scaled'], left]))"],
                       env=env, capture_output=True, text=True, timeout=300)
    crashed, text, flagged, left = json.loads(p.stdout.strip().splitlines()[-1])
    assert not crashed, text
    assert flagged == [1, 2]  # the subclass's own unscale_ was seen at steps 3 and 4
    assert not left  # the class-creation hook is removed with the other interceptors


# ---------------------------------------------------------------------------------------------- recorded series
def _view(series, **kw):
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.rules.base import RunView

    steps = [StepRecord(step=i, total_norm=n, loss=v, has_loss=True, numel=10)
             for i, (n, v) in enumerate(series, 1)]
    return RunView(steps=steps, **kw)


# pytorch/examples word_language_model (LSTM, hand-written SGD, clip 0.25) at --lr 2000, as checked: the loss
# jumps 20x at the second step and climbs on to 126x, the norms before the clip level at ~5
WLM_LR2000_LOSS = [7.9, 160.1, 21.4, 38.5, 335.9, 583.1, 436.4, 447.0, 450.6, 352.7, 470.0, 515.7, 613.9, 614.1,
                   498.4, 492.2, 582.1, 572.5, 642.1, 817.7, 877.2, 936.0, 822.0, 817.5, 736.3, 744.2, 926.4, 994.8,
                   829.1, 902.1, 809.1]
WLM_LR2000_NORM = [0.16, 32.48, 16.68, 3.91, 5.78, 28.49, 4.81, 5.43, 21.06, 4.2, 5.67, 3.48, 5.63, 5.98, 5.73, 4.07,
                   5.92, 5.7, 4.84, 4.6, 5.1, 5.85, 5.74, 5.41, 4.86, 5.66, 5.86, 5.47, 5.51, 5.06, 5.69]


def test_an_early_jump_that_keeps_climbing_is_not_a_bootstrapped_loss():
    from fastgrad.diagnose.advice import advise
    from fastgrad.diagnose.finding import Finding
    from fastgrad.diagnose.rules.loss_diverging import LOSS_DIVERGING

    f, = LOSS_DIVERGING.evaluate(_view(list(zip(WLM_LR2000_NORM, WLM_LR2000_LOSS))))
    assert f.severity == "critical" and f.evidence.get("variant") is None and f.evidence["first_step"] == 5
    # and so the depth finding of that run gets no "higher learning rate" advice
    depth = Finding("depth_vanishing", "warning", "vanishing across depth")
    texts = " ".join(t + s for _, t, s in advise([f, depth]))
    assert "10 * lr" not in texts and "higher learning rate" not in texts
    # the same climb reached gradually (10x only after the first quarter): still the bootstrapped notice
    slow = [7.9 * (1 + 0.15 * i) for i in range(31)]
    g, = LOSS_DIVERGING.evaluate(_view([(5.0, v) for v in slow]))
    assert g.severity == "notice" and g.evidence["variant"] == "bootstrapped"


def _td_rise(cross: int, n: int = 40) -> list[float]:
    """A TD critic's loss (recorded shape): tiny while its targets are 0, 10x its start at step ``cross``
    (its peak), then back down to about 1.8x its start, where it stays."""
    start, peak, end = 0.0064, 0.064, 0.0115
    return [start * (peak / start) ** (i / (cross - 1)) if i < cross else
            peak + (end - peak) * min(1.0, (i - cross + 1) / 8) for i in range(n)]


def test_a_rise_that_came_back_down_with_no_other_harm_is_the_bootstrapped_notice():
    from fastgrad.diagnose.rules.loss_diverging import LOSS_DIVERGING

    norms = [0.2 + 0.002 * (i % 5) for i in range(40)]
    loss = _td_rise(17)   # 10x only after the first quarter (step 17 of 40), its peak in the first half
    f, = LOSS_DIVERGING.evaluate(_view(list(zip(norms, loss))))
    assert f.severity == "notice" and f.evidence["variant"] == "bootstrapped"
    # nearest wrong variants: 10x within the first quarter (a jump), norms that grew 3x, an update that rewrote
    # the weights: the unrecovered warning
    f, = LOSS_DIVERGING.evaluate(_view(list(zip(norms, _td_rise(5)))))
    assert f.severity == "warning" and f.evidence["variant"] == "unrecovered"
    grown = norms[:20] + [3 * v for v in norms[20:]]   # a 3x rise of the norm's level with the loss's: its scale
    f, = LOSS_DIVERGING.evaluate(_view(list(zip(grown, loss))))
    assert f.severity == "notice" and f.evidence["variant"] == "bootstrapped"
    far = list(norms)
    far[25] = RunLimits.far_ratio * 1.01 * norms[24]     # one norm far above its own level
    f, = LOSS_DIVERGING.evaluate(_view(list(zip(far, loss))))
    assert f.severity == "warning" and f.evidence["variant"] == "unrecovered"
    far[25] = RunLimits.far_ratio * 0.95 * norms[24]
    assert LOSS_DIVERGING.evaluate(_view(list(zip(far, loss))))[0].severity == "notice"
    rw = _view(list(zip(norms, loss)))
    rw.ctx["updates"] = [{"step": 17, "series": 0, "lr": 0.01, "ratio": 1.2, "layers": {}}]
    f, = LOSS_DIVERGING.evaluate(rw)
    assert f.severity == "warning" and f.evidence["variant"] == "unrecovered" and f.evidence["rewrite"][0] == 17


def test_a_learning_rate_of_zero_is_named(tmp):
    r = run("lr0", tmp)
    losses = [t["loss"] for t in r["truth"]["steps"]]
    q = len(losses) // 4
    assert abs(sum(losses[:q]) - sum(losses[-q:])) < 0.25 * sum(losses[:q])  # the premise: only the batches move
    f = r["json"]["findings"][0]
    assert f["code"] == "lr_zero" and f["severity"] == "warning" and f["evidence"]["count"] == 60
    assert r["json"]["recommendations"][0]["code"] == "lr_zero" and r["rc"] == 0
    # a warm-up from 0 is not this
    from fastgrad.diagnose.rules.lr_zero import LR_ZERO

    v = _view([(1.0, 1.0)] * 5)
    for i, rec in enumerate(v.steps):
        rec.lr = 0.0 if i == 0 else 1e-3 * i
    assert LR_ZERO.evaluate(v) == []


def test_an_explosion_the_script_already_clips_is_not_told_to_add_a_clip():
    """word_language_model's Transformer with AdamW at lr 3, clip 0.25: norms of 100+ before the clip. The
    finding said 'clip (max_norm=1.0)' and the advice 'clip before every step' to a script that clips."""
    from fastgrad.diagnose.advice import advise
    from fastgrad.diagnose.rules.exploding import EXPLODING

    def view(updates=(), jump=1.0):
        v = _view([(0.25, 8.0)] * 6)
        for rec, pre in zip(v.steps, [1.13, 20.0, 60.0, 104.6, 133.3, 80.1]):
            rec.clipped, rec.clip_max, rec.clip_norm, rec.clip_read = True, 0.25, pre, True
        v.steps[4].loss *= jump
        v.ctx["updates"] = [{"step": s, "series": 0, "lr": 3.0, "ratio": u, "layers": {}} for s, u in updates]
        return v
    # with harm (the loss jumped 20x at step 5, a norm above 100): a warning whose advice is the learning rate,
    # not a clip
    f, = EXPLODING.evaluate(view(jump=20.0))
    assert f.severity == "warning" and f.evidence["variant"] == "clipped"
    assert "clip (max_norm=1.0)" not in f.title and "max_norm=0.25 bounds the update" in f.title
    (code, text, snippet), = advise([f])
    assert "Clip the gradient norm before every" not in text and "lr'] *= 0.1" in snippet
    # without harm (a flat loss, small updates): the guide's question, and still no advice to add a clip
    f, = EXPLODING.evaluate(view([(4, 0.01)]))
    assert f.severity == "notice" and "clip (max_norm=1.0)" not in f.title
    (code, text, snippet), = advise([f])
    assert "Clip the gradient norm before every" not in text and "clip_grad_norm_(" not in snippet


def test_the_watcher_names_a_bad_batch_but_not_a_mask_argument():
    import torch

    from fastgrad.diagnose.collect.watch import ForwardWatcher

    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    causal = torch.triu(torch.full((5, 5), float("-inf")), 1)  # a float mask: -inf above the diagonal
    with ForwardWatcher(mha) as w:
        mha(x, x, x, None, False, causal)  # the mask passed positionally
        assert w.first_nonfinite() is None
        x[1, 2, 3] = float("nan")
        w.step()
        mha(x, x, x)
        o = w.first_nonfinite()
        assert (o.where, o.module, o.step, o.call) == ("input", "MultiheadAttention", 1, 0)
        assert str(o).startswith("first non-finite input: MultiheadAttention")
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    w = ForwardWatcher()  # global: the root's batch
    try:
        net(torch.randn(3, 8))
        w.step()
        net(torch.full((3, 8), float("inf")))
        o = w.first_nonfinite()
        assert (o.where, o.module, o.step) == ("input", "Sequential", 1)
    finally:
        w.remove()
