"""``python -m fastgrad.check`` on real misbehaving training scripts (tests/check_scripts), in subprocesses.

The subprocess runs start together in one fixture (each subprocess spends most of its few seconds importing torch), then
each test asserts the statuses, the named layers/modules, the red flags and the exit code of one run."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastgrad
from fastgrad import check
from fastgrad.diagnose.finding import fmt as _fmt

from .check_runs import codes as _codes, finding as _finding, row as _row

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "check_scripts"

# name: (check options, script, script args[, True: run in this process]). A run happens when a test first
# asks for it (under parallel test workers, each worker runs only what its own tests read); the subprocess
# runs are those whose command line, files or streams the tests read.
RUNS = {
    "healthy": (["--steps", "40"], "healthy_mlp.py", []),
    "rnn": ([], "rnn_explode.py", [], True),
    "nan_loss": ([], "nan_loss.py", [], True),
    "vanishing": ([], "vanishing_sigmoid.py", [], True),
    "dead": ([], "dead_relu.py", [], True),
    "amp_scaled_clip": ([], "amp_clip_before_unscale.py", [], True),
    "no_zero": ([], "no_zero_grad.py", [], True),
    "crash": ([], "crash_after_steps.py", []),
    # one per pattern of a real training loop, each checked against the truth the script computes itself
    "closure_sgd": ([], "closure_opt.py", ["--opt", "sgd"], True),
    "closure_lbfgs": ([], "closure_opt.py", ["--opt", "lbfgs"], True),
    "closure_nan_last": ([], "closure_opt.py", ["--opt", "sgd", "--nan-last"], True),
    "lbfgs_nan_later_eval": ([], "closure_opt.py", ["--opt", "lbfgs", "--nan-last"], True),
    "lightning": ([], "lightning_run.py", []),
    "gan": ([], "gan_two_opts.py", [], True),
    "manual": ([], "manual_sgd.py", [], True),
    "diverge": ([], "diverge_lr.py", [], True),
    "embedding_lm": ([], "embedding_lm.py", [], True),
    "clip_zero": ([], "clip_zero.py", [], True),
    "norm_1000": ([], "norm_1000.py", [], True),
    "guarded": ([], "guarded_nan_and_spike.py", [], True),
    # issue 30's kinds, each with its own float64 truth
    "overflow": ([], "overflow_clip.py", [], True),
    "actor_critic": ([], "actor_critic.py", [], True),
    "dqn": ([], "dqn_td.py", [], True),
    "two_opts_one_zero": ([], "two_opts_one_zero.py", [], True),
    "free_params": ([], "free_params_rnn.py", [], True),
    "log0_loss": ([], "log0_cross_entropy.py", [], True),
    "sweep": ([], "sweep_rebuild.py", [], True),
}


class _Runs:
    """The runs of RUNS, each made on first access and kept for the module. A subprocess writes its output
    to files (a PIPE nobody reads would block its writer once the pipe's buffer is full) and has a deadline."""

    def __init__(self, base: Path):
        self.base = base
        self.done: dict[str, dict] = {}

    def __getitem__(self, name: str) -> dict:
        if name not in self.done:
            self.done[name] = self._run(name)
        return self.done[name]

    def _run(self, name: str) -> dict:
        opts, script, args, *inproc = RUNS[name]
        base = self.base
        truth = base / f"{name}.truth.json"
        if inproc:
            out = _inproc(args, script=script, truth=truth)
            out["truth"] = json.loads(truth.read_text()) if truth.exists() else None
            return out
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   FG_TRUTH=str(truth))
        cmd = [sys.executable, "-m", "fastgrad.check", *opts, "--out", str(base / name), str(SCRIPTS / script), *args]
        so, se = base / f"{name}.stdout", base / f"{name}.stderr"
        with open(so, "w") as fo, open(se, "w") as fe:
            # run from a different directory than the script's: the working directory must be kept
            p = subprocess.run(cmd, cwd=base, env=env, stdout=fo, stderr=fe, timeout=300)
        rep = base / name / "report.json"
        return {"rc": p.returncode, "stdout": so.read_text(), "stderr": se.read_text(), "dir": base / name,
                "json": json.loads(rep.read_text()) if rep.exists() else None,
                "truth": json.loads(truth.read_text()) if truth.exists() else None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _Runs(tmp_path_factory.mktemp("check"))


def _inproc(args, steps=None, script="accumulation.py", truth=None):
    """Variants run in this process (same report, no torch import per run)."""
    if truth is not None:
        os.environ["FG_TRUTH"] = str(truth)
    try:
        res = check.run_script(str(SCRIPTS / script), args, steps=steps)
    finally:
        os.environ.pop("FG_TRUTH", None)
    return {"rc": res.exit_code, "stdout": res.to_markdown(), "stderr": res.crash_text,
            "json": json.loads(json.dumps(res.to_dict(), default=str))}


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
    assert "scaler.unscale_(opt)" in r["stdout"]  # the script's own optimizer variable
    assert not r["json"]["red_flags"]["clip_after_step"] and not r["json"]["red_flags"]["clip_partial"]
    # the clip measured scaled gradients: no "norm before clipping" is claimed (it used to read NaN there and
    # the plot lost its norm line); the norm the update used stands in, everywhere finite
    steps = r["json"]["steps"]
    assert all(x["clip_norm"] is None and math.isfinite(x["grad_norm"]) for x in steps)
    assert not any(m["metric"].startswith("Norm before clipping") for m in r["json"]["summary"])
    assert "not readable (scaled)" in r["stdout"]


def test_never_zeroed_gradients_red_flag(runs):
    r = runs["no_zero"]
    assert r["rc"] == 1
    f = _finding(r, "no_zero_grad")
    assert f["severity"] == "critical" and len(f["steps"]) == 29  # every step after the first
    assert "opt.zero_grad(set_to_none=True)" in r["stdout"]  # the script's own optimizer variable
    assert "optimizer" not in r["stdout"].split("### Code to Add")[1]
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


def test_a_steps_stop_the_script_caught_is_a_stop_not_a_crash():
    # pytest running a test as the checked "script" reports the stop as a failed test and exits 1
    r = _inproc([], steps=10, script="catches_everything.py")
    assert r["rc"] == 0 and r["json"]["stopped_by_steps"] and not r["json"]["crashed"]
    assert "script_crashed" not in _codes(r) and len(r["json"]["steps"]) == 10
    r = _inproc([], script="catches_everything.py")     # no stop: it runs its 50 steps and exits 0
    assert r["rc"] == 0 and len(r["json"]["steps"]) == 50


def test_crashed_script_exit_3_with_partial_report(runs):
    r = runs["crash"]
    assert r["rc"] == 3
    assert "mat1 and mat2 shapes cannot be multiplied" in r["stderr"]
    assert len(r["json"]["steps"]) == 3 and "script_crashed" in _codes(r)
    assert "## Gradient Health Report" in r["stdout"]


def test_no_optimizer_step_exit_4(tmp_path, capsys):
    script = tmp_path / "no_steps.py"
    script.write_text("import torch\nprint('no optimizer here')\n")
    assert check.main([str(script)]) == 4
    assert "no optimizer here" in capsys.readouterr().out


def _check_cli(tmp_path, *argv, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {}))
    p = subprocess.run([sys.executable, "-m", "fastgrad.check", "--out", str(tmp_path / "o"), *argv], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    return p, json.loads((tmp_path / "o" / "report.json").read_text())


def test_training_in_child_processes_is_read_there(tmp_path):
    """A3C's workers step a shared model in processes of their own; the parent never calls backward(). Each
    worker whose function is the script's runs under a checker of its own, and the report is the first's: its 5
    steps, said to be a child's; the first that trained, after an evaluator that did not; where every worker
    crashed (and the parent ended well), the first crash. The nearest wrong
    reading, the parent's empty run, is NOT CHECKED (exit 4); so is
    a function of a library's (``--foreign``), which check leaves alone, and then says why nothing was read."""
    p, r = _check_cli(tmp_path, str(SCRIPTS / "trains_in_children.py"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(r["steps"]) == 5 and "not_checked" not in [f["code"] for f in r["findings"]]
    assert "in child process 1, the first the script started that trained" in \
        next(x["value"] for x in r["summary"] if x["metric"] == "Steps checked")
    for how in (("--subclass",), ("--subclass", "--spawn")):  # a Process subclass of the script's: its run()
        p, r = _check_cli(tmp_path, str(SCRIPTS / "trains_in_children.py"), *how)
        assert p.returncode == 0 and len(r["steps"]) == 5, (how, p.stderr[-3000:])
        assert "in child process 1, the first the script started that trained" in \
            next(x["value"] for x in r["summary"] if x["metric"] == "Steps checked")
    p, r = _check_cli(tmp_path, str(SCRIPTS / "trains_in_children.py"), "--evaluator-first")
    assert p.returncode == 0 and len(r["steps"]) == 5, p.stderr[-3000:]
    assert "in child process 2" in next(x["value"] for x in r["summary"] if x["metric"] == "Steps checked")
    p, r = _check_cli(tmp_path, str(SCRIPTS / "trains_in_children.py"), "--workers-fail")
    assert p.returncode == 3, p.stderr[-3000:]
    crash = next(x for x in r["findings"] if x["code"] == "script_crashed")
    assert crash["severity"] == "critical" and "expected np.ndarray (got tuple)" in crash["detail"]
    assert "in child process 1, which crashed" in next(x["value"] for x in r["summary"]
                                                      if x["metric"] == "Steps checked")
    p, r = _check_cli(tmp_path, str(SCRIPTS / "trains_in_children.py"), "--foreign")
    assert p.returncode == 4, p.stderr[-3000:]
    nc = next(x for x in r["findings"] if x["code"] == "not_checked")
    assert "started 2 child process(es)" in nc["detail"] and "no backward() call was seen" not in nc["detail"]
    assert "none running a function of the script's own" in nc["detail"]
    # children that ran the script's functions were read and trained nothing: said so, not "not seen"
    p, r = _check_cli(tmp_path, str(SCRIPTS / "trains_in_children.py"), "--evaluators-only")
    assert p.returncode == 4, p.stderr[-3000:]
    nc = next(x for x in r["findings"] if x["code"] == "not_checked")
    assert "the 2 that ran its own functions were read, and none reached an optimizer step" in nc["detail"]
    assert "not seen" not in nc["detail"]


def test_a_process_subclass_is_read_only_where_its_run_is_the_scripts(tmp_path):
    """The rule behind reading a Process subclass's child: its ``run`` defined in the script's folder. Not
    multiprocessing's own processes, nor a library's subclass (a file elsewhere), nor a subclass of the script's
    that keeps the inherited run (its target decides, as for a plain Process)."""
    import multiprocessing as mp
    import types

    from fastgrad.diagnose.collect.children import _own_run

    here = str(tmp_path)
    code = compile("def run(self):\n    pass\n", str(tmp_path / "workers.py"), "exec")
    ns: dict = {}
    exec(code, ns)
    own = type("Worker", (mp.Process,), {"run": ns["run"]})
    elsewhere = types.FunctionType(ns["run"].__code__.replace(co_filename="/elsewhere/lib.py"), {}, "run")
    assert _own_run(own, here)
    assert not _own_run(type("Lib", (mp.Process,), {"run": elsewhere}), here)
    assert not _own_run(mp.Process, here) and not _own_run(type("Plain", (mp.Process,), {}), here)


def test_ddp_started_by_spawn_is_read_on_rank_0_as_a_plain_run_records_it(tmp_path):
    """torch.multiprocessing.spawn pickles the script's function into fresh interpreters (through torch's own
    ``_wrap``): rank 0's steps are read there, and its losses are those the same script records run without
    check, bit for bit. ``--steps`` stops each rank quietly at that step: the parent's spawn sees no failure."""
    import socket

    def port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return str(s.getsockname()[1])
    plain = tmp_path / "plain.json"
    env = dict(os.environ, LOSSES=str(plain))
    subprocess.run([sys.executable, str(SCRIPTS / "trains_in_spawned_ddp.py"), port()], env=env, check=True,
                   timeout=300, capture_output=True)
    want = json.loads(plain.read_text())
    p, r = _check_cli(tmp_path, str(SCRIPTS / "trains_in_spawned_ddp.py"), port())
    assert p.returncode == 0, p.stderr[-3000:]
    assert [s["loss"] for s in r["steps"]] == want and len(want) == 25
    p, r = _check_cli(tmp_path, "--steps", "7", str(SCRIPTS / "trains_in_spawned_ddp.py"), port())
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(r["steps"]) == 7 and r["stopped_by_steps"] and not r["crashed"]


def test_a_forked_child_drops_its_parents_checker_before_its_own(tmp_path):
    """A forked child inherits its parent's installed checker (its patches and global hooks, a copy): it is removed
    before the child's own is installed, so each backward and step is read once, by the child's. Called in
    process here, as a fork would run it; the nearest wrong variant stacks the child's patches on the parent's."""
    import pickle

    from fastgrad.diagnose.collect.hooks import Checker
    from fastgrad.diagnose.run import _ACTIVE, CheckedChild
    orig_backward = torch.Tensor.backward
    parent = Checker(None, 64)
    parent.install()
    _ACTIVE.append(parent)
    seen = {}

    def train():
        seen["wrapped_once"] = torch.Tensor.backward.__wrapped__ is orig_backward
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 3)).pow(2).mean().backward()
            opt.step()
    try:
        CheckedChild(train, 0, str(tmp_path), str(tmp_path / "train.py"), [], None, 64, None)()
    finally:
        parent.remove()
        _ACTIVE.clear()
    assert seen["wrapped_once"] and torch.Tensor.backward is orig_backward
    result = pickle.loads((tmp_path / "child-0.pkl").read_bytes())
    assert len(result.steps) == 3 and parent.steps_done == 0


def test_only_the_scripts_own_functions_are_run_under_a_checker_in_a_child(tmp_path):
    """A DataLoader's workers and an environment's run a library's function: never wrapped. The script's own:
    defined in its ``__main__``, or in a module beside it, or through a ``functools.partial``."""
    import functools
    import types

    from torch.utils.data._utils.worker import _worker_loop

    from fastgrad.diagnose.collect.children import script_function
    here = str(tmp_path)
    assert not script_function(_worker_loop, here)
    beside = types.FunctionType(compile("def f():\n    pass\n", str(tmp_path / "workers.py"), "exec").co_consts[0],
                                {})
    beside.__module__ = "workers"
    assert script_function(beside, here) and script_function(functools.partial(beside), here)
    assert not script_function(beside, str(tmp_path / "other"))
    own = types.FunctionType(beside.__code__, {})
    own.__module__ = "__mp_main__"
    assert script_function(own, "")


def test_usage_errors_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        check.main([str(tmp_path / "missing.py")])
    assert e.value.code == 2 and "script not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        check.main(["--steps", "0", str(SCRIPTS / "healthy_mlp.py")])
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
    res = check.run_script(str(SCRIPTS / "healthy_mlp.py"), ["--steps", "5"], steps=3)
    assert len(res.steps) == 3 and res.stopped
    assert _global_state() == before
    res = check.run_script(str(SCRIPTS / "crash_after_steps.py"), [])
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
    orig_install, orig_remove = check.Checker.install, check.Checker.remove

    def install(self):
        orig_install(self)
        armed["on"] = True

    def remove(self):
        armed["on"] = False
        orig_remove(self)

    monkeypatch.setattr(check.Checker, "install", install)
    monkeypatch.setattr(check.Checker, "remove", remove)
    # flush_every larger than the run: the only reads are the final ones. SGD scripts: torch's Adam and
    # GradScaler.step read the device themselves (not ours to fix).
    res = check.run_script(str(SCRIPTS / "no_zero_grad.py"), [], flush_every=1000)
    assert not res.crashed, res.crash_text
    assert len(res.steps) == 30 and "no_zero_grad" in res.codes()
    res = check.run_script(str(SCRIPTS / "nan_loss.py"), [], flush_every=1000)
    assert not res.crashed, res.crash_text
    assert res.origin.startswith("LogLoss") and "nonfinite_loss" in res.codes()


def test_fused_amp_clip_is_clean_and_fastgrad_clip_of_scaled_grads_is_flagged(tmp_path):
    res = check.run_script(str(SCRIPTS / "accumulation.py"), ["--clip", "fused", "--amp", "--steps", "5"])
    assert not res.crashed and not any(res.flags.values()) and res.status == "healthy"
    assert all(s.clip_norm is not None and 0 < s.clip_norm < 10 for s in res.steps)  # unscaled norms
    src = (SCRIPTS / "amp_clip_before_unscale.py").read_text()
    bad = tmp_path / "amp_fastgrad_clip.py"
    bad.write_text("import fastgrad\n" + src.replace("torch.nn.utils.clip_grad_norm_", "fastgrad.clip_grad_norm_")
                   .replace("range(20)", "range(4)"))
    res = check.run_script(str(bad), [])
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
    res = check.run_script(str(bad), [])
    assert not res.crashed, res.crash_text
    assert res.flags["clip_scaled"] == [1, 2, 3, 4] and res.exit_code == 1
    res = check.run_script(str(good), [])
    assert not res.crashed, res.crash_text
    assert not res.flags["clip_scaled"] and res.exit_code == 0
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    assert "fastgrad" not in getattr(ShardedGradScaler.unscale_, "__module__", "")  # interceptor removed


def test_periodic_flush_gives_the_same_history():
    a = check.run_script(str(SCRIPTS / "no_zero_grad.py"), [], steps=10, flush_every=3)
    b = check.run_script(str(SCRIPTS / "no_zero_grad.py"), [], steps=10, flush_every=1000)
    assert [s.step for s in a.steps] == list(range(1, 11))
    assert [(s.total_norm, s.loss, s.leftover) for s in a.steps] == [(s.total_norm, s.loss, s.leftover)
                                                                     for s in b.steps]
    assert a.codes() == b.codes()


def test_sparse_gradients_are_read_not_refused(tmp_path, capsys):
    script = tmp_path / "sparse.py"
    script.write_text("import torch, json, sys\ntorch.manual_seed(0)\nemb = torch.nn.Embedding(10, 4, sparse=True)\n"
                      "opt = torch.optim.SGD(emb.parameters(), lr=0.1)\nnorms = []\nfor i in range(3):\n"
                      "    opt.zero_grad(); emb(torch.tensor([1, 2, 2])).sum().backward()\n"
                      "    norms.append(float(emb.weight.grad.to_dense().norm())); opt.step()\n"
                      f"json.dump(norms, open({str(tmp_path / 'n.json')!r}, 'w'))\nprint('script finished')\n")
    res = check.run_script(str(script), [])
    assert "script finished" in capsys.readouterr().out
    assert not res.crashed and res.exit_code == 0 and len(res.steps) == 3
    assert "checker_error" not in res.codes()
    truth = json.loads((tmp_path / "n.json").read_text())
    assert all(_close(s.total_norm, t) for s, t in zip(res.steps, truth)) and truth[0] > 0


def test_checker_failure_never_breaks_the_script(tmp_path, capsys, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("statistics unavailable")

    import importlib
    import pkgutil

    from fastgrad.diagnose import collect

    # every module of the checker that calls grad_stats (found, so one moved into a new module is covered too)
    users = [m for m in (importlib.import_module(f"{collect.__name__}.{i.name}")
                         for i in pkgutil.iter_modules(collect.__path__)) if hasattr(m, "grad_stats")]
    assert {m.__name__.rsplit(".", 1)[1] for m in users} >= {"manual", "optimizer_hooks"}
    for m in users:
        monkeypatch.setattr(m, "grad_stats", broken)
    res = check.run_script(str(SCRIPTS / "healthy_mlp.py"), ["--steps", "3"])
    assert "done 3" in capsys.readouterr().out
    assert not res.crashed and len(res.steps) == 3 and all(s.unread for s in res.steps)
    # three steps ran but none could be read: not healthy, and no "norm 0" verdict
    assert res.exit_code == 4 and res.status == "not checked" and "not_checked" in res.codes()
    assert not any(r[0].startswith("Total grad norm") for r in res.summary)
    assert "checker_error" in res.codes() and "statistics unavailable" in _finding(
        {"json": json.loads(json.dumps(res.to_dict(), default=str))}, "checker_error")["detail"]


# ---------------------------------------------------------------------------------------------- real loops
# Each script computes its own truth without fastgrad (tests/check_scripts/_truth.py): per-step gradient norms
# in float64 and losses. The report must match it step for step.
# What the statistic achieves: a float32 norm read against float64 truth agrees to ~1e-7 relative; 1e-6
# catches a reported norm off by 1e-5 (a mis-scaled or float16-accumulated statistic) that 1e-3 let through.
def _close(a, b, rel=1e-6):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def _match_norms(steps, truth, key="norm", field="grad_norm"):
    assert len(steps) == len(truth), (len(steps), len(truth))
    for s, t in zip(steps, truth):
        assert _close(s[field], t[key]), (s["step"], s[field], t[key])


def _match_losses(steps, truth):
    for s, t in zip(steps, truth):
        assert _close(s["loss"], t["loss"], 1e-6), (s["step"], s["loss"], t["loss"])


def _no_alarm(r):
    assert not _codes(r, "warning") and not _codes(r, "critical"), r["json"]["findings"]


def test_closure_sgd_read_after_the_closure(runs):
    # was: the pre-step hook read the gradients before the closure made them (step 1 "0 of 0", then
    # every step showed the previous one's)
    r = runs["closure_sgd"]
    assert r["rc"] == 0 and r["json"]["status"] == "healthy", r["stderr"]
    _no_alarm(r)
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    _match_norms(steps, truth)
    _match_losses(steps, truth)
    assert all(s["evals"] == 1 for s in steps)


def test_closure_lbfgs_first_evaluation_is_the_step(runs):
    r = runs["closure_lbfgs"]
    assert r["rc"] == 0 and r["json"]["status"] == "healthy", r["stderr"]
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    _match_norms(steps, truth)
    _match_losses(steps, truth)  # the first evaluation's loss (what LBFGS.step returns), not a sum of all
    assert [s["evals"] for s in steps] == [t["evals"] for t in truth] and max(s["evals"] for s in steps) > 1


def test_nan_born_in_the_last_step_of_a_closure(runs):
    r = runs["closure_nan_last"]
    assert r["rc"] == 1 and r["json"]["status"] == "critical"
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    _match_norms(steps[:-1], truth[:-1])
    assert math.isnan(steps[-1]["total_norm"]) and truth[-1]["norm"] == "nan"
    assert _finding(r, "nonfinite")["steps"] == [6] and _finding(r, "nonfinite_loss")["steps"] == [6]
    assert _row(r, "Norm trend")["value"].startswith("diverged: non-finite from step 6")


def test_lbfgs_nan_only_in_a_later_evaluation_is_counted(runs):
    r = runs["lbfgs_nan_later_eval"]
    assert r["rc"] == 1
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    _match_norms(steps, truth)  # the first evaluations were finite, and are what the step reports
    _match_losses(steps, truth)
    f = _finding(r, "nonfinite_history")
    assert f["severity"] == "critical" and f["steps"] == [6] and "later evaluation" in f["detail"]
    assert steps[-1]["nonfinite"] > 0
    # LBFGS is first read before its closure ever ran the model: the parameters still carry the model's names
    assert f["layers"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_layers_called_from_methods_are_named_by_the_model_that_holds_them():
    # each layer is a root of the forward (no forward() ran); by their own names fc1's and fc_pi's weights
    # would be "weight" and "Linear:weight", fc_v's the same string as fc_pi's
    r = _inproc([], script="agent_methods.py")
    assert r["rc"] == 0, r["stderr"]
    assert set(r["json"]["updates"][0]["layers"]) == {"fc1", "fc_pi", "fc_v"}


def test_a_wrapped_model_is_named_as_the_script_wrote_it():
    r = _inproc([], script="wrapped_model.py")
    assert r["rc"] == 0, r["stderr"]
    assert set(r["json"]["updates"][0]["layers"]) == {"0", "2"}        # not module.0, module.2


@pytest.mark.parametrize("env", [True, False])
def test_a_value_loss_that_rises_with_its_returns_is_no_harm_where_the_script_steps_an_environment(tmp_path, env):
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "fastgrad.check", "--out", str(out), str(SCRIPTS / "env_value_rise.py")]
    env_vars = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd + (["--env"] if env else []), cwd=tmp_path, env=env_vars, capture_output=True,
                       text=True, timeout=300)
    j = json.loads((out / "report.json").read_text())
    ex = next(f for f in j["findings"] if f["code"] == "exploding")
    if env:
        assert p.returncode == 0 and ex["severity"] == "notice" and ex["evidence"]["harm"] == [], p.stdout[-3000:]
    else:
        assert p.returncode == 1 and ex["severity"] == "warning" and "loss_rose" in ex["evidence"]["harm"]


@pytest.mark.parametrize("grad_rollout", [False, True])
def test_an_on_policy_agents_rollouts_are_read_and_its_first_batches_are_new_data(tmp_path, grad_rollout):
    """check counts the calls of a model between two steps: a PPO-style agent that acts 128 times before each
    rollout's 128 steps has 129 at each rollout's first step (with the critic's forward) and 1 elsewhere, whether
    it acts with gradients off or on (philtabor's PPO acts with them on). Its losses are then judged against
    those since the rollout began: the extreme batch at the fourth step of the third rollout, 61x the fit to the
    rollout before, is no outlier on its own rollout's data, where fewer than ten losses are known. The nearest
    wrong reading, the fit to the rollout before, made that batch a hard state of the agent's own data."""
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "fastgrad.check", "--out", str(out), str(SCRIPTS / "ppo_rollouts.py"), "--env"]
    env_vars = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd + (["--grad-rollout"] if grad_rollout else []), cwd=tmp_path, env=env_vars,
                       capture_output=True, text=True, timeout=300)
    j = json.loads((out / "report.json").read_text())
    assert not j["crashed"], p.stderr[-3000:]
    calls = [(s["step"], s["calls"]) for s in j["steps"] if s["calls"] != 1]
    assert calls == [(1 + 128 * i, 129) for i in range(6)] and len(j["steps"]) == 6 * 128
    ex = next(f for f in j["findings"] if f["code"] == "exploding")
    assert "hard_batch" not in ex["evidence"]["harm"] and "step 260 itself" not in ex["detail"], ex["detail"]


