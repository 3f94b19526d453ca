"""One plan per list: the route ``clip_grad_norm_`` takes for a list of parameters, chosen once and cached.

A route says how a list is read and written, never what is decided (that is ``fastgrad.decide``):

===============  ==============================================================================================
route            how the list is served
===============  ==============================================================================================
``cpu``          plain dense CPU grads on the cpu backend: norm, coefficient and scale in one C++ call
``plain``        plain grads: one backend call per device (norm, coefficient and scale fused when one backend
                 serves them all), devices combined through their totals
``sharded``      DTensor grads, or ``process_group=``: local norms, one collective (``fastgrad.distributed``)
``sharded-cpu``  DTensor grads with CPU local shards on the cpu backend: the local part in one C++ pass, then
                 the same collective and coefficient as ``sharded`` (the same bits)
``torch``        sparse, complex or other floating grads: ``torch.nn.utils`` itself
===============  ==============================================================================================

The first call on a list plans it (``route`` None until then: the call tries ``cpu`` and else takes the general
path, which records the route it took); later calls go straight to that route. The plan is keyed by the list's
length, its group and its first parameter (held and compared with ``is``, so a reused id cannot alias), so a loop
that passes ``model.parameters()`` every step reuses it. A route that finds its list changed declines (each
route checks what it relies on, in its own pass: the C++ passes check every grad) and the list is planned
again, so a stale plan costs one extra attempt, never a wrong result.

``plan_of(model.parameters())`` shows the plan, e.g. ``ListPlan(route='sharded-cpu', params=148,
collectives=all-reduce over the world)``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import distributed
from .distributed.plan import _keep, _used

__all__ = ["ListPlan", "plan_of", "lookup", "ROUTES"]

ROUTES = ("cpu", "plain", "sharded", "sharded-cpu", "torch")
_PLANS: dict = {}
_CAP = 64  # lists planned at once: a model's clip lists (a few per training script), each a few hundred bytes


class ListPlan:
    """How ``clip_grad_norm_`` serves one list: ``route`` (one of :data:`ROUTES`, None before the first call),
    ``layout`` (the sharded routes: the list's cached layout, with the plan of its collectives) and the list's
    identity (``n``, ``first``, ``group``)."""

    __slots__ = ("route", "layout", "n", "first", "group")

    def __init__(self, n: int, first, group):
        self.route: str | None = None
        self.layout = None
        self.n = n
        self.first = first
        self.group = group

    def __repr__(self) -> str:
        parts = [f"route={self.route!r}", f"params={self.n}"]
        if self.group is not None:
            parts.append(f"process_group={self.group!r}")
        plan = getattr(self.layout, "plan", None)
        if plan is not None:
            parts.append(f"collectives={plan.describe()}")
        return f"ListPlan({', '.join(parts)})"


def plan_of(params: Sequence, process_group=None) -> ListPlan:
    """The cached plan of ``params`` (a list, or any iterable of parameters) with this ``process_group``; a new,
    unplanned one for a list not seen yet."""
    return lookup(params if type(params) is list else list(params), process_group)


def lookup(params: list, process_group) -> ListPlan:
    """:func:`plan_of` for a list. While torch.compile traces, a fresh plan (Dynamo 2.11 cannot trace every id(),
    and the routes a plan remembers are eager C++ passes): the traced call plans it as a first call would."""
    if not params or torch.compiler.is_compiling():
        return ListPlan(len(params), params[0] if params else None, process_group)
    first = params[0]
    key = (len(params), 0 if process_group is None else id(process_group), id(first))  # (plan.group_key, inline)
    plan = _PLANS.get(key)
    if plan is not None and plan.first is first and plan.group is process_group:
        if len(_PLANS) > _CAP // 2:  # the recency order matters only once the cache can fill: skip its upkeep
            _used(_PLANS, key)
        return plan
    plan = ListPlan(len(params), first, process_group)
    _keep(_PLANS, key, plan, _CAP)
    return plan


def clear() -> None:
    """Forget every list's plan (``fastgrad.distributed.clear_cache`` calls it too)."""
    _PLANS.clear()


distributed._ON_CLEAR.append(clear)
