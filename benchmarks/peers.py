"""Side by side: ``python -m fastgrad.check``, gradsnitch 0.1.0 and torch-audit 0.3.0 on the check corpus
(tests/check_corpus/: real training scripts, healthy and broken, each with an expectation written from its own
float64 truth in ``cases.py``).

Every tool is fed as its README says, and no script is edited:
  check        ``python -m fastgrad.check --out DIR SCRIPT ARGS`` (its report.json)
  gradsnitch   ``gradsnitch.watch(model, optimizer)`` once per optimizer and ``mon.log(step, loss)`` once per
               step with the loss backpropagated since the last step (the norm a clip read passed as
               ``grad_norm``, the README's "caller-supplied signals"), ``mon.report()`` at the end
  torch-audit  ``torch_audit.autopatch(model, optimizer=..., every_n_steps=1)`` (its zero-touch mode, auditing
               every step: the corpus runs take 10-200 steps, the default of 1000 would audit none),
               ``auditor.finish()`` at the end
The model, the optimizer, the loss and each step are the ones the script already hands its truth recorder
(``_corpus.Recorder``): the feed wraps the recorder's methods from outside, at the points where a user would add
each tool's line. A script whose recorder gets no optimizer (LBFGS's closure) has the one optimizer it created
over the model passed; a loop without ``torch.optim`` (a hand-written SGD) gets gradsnitch's monitor without an
optimizer and torch-audit's forward audits only (its gradient audits run at ``optimizer.step``).

Every tool is judged by one rule: a healthy case must raise nothing above the tool's lowest level; a broken case
must raise a finding (any level) of a class the case names (``BROKEN``, from the manifest's justification).
Findings map to classes by ``CODE_CLASSES``. Cases whose manifest allows either (at most a notice, or a warning)
are listed but not scored.

    PEERS_PATH=DIR python benchmarks/peers.py --out benchmarks/results/peers/DATE     # run all
    python benchmarks/peers.py --judge benchmarks/results/peers/DATE/runs.json       # re-judge recorded runs

torch-audit 0.3.0's autopatch breaks an LR scheduler built after it (the script crashes); ``--late`` attaches it
at the first optimizer step instead, and ``--merge`` joins such a rerun with the first run.

The other tools are not dependencies of fastgrad: install them apart (``pip install --target DIR``) and put DIR
on ``PEERS_PATH`` for their runs only."""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "check_corpus"
TOOLS = ("check", "gradsnitch", "torch-audit")

#: each tool's levels, lowest first
LEVELS = {
    "check": ("notice", "warning", "critical"),
    "gradsnitch": ("warning", "error"),
    "torch-audit": ("INFO", "WARN", "ERROR", "FATAL"),
}

#: the class of harm a finding names, per tool and code (a code outside the table names no class of harm)
_C = {
    "divergence": ("loss_diverging", "exploding", "spike", "increasing"),
    "nonfinite": ("nonfinite_loss", "nonfinite_history", "nonfinite"),
    "accumulation": ("no_zero_grad",),
    "dead": ("never_learns", "zero_grads", "dead", "mostly_zero", "no_learning"),
    "clip": ("clip_scaled", "clip_after_step", "clip_partial", "clip_zeroes"),
    "vanishing": ("depth_vanishing", "vanishing", "low"),
    "stall": ("stall",),
    "lr": ("lr_zero", "lr_schedule"),
}
CODE_CLASSES = {
    "check": {code: {cls} for cls, codes in _C.items() for code in codes},
    "gradsnitch": {
        "GS001": {"nonfinite"}, "GS002": {"nonfinite", "divergence"}, "GS003": {"divergence"},
        "GS004": {"overfitting"}, "GS005": {"stall"}, "GS006": {"divergence"}, "GS007": {"vanishing"},
        "GS008": {"lr"}, "GS009": {"divergence"}, "GS010": {"lr"},
    },
    "torch-audit": {
        "TA100": {"nonfinite"}, "TA102": {"divergence"}, "TA103": {"dead"}, "TA104": {"dead"},
        "TA105": {"dead"}, "TA500": {"dead"},
    },
}

#: a tool's report of its own failure (a validator that crashed, a reading check could not make): no claim about
#: the run, so never an alarm; counted apart
INTERNAL = {"check": {"checker_error"}, "gradsnitch": set(), "torch-audit": {"TA000"}}
#: torch-audit's configuration lints (tensor-core alignment, channels-last, AMP, weight decay, bias before a norm,
#: even kernels): advice about the setup, true or not whatever the run does; the totals also count without them
LINTS = {"torch-audit": {"TA200", "TA201", "TA202", "TA203", "TA400", "TA401", "TA402", "TA403", "TA404"}}

