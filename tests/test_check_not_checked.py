"""The "Not checked" reasons beyond a rule's missing series: a validation loss, which no rule judges (a log's
validation losses are counted, and the report says they were not judged; a run without one says so), and a rank
of a multi-process run that sent rank 0 no records (``norm_miscounted`` cannot judge the clips, and says which
rank). The real Lightning log with a validation loss is pinned in tests/test_check_logs.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from fastgrad.diagnose.collect import ranks
from fastgrad.diagnose.collect.logs import read_log
from fastgrad.diagnose.collect.steps import StepRecord
from fastgrad.diagnose.render.run_text import not_checked_lines
from fastgrad.diagnose.result import build_log_result
from fastgrad.diagnose.rules.base import RunView
from fastgrad.diagnose.rules.registry import not_checked
from fastgrad.diagnose.rules.validation import OVERFITTING


def _why(res) -> dict:
    return {i["rule"]: i["reason"] for i in res.not_checked}


def _hf_state(path, eval_every: int | None):
    hist = []
    for s in range(1, 31):
        hist.append({"step": s, "loss": 2.0 / s, "grad_norm": 1.0, "learning_rate": 0.1, "epoch": s / 30})
        if eval_every and s % eval_every == 0:
            hist.append({"step": s, "eval_loss": 1.5, "eval_runtime": 0.1, "epoch": s / 30})
    hist.append({"step": 30, "train_loss": 0.5, "train_runtime": 1.0})
    path.write_text(json.dumps({"log_history": hist}))
    return path


def test_a_logs_validation_losses_are_counted_and_said_not_judged(tmp_path):
    res = build_log_result(read_log(str(_hf_state(tmp_path / "trainer_state.json", eval_every=10))))
    why = _why(res)[OVERFITTING]
    assert why.startswith("the log's 3 validation losses (`eval_loss`) were read, but no rule judges")
    # the eval rows are not training steps: the steps and the verdict are the log's training rows
    assert [r.step for r in res.steps] == list(range(1, 31)) and res.status == "healthy"
    # no code: nothing for --ignore to silence, and the text lists it apart from the rules
    item = next(i for i in res.not_checked if i["rule"] == OVERFITTING)
    assert item["codes"] == []
    md = "\n".join(not_checked_lines(res))
    assert "No rule judges these:" in md and f"- {OVERFITTING}: the log's 3 validation losses" in md


@pytest.mark.parametrize("header,rows,col,n", [
    ("step,train/loss,val/loss", ["1,1.0,", "2,0.9,0.95", "3,0.8,", "4,0.7,0.9"], "val/loss", 2),
    ("step,loss,val_loss_epoch", ["1,1.0,", "2,0.9,0.95"], "val_loss_epoch", 1),
])
def test_validation_columns_are_recognised_by_name(tmp_path, header, rows, col, n):
    p = tmp_path / "run.csv"
    p.write_text("\n".join([header, *rows]) + "\n")
    log = read_log(str(p))
    assert log.validation == (col, n)
    assert log.columns["loss"] != col  # a validation loss is never read as the training loss


def test_a_log_without_a_validation_loss_says_so(tmp_path):
    res = build_log_result(read_log(str(_hf_state(tmp_path / "trainer_state.json", eval_every=None))))
    assert _why(res)[OVERFITTING].startswith("no validation loss was recorded")
    # a validation column the log names but never fills is no validation loss either
    p = tmp_path / "run.csv"
    p.write_text("step,loss,val_loss\n1,1.0,\n2,0.9,\n")
    assert read_log(str(p)).validation is None


def test_a_live_report_says_it_reads_no_validation_loss(tmp_path):
    from fastgrad import check

    script = tmp_path / "fit.py"
    script.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "x, y = torch.randn(64, 4), torch.randn(64, 1)\n"
        "for _ in range(5):\n"
        "    opt.zero_grad()\n"
        "    torch.nn.functional.mse_loss(m(x), y).backward()\n"
        "    opt.step()\n")
    res = check.run_script(str(script), [])
    assert _why(res)[OVERFITTING].startswith("no validation loss: a live check reads only the loss")


def test_the_text_says_every_rule_judged_when_only_the_validation_item_is_left():
    res = SimpleNamespace(not_checked=[{"rule": OVERFITTING, "codes": [], "reason": "no validation loss"}])
    lines = not_checked_lines(res)
    assert "Every rule judged this run." in lines and "These rules could not judge" not in "\n".join(lines)


# ---------------------------------------------------------------------------------------------- a silent rank
def _run(**ctx) -> RunView:
    return RunView(steps=[StepRecord(step=i, loss=1.0, total_norm=1.0, lr=0.1) for i in range(1, 41)], ctx=ctx)


def test_a_rank_that_did_not_report_is_named_under_not_checked():
    assert "norm_miscounted" not in {i["rule"] for i in not_checked(_run(ranks_silent={}))}
    why = {i["rule"]: i["reason"] for i in not_checked(_run(ranks_silent={3: "could not read its norm records: x",
                                                                          1: "could not read its norm records: y"}))}
    assert why["norm_miscounted"] == ("rank 1 did not report (could not read its norm records: y); "
                                      "rank 3 did not report (could not read its norm records: x)")


class _Recorder(ranks.RankRecorder):
    def __init__(self):
        self.errors: list[str] = []
        self._rank_init()


@pytest.mark.parametrize("me", [0, 1])
def test_the_gather_flags_a_rank_whose_records_could_not_be_read(monkeypatch, me):
    """Rank ``me`` cannot read its records: it still joins the gather (or the others would wait forever), and
    rank 0 flags it by number; the other rank's records arrive but no clip is judged without both."""
    good = {"calls": [{"step": 1, "entries": [], "norm": 1.0, "dtype": "torch.float32", "max_norm": 1.0}],
            "groups": [[0, 1]], "failed": None}
    sent: list = []

    def gather_object(obj, out, dst):
        sent.append(obj)
        if out is not None:
            out[:] = [obj, good] if me == 0 else [good, obj]

    # rank 0 is the one that reports: when rank 1 is silent, this process plays rank 0 receiving its message
    silent = _Recorder()
    silent._rank_rows = [("not a record",)]  # what reading fails on
    monkeypatch.setattr(ranks, "world", lambda: (0, 2))
    monkeypatch.setattr(ranks, "_groups", lambda rank: [[0, 1]])
    monkeypatch.setattr(torch.distributed, "gather_object", gather_object)
    silent._rank_gather()
    assert sent[0]["failed"].startswith("could not read its norm records:") and sent[0]["calls"] == []
    assert set(silent.ranks_silent) == {me} and silent.ranks_silent[me].startswith("could not read its norm")
    assert silent.rank_calls == []

    # every rank readable: none flagged
    ok = _Recorder()
    sent.clear()
    monkeypatch.setattr(torch.distributed, "gather_object",
                        lambda obj, out, dst: out.__setitem__(slice(None), [obj, good]))
    ok._rank_gather()
    assert ok.ranks_silent == {}