def test_lightning_trainer(runs):
    # Lightning's automatic optimization always passes a closure
    r = runs["lightning"]
    assert r["rc"] == 0, r["stderr"][-3000:]
    _no_alarm(r)
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    _match_norms(steps, truth)
    _match_losses(steps, truth)


def test_two_alternating_optimizers_are_two_series(runs):
    r = runs["gan"]
    assert r["rc"] == 0, r["stderr"]
    _no_alarm(r)
    j = r["json"]
    assert j["series"] == ["Adam #1 (opt_d)", "Adam #2 (opt_g)"]
    steps, truth = j["steps"], r["truth"]["steps"]
    assert [s["series"] for s in steps] == [0 if t["opt"] == "D" else 1 for t in truth]
    _match_norms(steps, truth)
    _match_losses(steps, truth)
    assert "spike" not in _codes(r) and "loss_spike" not in _codes(r)
    # each series' trend is judged on its own steps (a merged series would mix two norm levels)
    assert _row(r, "Norm trend [Adam #1")["value"] == "stable" and _row(r, "Norm trend [Adam #2")["status"] == "healthy"
    rows = [m["metric"] for m in j["summary"]]
    assert "Loss (first -> last step) [Adam #1 (opt_d)]" in rows and "Loss (first -> last step) [Adam #2 (opt_g)]" in rows
    d = _row(r, "Loss (first -> last step) [Adam #1")["value"]
    assert d.startswith(_fmt(truth[0]["loss"])) and d.endswith(_fmt(truth[-2]["loss"]))


