"""``python -m fastgrad.check [--steps N] [--out DIR] [--flush K] [--nproc N] SCRIPT [ARGS...]``: check an
unmodified training script and report on its gradients. ``python -m fastgrad.check --log PATH``: judge a
finished run from its logs (``fastgrad.diagnose.collect.logs``) with the same rules, those the log holds the
evidence for. ``--ignore CODE[,CODE]``, ``--fail-on SEVERITY`` and a ``fastgrad-check.toml`` beside the script
or the log set what a CI gate leaves out and what fails it (``fastgrad.diagnose.policy``).

A multi-process script is checked on every rank: launched per rank (``torchrun ... -m fastgrad.check
script.py``), or with ``--nproc N``, which starts the N local processes itself with torchrun's environment
(``fastgrad.diagnose.launch``). Rank 0 prints and writes the one report; the other ranks only send it their
records (``fastgrad.diagnose.collect.ranks``).

The script runs as ``__main__`` in this process while global hooks watch it (``fastgrad.diagnose.collect``);
after it ends, every finding rule is evaluated on what was collected (``fastgrad.diagnose.rules``), the advice
is chosen so that no piece contradicts another (``fastgrad.diagnose.advice``), and the report is printed
(with ``--out``: written as report.md, report.json and grad_norm.png). ``--help`` prints the findings and the
exit codes. The command line is checked before the script runs: a bad option is exit code 2, never a
traceback after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap

from .diagnose.collect.hooks import Checker
from .diagnose.collect.logs import LogError, parse_columns, read_log
from .diagnose.launch import launch_ranks
from .diagnose.policy import FAIL_ON, PolicyError, load_policy
from .diagnose.result import EXIT_CODES, CheckResult, build_log_result
from .diagnose.rules.registry import RUN_RULES
from .diagnose.run import run_script

__all__ = ["EXIT_CODES", "Checker", "CheckResult", "main", "run_script", "reference"]


def reference() -> str:
    """The findings and the exit codes, as ``--help`` prints them (generated from the rules themselves)."""
    lines = ["findings (code, worst severity: when it fires):"]
    for rule in RUN_RULES:
        if rule.code == "last_step":
            lines.append("  the last step's statuses (nonfinite, no_learning, dead, mostly_zero, depth_vanishing,")
            lines.append("    vanishing, low, elevated: the gradient-health table)")
            continue
        lines += textwrap.wrap(f"{rule.code} ({rule.severity}): {rule.fires}", 100, initial_indent="  ",
                               subsequent_indent="    ")
    lines.append("")
    lines.append("exit codes:")
    for k, v in EXIT_CODES.items():
        lines += textwrap.wrap(f"{k}: {v}", 100, initial_indent="  ", subsequent_indent="     ")
    return "\n".join(lines)


def _positive(what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a positive whole number, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{what} must be a positive whole number, got {v}")
        return v
    return parse


def _writable_folder(path: str) -> str | None:
    """None when ``path`` is (or can be made) a folder this process can write into, else why not. Creates
    the folder, as the run would."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--out {path!r} exists and is not a folder"
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"--out {path!r} cannot be written: {e.strerror or e}"
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastgrad.check",
        usage="python -m fastgrad.check [-h] [--steps N] [--out DIR] [--flush K] [--nproc N] [--ignore CODES] "
              "[--fail-on SEVERITY] SCRIPT [ARGS ...]\n"
              "       python -m fastgrad.check --log PATH [--columns ROLE=NAME,...] [--out DIR] [--ignore CODES] "
              "[--fail-on SEVERITY]",
        description="Run an unmodified training script and report its gradient health, or judge a finished "
                    "run from its logs (--log). Steps are numbered from 1: step N is the N-th optimizer step "
                    "(the batch of `step == N - 1` in a loop counted from 0). The findings and the exit codes "
                    "are listed below.",
        epilog=reference(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=_positive("--steps"), default=None, metavar="N",
                        help="stop the script after N optimizer steps (default: run it to its end)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="also write report.md, report.json and grad_norm.png into DIR, created if missing "
                             "(default: print the report only)")
    parser.add_argument("--flush", type=_positive("--flush"), default=64, metavar="K",
                        help="read the device statistics every K steps (default: 64)")
    parser.add_argument("--nproc", type=_positive("--nproc"), default=None, metavar="N",
                        help="start N local processes of the script, each checked (as torchrun "
                             "--nproc_per_node=N would: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set); "
                             "rank 0 reports. Under torchrun, launch check itself per rank instead (default: one "
                             "process)")
    parser.add_argument("--log", default=None, metavar="PATH",
                        help="judge a finished run from its logs instead of running a script: a Hugging Face "
                             "trainer_state.json, a Lightning metrics.csv, TensorBoard event files (needs "
                             "tensorboard) or a CSV with loss, grad_norm, learning_rate/lr and step columns; a "
                             "folder holding one of them")
    parser.add_argument("--columns", default=None, metavar="ROLE=NAME,...",
                        help="with --log: the column of each role the names do not reveal (roles: loss, "
                             "grad_norm, lr, step), e.g. --columns loss=train/total,grad_norm=gn")
    parser.add_argument("--ignore", default=None, metavar="CODE[,CODE]",
                        help="leave these findings out of the verdict and the exit code (listed under Ignored); "
                             "added to those of a fastgrad-check.toml beside the script or the log")
    parser.add_argument("--fail-on", default=None, choices=FAIL_ON, metavar="SEVERITY",
                        help="the lowest severity that makes the exit code 1: notice, warning or critical "
                             "(default: critical, or the fastgrad-check.toml's fail-on)")
    # optional to argparse, so that a missing script gets its own message (REMAINDER args would be listed
    # as required too, and they are not)
    parser.add_argument("script", nargs="?", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments (default: none)")
    return parser


def _write(result: CheckResult, out: str | None) -> int:
    """Print the report; with ``out``, write report.md, report.json and grad_norm.png there. 0, or 2 when the
    folder cannot be written."""
    md = result.to_markdown()
    sys.stdout.flush()
    print("\n" + md, flush=True)
    if out:
        try:
            with open(os.path.join(out, "report.md"), "w") as f:
                f.write(md)
            with open(os.path.join(out, "report.json"), "w") as f:
                json.dump(result.to_dict(), f, indent=2, default=str)
        except OSError as e:  # checked before the run; the folder changed since
            print(f"python -m fastgrad.check: error: could not write the report into {out!r}: {e}",
                  file=sys.stderr)
            return 2
        try:
            result.plot(os.path.join(out, "grad_norm.png"))
        except ImportError as e:
            print(f"(no plot: {e})", file=sys.stderr)
    return 0


def _check_log(parser: argparse.ArgumentParser, ns) -> int:
    """``--log``: read the log (every error before anything is written), judge it, report."""
    bad = [opt for opt, v in (("--steps", ns.steps), ("--nproc", ns.nproc)) if v is not None]
    if ns.script is not None or bad:
        parser.error("--log judges a finished run: give no script" + (f" and no {', '.join(bad)}" if bad else ""))
    try:
        folder = ns.log if os.path.isdir(ns.log) else os.path.dirname(os.path.abspath(ns.log))
        policy = load_policy(folder, ns.ignore, ns.fail_on)
        log = read_log(ns.log, parse_columns(ns.columns))
    except (LogError, PolicyError) as e:
        parser.error(str(e))
    if ns.out:
        why = _writable_folder(ns.out)
        if why:
            parser.error(why)
    result = build_log_result(log, policy)
    return _write(result, ns.out) or result.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.log is not None:
        return _check_log(parser, ns)
    if ns.columns is not None:
        parser.error("--columns names the columns of a log: use it with --log")
    if ns.script is None:
        parser.error("the training script to check is required: python -m fastgrad.check SCRIPT [ARGS...]")
    if os.path.isdir(ns.script):
        parser.error(f"{ns.script} is a directory: give the training script itself (a .py file)")
    if not os.path.isfile(ns.script):
        parser.error(f"script not found: {ns.script}")
    try:
        policy = load_policy(os.path.dirname(os.path.abspath(ns.script)), ns.ignore, ns.fail_on)
    except PolicyError as e:
        parser.error(str(e))
    if ns.out:
        why = _writable_folder(ns.out)
        if why:
            parser.error(why)
    if ns.nproc is not None:
        opts = [*(["--steps", str(ns.steps)] if ns.steps else []), *(["--out", ns.out] if ns.out else []),
                "--flush", str(ns.flush), *(["--ignore", ns.ignore] if ns.ignore else []),
                *(["--fail-on", ns.fail_on] if ns.fail_on else [])]
        return launch_ranks(ns.nproc, opts, ns.script, ns.args)
    result = run_script(ns.script, ns.args, steps=ns.steps, flush_every=ns.flush, policy=policy)
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return result.exit_code  # rank 0 reports; the others sent it their records
    return _write(result, ns.out) or result.exit_code


if __name__ == "__main__":
    sys.exit(main())
