"""What the run itself says: ``hand_written_loop`` (no torch.optim step), ``not_checked`` (nothing could be
read), ``checker_error`` (the checker failed on some steps), ``script_crashed``."""

from __future__ import annotations

from ..finding import Finding
from .base import Rule, RunView

__all__ = ["HandWrittenLoop", "NotChecked", "CheckerError", "ScriptCrashed", "nothing_checked"]


def nothing_checked(run: RunView) -> bool:
    return not run.steps or (not run.used and not run.amp_skipped and not run.guarded)


class HandWrittenLoop(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        if not run.manual:
            return []
        how = ("the backward() calls between two zero_grad() calls" if run.zero_grad_calls
               else "one scalar backward() (the script never calls zero_grad())")
        return [Finding(
            self.code, "notice", "no torch.optim step: the loop was checked at its backward() calls",
            f"No optimizer stepped, so each step is the gradients after {how}, read where they are next zeroed "
            "or consumed; its loss is the sum of the losses backpropagated in it.")]


class NotChecked(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        if not nothing_checked(run):
            return []
        why = []
        if run.crashed:
            why.append("the script crashed before its first step")
        if run.optimizers_made:
            why.append(f"{run.optimizers_made} optimizer(s) were created but step() never ran")
        # a script that ran to its end after starting processes trained there, if anywhere (DataLoader workers
        # of a script that crashed first are not that)
        kids = run.processes_started and not run.crashed and not run.backward_calls
        if not run.backward_calls and not kids:
            why.append("no backward() call was seen (torch.autograd.grad and custom update rules are not watched)")
        elif not run.scalar_backward_calls and run.backward_calls:
            why.append(f"{run.backward_calls} backward() call(s), none on a scalar loss")
        if kids and run.processes_read:
            why.append(f"the script started {run.processes_started} child process(es) (multiprocessing); the "
                       f"{run.processes_read} that ran its own functions were read, and none reached an optimizer "
                       "step or a scalar backward()")
        elif kids:
            why.append(f"the script started {run.processes_started} child process(es) (multiprocessing), none "
                       "running a function of the script's own (check reads a child that does), so what they "
                       "trained was not seen: check a version that trains in one process or in its own "
                       "functions, or launch each training process with torchrun")
        if run.errors:
            why.append("the checker failed to read the gradients: " + run.errors[0])
        return [Finding(self.code, "warning", "nothing could be checked",
                        "Not a single step could be read, so there is no verdict on this run (it is not HEALTHY): "
                        + "; ".join(why or ["no reason recorded"]) + ".")]


class CheckerError(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        if not run.errors:
            return []
        e = run.errors
        return [Finding(self.code, "notice", "the checker could not read some steps",
                        "; ".join(e[:3]) + (f" (+{len(e) - 3} more)" if len(e) > 3 else ""))]


class ScriptCrashed(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        if not run.crashed:
            return []
        return [Finding(self.code, "critical", "the script crashed", run.crash_text or "")]


HAND_WRITTEN_LOOP = HandWrittenLoop("hand_written_loop", "notice", "whether any torch.optim optimizer stepped",
                                    "no torch.optim step: steps read at the scalar backward() calls", needs=("script",))
NOT_CHECKED = NotChecked("not_checked", "warning", "the steps read",
                         "nothing could be read (exit code 4, status \"not checked\": never healthy)",
                         needs=("script",))
CHECKER_ERROR = CheckerError("checker_error", "notice", "the checker's own failures",
                             "the checker failed to read some steps (the script ran on)", needs=("script",))
SCRIPT_CRASHED = ScriptCrashed("script_crashed", "critical", "how the script ended",
                               "the script raised or exited non-zero (exit code 3)", needs=("script",))
