"""What a whole-run rule reads (``RunView``: the host copy of a checked run) and what a rule is (``Rule``).

A rule is a small object: its ``code``, the ``severity`` it can reach, ``reads`` (which parts of the run it
looks at), ``fires`` (when, in words: the reference ``python -m fastgrad.check --help`` prints),
``suppresses`` (findings of other rules that its own makes wrong: a clip that zeroes every gradient is not
"dead units"), and ``evaluate(run) -> list[Finding]`` whose findings carry their evidence (steps, layers and
the numbers, in ``Finding.evidence``). Rules are evaluated after the run, in ``RUN_RULES`` order
(``fastgrad.diagnose.rules.registry``); a rule may read the findings of the rules before it
(``run.findings``), e.g. to stay quiet where a more severe cause explains the same steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..collect.steps import StepRecord
from ..finding import Finding
from ..thresholds import RunLimits, Thresholds

__all__ = ["RunView", "Rule", "NanOrigin", "NEEDS", "median"]


@dataclass
class NanOrigin:
    """Where the first NaN/Inf of the run was born: ``where`` is "input" (what the script passed to its model
    was already non-finite: the data, or an op between module calls), "forward" (a module's output), "loss"
    (the loss went non-finite while every module output of that step was finite: a functional loss) or
    "backward" (the loss and module outputs were finite, the gradients were not);
    ``step`` the step, ``module`` the module (forward only), ``text`` the evidence in words."""

    where: str
    step: int
    module: str | None
    text: str
    #: "learning_rate" when a measured update just before threw the weights out of range
    cause: str | None = None


@dataclass
class RunView:
    """A checked run as the rules see it: host values only (built once, after the script, by
    ``fastgrad.diagnose.result.build_result``). ``steps``: every step; ``used``: those the optimizer stepped on
    (not skipped by a GradScaler or a StepGuard, not unread); ``per``: ``used`` per optimizer series."""

    steps: list[StepRecord]
    names: list[str] = field(default_factory=lambda: ["steps"])
    manual: bool = False
    lrs: list = field(default_factory=list)
    last: object | None = None           # the last used step's GradientReport
    last_series: int = 0
    forward_origin: object | None = None  # the watcher's NonFiniteOrigin (its step counted from 0)
    bad_params: list[str] = field(default_factory=list)  # parameters that had NaN/Inf gradients at some step
    flags: dict = field(default_factory=dict)
    clip_calls: int = 0
    zero_grad_calls: int = 0
    amp_skipped: int = 0
    optimizers_made: int = 0
    processes_started: int = 0  # child processes the script started
    processes_read: int = 0     # of those, the ones that ran a function of the script's under a checker of their own
    backward_calls: int = 0
    scalar_backward_calls: int = 0
    errors: list[str] = field(default_factory=list)
    crashed: bool = False
    crash_text: str | None = None
    ctx: dict = field(default_factory=dict)
    th: Thresholds = field(default_factory=Thresholds)
    limits: RunLimits = field(default_factory=RunLimits)
    findings: list[Finding] = field(default_factory=list)  # those of the rules evaluated so far
    key_steps: set = field(default_factory=set)             # steps the trend table must show
    #: where the run came from: "live" (a script check ran) or a log's format ("hf", "lightning", ...)
    source: str = "live"

    def has(self, what: str) -> bool:
        """Whether the run holds the evidence ``what`` (one of ``NEEDS``) at all."""
        if what == "loss":
            return any(r.loss is not None for r in self.steps)
        if what == "lr":
            return any(r.lr is not None for r in self.steps)
        if what == "grad_norm":
            return any(r.norm_read for r in self.steps)
        return self.source == "live"  # "tensors", "script": only a run check watched itself

    def points(self, what: str) -> int:
        """The most steps of one optimizer series that hold ``what`` (finite for a loss: what the loss rules
        judge)."""
        def holds(r: StepRecord) -> bool:
            if what == "loss":
                return r.loss is not None and math.isfinite(r.loss)
            if what == "lr":
                return r.lr is not None
            return r.norm_read
        return max((sum(1 for r in recs if holds(r)) for recs in self.per.values()), default=0)

    @property
    def used(self) -> list[StepRecord]:
        return [r for r in self.steps if not r.skipped and not r.unread and not r.guard_skipped]

    @property
    def guarded(self) -> list[StepRecord]:
        return [r for r in self.steps if r.guard_skipped]

    @property
    def per(self) -> dict[int, list[StepRecord]]:
        used = self.used
        return {k: [r for r in used if r.series == k] for k in range(len(self.names))}

    @property
    def multi(self) -> bool:
        return len(self.names) > 1

    def label(self, k: int) -> str:
        """"NAME: " before a series' text when the run has several optimizers."""
        return f"{self.names[k]}: " if self.multi else ""

    def lr_at(self, k: int, step: int | None = None) -> float | None:
        """The learning rate series ``k`` stepped with at ``step`` (first param group), as the run's schedule
        set it; without a step (or where that step's is unknown) the last one read."""
        if step is not None:
            lr = next((r.lr for r in self.steps if r.step == step and r.series == k), None)
            if lr is not None:
                return lr
        return self.lrs[k] if k < len(self.lrs) else None

    def lr_text(self, k: int, step: int | None = None) -> str:
        """" The learning rate was X." of series ``k``: the lr in force at ``step`` (where the harm began)."""
        lr = self.lr_at(k, step)
        if lr is None:
            return ""
        last = self.lrs[k] if k < len(self.lrs) else None
        at = f" at step {step}" if step is not None and last is not None and last != lr else ""
        return f" The learning rate was {lr:g}{at}" + (f" ({self.names[k]})" if self.multi else "") + "."

    def codes(self) -> set[str]:
        return {f.code for f in self.findings}


#: the evidence a rule can need, and what a report says when a run lacks it ("Not checked")
NEEDS = {
    "loss": "no loss was recorded",
    "grad_norm": "no gradient norm was recorded",
    "lr": "no learning rate was recorded",
    "tensors": "needs per-tensor gradients, which a log does not hold",
    "script": "needs the script's own calls (optimizer steps, clip, zero_grad, AMP), which a log does not record",
}


@dataclass(frozen=True)
class Rule:
    """One whole-run finding (see the module docstring). Subclasses implement :meth:`evaluate`.

    ``needs``: the evidence it reads (keys of ``NEEDS``); ``min_steps``: the fewest steps of one optimizer
    holding that evidence it judges (a number, or the name of a ``RunLimits`` field). A rule whose needs a run
    does not meet is not evaluated and the report lists it under "Not checked" with :meth:`unmet`'s reason."""

    code: str
    severity: str
    reads: str
    fires: str
    suppresses: tuple[str, ...] = ()
    needs: tuple[str, ...] = ("tensors",)
    min_steps: int | str = 1

    def evaluate(self, run: RunView) -> list[Finding]:  # pragma: no cover - every rule overrides it
        raise NotImplementedError

    def unmet(self, run: RunView) -> str | None:
        """Why this rule cannot judge ``run``, or None when it can."""
        for what in self.needs:
            if not run.has(what):
                return NEEDS[what]
        least = self.min_steps if isinstance(self.min_steps, int) else getattr(run.limits, self.min_steps)
        series = [w for w in self.needs if w in ("loss", "grad_norm", "lr")]
        if least > 1 and series:
            got = min(run.points(w) for w in series)
            if got < least:
                what = "finite losses" if "loss" in series else "steps"
                return f"too few steps: {got} {what} recorded, it needs {least}"
        return None


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def finite(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]
