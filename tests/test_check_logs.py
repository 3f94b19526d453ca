"""``python -m fastgrad.check --log``: a finished run judged from its logs. The logs are real: each training
script of ``tests/log_runs/`` runs once under the live check (``run_script``), and the log it wrote along the
way (the Hugging Face Trainer's trainer_state.json, Lightning's CSVLogger metrics.csv, a TensorBoard
SummaryWriter's event file, CSVs) is judged after it. The log's verdict must be the live run's, its findings
the live run's findings that need only the logged series, and its steps the live run's steps. Then the "Not
checked" section, the CI policy (--ignore, --fail-on, fastgrad-check.toml) and the errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fastgrad import check
from fastgrad.diagnose.collect.logs import LogError, parse_columns, read_log
from fastgrad.diagnose.collect.steps import StepRecord
from fastgrad.diagnose.policy import load_policy
from fastgrad.diagnose.result import build_log_result
from fastgrad.diagnose.rules.base import RunView
from fastgrad.diagnose.rules.registry import not_checked

RUNS = Path(__file__).parent / "log_runs"


def _live(script: str, out: Path, *args: str):
    return check.run_script(str(RUNS / script), [str(out), *args])


def _same_verdict(live, log_res):
    """The log's verdict is the live run's; its findings are the live findings the log can judge."""
    skipped = {c for item in log_res.not_checked for c in item["codes"]}
    assert log_res.status == live.status
    assert log_res.exit_code == live.exit_code
    # a live run whose last step is non-finite tells the NaN history in the last step's ``nonfinite`` finding
    # (rules.nonfinite.NonfiniteHistory); a log has no last-step tensors, so the history rule says it itself
    live_codes = {"nonfinite_history" if c == "nonfinite" else c for c in live.codes()}
    assert set(log_res.codes()) == {c for c in live_codes if c not in skipped}
    assert "exploding" not in skipped and "loss_diverging" not in skipped  # judged from the log, not left out


def _same_steps(live, log_res):
    assert [r.step for r in log_res.steps] == [r.step for r in live.steps]
    for a, b in zip(live.steps, log_res.steps):
        assert b.loss == pytest.approx(a.loss, rel=1e-5, nan_ok=True)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4, nan_ok=True)


@pytest.mark.parametrize("lr,status", [("0.05", "healthy"), ("2", "critical")])
def test_hf_trainer_state_gives_the_live_verdict(tmp_path, lr, status):
    pytest.importorskip("transformers")
    live = _live("hf_trainer.py", tmp_path, "--lr", lr)
    res = build_log_result(read_log(str(tmp_path / "trainer_state.json")))
    assert live.status == status
    _same_verdict(live, res)
    _same_steps(live, res)
    if status == "critical":
        assert {"loss_diverging", "exploding"} <= set(res.codes())
    # the folder finds its trainer_state.json
    assert read_log(str(tmp_path)).kind == "hf"


@pytest.mark.parametrize("lr,status", [("0.05", "healthy"), ("2", "critical")])
def test_lightning_metrics_csv_gives_the_live_verdict(tmp_path, lr, status):
    pytest.importorskip("lightning")
    live = _live("lightning_csv.py", tmp_path, "--lr", lr)
    log = read_log(str(tmp_path / "run" / "version_0"))
    assert log.kind == "lightning" and log.columns["grad_norm"] == "grad_2.0_norm_total"
    assert log.columns["lr"] == "lr-SGD"
    res = build_log_result(log)
    assert live.status == status
    _same_verdict(live, res)
    # Lightning logs step N under N - 1: read back as the live run's numbering
    _same_steps(live, res)
    # its validation loss is counted and said not judged; the live run says it read none
    why = {i["rule"]: i["reason"] for i in res.not_checked}
    assert log.validation[0] == "val_loss" and log.validation[1] >= 2
    assert why["overfitting"].startswith(f"the log's {log.validation[1]} validation losses (`val_loss`)")
    assert {i["rule"]: i["reason"] for i in live.not_checked}["overfitting"].startswith("no validation loss: a live")


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    pytest.importorskip("tensorboard")
    out = {}
    for name, args in (("healthy", []), ("nan", ["--nan-at", "30"])):
        d = tmp_path_factory.mktemp(name)
        out[name] = (_live("tb_loop.py", d, *args), d)
    return out


@pytest.mark.parametrize("name,status", [("healthy", "healthy"), ("nan", "critical")])
@pytest.mark.parametrize("which", ["tb", "log.csv"])
def test_tensorboard_and_csv_give_the_live_verdict(loop_runs, name, status, which):
    live, d = loop_runs[name]
    res = build_log_result(read_log(str(d / which)))
    assert res.source["kind"] == ("tensorboard" if which == "tb" else "csv")
    assert live.status == status
    _same_verdict(live, res)
    _same_steps(live, res)
    if name == "nan":
        assert "nonfinite_loss" in res.codes() and 30 in res.findings[0].steps


def test_columns_mapping_and_errors_write_nothing(loop_runs, tmp_path, capsys):
    _, d = loop_runs["healthy"]
    out = tmp_path / "out"
    # names it does not know: an error naming the columns, nothing written
    with pytest.raises(SystemExit) as e:
        check.main(["--log", str(d / "custom.csv"), "--out", str(out)])
    assert e.value.code == 2 and "it, objective, gnorm, eta" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit):
        check.main(["--log", str(d / "custom.csv"), "--columns", "loss=objective,grad_norm=missing", "--out", str(out)])
    assert "no column 'missing'" in capsys.readouterr().err and not out.exists()
    assert check.main(["--log", str(d / "custom.csv"), "--columns", "loss=objective,grad_norm=gnorm,lr=eta,step=it",
                       "--out", str(out)]) == 0
    doc = json.loads((out / "report.json").read_text())
    assert doc["schema_version"] == 1 and doc["status"] == "healthy" and doc["log"]["kind"] == "csv"
    assert {"last_step", "no_zero_grad"} <= {item["rule"] for item in doc["not_checked"]}
    assert "### Not Checked" in (out / "report.md").read_text()


@pytest.mark.parametrize("text,msg", [
    ("{not json", "cannot be read as JSON"),
    ('{"best_metric": 1}', "no log_history"),
])
def test_unreadable_hf_file_is_an_error(tmp_path, text, msg):
    p = tmp_path / "trainer_state.json"
    p.write_text(text)
    with pytest.raises(LogError, match=msg):
        read_log(str(p))


def test_csv_errors(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("step,loss,train/loss\n1,2,3\n")
    with pytest.raises(LogError, match="2 columns could be the loss"):
        read_log(str(p))
    p.write_text("step,loss\n1,abc\n")
    with pytest.raises(LogError, match="'abc', not a number"):
        read_log(str(p))
    with pytest.raises(LogError, match="no such file"):
        read_log(str(tmp_path / "none.csv"))
    with pytest.raises(LogError, match="unknown role"):
        parse_columns("weight=w")
    with pytest.raises(LogError, match="not ROLE=COLUMN"):
        parse_columns("loss")


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tb(name, *a, **k):
        if name.startswith("tensorboard"):
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_tb)
    (tmp_path / "events.out.tfevents.1.host").write_bytes(b"")
    with pytest.raises(LogError, match="pip install tensorboard"):
        read_log(str(tmp_path))


# ---------------------------------------------------------------------------------------------- Not checked
def _run(n: int, **kw) -> RunView:
    return RunView(steps=[StepRecord(step=i, loss=1.0 + 0.01 * (i % 3), total_norm=1.0, lr=0.1, **kw)
                          for i in range(1, n + 1)])


def test_not_checked_names_too_few_steps_at_each_rules_own_minimum():
    lim = RunView(steps=[]).limits
    for n, stall_left in ((lim.stall_min_steps - 1, True), (lim.stall_min_steps, False)):
        why = {i["rule"]: i["reason"] for i in not_checked(_run(n))}
        assert ("stall" in why) == stall_left, n
    why = {i["rule"]: i["reason"] for i in not_checked(_run(20))}
    assert why["spike/increasing/decaying"] == "too few steps: 20 steps recorded, it needs 21"
    assert "spike/increasing/decaying" not in {i["rule"] for i in not_checked(_run(21))}
    assert "lr_zero" in {i["rule"] for i in not_checked(_run(1))}
    assert "lr_zero" not in {i["rule"] for i in not_checked(_run(2))}
    # a live run with everything: nothing left out
    assert not_checked(_run(40)) == []


def test_a_log_without_a_norm_leaves_the_norm_rules_out(tmp_path):
    p = tmp_path / "loss.csv"
    p.write_text("step,loss\n" + "".join(f"{i},{1 / i}\n" for i in range(1, 31)))
    res = build_log_result(read_log(str(p)))
    why = {i["rule"]: i["reason"] for i in res.not_checked}
    assert why["exploding"] == "no gradient norm was recorded" and why["lr_zero"] == "no learning rate was recorded"
    assert "stall" not in why and res.status == "healthy"
    # a NaN norm is not invented where there is none
    assert not any(r.bad for r in res.steps) and res.trend == "no gradient norm in the log"
    # a norm logged at 10 of 30 steps: the trends count those 10
    p.write_text("step,loss,grad_norm\n" + "".join(f"{i},{1 / i},{1.0 if i % 3 == 0 else ''}\n" for i in range(1, 31)))
    why = {i["rule"]: i["reason"] for i in build_log_result(read_log(str(p))).not_checked}
    assert why["spike/increasing/decaying"] == "too few steps: 10 steps recorded, it needs 21"


# ---------------------------------------------------------------------------------------------- CI policy
@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    d = tmp_path_factory.mktemp("div")
    check.run_script(str(RUNS / "tb_loop.py"), [str(d), "--lr", "2", "--no-tb"])
    return d / "log.csv"


def test_ignore_and_fail_on_set_the_exit_code(diverged, capsys):
    res = build_log_result(read_log(str(diverged)))
    assert res.status == "critical" and res.exit_code == 1
    worst_codes = res.codes("critical")
    rest = [f for f in res.findings if f.severity != "critical"]
    assert rest and {f.severity for f in rest} <= {"warning", "notice"}
    warned = any(f.severity == "warning" for f in rest)
    ign = ",".join(worst_codes)
    assert check.main(["--log", str(diverged), "--ignore", ign]) == 0
    out = capsys.readouterr().out
    assert "### Ignored" in out and f"`{worst_codes[0]}` (critical)" in out
    # the bar decides: what is left fails at its own severity and passes above it
    assert check.main(["--log", str(diverged), "--ignore", ign, "--fail-on", "warning"]) == int(warned)
    assert check.main(["--log", str(diverged), "--ignore", ign, "--fail-on", "notice"]) == 1
    assert check.main(["--log", str(diverged), "--ignore", ign + "," + ",".join(f.code for f in rest),
                       "--fail-on", "notice"]) == 0
    with pytest.raises(SystemExit) as e:
        check.main(["--log", str(diverged), "--ignore", "exploding,no_such_code"])
    assert e.value.code == 2 and "unknown finding code 'no_such_code'" in capsys.readouterr().err


def test_fail_on_notice_fails_on_a_notice(tmp_path):
    p = tmp_path / "lr0.csv"
    # a loss that falls while the learning rate is 0: lr_zero, a warning
    p.write_text("step,loss,lr\n" + "".join(f"{i},{1 / i},0\n" for i in range(1, 31)))
    res = build_log_result(read_log(str(p)))
    assert res.codes() == ["lr_zero"] and res.exit_code == 0
    for fail_on, code in (("critical", 0), ("warning", 1), ("notice", 1)):
        assert build_log_result(read_log(str(p)), load_policy(None, None, fail_on)).exit_code == code


def test_config_file_beside_the_log(diverged, tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    (d / "log.csv").write_text(diverged.read_text())
    (d / "fastgrad-check.toml").write_text('fail-on = "notice"\n[ignore]\nloss_diverging = "known: lr sweep"\n'
                                           'exploding = "known: lr sweep"\n')
    assert check.main(["--log", str(d / "log.csv")]) == 1  # the spike's notice fails it
    out = capsys.readouterr().out
    assert "(ignored: known: lr sweep)" in out and "fails on notice or worse" in out
    assert check.main(["--log", str(d / "log.csv"), "--fail-on", "critical"]) == 0
    (d / "fastgrad-check.toml").write_text('fail-on = "sometimes"\n')
    with pytest.raises(SystemExit) as e:
        check.main(["--log", str(d / "log.csv")])
    assert e.value.code == 2 and "fail-on must be one of" in capsys.readouterr().err


def test_live_run_reads_the_config_beside_its_script(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text((RUNS / "tb_loop.py").read_text())
    (tmp_path / "fastgrad-check.toml").write_text('ignore = ["loss_diverging", "exploding", "spike"]\n')
    code = check.main([str(script), str(tmp_path / "o"), "--lr", "2", "--no-tb"])
    out = capsys.readouterr().out
    assert "### Ignored" in out and "### Not Checked" in out
    assert code == 0
    assert os.path.exists(tmp_path / "o" / "log.csv")


def test_rows_without_a_step_count_from_1_and_a_folder_with_two_logs_is_refused(tmp_path):
    (tmp_path / "metrics.csv").write_text("loss\n3\n2\n1\n")
    assert [r.step for r in read_log(str(tmp_path / "metrics.csv")).steps] == [1, 2, 3]
    (tmp_path / "trainer_state.json").write_text('{"log_history": [{"loss": 1.0, "step": 1}]}')
    with pytest.raises(LogError, match=r"several logs \(hf, lightning\)"):
        read_log(str(tmp_path))
