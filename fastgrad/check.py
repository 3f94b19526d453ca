"""``python -m fastgrad.check [--steps N] [--out DIR] [--flush K] [--nproc N] SCRIPT [ARGS...]``: check an
unmodified training script and report on its gradients.

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
from .diagnose.launch import launch_ranks
from .diagnose.result import EXIT_CODES, CheckResult
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
        usage="python -m fastgrad.check [-h] [--steps N] [--out DIR] [--flush K] [--nproc N] SCRIPT [ARGS ...]",
        description="Run an unmodified training script and report its gradient health. Steps are numbered from "
                    "1: step N is the N-th optimizer step (the batch of `step == N - 1` in a loop counted from "
                    "0). The findings and the exit codes are listed below.",
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
    # optional to argparse, so that a missing script gets its own message (REMAINDER args would be listed
    # as required too, and they are not)
    parser.add_argument("script", nargs="?", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments (default: none)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.script is None:
        parser.error("the training script to check is required: python -m fastgrad.check SCRIPT [ARGS...]")
    if os.path.isdir(ns.script):
        parser.error(f"{ns.script} is a directory: give the training script itself (a .py file)")
    if not os.path.isfile(ns.script):
        parser.error(f"script not found: {ns.script}")
    if ns.out:
        why = _writable_folder(ns.out)
        if why:
            parser.error(why)
    if ns.nproc is not None:
        opts = [*(["--steps", str(ns.steps)] if ns.steps else []), *(["--out", ns.out] if ns.out else []),
                "--flush", str(ns.flush)]
        return launch_ranks(ns.nproc, opts, ns.script, ns.args)
    result = run_script(ns.script, ns.args, steps=ns.steps, flush_every=ns.flush)
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return result.exit_code  # rank 0 reports; the others sent it their records
    md = result.to_markdown()
    sys.stdout.flush()
    print("\n" + md, flush=True)
    if ns.out:
        try:
            with open(os.path.join(ns.out, "report.md"), "w") as f:
                f.write(md)
            with open(os.path.join(ns.out, "report.json"), "w") as f:
                json.dump(result.to_dict(), f, indent=2, default=str)
        except OSError as e:  # checked before the run; the folder changed since
            print(f"python -m fastgrad.check: error: could not write the report into {ns.out!r}: {e}",
                  file=sys.stderr)
            return 2
        try:
            result.plot(os.path.join(ns.out, "grad_norm.png"))
        except ImportError as e:
            print(f"(no plot: {e})", file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