def test_sweep_that_rebuilds_its_model_keeps_nothing_of_a_dead_run(runs):
    # was: check kept every run's parameters (with their gradients) until the script ended, keyed by id(),
    # which CPython reuses for later objects
    r = runs["sweep"]
    assert r["rc"] == 0, r["stderr"]
    _no_alarm(r)
    j, truth = r["json"], r["truth"]
    assert j["series"] == ["Adam #1 (opt)", "Adam #2 (opt)", "Adam #3 (opt)"]
    assert [s["series"] for s in j["steps"]] == [t["run"] for t in truth["steps"]]
    _match_norms(j["steps"], truth["steps"])
    _match_losses(j["steps"], truth["steps"])
    # after run k: runs 0..k dead (parameter, optimizer, model), as in the same script without check
    assert truth["alive"] == [[[False] * 3] * (k + 1) for k in range(3)], truth["alive"]


def test_identity_map_answers_only_for_its_object_and_lets_go():
    import gc

    from fastgrad.diagnose.collect.identity import IdentityMap

    class Obj:
        pass

    m, a, b = IdentityMap(), Obj(), Obj()
    m[a] = 1
    assert m.get(a) == 1 and a in m and m.get(b) is None and b not in m and len(m) == 1
    assert m.setdefault(a, 2) == 1 and m.setdefault(b, 3) == 3
    del a
    gc.collect()
    assert len(m) == 1 and m.get(b) == 3  # a's entry went with it
    # an entry made for another object under the same key is never answered for a new one
    c = Obj()
    m._d[id(c)] = (m._d[id(b)][0], "b's")  # as if c had reused a dead object's id
    assert m.get(c) is None and c not in m
    m[c] = "c's"
    assert m.get(c) == "c's"
    m[5] = "int"  # not weakly referenceable: not kept
    assert 5 not in m and m.get(5) is None
    t = torch.zeros(2)  # tensors are looked up by identity, never compared by value
    m[t] = "t"
    assert m.get(t) == "t" and torch.zeros(2) not in m


