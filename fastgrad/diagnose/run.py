"""``run_script``: run an unmodified training script as ``__main__`` in this process (its arguments in
``sys.argv``, its directory on ``sys.path``, the working directory left as it is) under a ``Checker``, and
return the ``CheckResult``. Every hook is removed when the script ends, whichever way it ends.

A script that trains only in processes it starts (``CheckedChild``): each of its own functions run there runs
under a checker of its own, and the report is that of the first of them that read steps."""

from __future__ import annotations

import os
import pickle
import re
import runpy
import shutil
import sys
import tempfile
import traceback
import warnings

from .collect.hooks import Checker, StopCheck
from .policy import Policy
from .result import CheckResult, build_result

__all__ = ["run_script", "CheckedChild"]

#: the checker installed in this process: a forked child inherits its parent's, and drops it before its own
_ACTIVE: list[Checker] = []

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_COMPILE_HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def _read_buffers(chk: Checker, call):
    """``call()``, then read the models' buffers while its objects still live: in the ``finally`` the returned
    globals, or the frames of the exception in flight, still hold them."""
    try:
        return call()
    finally:
        try:
            chk.buffers_at_end()
        except Exception as e:  # noqa: BLE001 - never change how the script ended
            chk.errors.append(f"could not read the buffers at the end: {e}")


def _install(chk: Checker) -> None:
    chk.install()
    _ACTIVE.append(chk)


def _uninstall(chk: Checker) -> None:
    """Send a multi-process run's records to rank 0 (its script kept its default group), then remove every hook."""
    try:
        chk._rank_gather()
    except Exception as e:  # noqa: BLE001
        chk.errors.append(f"could not gather the ranks' norm records: {e}")
    chk.remove()
    _ACTIVE.clear()


def _crash_text(e: BaseException) -> str:
    # rich/colored exception texts carry ANSI escape codes: the report is Markdown and JSON
    return _ANSI.sub("", "".join(traceback.format_exception_only(type(e), e))).strip()


def _judged(chk: Checker, *, script: str, args: list[str], crashed: bool, crash_text: str | None, stopped: bool,
            steps: int | None, policy: Policy | None) -> CheckResult:
    """The result of a run that ended, read and judged."""
    if chk.stop_raised and not stopped:
        # the script caught the stop and ended its own way (pytest counts it a failed test and exits 1): the run
        # was stopped by --steps, not crashed
        stopped, crashed, crash_text = True, False, None
    chk.finish()
    return build_result(chk, script=script, args=args, crashed=crashed, crash_text=crash_text, stopped=stopped,
                        max_steps=steps, policy=policy)


class CheckedChild:
    """What a child process the script starts runs instead of the script's function ``fn``: ``fn`` itself under a
    checker of its own (the same ``--steps``, flush and policy), whose result it leaves, pickled, in the parent's
    ``folder`` as ``child-<index>.pkl``. The child ends as ``fn`` would have (its exception re-raised), except
    at ``--steps``, where it returns quietly. Picklable: a ``spawn`` child receives it by value."""

    def __init__(self, fn, index: int, folder: str, script: str, args: list[str], steps: int | None,
                 flush_every: int, policy: Policy | None):
        self.fn, self.index, self.folder, self.script, self.args = fn, index, folder, script, args
        self.steps, self.flush_every, self.policy = steps, flush_every, policy

    def __call__(self, *args, **kwargs):
        for inherited in _ACTIVE:   # fork: the parent's checker, copied with its patches and hooks
            inherited.remove()
        _ACTIVE.clear()
        chk = Checker(self.steps, self.flush_every)
        chk.script_path, chk.child_index = self.script, self.index
        crashed, stopped, crash_text = False, False, None
        _install(chk)
        try:
            return _read_buffers(chk, lambda: self.fn(*args, **kwargs))
        except StopCheck:
            stopped = True
        except SystemExit as e:
            if e.code not in (None, 0):
                crashed, crash_text = True, f"the process exited with status {e.code!r}"
            raise
        except BaseException as e:
            crashed, crash_text = True, _crash_text(e)
            raise
        finally:
            _uninstall(chk)
            self._leave(chk, crashed, crash_text, stopped)

    def _leave(self, chk: Checker, crashed: bool, crash_text: str | None, stopped: bool) -> None:
        """Leave the child's result for the parent; a failure here never changes how the child ends."""
        try:
            result = _judged(chk, script=self.script, args=self.args, crashed=crashed, crash_text=crash_text,
                             stopped=stopped, steps=self.steps, policy=self.policy)
            path = os.path.join(self.folder, f"child-{self.index}.pkl")
            with open(path + ".tmp", "wb") as f:
                pickle.dump(result, f)
            os.replace(path + ".tmp", path)
        except Exception as e:  # noqa: BLE001
            print(f"python -m fastgrad.check: could not read child process {self.index + 1}: {e}", file=sys.stderr)


