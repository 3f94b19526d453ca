"""``run_script``: run an unmodified training script as ``__main__`` in this process (its arguments in
``sys.argv``, its directory on ``sys.path``, the working directory left as it is) under a ``Checker``, and
return the ``CheckResult``. Every hook is removed when the script ends, whichever way it ends."""

from __future__ import annotations

import os
import re
import runpy
import sys
import traceback
import warnings

from .collect.hooks import Checker, StopCheck
from .policy import Policy
from .result import CheckResult, build_result

__all__ = ["run_script"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_COMPILE_HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def _run_then_read_buffers(script: str, chk: Checker) -> dict:
    """Run the script, then read its models' buffers while its objects still live: in the ``finally`` the
    returned globals, or the frames of the exception in flight, still hold them."""
    try:
        return runpy.run_path(script, run_name="__main__")
    finally:
        try:
            chk.buffers_at_end()
        except Exception as e:  # noqa: BLE001 - never change how the script ended
            chk.errors.append(f"could not read the buffers at the end: {e}")


def run_script(script: str, args: list[str], *, steps: int | None = None, flush_every: int = 64,
               policy: Policy | None = None) -> CheckResult:
    """Run ``script`` as ``__main__`` with ``args`` under a :class:`Checker` and return the result.
    ``steps``: stop after that many optimizer steps; ``flush_every``: read the device rows every K steps;
    ``policy``: the findings to ignore and the severity that fails the run (``fastgrad.diagnose.policy``)."""
    chk = Checker(steps, flush_every)
    chk.script_path = os.path.abspath(script)
    old_argv, old_path = sys.argv[:], sys.path[:]
    sys.argv = [script] + list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    crashed, stopped, crash_text = False, False, None
    chk.install()
    try:
        with warnings.catch_warnings():
            # torch warns on calls of a torch.compile'd module while global module hooks exist: here those are
            # check's own (the forward watcher), not the script's, and the warning would repeat in its output
            warnings.filterwarnings("ignore", message=_COMPILE_HOOKS_WARNING, category=UserWarning)
            _run_then_read_buffers(script, chk)
    except StopCheck:
        stopped = True
    except SystemExit as e:
        if e.code not in (None, 0):
            crashed, crash_text = True, f"the script exited with status {e.code!r}"
    except BaseException as e:  # noqa: BLE001 - any failure of the script is reported, not re-raised
        if isinstance(e, KeyboardInterrupt):
            raise
        crashed = True
        # rich/colored exception texts carry ANSI escape codes: the report is Markdown and JSON
        crash_text = _ANSI.sub("", "".join(traceback.format_exception_only(type(e), e))).strip()
        traceback.print_exc()
    finally:
        try:  # a multi-process run whose script kept its default group: the ranks' records go to rank 0 now
            chk._rank_gather()
        except Exception as e:  # noqa: BLE001
            chk.errors.append(f"could not gather the ranks' norm records: {e}")
        chk.remove()
        sys.argv, sys.path[:] = old_argv, old_path
    if chk.stop_raised and not stopped:
        # the script caught the stop and ended its own way (pytest counts it a failed test and exits 1): the run
        # was stopped by --steps, not crashed
        stopped, crashed, crash_text = True, False, None
    chk.finish()
    return build_result(chk, script=script, args=list(args), crashed=crashed, crash_text=crash_text,
                        stopped=stopped, max_steps=steps, policy=policy)
