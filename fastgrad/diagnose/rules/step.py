"""The rules of one step's report (``GradientReport``): each reads the step's host statistics (total norm,
per-parameter and per-layer rows, the loss) and returns its findings. The thresholds are the status table
of ``fastgrad.diagnose.thresholds``."""

from __future__ import annotations

import math
from typing import Sequence

from ..collect.snapshot import depth_of, group_layers
from ..finding import Finding, cap as _cap, fmt as _fmt
from .trends import detect_loss_jumps

__all__ = ["classify", "loss_findings", "depth_check"]


def loss_findings(loss: float | None, history: Sequence[float] | None, steps: Sequence[int],
                  step: int | None, *, jumps: bool = True) -> list[Finding]:
    """A non-finite current loss or history value (critical), else a jump of the last history values far
    above their recent median (``detect_loss_jumps``)."""
    hist = list(history) if history is not None else []
    bad = [s for s, v in zip(steps, hist) if not math.isfinite(v)]
    now_bad = loss is not None and not math.isfinite(loss)
    if now_bad or bad:
        where = []
        if now_bad:
            where.append(f"the current loss is {loss}" + (f" (step {step})" if step is not None else ""))
        if bad:
            where.append(f"{len(bad)} value(s) of the loss history are NaN/Inf, first at step {bad[0]}")
        return [Finding("nonfinite_loss", "critical", "non-finite loss (NaN/Inf); check the loss before backward()",
                        _cap("; ".join(where)) + ". The gradients computed from it are meaningless even "
                        "if finite.", steps=sorted(set(bad + ([step] if now_bad and step is not None else []))))]
    return detect_loss_jumps(steps, hist) if jumps else []



def classify(rep) -> list[Finding]:
    th = rep.thresholds
    found: list[Finding] = []
    total = rep.total_norm
    bad = rep.nonfinite_params()
    if bad:
        found.append(Finding(
            "nonfinite", "critical",
            f"NaN/Inf gradients in {len(bad)} parameter(s); check the loss before backward()",
            f"{rep.nan:,} NaN and {rep.inf:,} Inf gradient values.", bad))
    elif not rep.params:
        found.append(Finding("no_learning", "critical",
                             "no learning; frozen parameters or dead units",
                             "No parameter has a gradient (all frozen, unused, or backward() not called).",
                             list(rep.no_grad)))
    elif total == 0 and _clipped_to_zero(rep):
        found.append(_clip_finding(rep))
    elif total == 0:
        found.append(Finding("no_learning", "critical", "no learning; frozen parameters or dead units",
                             "Every gradient is exactly zero.", [r.name for r in rep.layers]))
    elif total > th.critical:
        found.append(Finding("exploding", "critical", "exploding: clip now, lower the learning rate",
                             f"Total norm {_fmt(total)} > {_fmt(th.critical)}.", _largest(rep)))
    elif total > th.exploding:
        found.append(Finding("exploding", "warning", "exploding, clip (max_norm=1.0)",
                             f"Total norm {_fmt(total)} > {_fmt(th.exploding)}.", _largest(rep)))
    elif total > th.healthy_high:
        found.append(Finding("elevated", "notice", "elevated: above the healthy range",
                             f"Total norm {_fmt(total)} is between {_fmt(th.healthy_high)} and "
                             f"{_fmt(th.exploding)}.", _largest(rep)))
    elif total < th.vanishing:
        if rep.loss_progress:
            found.append(Finding("small_but_learning", "notice", "small gradients, but the loss is improving",
                                 f"Total norm {_fmt(total)} < {_fmt(th.vanishing)}; small but learning is fine."))
        else:
            why = ("the loss is not improving" if rep.loss_progress is False
                   else "no loss history to show progress")
            found.append(Finding("vanishing", "warning", "vanishing; check architecture and initialisation",
                                 f"Total norm {_fmt(total)} < {_fmt(th.vanishing)} and {why}."))
    elif total < th.healthy_low:
        found.append(Finding("low", "notice", "low: below the healthy range",
                             f"Total norm {_fmt(total)} is between {_fmt(th.vanishing)} and "
                             f"{_fmt(th.healthy_low)}; fine while the loss decreases."))

    if total != 0 and rep.clip_max_norm == 0 and not bad:  # statistics read before a clip to 0
        found.append(_clip_finding(rep))

    # Dead parameters: the share of parameter TENSORS whose gradient is entirely zero. An all-zero model is
    # already "no_learning". Counting values instead would call every embedding dead (the rows not looked up
    # have a zero gradient), so values only give a notice, over the dense (not row-sparse) tensors.
    zero_params = rep.zero_params()
    sparse_names = {r.name for r in rep.row_sparse}
    dense = [r for r in rep.params if r.name not in sparse_names]
    dense_numel = sum(r.numel for r in dense)
    dense_zero = sum(r.zero for r in dense)
    if rep.params and total != 0 and len(zero_params) / len(rep.params) > th.dead_fraction:
        found.append(Finding("dead", "warning", "dead parameters",
                             f"{len(zero_params)} of {len(rep.params)} parameter tensors have an all-zero gradient "
                             f"(> {th.dead_fraction:.0%}); {rep.zero / rep.numel:.1%} of all gradient values are "
                             "zero.", zero_params))
    elif dense_numel and total != 0 and dense_zero / dense_numel > th.mostly_zero:
        mostly = [r.name for r in dense if r.numel and r.zero / r.numel > th.mostly_zero]
        found.append(Finding("mostly_zero", "notice", "most gradient values are exactly zero",
                             f"{dense_zero / dense_numel:.1%} of the values of the dense gradients are exactly "
                             f"zero (> {th.mostly_zero:.0%}); {len(zero_params)} of {len(rep.params)} tensors "
                             "are entirely zero.", mostly))

    excluded = {r.name for r in rep.row_sparse if r.excluded}
    # by layer of depth: a stacked RNN's layers, a ModuleList's blocks (not by owning module)
    depth = depth_check(group_layers(rep.params, False, depth_of), th.depth_ratio, excluded, rep.row_sparse,
                        free_params(rep.params))
    if depth is not None:
        found.append(depth)
    return found