def _first_child(folder: str) -> CheckResult | None:
    """The result of the first child process (in the order started) that read steps; where none did, of the
    first that crashed (the workers of a script whose parent ends well can all fail); else None."""
    done = sorted((int(n[6:-4]), n) for n in os.listdir(folder) if n.startswith("child-") and n.endswith(".pkl"))
    results = []
    for _, name in done:
        with open(os.path.join(folder, name), "rb") as f:
            results.append(pickle.load(f))
    return next((r for r in results if r.steps), None) or next((r for r in results if r.crashed), None)


def run_script(script: str, args: list[str], *, steps: int | None = None, flush_every: int = 64,
               policy: Policy | None = None) -> CheckResult:
    """Run ``script`` as ``__main__`` with ``args`` under a :class:`Checker` and return the result.
    ``steps``: stop after that many optimizer steps; ``flush_every``: read the device rows every K steps;
    ``policy``: the findings to ignore and the severity that fails the run (``fastgrad.diagnose.policy``)."""
    chk = Checker(steps, flush_every)
    chk.script_path = os.path.abspath(script)
    folder = tempfile.mkdtemp(prefix="fastgrad-check-")
    chk.wrap_child = lambda fn, index: CheckedChild(fn, index, folder, chk.script_path, list(args), steps,
                                                    flush_every, policy)
    old_argv, old_path = sys.argv[:], sys.path[:]
    sys.argv = [script] + list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    crashed, stopped, crash_text = False, False, None
    _install(chk)
    try:
        with warnings.catch_warnings():
            # torch warns on calls of a torch.compile'd module while global module hooks exist: here those are
            # check's own (the forward watcher), not the script's, and the warning would repeat in its output
            warnings.filterwarnings("ignore", message=_COMPILE_HOOKS_WARNING, category=UserWarning)
            _read_buffers(chk, lambda: runpy.run_path(script, run_name="__main__"))
    except StopCheck:
        stopped = True
    except SystemExit as e:
        if e.code not in (None, 0):
            crashed, crash_text = True, f"the script exited with status {e.code!r}"
    except BaseException as e:  # noqa: BLE001 - any failure of the script is reported, not re-raised
        if isinstance(e, KeyboardInterrupt):
            raise
        crashed, crash_text = True, _crash_text(e)
        traceback.print_exc()
    finally:
        _uninstall(chk)
        sys.argv, sys.path[:] = old_argv, old_path
    result = _judged(chk, script=script, args=list(args), crashed=crashed, crash_text=crash_text, stopped=stopped,
                     steps=steps, policy=policy)
    try:
        if not result.steps and not crashed and chk.processes_wrapped:
            # the script trained only in the processes it started: the first of them that read steps speaks
            child = _first_child(folder)
            if child is not None:
                child.script = script
                result = child
    except Exception as e:  # noqa: BLE001
        print(f"python -m fastgrad.check: could not read the child processes' results: {e}", file=sys.stderr)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return result