def test_hand_written_update_without_torch_optim(runs):
    r = runs["manual"]
    assert r["rc"] == 0, r["stderr"]
    _no_alarm(r)
    j = r["json"]
    assert j["status"] == "notice" and _codes(r) == ["hand_written_loop"]
    steps, truth = j["steps"], r["truth"]["steps"]
    _match_norms(steps, truth, key="raw")                       # before the clip: what backward produced
    _match_norms(steps, truth, key="norm", field="total_norm")  # after it: what the update consumed
    _match_losses(steps, truth)
    assert all(s["source"] == "backward" for s in steps)
    assert "Loss not seen" not in r["stdout"] and "keep training" in r["stdout"]


def test_accumulation_loss_is_the_sum_backpropagated(tmp_path):
    truth = tmp_path / "t.json"
    r = _inproc(["--clip", "window", "--steps", "6"], truth=truth)
    t = json.loads(truth.read_text())["steps"]
    steps = r["json"]["steps"]
    _match_norms(steps, t)
    _match_losses(steps, t)  # not one micro-batch's (4x low), nor their mean
    assert all(1.0 < s["loss"] < 2.0 for s in steps)


def test_finite_divergence_from_an_absurd_learning_rate(runs):
    r = runs["diverge"]
    assert r["rc"] == 1 and r["json"]["status"] == "critical"
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    _match_norms(steps, truth)
    _match_losses(steps, truth)
    assert max(s["grad_norm"] for s in steps) < 1000 and all(math.isfinite(s["loss"]) for s in steps)
    f = _finding(r, "loss_diverging")
    assert f["severity"] == "critical" and "The learning rate was 1.5" in f["detail"]
    assert f["steps"][0] == 3  # 4.65 -> 164.8 at step 3
    # the first update (step 1) moved the weights by 12x their size, before the loss crossed 10x: the rewrite
    # comes first, with its lr, and the divergence follows from it (its guess at the lr dropped)
    w = _finding(r, "update_rewrote")
    assert _codes(r)[0] == "update_rewrote" and w["evidence"]["first_step"] == 1 and w["evidence"]["lr"] == 1.5
    assert f["evidence"]["follows"] == "update_rewrote" and "first suspect" not in f["title"]
    assert _row(r, "Loss")["status"] == "critical" and _row(r, "Norm trend")["value"].startswith("diverging")
    assert _row(r, "Norm trend")["status"] == "critical"
    assert "group['lr'] *= 0.1" in r["stdout"]


