"""``python -m fastgrad.check`` on real misbehaving training scripts (tests/check_scripts), in subprocesses.

The subprocess runs start together in one fixture (each subprocess spends most of its few seconds importing torch), then
each test asserts the statuses, the named layers/modules, the red flags and the exit code of one run."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fastgrad
from fastgrad import check as C

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "check_scripts"

RUNS = {
    "healthy": (["--steps", "40"], "healthy_mlp.py", []),
    "rnn": ([], "rnn_explode.py", []),
    "nan_loss": ([], "nan_loss.py", []),
    "vanishing": ([], "vanishing_sigmoid.py", []),
    "dead": ([], "dead_relu.py", []),
    "amp_scaled_clip": ([], "amp_clip_before_unscale.py", []),
    "no_zero": ([], "no_zero_grad.py", []),
    "crash": ([], "crash_after_steps.py", []),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("check")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs, out = {}, {}
    pending = list(RUNS.items())
    # at most 4 at once: the machine is shared
    while pending or procs:
        while pending and len(procs) < 4:
            name, (opts, script, args) = pending.pop(0)
            path = str(SCRIPTS / script)
            cmd = [sys.executable, "-m", "fastgrad.check", *opts, "--out", str(base / name), path, *args]
            # run from a different directory than the script's: the working directory must be kept
            procs[name] = subprocess.Popen(cmd, cwd=base, env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
        for name, p in list(procs.items()):
            if p.poll() is not None:
                stdout, stderr = p.communicate()
                rep = base / name / "report.json"
                out[name] = {"rc": p.returncode, "stdout": stdout, "stderr": stderr, "dir": base / name,
                             "json": json.loads(rep.read_text()) if rep.exists() else None}
                del procs[name]
        time.sleep(0.05)
    return out


def _inproc(args, steps=None):
    """The accumulation variants run in this process (same report, no torch import per run)."""
    res = C.run_script(str(SCRIPTS / "accumulation.py"), args, steps=steps)
    return {"rc": res.exit_code, "stdout": res.to_markdown(), "stderr": res.crash_text,
            "json": json.loads(json.dumps(res.to_dict(), default=str))}


def _codes(run, severity=None):
    return [f["code"] for f in run["json"]["findings"] if severity is None or f["severity"] == severity]


def _finding(run, code):
    return next(f for f in run["json"]["findings"] if f["code"] == code)


def _row(run, metric):
    return next(r for r in run["json"]["summary"] if r["metric"].startswith(metric))


def test_healthy_mlp_exit_0_no_warnings_and_all_outputs(runs):
    r = runs["healthy"]
    assert r["rc"] == 0, r["stderr"]
    assert not _codes(r, "warning") and not _codes(r, "critical")
    md = r["stdout"]
    for head in ("## Gradient Health Report", "### Summary", "| Metric | Value | Status |", "### Issues Detected",
                 "### Recommendations", "### Code to Add", "### Gradient Norm Trend"):
        assert head in md
    assert "done" not in md.split("## Gradient Health Report")[0]  # stopped before its own 60 steps
    j = r["json"]
    assert j["stopped_by_steps"] and len(j["steps"]) == 40
    assert _row(r, "Total grad norm")["status"] == "healthy"
    assert _row(r, "Loss")["status"] == "healthy"
    assert (r["dir"] / "report.md").read_text().startswith("## Gradient Health Report")
    try:
        import matplotlib  # noqa: F401  (the plot is optional: the diagnostics extra brings it)
    except ImportError:
        assert not (r["dir"] / "grad_norm.png").exists() and "no plot: the plot needs matplotlib" in r["stderr"]
    else:
        png = (r["dir"] / "grad_norm.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_rnn_explodes_named_and_critical(runs):
    r = runs["rnn"]
    assert r["rc"] == 1
    nf = _finding(r, "nonfinite")
    assert nf["severity"] == "critical" and "rnn.weight_hh_l0" in nf["layers"]
    assert r["json"]["first_nonfinite_output"].startswith("rnn (RNN) at step ")
    assert _finding(r, "no_clipping")["severity"] == "warning"
    assert _row(r, "Norm trend")["value"].startswith("diverged")
    assert "clip_grad_norm_(model.parameters(), max_norm=1.0)" in r["stdout"]


def test_nan_loss_with_finite_gradients_is_critical(runs):
    r = runs["nan_loss"]
    assert r["rc"] == 1
    f = _finding(r, "nonfinite_loss")
    assert f["severity"] == "critical" and f["layers"] == ["LogLoss"]
    assert "every gradient stayed finite" in f["detail"]
    assert "nonfinite" not in _codes(r) and "nonfinite_history" not in _codes(r)
    assert _row(r, "NaN/Inf parameters")["status"] == "healthy"
    assert _row(r, "Loss")["status"] == "critical"
    assert r["json"]["first_nonfinite_output"].startswith("LogLoss (LogLoss)")
    assert "torch.log(p.clamp_min(1e-8))" in r["stdout"]  # the eps/clamp fix as code (report.py advice)


def test_deep_sigmoid_vanishes_across_depth(runs):
    r = runs["vanishing"]
    assert r["rc"] == 0  # warnings only
    f = _finding(r, "depth_vanishing")
    assert f["severity"] == "warning" and f["layers"][:2] == ["0", "2"]
    assert "kaiming_normal_" in r["stdout"] or "residual" in r["stdout"]


def test_dead_relus(runs):
    r = runs["dead"]
    assert r["rc"] == 0
    f = _finding(r, "dead")
    assert f["severity"] == "warning" and {"0.weight", "2.weight"} <= set(f["layers"])
    assert _row(r, "Zero-gradient parameters")["status"] == "warning"
    assert "LeakyReLU" in r["stdout"]


def test_amp_clip_before_unscale_red_flag(runs):
    r = runs["amp_scaled_clip"]
    assert r["rc"] == 1
    f = _finding(r, "clip_scaled")
    assert f["severity"] == "critical" and f["steps"][:3] == [1, 2, 3]
    assert "scaler.unscale_(optimizer)" in r["stdout"]
    assert not r["json"]["red_flags"]["clip_after_step"] and not r["json"]["red_flags"]["clip_partial"]


def test_never_zeroed_gradients_red_flag(runs):
    r = runs["no_zero"]
    assert r["rc"] == 1
    f = _finding(r, "no_zero_grad")
    assert f["severity"] == "critical" and len(f["steps"]) == 29  # every step after the first
    assert "optimizer.zero_grad(set_to_none=True)" in r["stdout"]
    assert _row(r, "Gradient zeroing")["status"] == "critical"


def test_amp_accumulation_done_right_is_clean():
    r = _inproc(["--clip", "window", "--amp", "--steps", "15"])
    assert r["rc"] == 0, r["stderr"]
    assert not _codes(r, "warning") and not _codes(r, "critical")
    assert not any(r["json"]["red_flags"].values())
    steps = r["json"]["steps"]
    assert len(steps) == 15 and all(s["clip_norm"] is not None for s in steps)
    # the loss seen is the unscaled one (the per-micro-batch loss / 4), not loss * 65536
    assert all(0 < s["loss"] < 2 for s in steps)


def test_clip_inside_accumulation_window_red_flag():
    r = _inproc(["--clip", "micro", "--steps", "10"])
    assert r["rc"] == 0
    f = _finding(r, "clip_partial")
    assert f["severity"] == "warning" and f["steps"] == list(range(1, 11))
    assert "once per window" in r["stdout"]
    assert "clip_after_step" not in _codes(r)


def test_clip_after_step_red_flag_and_steps_option():
    r = _inproc(["--clip", "after-step"], steps=10)
    assert r["rc"] == 0
    f = _finding(r, "clip_after_step")
    assert f["severity"] == "warning" and f["steps"] == list(range(1, 10))  # the 10th clip never ran (--steps)
    assert "clip_partial" not in _codes(r)
    assert r["json"]["stopped_by_steps"] and len(r["json"]["steps"]) == 10


def test_crashed_script_exit_3_with_partial_report(runs):
    r = runs["crash"]
    assert r["rc"] == 3
    assert "mat1 and mat2 shapes cannot be multiplied" in r["stderr"]
    assert len(r["json"]["steps"]) == 3 and "script_crashed" in _codes(r)
    assert "## Gradient Health Report" in r["stdout"]


def test_no_optimizer_step_exit_4(tmp_path, capsys):
    script = tmp_path / "no_steps.py"
    script.write_text("import torch\nprint('no optimizer here')\n")
    assert C.main([str(script)]) == 4
    assert "no optimizer here" in capsys.readouterr().out


def test_usage_errors_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        C.main([str(tmp_path / "missing.py")])
    assert e.value.code == 2 and "script not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        C.main(["--steps", "0", str(SCRIPTS / "healthy_mlp.py")])
    assert e.value.code == 2


# ---------------------------------------------------------------------------------------------- in-process
def _global_state():
    import torch.nn.modules.module as M
    import torch.optim.optimizer as O
    from torch.nn.utils import clip_grad

    return (torch.Tensor.backward, torch.autograd.backward, torch.optim.Optimizer.zero_grad,
            torch.nn.Module.zero_grad, torch.amp.GradScaler.scale, torch.amp.GradScaler.unscale_,
            torch.amp.GradScaler.step, torch.nn.utils.clip_grad_norm_, clip_grad.clip_grad_value_,
            fastgrad.clip_grad_norm_, fastgrad.scaler_unscale_and_clip, fastgrad.adaptive_clip_grad_,
            len(O._global_optimizer_pre_hooks), len(O._global_optimizer_post_hooks),
            len(M._global_forward_hooks), len(M._global_forward_pre_hooks), list(sys.argv), list(sys.path))


def test_interceptors_and_hooks_removed_after_run():
    before = _global_state()
    res = C.run_script(str(SCRIPTS / "healthy_mlp.py"), ["--steps", "5"], steps=3)
    assert len(res.steps) == 3 and res.stopped
    assert _global_state() == before
    res = C.run_script(str(SCRIPTS / "crash_after_steps.py"), [])
    assert res.crashed and res.exit_code == 3
    assert _global_state() == before


def test_no_host_sync_while_the_script_runs(monkeypatch):
    """Every read of the device happens after the script: item/bool/tolist raise while it runs."""
    armed = {"on": False}
    real = {n: getattr(torch.Tensor, n) for n in ("item", "__bool__", "tolist", "__float__", "__int__")}

    def guard(name):
        def f(self, *a, **k):
            if armed["on"]:
                raise AssertionError(f"host sync ({name}) while the checked script runs")
            return real[name](self, *a, **k)
        return f

    for n in real:
        monkeypatch.setattr(torch.Tensor, n, guard(n))
    orig_install, orig_remove = C.Checker.install, C.Checker.remove

    def install(self):
        orig_install(self)
        armed["on"] = True

    def remove(self):
        armed["on"] = False
        orig_remove(self)

    monkeypatch.setattr(C.Checker, "install", install)
    monkeypatch.setattr(C.Checker, "remove", remove)
    # flush_every larger than the run: the only reads are the final ones. SGD scripts: torch's Adam and
    # GradScaler.step read the device themselves (not ours to fix).
    res = C.run_script(str(SCRIPTS / "no_zero_grad.py"), [], flush_every=1000)
    assert not res.crashed, res.crash_text
    assert len(res.steps) == 30 and "no_zero_grad" in res.codes()
    res = C.run_script(str(SCRIPTS / "nan_loss.py"), [], flush_every=1000)
    assert not res.crashed, res.crash_text
    assert res.origin.startswith("LogLoss") and "nonfinite_loss" in res.codes()


def test_fused_amp_clip_is_clean_and_fastgrad_clip_of_scaled_grads_is_flagged(tmp_path):
    res = C.run_script(str(SCRIPTS / "accumulation.py"), ["--clip", "fused", "--amp", "--steps", "5"])
    assert not res.crashed and not any(res.flags.values()) and res.status == "healthy"
    assert all(s.clip_norm is not None and 0 < s.clip_norm < 10 for s in res.steps)  # unscaled norms
    src = (SCRIPTS / "amp_clip_before_unscale.py").read_text()
    bad = tmp_path / "amp_fastgrad_clip.py"
    bad.write_text("import fastgrad\n" + src.replace("torch.nn.utils.clip_grad_norm_", "fastgrad.clip_grad_norm_")
                   .replace("range(20)", "range(4)"))
    res = C.run_script(str(bad), [])
    assert res.flags["clip_scaled"] == [1, 2, 3, 4] and res.exit_code == 1


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_sharded_grad_scaler_clip_before_unscale_is_flagged(tmp_path):
    # FSDP's ShardedGradScaler overrides scale() and unscale_() without calling GradScaler's: the checker
    # must intercept its own methods, or the clip of still-scaled gradients goes unseen (and a correct loop
    # that unscales first would be flagged).
    src = (SCRIPTS / "amp_clip_before_unscale.py").read_text().replace("range(20)", "range(4)")
    pg = (f"import torch.distributed as dist\n"
          f"from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
          f"dist.init_process_group('gloo', init_method={(tmp_path / 'pg').as_uri()!r}, rank=0, world_size=1)\n")
    sharded = src.replace('scaler = torch.amp.GradScaler("cpu")', 'scaler = ShardedGradScaler("cpu")')
    assert sharded != src
    bad, good = tmp_path / "sharded_bad.py", tmp_path / "sharded_good.py"
    bad.write_text(pg + sharded + "dist.destroy_process_group()\n")
    good.write_text(pg + sharded.replace("    torch.nn.utils.clip_grad_norm_",
                                         "    scaler.unscale_(opt)\n    torch.nn.utils.clip_grad_norm_")
                    .replace("init_method=" + repr((tmp_path / "pg").as_uri()),
                             "init_method=" + repr((tmp_path / "pg2").as_uri()))
                    + "dist.destroy_process_group()\n")
    res = C.run_script(str(bad), [])
    assert not res.crashed, res.crash_text
    assert res.flags["clip_scaled"] == [1, 2, 3, 4] and res.exit_code == 1
    res = C.run_script(str(good), [])
    assert not res.crashed, res.crash_text
    assert not res.flags["clip_scaled"] and res.exit_code == 0
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    assert "fastgrad" not in getattr(ShardedGradScaler.unscale_, "__module__", "")  # interceptor removed


def test_periodic_flush_gives_the_same_history():
    a = C.run_script(str(SCRIPTS / "no_zero_grad.py"), [], steps=10, flush_every=3)
    b = C.run_script(str(SCRIPTS / "no_zero_grad.py"), [], steps=10, flush_every=1000)
    assert [s.step for s in a.steps] == list(range(1, 11))
    assert [(s.total_norm, s.loss, s.leftover) for s in a.steps] == [(s.total_norm, s.loss, s.leftover)
                                                                     for s in b.steps]
    assert a.codes() == b.codes()


def test_checker_failure_never_breaks_the_script(tmp_path, capsys):
    # sparse gradients: grad_stats refuses them; the script must still run to its end
    script = tmp_path / "sparse.py"
    script.write_text("import torch\nemb = torch.nn.Embedding(10, 4, sparse=True)\n"
                      "opt = torch.optim.SGD(emb.parameters(), lr=0.1)\nfor i in range(3):\n"
                      "    opt.zero_grad(); emb(torch.tensor([1, 2])).sum().backward(); opt.step()\n"
                      "print('script finished')\n")
    res = C.run_script(str(script), [])
    assert "script finished" in capsys.readouterr().out
    assert not res.crashed and res.exit_code == 0 and len(res.steps) == 3
    assert res.codes() == ["checker_error"] and "sparse" in res.findings[0].detail