#: each broken case: the classes of which any one is the right alarm (from the manifest's ``why``). A learning
#: rate far too high is rightly named by the blow-up it causes or by the update size/learning rate itself.
BROKEN = {
    "pe_wlm_lr2000": {"divergence", "lr"},
    "pe_wlm_deep_tanh": {"vanishing"},
    "pe_lbfgs_no_zero_grad": {"accumulation", "divergence"},
    "pe_dcgan_g_detached": {"dead"},
    "pe_vae_zero_init": {"dead"},
    "pe_reinforce_no_zero_grad": {"accumulation"},
    "pe_actor_critic_lr3": {"divergence", "dead", "lr"},
    "pe_mnist_lr100": {"divergence", "dead", "lr"},
    "mingpt_blocks_unused": {"dead"},
    "ppo_reward_norm": {"nonfinite"},
    "dqn_lr": {"divergence", "lr"},
    "clm_pad_lines": {"nonfinite"},
    "timm_clip_before_unscale": {"clip", "stall"},
    "timm_nan_image": {"nonfinite"},
    "ddpm_clip_after_step": {"clip"},
    "gcn_no_zero_grad": {"accumulation"},
    "charrnn_lr": {"nonfinite", "divergence", "lr"},
    "lightning_gan_no_zero_grad_d": {"accumulation"},
    "mixup_lr10": {"divergence", "lr"},
}


# ---------------------------------------------------------------------------------------------- judging
def expectation(worst: tuple) -> str:
    """``healthy``, ``broken`` or ``unscored`` from a manifest case's ``worst`` (least, most) severity."""
    lo, hi = worst
    if hi in ("healthy", "notice"):
        return "healthy"
    if lo in ("warning", "critical"):
        return "broken"
    return "unscored"


def alarms(tool: str, findings: list[dict]) -> list[dict]:
    """The findings above the tool's lowest level (a tool's report of its own failure is none)."""
    lowest = LEVELS[tool][0]
    return [f for f in findings if f["severity"] != lowest and f["code"] not in INTERNAL[tool]]


def judge(tool: str, kind: str, classes: set | None, findings: list[dict]) -> tuple[str, list[str]]:
    """One run's verdict: ``clean`` or ``false alarm`` (healthy), ``detected`` or ``missed`` (broken),
    ``unscored``; and the codes that decided it."""
    if tool not in LEVELS:
        raise ValueError(f"unknown tool {tool!r}: expected one of {', '.join(LEVELS)}")
    for f in findings:
        if f["severity"] not in LEVELS[tool]:
            raise ValueError(f"{tool}: unknown level {f['severity']!r} (levels: {', '.join(LEVELS[tool])})")
    table = CODE_CLASSES[tool]
    if kind == "healthy":
        loud = sorted({f["code"] for f in alarms(tool, findings)})
        return ("false alarm", loud) if loud else ("clean", [])
    if kind == "broken":
        if not classes:
            raise ValueError("a broken case needs the classes of its right alarm")
        hits = sorted({f["code"] for f in findings if table.get(f["code"], set()) & classes})
        return ("detected", hits) if hits else ("missed", sorted({f["code"] for f in alarms(tool, findings)}))
    return "unscored", sorted({f["code"] for f in findings})


def score(runs: list[dict], cases: dict, lints: bool = True) -> dict:
    """{tool: {case: (verdict, codes)}} for the recorded ``runs`` against the manifest ``cases`` (without
    ``lints``: torch-audit's configuration lints left out)."""
    out: dict = {t: {} for t in TOOLS}
    for r in runs:
        kind = expectation(cases[r["case"]].worst)
        fs = r["findings"] if lints else [f for f in r["findings"] if f["code"] not in LINTS.get(r["tool"], ())]
        out[r["tool"]][r["case"]] = judge(r["tool"], kind, BROKEN.get(r["case"]), fs)
    return out


def _crashed(run: dict, cases: dict) -> bool:
    """The script crashed under the tool where it does not on its own (the manifest's crashes have rc 3)."""
    return run["rc"] == 3 and cases[run["case"]].rc != 3


def _totals(tool: str, verdicts: dict, label: str, crashed: int) -> str:
    vs = [v for v, _ in verdicts.values()]
    broken = vs.count("detected") + vs.count("missed")
    healthy = vs.count("clean") + vs.count("false alarm")
    return (f"| {label} | {vs.count('detected')}/{broken} | {vs.count('missed')} | {vs.count('false alarm')}/{healthy}"
            f" | {vs.count('clean')}/{healthy} | {crashed} |")