def test_healthy_embedding_language_model_has_no_false_alarm(runs):
    r = runs["embedding_lm"]
    assert r["rc"] == 0, r["stderr"]
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    _match_norms(steps, truth)
    _match_losses(steps, truth)
    _no_alarm(r)
    assert r["json"]["status"] == "healthy" and "depth_vanishing" not in _codes(r)


def test_clip_with_max_norm_zero_is_named(runs):
    r = runs["clip_zero"]
    assert r["rc"] == 1
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    _match_norms(steps, truth, key="raw")
    assert all(s["total_norm"] == 0 for s in steps)
    f = _finding(r, "clip_zeroes")
    assert f["severity"] == "critical" and len(f["steps"]) == 10 and "max_norm=0" in f["title"]
    assert "no_learning" not in _codes(r) and "dead" not in _codes(r)
    assert "max_norm=1.0)   # not max_norm=0" in r["stdout"]


def test_norm_passing_1000_mid_run_is_a_warning_that_names_the_outlier_batch(runs):
    """A corrupt batch at step 14: its own loss jumps 1e8x and its norm passes 1000; the script restores its
    weights after it, so the loss of step 15 is back at its level (plain reads). The outlier batch is named,
    a warning: no damage shows after it, so not critical, and not "is this the loss's own scale?" either."""
    r = runs["norm_1000"]
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    _match_norms(steps, truth)
    _match_losses(steps, truth)
    t = {x["step"]: x for x in truth}
    assert t[14]["loss"] > 1e6 * t[13]["loss"] and t[15]["loss"] < 3 * t[13]["loss"]    # the premise
    assert r["rc"] == 0 and r["json"]["status"] == "warning"
    f = next(f for f in r["json"]["findings"] if f["code"] == "exploding")
    assert f["severity"] == "warning" and f["steps"] == [14] and f["evidence"]["harm"] == ["outlier_batch"]
    assert "step 14 itself jumped" in f["detail"] and "own scale" not in f["title"]
    peak = _row(r, "Max grad norm")
    assert peak["status"] == "warning" and peak["value"].endswith("at step 14")
    assert _row(r, "Total grad norm (last step)")["status"] == "healthy"  # the last step is fine, and says so
    assert _row(r, "Norm trend")["status"] == "warning" and "step 14" in _row(r, "Norm trend")["value"]
    # the sampled trend table (12 of 40 rows) always shows the step where it broke
    assert "| 14 (!) |" in r["stdout"] and 14 in r["json"]["key_steps"]


def test_gradscaler_script_gets_unscale_in_code_to_add(tmp_path):
    r = _inproc(["--amp", "--steps", "16"], script="norm_1000.py", truth=tmp_path / "t.json")
    t = json.loads((tmp_path / "t.json").read_text())["steps"]
    _match_norms(r["json"]["steps"], t)  # the unscaled norms
    assert r["rc"] == 1 and "exploding" in _codes(r, "critical")
    code = r["stdout"].split("### Code to Add")[1]
    assert "scaler.unscale_(opt)" in code  # the script's own optimizer variable
    assert code.index("scaler.unscale_(opt)") < code.index("clip_grad_norm_(")


def test_no_leaky_relu_advice_for_a_recurrent_model():
    from fastgrad.diagnose.advice import advise
    from fastgrad.diagnose.finding import Finding

    dead = [Finding("dead", "warning", "dead parameters")]
    lstm = dict((c, t + s) for c, t, s in advise(dead, {"modules": ["Embedding", "LSTM", "Linear"]}))
    assert "LeakyReLU" not in lstm["dead"] and "LSTM" in lstm["dead"]
    relu = [(c, t + s) for c, t, s in advise(dead, {"modules": ["Linear", "ReLU"]})]
    assert "LeakyReLU" in dict(relu)["dead"]


def test_depth_vanishing_advice_fits_what_the_model_already_has():
    """"Add residual connections and normalisation" is no advice to a model that normalises (a post-norm
    Transformer whose first layers stop learning under a large first lr): it is told warm-up or pre-norm, with a
    warm-up in code, and not a higher lr for the first layers; a plain stack keeps the usual advice."""
    from fastgrad.diagnose.advice import advise
    from fastgrad.diagnose.finding import Finding

    f = [Finding("depth_vanishing", "warning", "vanishing across depth", layers=["enc.0"],
                 evidence={"units": {"enc.0": ["enc.0.weight"]}})]

    def text(modules):
        (code, t, snippet), = advise(f, {"modules": modules})
        return t, snippet
    t, snippet = text(["Embedding", "Linear", "LayerNorm"])
    assert "pre-norm" in t and "warm" in t and "add residual" not in t
    assert "LambdaLR" in snippet and "10 * lr" not in snippet
    assert "pre-norm" in text(["Conv2d", "BatchNorm2d", "ReLU"])[0]
    t, snippet = text(["Linear", "Tanh"])
    assert "residual connections and normalisation" in t and "10 * lr" in snippet and "enc.0.weight" in snippet


def test_crash_text_has_no_ansi_escape_codes(tmp_path):
    script = tmp_path / "ansi.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "m(torch.ones(1, 2)).sum().backward(); opt.step()\n"
                      "raise RuntimeError('\\x1b[1;31mCUDA out of memory\\x1b[0m')\n")
    res = check.run_script(str(script), [])
    assert res.exit_code == 3 and res.crash_text == "RuntimeError: CUDA out of memory"
    assert "\x1b" not in res.to_markdown() and "\x1b" not in json.dumps(res.to_dict())


