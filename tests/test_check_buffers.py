"""``python -m fastgrad.check`` reads the models' buffers: a NaN batch through a BatchNorm in training mode writes
NaN into its running statistics before any guard decides, and check names those buffers (``nonfinite_buffers``)
and never calls such a run protected. The truth is the script's own (``tests/check_scripts/bn_nan_guarded.py``:
the buffers and the evaluation output read with plain calls at the end). Also: no summary row rates a NaN/Inf
value healthy."""

import math

import pytest

from fastgrad.diagnose.collect.buffers import sampled
from fastgrad.diagnose.collect.steps import StepRecord
from fastgrad.diagnose.rules.base import RunView
from fastgrad.diagnose.rules.buffers import NONFINITE_BUFFERS, buffers_bad

from .check_runs import checked_once, codes, finding, row

_cache: dict = {}


def run(tmp_path_factory, *args):
    return checked_once(_cache, tmp_path_factory, "bn_nan_guarded.py", *args)


def _nonfinite_text(v: str) -> bool:
    return any(w in str(v).lower().replace(",", " ").split() for w in ("nan", "inf"))


def _buffer_names(f: dict) -> list[str]:
    return sorted(f["layers"])


def test_a_guard_without_the_model_is_not_protection_for_the_buffers(tmp_path_factory):
    r = run(tmp_path_factory, "guarded")
    t = r["truth"]
    # the premise, by plain reads: the guard skipped the NaN step, the buffers are NaN, eval output too
    assert t["skipped"] == 1 and t["bad_buffers"] == ["1.running_mean", "1.running_var"] and not t["eval_finite"]
    # the NaN batch first (the cause), then what it left in the model; both critical: the model is damaged
    assert [f["code"] for f in r["json"]["findings"][:2]] == ["nonfinite_loss", "nonfinite_buffers"]
    f = finding(r, "nonfinite_buffers")
    assert f["severity"] == "critical" and r["rc"] == 1 and finding(r, "nonfinite_loss")["severity"] == "critical"
    assert _buffer_names(f) == t["bad_buffers"] and f["evidence"]["written_at"] == 6 and f["steps"] == [6]
    assert "protected" not in r["md"].lower() and "the buffers did" in finding(r, "nonfinite_loss")["title"]
    assert "the buffers are not" in finding(r, "guard_skipped")["detail"]
    rec = next(x for x in r["json"]["recommendations"] if x["code"] == "nonfinite_buffers")
    # the advice in the script's own names: its optimizer is `opt`, its model `model`
    assert "fastgrad.StepGuard(opt, max_norm=1.0, model=model)" in rec["code_to_add"]
    assert "reset_running_stats" in rec["code_to_add"]


def test_a_guard_given_the_model_keeps_the_run_protected(tmp_path_factory):
    r = run(tmp_path_factory, "model")
    t = r["truth"]
    assert t["skipped"] == 1 and t["bad_buffers"] == [] and t["eval_finite"]
    assert "nonfinite_buffers" not in codes(r) and r["rc"] == 0
    assert "the run is protected" in finding(r, "nonfinite_loss")["title"]
    assert "the run is protected" in row(r, "Steps checked")["value"]


def test_an_unguarded_nan_batch_names_the_buffers_and_rates_no_nan_healthy(tmp_path_factory):
    r = run(tmp_path_factory, "unguarded")
    t = r["truth"]
    assert t["skipped"] == 0 and t["bad_buffers"] == ["1.running_mean", "1.running_var"] and not t["eval_finite"]
    assert any(not math.isfinite(float(s["norm"])) for s in t["steps"])
    assert _buffer_names(finding(r, "nonfinite_buffers")) == t["bad_buffers"]
    assert r["json"]["findings"][0]["code"] == "nonfinite_loss"   # the batch is the cause, the buffers an effect
    assert row(r, "Norm before clipping (last step)")["value"] == "nan"
    lies = [x for x in r["json"]["summary"] if x["status"] == "healthy" and _nonfinite_text(x["value"])
            and not x["value"].startswith("0 of")]
    assert not lies, lies


