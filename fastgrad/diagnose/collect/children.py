"""Processes the script starts itself to train in (A3C's and Hogwild's workers stepping a shared model,
``torch.multiprocessing.spawn`` of a DDP script): which of them are the script's training, and how each is handed
to a checker of its own. A mixin of :class:`~fastgrad.diagnose.collect.hooks.Checker`.

At ``Process.start()`` (the parent's checker patches ``multiprocessing``'s ``BaseProcess.start``) a process whose
function is the script's own (defined in the script or beside it; under ``spawn``, the function torch's
``_wrap`` calls; the ``run`` of a Process subclass the script defines) has that function replaced by
``wrap_child(fn, index)``, supplied by whoever runs the check
(``fastgrad.diagnose.run``: the function runs under a checker in the child and leaves its result for the parent).
The functions of libraries (a DataLoader's workers, a vector environment's) are left alone: they train
nothing. Host only, once per process started."""

from __future__ import annotations

import functools
import os

__all__ = ["ChildProcesses", "script_function"]


def script_function(fn, script_dir: str) -> bool:
    """Whether ``fn`` is the script's own: defined in its ``__main__`` (``__mp_main__`` in a spawned child), or in a
    file in the script's folder or below it (a module beside it), never in an installed package."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    if getattr(fn, "__module__", None) in ("__main__", "__mp_main__"):
        return True
    code = getattr(fn, "__code__", None)
    if code is None or not script_dir:
        return False
    path = os.path.abspath(code.co_filename)
    return path.startswith(os.path.join(script_dir, "")) and "site-packages" not in path


def _own_run(cls: type, script_dir: str) -> bool:
    """A Process subclass whose ``run`` (overriding multiprocessing's) is the script's own."""
    run = getattr(cls, "run", None)
    return run is not None and script_function(run, script_dir)


def _spawn_wrap(target) -> bool:
    """torch.multiprocessing.spawn's ``_wrap(fn, i, args, error_file)``: the script's function is its first argument."""
    return getattr(target, "__name__", None) == "_wrap" and \
        getattr(target, "__module__", None) == "torch.multiprocessing.spawn"


class ChildProcesses:
    def _children_init(self) -> None:
        self.processes_started = 0  # child processes the script started (multiprocessing, torch.multiprocessing)
        self.processes_wrapped = 0  # of those, the ones run under a checker of their own (their function the script's)
        self.wrap_child = None      # (fn, index) -> the function the child runs instead; None: children not read
        self.child_index = None     # in a child process run under its own checker: its index among those started

    def _wrap_start(self, orig):
        """``BaseProcess.start``, counting the processes and handing the script's own to ``wrap_child``."""
        chk = self

        def start(process, *args, **kwargs):
            chk.processes_started += 1
            if chk.wrap_child is not None:
                try:
                    chk._hand_over(process)
                except Exception as e:  # noqa: BLE001 - never break the script's process start
                    chk.errors.append(f"child process {chk.processes_started}: {e}")
            return orig(process, *args, **kwargs)
        return start

    def _hand_over(self, process) -> None:
        target = getattr(process, "_target", None)
        script_dir = os.path.dirname(self.script_path) if self.script_path else ""
        if _spawn_wrap(target) and process._args and script_function(process._args[0], script_dir):
            fn, *rest = process._args
            process._args = (self.wrap_child(fn, self.processes_wrapped), *rest)
        elif target is not None and script_function(target, script_dir):
            process._target = self.wrap_child(target, self.processes_wrapped)
        elif _own_run(type(process), script_dir):
            # a Process subclass of the script's whose run() is the training (A3C's ``class Worker(mp.Process)``):
            # the instance's run goes first; the class's function and the process, not the bound method, are
            # kept, so a spawned child unpickles the class's run, not this wrapper again
            process.run = self.wrap_child(functools.partial(type(process).run, process), self.processes_wrapped)
        else:
            return
        self.processes_wrapped += 1