def test_nothing_checked_is_never_healthy(tmp_path, capsys):
    script = tmp_path / "no_scalar.py"
    script.write_text("import torch\nw = torch.ones(3, requires_grad=True)\n(w * 2).backward(torch.ones(3))\n")
    res = check.run_script(str(script), [])
    assert res.exit_code == 4 and res.status == "not checked" and not res.steps
    f = next(f for f in res.findings if f.code == "not_checked")
    assert "none on a scalar loss" in f.detail and "not HEALTHY" in f.detail
    md = res.to_markdown()
    assert "**NOT CHECKED**" in md and "keep training" not in md and "No issues detected" not in md


def test_loss_divergence_tiers():
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.rules.loss_diverging import loss_divergence

    def _loss_divergence(recs, ratio=10.0, hold=2):
        return None if (d := loss_divergence(recs, ratio, hold)) is None else d[:6]
    _RISE_RATIO, _RISE_HOLD = 3.0, 3

    def recs(losses):
        return [StepRecord(step=i, loss=v, has_loss=True) for i, v in enumerate(losses, 1)]

    # pytorch/examples word_language_model at --lr 100 (tiny vocabulary, 23 steps): never 10x its start, 3x
    # and more from step 11 on: the warning tier
    lm = [3.13, 6.29, 4.1, 14.82, 8.23, 4.93, 10.22, 9.23, 5.84, 6.6, 10.73, 13.9, 13.47, 15.1, 14.58, 13.17,
          13.51, 14.04, 17.21, 17.7, 15.96, 16.84, 17.91]
    assert _loss_divergence(recs(lm)) is None
    s0, v0, s1, v1, sp, vp = _loss_divergence(recs(lm), _RISE_RATIO, _RISE_HOLD)
    assert (s0, v0, s1, sp, vp) == (1, 3.13, 11, 23, 17.91)
    # one 10x outlier that comes back is not a divergence; noise around a level is not either
    assert _loss_divergence(recs([2.0, 2.1, 25.0, 2.0, 1.9, 1.8])) is None
    assert _loss_divergence(recs([2.0, 2.5, 1.8, 2.2, 2.6, 1.9]), _RISE_RATIO, _RISE_HOLD) is None
    # a signed objective (policy gradient) is not judged by ratios
    assert _loss_divergence(recs([-0.5, 0.1, 5.0, 8.0, 9.0])) is None
    # held to the end of the run counts
    assert _loss_divergence(recs([1.0, 1.1, 1.0, 1.2, 30.0]))[2] == 5


def test_steps_a_step_guard_skipped_are_reported_not_blamed(runs):
    """NaN gradients at steps 6-7 and a 1000x spike at step 12, all skipped by fastgrad.StepGuard: the
    optimizer never stepped on them, so no critical nonfinite_history; a guard_skipped warning names them."""
    r = runs["guarded"]
    steps, truth = r["json"]["steps"], r["truth"]
    assert truth["skipped"] == 3
    finite = [(s, t) for s, t in zip(steps, truth["steps"]) if isinstance(t["norm"], float)]
    _match_norms([s for s, _ in finite], [t for _, t in finite])
    assert [s["step"] for s in steps if s["guard_skipped"]] == [6, 7, 12]
    f = _finding(r, "guard_skipped")
    assert f["severity"] == "warning" and f["steps"] == [6, 7, 12]
    assert "2 with NaN/Inf gradients, 1 spikes" in f["detail"]
    assert "nonfinite_history" not in _codes(r) and "exploding" not in _codes(r)
    assert r["rc"] == 0 and r["json"]["status"] == "warning"
    assert "3 skipped by the step guard" in _row(r, "Steps checked")["value"]


# ---------------------------------------------------------------------------------------------- issue 30's kinds
# New scripts, one per defect of the second round; each computes its truth without fastgrad and each
# reproduces its defect under the rules it replaced (see the premise asserted in each test).
def test_float32_overflow_is_the_largest_explosion_and_the_first_finding(runs):
    r = runs["overflow"]
    truth = r["truth"]["steps"]
    over = [t["step"] for t in truth if t["clip_return"] == "inf"]
    # the premise: finite gradients whose float64 norm is far beyond float32's, clipped at 1.0
    assert over == list(range(2, 31)) and all(t["finite_grads"] for t in truth)
    assert all(t["norm"] > 1e19 for t in truth[1:])
    assert r["rc"] == 1
    steps = r["json"]["steps"]
    assert [s["step"] for s in steps if s["overflow"]] == over
    assert _close(steps[0]["grad_norm"], truth[0]["norm"])
    # the cause first: the clipped update of step 1 (lr 1e6 x a unit gradient) rewrote the weights, and the
    # gradients on the weights it threw overflowed from step 2 (the explosion, right after it, follows it)
    cause, f = r["json"]["findings"][:2]
    assert cause["code"] == "update_rewrote" and cause["evidence"]["first_step"] == 1
    assert "learning rate of 1e+06" in cause["detail"]
    assert f["code"] == "exploding" and f["severity"] == "critical" and "overflowed float32" in f["title"]
    assert f["evidence"]["overflow_steps"] == over and f["steps"] == over and f["evidence"]["first_step"] == 2
    assert f["evidence"]["follows"] == "update_rewrote"
    for code in ("clip_zeroes", "dead", "no_learning", "mostly_zero", "clipped_to_zero"):
        assert code not in _codes(r), code
    recs = r["json"]["recommendations"]
    assert recs[0]["code"] == "update_rewrote" and "lower the learning rate" in recs[0]["text"]
    assert "max_norm=0" not in r["stdout"] and "LeakyReLU" not in r["stdout"]
    assert _row(r, "Max grad norm")["value"].startswith("inf (overflowed float32) at step 2")
    assert "made by the clip" in _row(r, "Zero-gradient parameters")["value"]


def test_bootstrapped_td_loss_rising_with_stable_norms_is_a_notice(runs):
    r = runs["dqn"]
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    _match_norms(steps, truth)
    _match_losses(steps, truth)
    losses = [t["loss"] for t in truth]
    assert sorted(losses[-30:])[15] > 10 * losses[0]  # the premise: the TD loss rose 10x+ and stayed up
    assert r["rc"] == 0, r["json"]["findings"]
    _no_alarm(r)
    f = _finding(r, "loss_diverging")
    assert f["severity"] == "notice" and f["evidence"]["variant"] == "bootstrapped"
    assert "lower the learning rate" not in r["stdout"] and "group['lr'] *= 0.1" not in r["stdout"]


def test_actor_critic_critic_loss_that_comes_back_down_is_not_diverging(runs):
    r = runs["actor_critic"]
    j, truth = r["json"], r["truth"]["steps"]
    assert j["series"] == ["Adam #1 (actor_opt)", "Adam #2 (critic_opt)"]
    _match_norms(j["steps"], truth)
    _match_losses(j["steps"], truth)
    critic = [t["loss"] for t in truth if t["opt"] == "critic"]
    assert max(critic) > 3 * critic[0] and critic[-1] < critic[0]  # the premise: up 3x+, then below its start
    assert r["rc"] == 0 and "loss_diverging" not in _codes(r)
    _no_alarm(r)


def test_an_optimizer_whose_gradients_are_all_zero_gets_its_own_finding(runs):
    r = runs["two_opts_one_zero"]
    j, truth = r["json"], r["truth"]["steps"]
    _match_norms(j["steps"], truth)
    actor = [s["step"] for s, t in zip(j["steps"], truth) if t["opt"] == "actor"]
    assert [t["norm"] for t in truth if t["opt"] == "actor"][1:] == [0.0] * 29  # the premise
    assert r["rc"] == 1
    f = _finding(r, "zero_grads")
    assert f["severity"] == "critical" and f["evidence"]["series"] == 0 and f["steps"] == actor[1:]
    assert f["title"].startswith("Adam #1 (actor_opt):")
    assert [g["evidence"]["series"] for g in j["findings"] if g["code"] == "zero_grads"] == [0]
    assert _row(r, "Norm trend [Adam #1")["value"].startswith("all zero from step 3")
    assert _row(r, "Norm trend [Adam #1")["status"] == "critical"
    assert _row(r, "Norm trend [Adam #2")["status"] == "healthy"