def table(runs: list[dict], cases: dict) -> str:
    """The markdown table tool x case and the totals."""
    s = score(runs, cases)
    tools = [t for t in TOOLS if s[t]]
    lines = ["| case | expected | " + " | ".join(tools) + " |", "|---|---|" + "---|" * len(tools)]
    for name, c in cases.items():
        if not any(name in s[t] for t in tools):
            continue
        kind = expectation(c.worst)
        want = kind if kind != "broken" else "broken: " + "/".join(sorted(BROKEN[name]))
        cells = []
        broken_by = {r["tool"] for r in runs if r["case"] == name and _crashed(r, cases)}
        for t in tools:
            v, codes = s[t].get(name, ("not run", []))
            broke = t in broken_by
            late = any(r.get("late") for r in runs if r["case"] == name and r["tool"] == t)
            cells.append(v + (f" ({', '.join(codes)})" if codes else "") + (" [the script crashed under it]" if broke
                                                                          else "") + (" [attached late]" if late else ""))
        lines.append(f"| {name} | {want} | " + " | ".join(cells) + " |")
    lines += ["", "| tool | detections | misses | false alarms | clean healthy runs | scripts crashed under it |",
              "|---|---|---|---|---|---|"]
    crashes = {t: sum(1 for r in runs if r["tool"] == t and _crashed(r, cases)) for t in tools}
    lines += [_totals(t, s[t], t, crashes[t]) for t in tools]
    quiet = score(runs, cases, lints=False)
    lines += [_totals(t, quiet[t], f"{t} without its configuration lints", crashes[t]) for t in tools if t in LINTS]
    errors = {t: sorted({f["code"] for r in runs if r["tool"] == t for f in r["findings"] if f["code"] in INTERNAL[t]}
                        ) for t in tools}
    crashed = {t: sorted(r["case"] for r in runs if r["tool"] == t and any(
        f["code"] in INTERNAL[t] for f in r["findings"])) for t in tools}
    notes = [f"- {t} reported its own failure ({', '.join(errors[t])}) in {len(crashed[t])} run(s): "
             f"{', '.join(crashed[t])}; not counted as alarms" for t in tools if errors[t]]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


