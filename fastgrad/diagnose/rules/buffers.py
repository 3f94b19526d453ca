"""``nonfinite_buffers``: the model's floating buffers (BatchNorm's running statistics, any buffer a forward
updates) hold NaN/Inf when the run ends, and ``buffers_bad``: the one test of that, which every statement
that the run "is protected" defers to.

A forward in training mode writes the batch's statistics into BatchNorm's running buffers before any clip,
GradScaler or StepGuard decides about the step. Skipping the step keeps the weights and the optimizer state
finite, not these: from then on the model evaluates to NaN, and a checkpoint saves them so. The buffers are
read by ``collect.buffers`` at the sampled steps and when the script ends."""

from __future__ import annotations

import math

from ..collect.buffers import sampled
from ..finding import Finding
from .base import Rule, RunView

__all__ = ["buffers_bad", "NonfiniteBuffers", "NONFINITE_BUFFERS"]

_NORM_TYPES = ("BatchNorm", "SyncBatchNorm", "InstanceNorm")


def buffers_bad(run: RunView) -> list[dict]:
    """The floating buffers that hold NaN/Inf at the last read (the end of the script, where its models were
    still alive): the model as the run leaves it."""
    return [b for b in run.ctx.get("buffers") or () if b["at_end"]]


def _written_at(run: RunView, first: int | None) -> tuple[int | None, int | None]:
    """(the step that most likely wrote the NaN, the last read before that found the buffers finite): the first
    step with a non-finite loss after that read and no later than the read that found them (a NaN batch makes
    both), else None."""
    if first is None:
        return None, None
    reads = sorted({r.step for r in run.steps if r.step < first and sampled(r.step)})
    before = reads[-1] if reads else 0
    bad = [r.step for r in run.steps if r.loss is not None and not math.isfinite(r.loss) and before < r.step <= first]
    return (bad[0] if bad else None), (before or None)


def _series_of(run: RunView, name: str) -> int | None:
    """The optimizer series that trains the module owning buffer ``name`` (its parameters' series)."""
    owner = name.rsplit(".", 1)[0] + "." if "." in name else ""
    live = run.ctx.get("live") or {}
    for n, v in live.items():
        if owner and n.startswith(owner):
            return v[0]
    return None


class NonfiniteBuffers(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        bad = buffers_bad(run)
        if not bad:
            return []
        names = [b["name"] for b in bad]
        types = sorted({b["module_type"] for b in bad})
        model = next((b["model"] for b in bad if b["model"]), None)
        firsts = [b["first_step"] for b in bad if b["first_step"] is not None]
        first = min(firsts) if firsts else None
        # first seen when the script ended: the NaN was written after the last sampled read
        wrote, before = _written_at(run, first if first is not None else (run.steps[-1].step if run.steps else None))
        step = wrote or first
        if step is not None:
            run.key_steps.add(step)
        kept = {r.step: ("the step guard" if r.guard_skipped else "the GradScaler")
                for r in run.steps if r.guard_skipped or r.skipped}
        who = kept.get(step) if step is not None else None
        guard = bool(run.guarded)
        norm = any(t.startswith(_NORM_TYPES) for t in types)
        of = f" of `{model}`" if model else ""
        when = ""
        if wrote is not None:
            when = (f" They were written at step {wrote}, whose loss was NaN/Inf (a NaN batch through the forward)"
                    + (f"; the read after step {before} found them finite" if before else "") + ".")
        elif first is not None:
            when = f" First seen non-finite at the read after step {first}."
        else:
            when = " Seen when the script ended."
        last = "" if all(b["final_read"] for b in bad) else (
            " (the last read: the script's models were gone when it ended)")
        skipped = ""
        if who is not None:
            skipped = (f" {who[:1].upper() + who[1:]} skipped that step, which kept the weights and the optimizer "
                       "state finite, not these: a forward in training mode writes the running statistics before "
                       "any clip, GradScaler or guard decides.")
        effect = ("In eval mode every output through them is NaN, and a checkpoint saves them so."
                  if norm else "Every forward that reads them computes on NaN, and a checkpoint saves them so.")
        fix = (" The step guard was not given the model: `StepGuard(optimizer, ..., model=model)` puts every buffer "
               "back on a skipped step." if guard else "")
        detail = (f"{len(bad)} floating buffer(s){of} ({', '.join(types)}) hold NaN/Inf at the end of the "
                  f"run{last}.{when}{skipped} {effect}{fix}")
        return [Finding(
            self.code, "critical", "NaN/Inf in the model's buffers" + (
                ": its running statistics are NaN, so it evaluates to NaN" if norm else ""),
            detail, names, [step] if step is not None else [],
            {"buffers": names, "module_types": types, "first_step": first, "written_at": wrote, "model": model,
             "skipped_by": who, "guard": guard, "variant": "guard" if guard else None,
             "series": _series_of(run, names[0])})]


NONFINITE_BUFFERS = NonfiniteBuffers(
    "nonfinite_buffers", "critical", "the models' floating buffers at the sampled steps and when the script ends",
    "a floating buffer of a model (BatchNorm's running statistics, any buffer a forward updates) holds NaN/Inf "
    "when the run ends, even where a StepGuard or GradScaler skipped the step that wrote it",
    needs=("script",))