def test_small_by_construction_parameters_are_not_vanishing_layers(runs):
    r = runs["free_params"]
    steps, truth = r["json"]["steps"], r["truth"]["steps"]
    _match_norms(steps, truth)
    _match_losses(steps, truth)
    assert truth[-1]["start"] * 1000 < truth[-1]["head"]  # the premise: the depth ratio alone would flag it
    assert r["rc"] == 0 and "depth_vanishing" not in _codes(r)
    _no_alarm(r)


def test_nan_born_in_a_hand_written_loss_is_traced_to_the_loss(runs):
    r = runs["log0_loss"]
    truth = r["truth"]["steps"]
    k = int(next(t["step"] for t in truth if not t["loss_finite"]))
    _match_norms(r["json"]["steps"][:k - 1], truth[:k - 1])
    assert r["rc"] == 1
    born = r["json"]["nan_born"]
    assert born["where"] == "loss" and born["step"] == k and born["module"] is None
    # the watcher's own answer is a consequence one step later, and is named as such
    assert r["json"]["first_nonfinite_output"] == f"0 (Linear) at step {k + 1}"
    f = _finding(r, "nonfinite_loss")
    assert f["layers"] == [] and f"born in the loss at step {k}" in f["detail"] and "not the source" in f["detail"]
    # born in the loss, and the learning rate's (lr 20 rewrote the weights at the steps before): the rewrite
    # first, the NaN following it
    assert [x["code"] for x in r["json"]["findings"][:2]] == ["update_rewrote", "nonfinite_loss"]
    assert f["evidence"]["follows"] == "update_rewrote" and "learning rate 20" in f["detail"]
    assert r["json"]["recommendations"][0]["code"] == "update_rewrote"
    assert _row(r, "NaN/Inf born in")["value"] == f"loss at step {k}"


def test_nan_born_in_a_module_is_still_named(runs):
    r = runs["nan_loss"]  # the LogLoss module makes it: the forward pass
    assert r["json"]["nan_born"]["where"] == "forward" and r["json"]["nan_born"]["module"] == "LogLoss"


# ---------------------------------------------------------------------------------------------- the rules alone
def _view(series, **kw):
    """A RunView from recorded per-step (norm, loss) series, one per optimizer."""
    from fastgrad.diagnose.collect.steps import StepRecord
    from fastgrad.diagnose.rules.base import RunView

    steps, n = [], 0
    for k, rows in enumerate(series):
        for row in rows:
            n += 1
            norm, loss = row[:2]
            extra = row[2] if len(row) > 2 else {}
            steps.append(StepRecord(step=n, series=k, total_norm=norm, loss=loss, has_loss=loss is not None,
                                    numel=10, **extra))
    return RunView(steps=steps, names=[f"opt{k}" for k in range(len(series))], **kw)


def test_loss_diverging_judges_the_whole_run():
    from fastgrad.diagnose.rules.loss_diverging import LOSS_DIVERGING

    # a PPO critic (Lightning's example): 316 first, 778 peak, 90 last: the report's own row said it fell 3.5x
    ppo = [316, 280, 350, 500, 778, 700, 540, 300, 200, 150, 120, 100, 95, 90]
    assert LOSS_DIVERGING.evaluate(_view([[(5.0, v) for v in ppo]])) == []
    # an absurd learning rate: up 30x and up to the end, norms growing with it
    lr = [2.0, 2.5, 8.0, 30.0, 55.0, 60.0, 64.0, 70.0]
    f, = LOSS_DIVERGING.evaluate(_view([[(1.0 * i, v) for i, v in enumerate(lr, 1)]]))
    assert f.severity == "critical" and f.evidence["start"] == 2.0 and f.evidence["first_step"] == 4
    # the same rise with level, modest norms: a bootstrapped loss, a notice
    f, = LOSS_DIVERGING.evaluate(_view([[(1.0 + 0.01 * i, v) for i, v in enumerate(lr, 1)]]))
    assert f.severity == "notice" and f.evidence["variant"] == "bootstrapped"
    # makemore's RNN at lr=1 (recorded): the loss jumps 8x within six steps and stays 3.6x up, the norms level:
    # a supervised model blowing up early, not a bootstrapped loss: a warning, not the notice
    mm = [3.35, 3.3, 6.9, 14.2, 20.3, 26.4, 18.0, 15.1, 13.9, 12.6, 11.4, 14.2, 13.1, 12.1, 11.8, 12.5]
    f, = LOSS_DIVERGING.evaluate(_view([[(2.8 + 0.1 * (i % 3), v) for i, v in enumerate(mm, 1)]]))
    assert f.severity == "warning" and "variant" not in f.evidence
    # judged per optimizer: the second series' rise is its own
    got = LOSS_DIVERGING.evaluate(_view([[(1.0, 1.0)] * 8, [(1.0 * i, v) for i, v in enumerate(lr, 1)]]))
    assert [g.evidence["series"] for g in got] == [1] and got[0].title.startswith("opt1:")


def test_an_inf_clip_return_of_finite_gradients_is_an_overflow_not_a_zero_bound():
    from fastgrad.diagnose.rules.clip_zeroes import CLIP_ZEROES
    from fastgrad.diagnose.rules.exploding import EXPLODING

    rows = [(0.5, 1.0, {"clipped": True, "clip_norm": 1.5, "clip_max": 1.0, "clip_read": True})]
    rows += [(0.0, 1e30, {"clipped": True, "clip_norm": math.inf, "clip_max": 1.0, "clip_read": True})] * 5
    run = _view([rows])
    f, = EXPLODING.evaluate(run)
    assert f.evidence["overflow_steps"] == [2, 3, 4, 5, 6] and f.evidence["variant"] == "overflow"
    assert CLIP_ZEROES.evaluate(run) == []
    # NaN gradients behind the inf (nonfinite > 0) are not an overflow
    bad = _view([[(math.nan, 1.0, {"clipped": True, "clip_norm": math.inf, "nonfinite": 3.0})]])
    assert not bad.steps[0].overflow and bad.steps[0].bad
    # a real zero bound still is clip_zeroes
    zero = _view([[(0.0, 1.0, {"clipped": True, "clip_norm": 2.0, "clip_max": 0.0, "clip_read": True})] * 3])
    assert CLIP_ZEROES.evaluate(zero)[0].title.startswith("the gradient clip (max_norm=0)")


def test_the_exploding_wording_says_what_the_clip_did():
    from fastgrad.diagnose.rules.exploding import EXPLODING

    wide = {"clipped": True, "clip_max": 1e6, "clip_read": True}
    run = _view([[(1.0, 1.0, dict(wide, clip_norm=v)) for v in (5.0, 7.6e3, 40.0)]])
    f, = EXPLODING.evaluate(run)
    assert "max_norm=1.000e+06, above every norm seen: the clip never acted" in f.detail
    assert "bounded" not in f.detail
    tight = {"clipped": True, "clip_max": 1.0, "clip_read": True}
    f, = EXPLODING.evaluate(_view([[(1.0, 1.0, dict(tight, clip_norm=v)) for v in (5.0, 7.6e3, 40.0)]]))
    assert "clips at max_norm=1, so the update was bounded" in f.detail