def test_a_nan_written_after_the_last_sampled_step_is_read_when_the_script_ends(tmp_path_factory):
    # steps 9 to 12 are not sampled: only the read when the script has returned sees the NaN of step 10
    assert not any(sampled(s) for s in (9, 10, 11, 12)) and sampled(8) and sampled(16)
    r = run(tmp_path_factory, "guarded", "10")
    t = r["truth"]
    assert t["bad_buffers"] == ["1.running_mean", "1.running_var"]
    f = finding(r, "nonfinite_buffers")
    assert _buffer_names(f) == t["bad_buffers"] and f["evidence"]["first_step"] is None
    assert f["evidence"]["written_at"] == 10 and "protected" not in r["md"].lower()


def _view(buffers, bad_loss_at=()):
    steps = [StepRecord(step=s, total_norm=1.0, loss=math.nan if s in bad_loss_at else 1.0, has_loss=True,
                        guard_skipped=s in bad_loss_at) for s in range(1, 21)]
    return RunView(steps=steps, ctx={"buffers": buffers, "live": {}})


def _buf(at_end, first=4, final=True):
    return {"name": "bn.running_var", "module_type": "BatchNorm1d", "model": "net", "first_step": first,
            "at_end": at_end, "final_read": final}


def test_the_rule_judges_the_buffers_as_the_run_leaves_them():
    # non-finite at the last read: a finding; non-finite once but finite at the end (reset by the script): none
    assert buffers_bad(_view([_buf(True)])) and not buffers_bad(_view([_buf(False)]))
    assert NONFINITE_BUFFERS.evaluate(_view([_buf(False)])) == []
    f, = NONFINITE_BUFFERS.evaluate(_view([_buf(True, first=16)], bad_loss_at=(11,)))
    # first seen at the read after step 16; the last read before (step 8) found it finite; step 11's loss was NaN
    assert f.evidence["written_at"] == 11 and f.steps == [11] and "step 8" in f.detail
    f, = NONFINITE_BUFFERS.evaluate(_view([_buf(True, first=16)], bad_loss_at=(7,)))
    assert f.evidence["written_at"] is None and f.steps == [16]   # step 7 was before a finite read: not it
    f, = NONFINITE_BUFFERS.evaluate(_view([_buf(True, final=False)]))
    assert "models were gone" in f.detail and f.severity == "critical"


@pytest.mark.parametrize("step,read", [(1, True), (8, True), (9, False), (15, False), (16, True), (17, False)])
def test_the_buffers_are_read_at_the_steps_whose_update_is_measured(step, read):
    assert sampled(step) is read


def test_the_read_flags_nan_and_inf_in_every_floating_dtype_and_nothing_else():
    import torch

    from fastgrad.diagnose.collect.hooks import Checker
    from fastgrad.diagnose.collect.watch import ForwardWatcher

    m = torch.nn.Module()
    m.register_buffer("big", torch.tensor([1e300], dtype=torch.float64))   # finite: not Inf once cast down
    m.register_buffer("h", torch.tensor([1.0, float("nan")], dtype=torch.float16))
    m.register_buffer("b", torch.tensor([float("-inf")], dtype=torch.bfloat16))
    m.register_buffer("ok", torch.zeros(3))
    m.register_buffer("count", torch.tensor(7))
    chk = Checker()
    chk.watcher = ForwardWatcher(m)
    chk._sample_buffers(3)
    m.ok[1] = float("nan")          # turns bad after the sampled read: only the end sees it
    chk.buffers_at_end()
    got = {b["name"]: (b["first_step"], b["at_end"]) for b in chk.buffer_report()}
    assert got == {"h": (3, True), "b": (3, True), "ok": (None, True)}
