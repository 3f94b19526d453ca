"""The whole-run rules of ``python -m fastgrad.check``, in evaluation order, and ``evaluate`` (run them all,
then drop the findings a fired rule suppresses)."""

from __future__ import annotations

from ..finding import Finding
from .base import Rule, RunView
from .accum_not_divided import ACCUM_NOT_DIVIDED
from .ascent import GRADIENT_ASCENT
from .buffers import NONFINITE_BUFFERS
from .clip_zeroes import CLIP_ZEROES
from .exploding import EXPLODING
from .frozen import FROZEN_IN_OPTIMIZER
from .last_step import LAST_STEP
from .loss_diverging import LOSS_DIVERGING
from .lr_schedule import LR_SCHEDULE
from .lr_zero import LR_ZERO
from .never_learns import NEVER_LEARNS
from .nonfinite import NONFINITE_HISTORY, NONFINITE_LOSS
from .norm_miscounted import NORM_MISCOUNTED
from .norm_trends import NORM_TRENDS
from .probabilities_ce import PROBABILITIES_INTO_CE
from .red_flags import CLIP_AFTER_STEP, CLIP_NOT_PARAMS, CLIP_PARTIAL, CLIP_SCALED, NO_CLIPPING, NO_ZERO_GRAD
from .rewrite import UPDATE_REWROTE, UPDATE_TINY
from .saturation import SATURATED_AT_INIT
from .run_state import CHECKER_ERROR, HAND_WRITTEN_LOOP, NOT_CHECKED, SCRIPT_CRASHED
from .stall import STALL
from .skips import AMP_SKIPPED, GUARD_SKIPPED
from .weight_decay import WEIGHT_DECAY_DRAG
from .zero_grads import ZERO_GRADS

__all__ = ["RUN_RULES", "FINDING_CODES", "evaluate", "not_checked"]

# A non-finite loss first: when both fire at the same step, the loss is the earlier cause (the gradients are
# computed from it). The last step's statuses before the history rule, which extends their nonfinite finding.
# A loss wrongly formed (probabilities into a cross-entropy, a loss negated, a window summed) and a decay that
# erases the weights before the norm rules: at the same step, the cause leads its effects. An initialisation that
# saturates the activations after the stall it explains (the stall is its harm; the report puts it first).
RUN_RULES: tuple[Rule, ...] = (
    NONFINITE_LOSS, LAST_STEP, NONFINITE_HISTORY, NONFINITE_BUFFERS, NORM_MISCOUNTED, PROBABILITIES_INTO_CE,
    GRADIENT_ASCENT, ACCUM_NOT_DIVIDED, WEIGHT_DECAY_DRAG, EXPLODING, CLIP_ZEROES, ZERO_GRADS, NEVER_LEARNS, FROZEN_IN_OPTIMIZER, LR_ZERO,
    LR_SCHEDULE, UPDATE_REWROTE, UPDATE_TINY,
    LOSS_DIVERGING,
    NORM_TRENDS, STALL, SATURATED_AT_INIT, CLIP_SCALED, CLIP_AFTER_STEP, CLIP_NOT_PARAMS, CLIP_PARTIAL, NO_ZERO_GRAD, NO_CLIPPING,
    GUARD_SKIPPED, AMP_SKIPPED, HAND_WRITTEN_LOOP, NOT_CHECKED, CHECKER_ERROR, SCRIPT_CRASHED,
)


#: the last step's own statuses (``rules.step``), which ``last_step`` passes on as run findings
STEP_CODES = ("nonfinite", "no_learning", "dead", "mostly_zero", "depth_vanishing", "vanishing", "low", "elevated",
              "small_but_learning", "clipped_to_zero")
#: every code a run's finding can carry (what ``--ignore`` accepts)
FINDING_CODES: tuple[str, ...] = tuple(dict.fromkeys(
    [c for rule in RUN_RULES if rule is not LAST_STEP for c in rule.code.split("/")] + list(STEP_CODES)))


def not_checked(run: RunView, rules=RUN_RULES) -> list[dict]:
    """``{"rule", "codes", "reason"}`` of each rule that cannot judge ``run`` (``Rule.unmet``), in rule order."""
    out = []
    for rule in rules:
        why = rule.unmet(run)
        if why is not None:
            codes = list(STEP_CODES) if rule is LAST_STEP else rule.code.split("/")
            out.append({"rule": rule.code, "codes": codes, "reason": why})
    return out


def evaluate(run: RunView, rules=RUN_RULES) -> list[Finding]:
    """Every rule's findings (``run.findings`` grows as they run), less those a fired rule suppresses. A rule
    whose needs the run does not meet (``Rule.unmet``) is not evaluated: the report lists it as not checked."""
    run.findings = []
    drop: set[str] = set()
    for rule in rules:
        if rule.unmet(run) is not None:
            continue
        got = rule.evaluate(run)
        if got and rule.suppresses:
            drop |= set(rule.suppresses)
        run.findings += got
    run.findings = [f for f in run.findings if f.code not in drop]
    return run.findings