def test_a_falling_norm_above_the_healthy_range_is_not_decaying():
    from fastgrad.diagnose.rules.trends import detect_trends

    falling = [1e7 * 0.8 ** i for i in range(60)]  # 1e7 -> 1.5e1: 1000x down, still above 10
    assert "decaying" not in [f.code for f in detect_trends(list(range(1, 61)), falling)]
    to_zero = [1.0 * 0.75 ** i for i in range(60)]  # 1 -> 3e-8
    assert "decaying" in [f.code for f in detect_trends(list(range(1, 61)), to_zero)]


def test_advice_never_raises_a_learning_rate_while_the_run_diverges():
    from fastgrad.diagnose.advice import advise
    from fastgrad.diagnose.finding import Finding

    depth = Finding("depth_vanishing", "warning", "vanishing across depth")
    div = Finding("loss_diverging", "critical", "the loss is diverging")
    alone = dict((c, t + s) for c, t, s in advise([depth]))
    assert "10 * lr" in alone["depth_vanishing"] and "higher learning rate" in alone["depth_vanishing"]
    both = advise([depth, div])
    text = " ".join(t + s for _, t, s in both)
    assert "10 * lr" not in text and "higher learning rate" not in text
    assert [c for c, _, _ in both] == ["loss_diverging", "depth_vanishing"]
    assert "fix that first" in dict((c, t) for c, t, _ in both)["depth_vanishing"]
    # a bootstrapped rise is not a divergence: the depth advice stands
    boot = Finding("loss_diverging", "notice", "the loss rose", evidence={"variant": "bootstrapped"})
    assert "10 * lr" in dict((c, t + s) for c, t, s in advise([depth, boot]))["depth_vanishing"]


def test_a_notice_never_says_no_action_under_a_worse_verdict():
    from fastgrad.diagnose.advice import advise
    from fastgrad.diagnose.finding import Finding

    small = Finding("small_but_learning", "notice", "small gradients, but the loss is improving")
    assert "no action needed" in advise([small])[0][1]
    crit = Finding("no_zero_grad", "critical", "gradients are never zeroed")
    assert [c for c, _, _ in advise([small, crit])] == ["no_zero_grad"]
    from fastgrad.diagnose.advice import reword_notices

    rising = Finding("increasing", "notice", "rising", "The loss fell 3 -> 1: usual for a converging run, no "
                     "action needed.")
    reword_notices([rising])
    assert rising.detail.endswith("no action needed.")
    reword_notices([rising, crit])
    assert "no action needed by itself (see the findings above)" in rising.detail


def test_every_run_rule_is_listed_in_help_and_has_advice_or_says_why_not():
    from fastgrad.diagnose.advice import RUN_ADVICE, STEP_ADVICE
    from fastgrad.diagnose.rules.registry import RUN_RULES

    ref = check.reference()
    for rule in RUN_RULES:
        if rule.code != "last_step":
            assert rule.code in ref
        for code in rule.code.split("/"):
            if code not in ("last_step", "guard_skipped", "hand_written_loop", "checker_error", "loss_diverging"):
                assert code in RUN_ADVICE or code in STEP_ADVICE, code


# ---------------------------------------------------------------------------------------------- the command line
def _marker_script(tmp_path):
    marker = tmp_path / "ran.txt"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return script, marker


@pytest.mark.parametrize("opts, message", [
    (["--flush", "0"], "--flush must be a positive whole number, got 0"),
    (["--flush", "-5"], "--flush must be a positive whole number, got -5"),
    (["--flush", "many"], "--flush must be a positive whole number, got 'many'"),
    (["--steps", "0"], "--steps must be a positive whole number, got 0"),
])
def test_bad_numbers_are_refused_before_the_script_runs(tmp_path, capsys, opts, message):
    script, marker = _marker_script(tmp_path)
    with pytest.raises(SystemExit) as e:
        check.main([*opts, str(script)])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not marker.exists()


def test_an_unwritable_out_is_refused_before_the_script_runs(tmp_path, capsys):
    script, marker = _marker_script(tmp_path)
    a_file = tmp_path / "report.md"
    a_file.write_text("not a folder")
    for out in (a_file, a_file / "sub"):
        with pytest.raises(SystemExit) as e:
            check.main(["--out", str(out), str(script)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--out {str(out)!r}" in err and "Traceback" not in err
        assert not marker.exists()
    # a folder that does not exist yet is made, and the run goes on
    assert check.main(["--out", str(tmp_path / "new" / "dir"), str(script)]) == 4 and marker.exists()


def test_help_carries_the_reference_and_every_default(capsys):
    with pytest.raises(SystemExit) as e:
        check.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines to the terminal
    assert e.value.code == 0 and "contract.md" not in out and "docs/" not in out
    for text in ("(default: 64)", "(default: run it to its end)", "(default: print the report only)",
                 "exploding (critical)", "zero_grads (critical)", "exit codes:", "2: usage error"):
        assert text in out, text
    assert all(f" {k}: " in out for k in check.EXIT_CODES)


def test_scaler_unscale_and_clip_without_a_scaler_is_a_clear_error():
    m = torch.nn.Linear(3, 2)
    m(torch.randn(4, 3)).sum().backward()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.grad.clone() for p in m.parameters()]
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler, got NoneType"):
        fastgrad.scaler_unscale_and_clip(None, opt, 1.0)
    with pytest.raises(TypeError, match="swapped"):  # the swapped arguments keep their own message
        fastgrad.scaler_unscale_and_clip(opt, torch.amp.GradScaler("cpu"), 1.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(m.parameters(), before))


def test_the_hooks_lift_no_host_value_while_the_script_runs():
    """check's hooks on the script's path write per-step values with device ops only (on CUDA, a host value
    lifted into a tensor and copied to the device is a synchronizing copy)."""
    from .sync_watch import HostValueWatch

    for script in ("no_zero_grad.py", "nan_loss.py", "overflow_clip.py", "guarded_nan_and_spike.py"):
        with HostValueWatch() as w:
            res = check.run_script(str(SCRIPTS / script), [], flush_every=1000, steps=12)
        assert not res.crashed, res.crash_text
        # the hooks' own values only: what the script and the ops below do is not theirs
        assert not w.hits, script + ":\n" + "\n".join(h for _, h in w.hits)


@pytest.mark.parametrize("name", ["gan", "dqn", "lbfgs_nan_later_eval", "embedding_lm"])
def test_a_checked_eager_run_computes_what_the_unchecked_run_computes(runs, name, tmp_path):
    """check only reads: the script's own float64 record of every step (gradient norms, losses) is the same,
    bit for bit, with and without check (docs/diagnostics-reference.md says so for eager scripts)."""
    checked = runs[name]["truth"]
    _, script, args, *_ = RUNS[name]
    truth = tmp_path / "plain.json"
    env = dict(os.environ, FG_TRUTH=str(truth))
    p = subprocess.run([sys.executable, str(SCRIPTS / script), *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    plain = json.loads(truth.read_text())
    assert len(plain["steps"]) >= 6  # the premise: a run with steps to compare
    assert plain["steps"] == checked["steps"]


def test_a_compiled_model_is_checked_without_torch_s_global_hook_warning(tmp_path):
    """torch warns on every call of a torch.compile'd module while global module hooks exist; under check
    those hooks are check's own, so run_script silences exactly that warning (docs/diagnostics-reference.md)."""
    import warnings

    truth = tmp_path / "truth.json"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = _inproc([], script="compiled_mlp.py", truth=truth)
    assert not [w for w in seen if "global hooks on modules" in str(w.message)]
    steps = json.loads(truth.read_text())["steps"]
    assert r["rc"] == 0 and len(r["json"]["steps"]) == len(steps) == 30
    _match_norms(r["json"]["steps"], steps, field="clip_norm")  # the norm the clip saw, as the script's record
    _match_losses(r["json"]["steps"], steps)
