"""The numbers every diagnosis judges by, in one place: the gradient-health status table and the run rules'
limits. Rules import them from here; nothing here reads a tensor.

Per-step statuses of one total gradient norm (``Thresholds``):

========================================  ==========
total norm                                status
========================================  ==========
NaN/Inf, or exactly 0                     critical
> 1000 (``critical``)                     critical
100 < norm <= 1000 (``exploding``)        warning
10 < norm <= 100 (``healthy_high``)       notice
0.1 <= norm <= 10                         healthy
1e-3 <= norm < 0.1 (``healthy_low``)      notice
0 < norm < 1e-3 (``vanishing``)           warning
========================================  ==========
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SEVERITIES", "RANK", "Thresholds", "RunLimits", "worst", "rate_norm"]

SEVERITIES = ("notice", "warning", "critical")
RANK = {"healthy": 0, "notice": 1, "warning": 2, "critical": 3}


@dataclass(frozen=True)
class Thresholds:
    """The numbers of the gradient-health table; change them per model if its healthy range differs."""

    healthy_low: float = 0.1
    healthy_high: float = 10.0
    exploding: float = 100.0
    critical: float = 1000.0
    vanishing: float = 1e-3
    dead_fraction: float = 0.5
    # mostly_zero: more than this share of the dense gradient values exactly zero. Not 0.5: ReLU units that are
    # off and the positions a max-pool did not pick pass no gradient, so an ordinary ReLU + max-pool CNN sits
    # at 50-60% by construction.
    mostly_zero: float = 0.75
    depth_ratio: float = 1000.0
    # A loss history "shows progress" when its last quarter's mean is this fraction below its first quarter's.
    loss_progress: float = 0.01


@dataclass(frozen=True)
class RunLimits:
    """The limits of the whole-run rules of ``python -m fastgrad.check``."""

    #: loss_diverging: the loss's level (median of a window) this many times its starting level ...
    diverge_ratio: float = 10.0
    #: ... the warning tier ("rising")
    rise_ratio: float = 3.0
    #: ... and it stays there: the median of the last quarter of the run is at least this share of the ratio
    #: (a rise that comes back down is not a divergence)
    hold_share: float = 1.0
    #: a 10x jump after which the loss stays this many times its start (last half and last quarter): a warning
    unrecovered_ratio: float = 1.5
    #: steps at least, for a trend over the run to be judged
    min_steps: int = 6
    #: a bootstrapped value/TD loss with gradient norms below this (and a stable trend) is at most a notice
    modest_norm: float = 100.0
    #: stall: losses at least, and the window judged (the last this many losses of one optimizer)
    stall_min_steps: int = 20
    stall_window: int = 1000
    #: ... the loss improved when its last quarter's mean is below its first quarter's by more than this many
    #: standard errors of that difference (the step-to-step noise, robust to a trend) AND by more than
    #: ``Thresholds.loss_progress`` of its level (the rule that says "the loss is improving" elsewhere)
    stall_z: float = 3.0
    #: ... a loss this close to ln(classes) (relative) sits at chance: a uniform guess scores as well
    stall_chance: float = 0.05
    #: ... and a loss whose noise and change are both below this share of its level is flat: a warning
    stall_flat: float = 1e-3
    #: ... or whose measured updates are below this share of the weights (median update/weight ratio; about
    #: 1e-3 is typical): the learning rate does not move the weights, a warning
    stall_tiny_update: float = 1e-6
    #: update_tiny: the fewest measured updates of one optimizer whose median it judges
    tiny_update_steps: int = 3
    #: ... and above this share, updates that large without progress: the optimizer bounces across the valley
    #: (the advice is then to lower the learning rate, not to raise it)
    stall_large_update: float = 0.1
    #: nonfinite_loss: an update at least this size relative to the weights, the step before the loss went
    #: non-finite, threw the weights out of range: the learning rate is the cause, not the loss's formula.
    #: Anywhere in a run, an update this size rewrote the weights: harm (``rules.evidence``)
    blowup_update: float = 1.0
    #: harm: a step's norm this many times the run's own level (the median of the norms before it) is far above
    #: it; the guide's own ladder (10, 100, 1000) steps by 10x. A norm's level from the guide alone (above 100
    #: or 1000) is a notice: a warning or a critical finding about the norm needs harm the run shows
    far_ratio: float = 10.0
    #: ... and the run's own level needs at least this many finite values before the step (one: a norm 10x the
    #: first step's at the second is far above it)
    far_history: int = 1
    #: harm, in a run that steps an RL environment: a step of a series most of whose steps follow the same
    #: number of model calls, after at least this many more (since the series' step before), is its first on
    #: freshly collected data (an on-policy rollout: PPO's); its losses and those after it are compared with the
    #: losses since it, not with the fit to the data before. A usual rollout is some hundreds of calls; a DQN
    #: acts once per step
    refresh_calls: int = 16
    #: never_learns: reads of a tensor's optimizer at least, for "zero (or absent) at every step" to be judged
    never_learns_steps: int = 2
    #: lr_schedule: a learning rate below this share of its own peak has collapsed ...
    lr_collapse: float = 1e-3
    #: ... when it stays there to the end over at least this share of the optimizer's steps (a cosine schedule
    #: that reaches 0 at its last step spends about 2% of them there)
    lr_collapse_share: float = 0.25
    #: probabilities_into_ce: a cross-entropy input whose values lie in [0, 1] and whose rows sum to 1 within this
    #: (bfloat16 softmax rows are off by a few 1e-3) is a row of probabilities, not logits ...
    prob_row_tol: float = 1e-2
    #: ... and the finding needs this share of the run's cross-entropy calls to have been handed probabilities
    #: (an evaluation pass on a softmax, next to a training loss on logits, is not the loss being trained)
    prob_share: float = 0.5
    #: accum_not_divided: this share of an optimizer's steps, at least, ran k >= 2 scalar backward calls each of
    #: a loss function's output as it returned it (a window of micro-batches summed, not averaged)
    accum_share: float = 0.9
    #: gradient_ascent: this share of the run's scalar backward calls, at least, reached a loss function with its
    #: sign flipped (and none with it kept), or, under maximize=True, with it kept
    ascent_share: float = 0.9
    #: weight_decay_drag: lr x weight_decay of a step at least this (100x the usual 1e-4 or less: AdamW at lr 1e-3
    #: and weight_decay 0.1): the decay alone shrinks the weights by this share each step ...
    decay_pull: float = 0.01
    #: ... and the measured weights' norm fell to this share of its first measured value, or below
    decay_fall: float = 0.5
    #: saturated_at_init: an activation output whose slope is below this share of the activation's largest
    #: (tanh: |y| above 0.99) sits on a flat tail: it passes back under 2% of the gradient that reaches it ...
    saturated_slope: float = 0.02
    #: ... and a tanh or sigmoid layer with at least this share of its outputs there, at the first forward,
    #: before any update, is saturated by the initialisation's scale (or the input's)
    saturated_share: float = 0.5


def worst(*severities: str) -> str:
    """The worst of severities (``"healthy"`` counts as the mildest)."""
    return max(severities, key=RANK.__getitem__, default="healthy")


def rate_norm(v: float, th: Thresholds | None = None) -> str:
    """The table's status of one total norm, by its own value."""
    th = th or Thresholds()
    if not math.isfinite(v) or v == 0 or v > th.critical:
        return "critical"
    if v > th.exploding or v < th.vanishing:
        return "warning"
    return "notice" if v > th.healthy_high or v < th.healthy_low else "healthy"