def _largest(rep, k: int = 3) -> list[str]:
    finite = [r for r in rep.layers if math.isfinite(r.norm)]
    return [r.name for r in sorted(finite, key=lambda r: -r.norm)[:k]]


def _clipped_to_zero(rep) -> bool:
    return rep.clip_max_norm == 0 or (rep.pre_clip_norm is not None and rep.pre_clip_norm != 0)


def _clip_finding(rep) -> Finding:
    before = "" if rep.pre_clip_norm is None else f"The total norm was {_fmt(rep.pre_clip_norm)} before the clip"
    mx = "" if rep.clip_max_norm is None else f"max_norm={_fmt(rep.clip_max_norm)}"
    detail = (before + (" and " if before else "The ") + f"clip ({mx or 'told by the caller'}) scaled every "
              "gradient to zero: the clip, not frozen parameters or dead units, stopped learning.")
    return Finding("clipped_to_zero", "critical", "no learning: the gradients were clipped to zero"
                   + (f" ({mx})" if mx else ""), detail)



def free_params(params) -> list[str]:
    """Parameters whose gradient is small by construction, not by depth: those registered on the model itself
    beside its submodules (a learned initial state, a start token, a scalar gain or temperature): they are not
    a layer of the stack, and their gradient's size says nothing about how deep layers learn."""
    nested = any("." in r.name for r in params)
    return [r.name for r in params if nested and "." not in r.name]


def depth_check(layers: list, ratio: float, excluded: set[str] = frozenset(),
                row_sparse: Sequence = (), free: Sequence[str] = ()) -> Finding | None:
    """Compare the mean gradient norm of the first quarter of the layers of depth (``collect.snapshot.depth_of``;
    registration order, which is depth order for Sequential-style models and stacked RNNs) with that of the last
    quarter. Layers holding a row-sparse parameter
    that touched only some rows (``excluded``: an embedding) are left out: their norm grows with the number
    of rows a batch looks up, not with depth."""
    # Layers with exactly zero gradient are dead (a separate finding), not "vanishing".
    # Free parameters (see free_params) are left out too: their gradient is small by construction.
    free = set(free)
    rows = [r for r in layers if math.isfinite(r.norm) and r.norm > 0 and not (set(r.params) & excluded)
            and not set(r.params) <= free]
    if len(rows) < 2:
        return None
    k = max(1, len(rows) // 4)
    early = sum(r.norm for r in rows[:k]) / k
    late = sum(r.norm for r in rows[-k:]) / k
    if late == 0 or early * ratio >= late:
        return None
    affected = [r.name for r in rows[:-k] if r.norm * ratio < late]
    detail = (f"Mean norm of the first {k} layer(s) {_fmt(early)} vs the last {k} {_fmt(late)} "
              f"(ratio {_fmt(late / early) if early else 'inf'}).")
    left_free = [n for r in layers for n in r.params if n in free]
    if left_free:
        detail += " Left out (free parameters, small by construction): " + ", ".join(left_free) + "."
    left = [r for r in row_sparse if r.excluded]
    if left:
        detail += " Left out (row-sparse): " + ", ".join(
            f"{r.name} ({r.touched:,} of {r.rows:,} rows touched, norm {_fmt(r.norm)})" for r in left) + "."
    units = {r.name: list(r.params) for r in rows[:-k] if r.name in affected}
    return Finding("depth_vanishing", "warning", "vanishing across depth", detail, affected,
                   evidence={"units": units, "ratio": late / early if early else math.inf})