# ---------------------------------------------------------------------------------------------- feeding
def _feed(tool: str, out: str, script: str, args: list[str]) -> None:
    """Run ``script`` in this process with ``tool`` attached where the script's recorder sees the model, the
    optimizer, the loss and each step; write the tool's findings to ``out`` even when the script crashes."""
    import runpy

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(CORPUS))
    import _corpus

    rec = _corpus.Recorder
    sinks: dict = {}  # recorder name -> the tool's object
    findings: list[dict] = []
    made: list = []  # the optimizers the script creates: LBFGS's closure hands its recorder none

    init0 = torch.optim.Optimizer.__init__

    def init(self, *a, **k):
        init0(self, *a, **k)
        made.append(self)

    torch.optim.Optimizer.__init__ = init

    def owner(model):
        """The one optimizer that holds only ``model``'s parameters, as a user would pass it; else None."""
        if model is None:
            return None
        ids = {id(p) for p in model.parameters()}
        hits = [o for o in made if all(id(p) in ids for g in o.param_groups for p in g["params"])]
        return hits[0] if len(hits) == 1 else None

    def attach(name, model, optimizer):
        if name in sinks:
            return
        if tool == "gradsnitch":
            import gradsnitch
            sinks[name] = gradsnitch.watch(model, optimizer)
        else:
            import torch_audit
            sinks[name] = torch_audit.autopatch(model, optimizer=optimizer, every_n_steps=1, reporters=[])

    def log(name, loss, raw):
        if tool != "gradsnitch" or loss is None:
            return
        mon = sinks[name]
        mon.log(len(mon.rows), loss, **({"grad_norm": raw} if raw is not None else {}))

    watch0, row0, skipped0 = rec.watch, rec.row, rec.skipped

    # torch-audit 0.3.0's autopatch replaces optimizer.step with a plain function, and an LR scheduler built
    # after it fails (torch wraps step.__func__): with --late, it is attached at the first step instead
    late = tool == "torch-audit" and os.environ.get("PEERS_LATE") == "1"
    pending: dict = {}

    def watch(self, optimizer, name="", model=None):
        if late:
            pending[name] = (model, optimizer)
        else:
            attach(name, model, optimizer)
        return watch0(self, optimizer, name, model)

    def row(self, params, name="", model=None, lr=None, names=None, **extra):
        if name in pending:
            attach(name, *pending.pop(name))
        attach(name, model, owner(model))  # no watch() came first: a hand-written update, or LBFGS
        log(name, self._loss.get(name), self._raw.get(name))
        return row0(self, params, name, model=model, lr=lr, names=names, **extra)

    def skipped(self, name="", **extra):
        log(name, self._loss.get(name, math.nan), self._raw.get(name))
        return skipped0(self, name, **extra)

    rec.watch, rec.row, rec.skipped = watch, row, skipped
    sys.argv = [script, *args]
    rc = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 - a crashing script is a case: its findings still count
        rc = 3
        print(f"script crashed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        for name, sink in sinks.items():
            if tool == "gradsnitch":
                for f in sink.report():
                    findings.append({"code": f.code, "severity": f.severity, "text": f"{f.name}: {f.evidence}",
                                     "opt": name})
            else:
                for f in sink.finish().findings:
                    findings.append({"code": f.rule_id, "severity": f.severity.value, "text": f.message,
                                     "step": f.step, "opt": name})
        Path(out).write_text(json.dumps({"rc": rc, "findings": findings, "late": late}))


def _run_one(tool: str, name: str, c, peers_path: str, timeout: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    script = str(CORPUS / c.script)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        if tool == "check":
            cmd = [sys.executable, "-m", "fastgrad.check", "--out", d, script, *c.args]
        else:
            env["PYTHONPATH"] = os.pathsep.join([peers_path, str(ROOT)])
            cmd = [sys.executable, str(Path(__file__).resolve()), "--feed", tool, f"{d}/out.json", script, *c.args]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            rc, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired:
            rc, err = "timeout", ""
        findings: list[dict] = []
        if tool == "check" and Path(d, "report.json").exists():
            rep = json.loads(Path(d, "report.json").read_text())
            findings = [{"code": f["code"], "severity": f["severity"], "text": f.get("title", "")[:200]}
                        for f in rep["findings"]]
        elif Path(d, "out.json").exists():
            got = json.loads(Path(d, "out.json").read_text())
            rc, findings = got["rc"], got["findings"]
    run = {"tool": tool, "case": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
           "findings": findings, "stderr_tail": err[-400:] if rc not in (0, 1) else ""}
    if env.get("PEERS_LATE") == "1" and tool == "torch-audit":
        run["late"] = True
    return run


def _cases():
    sys.path.insert(0, str(ROOT))
    from tests.check_corpus.cases import CASES
    missing = [n for n, c in CASES.items() if expectation(c.worst) == "broken" and n not in BROKEN]
    if missing:
        raise SystemExit(f"broken cases without an expected class in BROKEN: {', '.join(missing)}")
    return CASES


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write runs.json and table.md into this folder")
    ap.add_argument("--judge", metavar="RUNS_JSON", help="print the table of recorded runs")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--late", action="store_true",
                    help="attach torch-audit at the first optimizer step, not where the optimizer is made (its "
                         "autopatch breaks an LR scheduler built after it)")
    ap.add_argument("--merge", nargs="+", metavar="RUNS_JSON",
                    help="with --out: join the runs of several recorded runs.json (parts run side by side; a later "
                         "file's run of a tool and case replaces an earlier one) in the manifest's order")
    ap.add_argument("--feed", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.feed:
        _feed(a.feed[0], a.feed[1], a.feed[2], a.feed[3:])
        return 0
    cases = _cases()
    if a.judge:
        print(table(json.loads(Path(a.judge).read_text())["runs"], cases), end="")
        return 0
    if not a.out:
        ap.error("give --out DIR (or --judge RUNS_JSON)")
    if a.merge:
        got, metas = {}, []
        for path in a.merge:
            doc = json.loads(Path(path).read_text())
            metas.append(doc["meta"])
            got.update({(r["tool"], r["case"]): r for r in doc["runs"]})
        order = {n: i for i, n in enumerate(cases)}
        runs = sorted(got.values(), key=lambda r: (order[r["case"]], TOOLS.index(r["tool"])))
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "runs.json").write_text(json.dumps({"meta": metas, "runs": runs}, indent=1))
        (out / "table.md").write_text(table(runs, cases))
        print(table(runs, cases), end="")
        return 0
    tools = a.tools.split(",")
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        ap.error(f"unknown tool(s) {', '.join(bad)}: expected {', '.join(TOOLS)}")
    names = a.cases.split(",") if a.cases else list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}")
    if a.late:
        os.environ["PEERS_LATE"] = "1"
    peers_path = os.environ.get("PEERS_PATH", "")
    if any(t != "check" for t in tools) and not peers_path:
        ap.error("set PEERS_PATH to the folder where gradsnitch and torch-audit are installed")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for n in names:
        for t in tools:
            r = _run_one(t, n, cases[n], peers_path, a.timeout)
            runs.append(r)
            print(f"{n:32s} {t:12s} rc={r['rc']} {r['seconds']:6.1f}s {[f['code'] for f in r['findings']]}",
                  flush=True)
            (out / "runs.json").write_text(json.dumps({"meta": _meta(a), "runs": runs}, indent=1))
    (out / "table.md").write_text(table(runs, cases))
    print(table(runs, cases), end="")
    return 0


def _meta(a) -> dict:
    import torch
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
            "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
            "command": "python benchmarks/peers.py " + " ".join(sys.argv[1:]),
            "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip()}


if __name__ == "__main__":
    sys.exit(main())
