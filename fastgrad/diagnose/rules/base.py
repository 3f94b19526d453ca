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

__all__ = ["RunView", "Rule", "NanOrigin", "median"]


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


@dataclass(frozen=True)
class Rule:
    """One whole-run finding (see the module docstring). Subclasses implement :meth:`evaluate`."""

    code: str
    severity: str
    reads: str
    fires: str
    suppresses: tuple[str, ...] = ()

    def evaluate(self, run: RunView) -> list[Finding]:  # pragma: no cover - every rule overrides it
        raise NotImplementedError


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def finite(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]
