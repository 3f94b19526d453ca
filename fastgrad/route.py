"""One plan per list: which way a list of gradients goes, decided once and cached, for every public op that reads
them.

A route says how a list is read and written, never what is decided (that is ``fastgrad.decide``):

===============  ==============================================================================================
route            how the list is served
===============  ==============================================================================================
``cpu``          plain dense CPU grads on the cpu backend: ``clip_grad_norm_``'s norm, coefficient and scale in
                 one C++ call
``plain``        plain dense grads: one backend call per device (read, decision and write fused in one call when
                 one device and one backend serve them: :func:`one_call_backend`), devices combined through their
                 totals (``fastgrad.passes``)
``sharded``      DTensor grads, or ``process_group=``: local reads, one collective (``fastgrad.distributed``)
``sharded-cpu``  DTensor grads with CPU local shards on the cpu backend: ``clip_grad_norm_``'s local part in one
                 C++ pass, then the same collective and coefficient as ``sharded`` (the same bits)
``torch``        sparse, complex or other floating grads: torch's own implementation, where the call allows it
                 (:meth:`ListPlan.refuse_fallback`)
===============  ==============================================================================================

The questions a route answers are asked here and nowhere else: is the list sharded, and over which ranks
(:meth:`ListPlan.place`, which keeps the list's layout and the plan of its collectives); may torch's own
implementation serve it (:meth:`ListPlan.refuse_fallback`); does one backend call do the whole clip
(:func:`one_call_backend`); exact or not (:func:`total_norm`, :func:`norms`: the readings of a placed list).
The routes that run here: the plan's one-pass C++ clips (:meth:`ListPlan.one_pass_clip`), and :func:`clip_`, the
clip of a placed list with or without a GradScaler's unscale (``clip_grad_norm_``, ``scaler_unscale_and_clip``,
``clip_optimizer_grad_norm_``). An entry asks the plan, then runs the route it names.

The plan of a parameter list (:func:`lookup`) is cached, keyed by the list's length, its group and its first
parameter (held and compared with ``is``, so a reused id cannot alias), so a loop that passes
``model.parameters()`` every step reuses it. Its first call places it (``route`` None until then); a later call
goes straight to the route it recorded. A route that finds its list changed declines (each route checks what it
relies on, in its own pass: the C++ passes check every grad) and the list is placed again, so a stale plan costs
one extra attempt, never a wrong result. A list of gradients themselves (``get_total_norm``,
``multi_tensor_norm``) gets a fresh plan per call (:func:`plan_for`): a cache keyed by a gradient would keep it
alive after ``zero_grad``.

``plan_of(model.parameters())`` shows the plan, e.g. ``ListPlan(route='sharded-cpu', params=148,
collectives=all-reduce over the world)``.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch import Tensor

from . import _inputs as inputs
from . import _scan
from . import distributed
from . import exact_reads
from . import passes
from . import scaler_state
# torch's own functions as captured at import: the fallback must not reach a patch_torch() router (recursion)
from ._torch_fns import TORCH
from .backends import Backend, BackendError
from .decide import amp_factor, clip_coef, grad_scale
from .distributed.plan import bounded_put, mark_used

__all__ = ["ListPlan", "plan_of", "lookup", "plan_for", "ROUTES", "SHARDED", "one_call_backend", "total_norm",
           "norms", "clip_", "clip_params"]

ROUTES = ("cpu", "plain", "sharded", "sharded-cpu", "torch")
SHARDED = ("sharded", "sharded-cpu")
_MAY_BE_CPU = (None, "cpu", "plain")  # a plain list may have moved to the CPU: the C++ call tells
_PLANS: dict = {}
_CAP = 64  # lists planned at once: a model's clip lists (a few per training script), each a few hundred bytes


class ListPlan:
    """How one list is served: ``route`` (one of :data:`ROUTES`, None before the list is placed), ``layout``
    (the sharded routes: the list's cached layout, with the plan of its collectives) and the list's identity
    (``n``, ``first``: a weak reference to its first parameter, None for a plan never looked up; ``group``: the
    ``process_group=`` its calls pass)."""

    __slots__ = ("route", "layout", "n", "first", "group")

    def __init__(self, n: int, first, group):
        self.route: str | None = None
        self.layout = None
        self.n = n
        # weakly: a cached plan must not keep a dead model's parameter (and its gradient) alive
        self.first = None if first is None else _weak(first)
        self.group = group

    def __repr__(self) -> str:
        parts = [f"route={self.route!r}", f"params={self.n}"]
        if self.group is not None:
            parts.append(f"process_group={self.group!r}")
        plan = getattr(self.layout, "plan", None)
        if plan is not None:
            parts.append(f"collectives={plan.describe()}")
        return f"ListPlan({', '.join(parts)})"

    def sharded(self, tensors: Sequence[Tensor]) -> bool:
        """Whether ``tensors`` (this call's gradients of the list, or the list itself) are reduced across ranks:
        a ``process_group=``, or a DTensor among them."""
        return self.group is not None or distributed.has_dtensor(tensors)

    def place(self, tensors: Sequence[Tensor], what: str = "gradients", *, for_norm: bool = True
              ) -> distributed.Sharded | None:
        """This call's route for ``tensors``, recorded in the plan: the sharded view of a sharded list (local
        shards, what this rank counts, the collectives; with ``for_norm=False`` only the local tensors to
        write), else None, the route then ``plain`` or ``torch`` (some tensor that torch's own implementation
        serves: :meth:`refuse_fallback` says whether this call may). Raises TypeError for integer or bool
        tensors (``what`` names them)."""
        if type(tensors) is _scan.Checked and self.group is None:  # plain dense real floating: one C++ scan said so
            self.route = "plain"
            return None
        if self.sharded(tensors):
            sh = distributed.prepare(tensors, self.group, for_norm=for_norm)
            # the compiled scan of the local tensors checked the usual list in one C++ pass; only a list it
            # declines pays the Python check (through the DTensors, about a microsecond each)
            if sh.checked or not inputs.check_tensors(tensors, what):
                if sh.layout is not None:
                    self.layout = sh.layout  # (the sharded-cpu route's input; for the repr, the collectives)
                    self.route = "sharded-cpu" if distributed.takes_cpu_pass(sh, self.group) else "sharded"
                elif self.route not in SHARDED:
                    self.route = "sharded"
                return sh
            self.route = "torch"
            return None
        self.route = "torch" if inputs.check_tensors(tensors, what) else "plain"
        return None

    def one_pass_clip(self, params: list, max_norm: float, p: float, check: bool, backend: str | None, exact: bool
                      ) -> Tensor | None:
        """``clip_grad_norm_`` by the plan's one-pass C++ routes, or None (nothing done) when the plan names neither
        or its route declines (the list changed: the general path then places it again). ``cpu``: norm,
        coefficient and scale in one C++ call, which checks every grad itself (called outside no_grad: it records
        nothing for autograd, and entering no_grad costs ~2.5 us, a tenth of the whole call on a 148-tensor model).
        ``sharded-cpu``: DTensor grads with CPU local shards on the cpu backend, their per-tensor part in one C++
        pass (grads, specs, local tensors, local norm, checked against the plan's layout) and one more for the
        scale, the sharded route's collective and coefficient in between: the same bits."""
        if exact:
            return None
        if self.route in _MAY_BE_CPU and self.group is None:
            fast = _scan.clip_norm_cpu(params, max_norm, p, check, backend)
            if fast is not None:
                self.route = "cpu"
                if fast[1]:
                    raise RuntimeError(inputs.NONFINITE_MSG.format(p))
                return fast[0]
        if self.route != "sharded-cpu":
            return None
        with torch.no_grad():
            local = distributed.local_cpu_norm(params, self.layout, p, backend)
            if local is None:
                return None
            sh, local_total, handle = local
            total, _ = distributed.reduced_norm(sh, p, False, None, local_total=local_total)
            if check:
                inputs.check_finite(total, p)  # the same value on every rank: all of them raise, none writes
            distributed.scale_local_cpu(handle, clip_coef(total, max_norm))
            return distributed.wrap_like(total.to(inputs.promoted_dtype(sh.writes)), sh)

    def refuse_fallback(self, fn: str, backend: str | None, exact: bool = False) -> None:
        """The ``torch`` route's question: may torch's own implementation serve this call of ``fn``? Raises when
        not: a ``process_group=`` (fastgrad's reduction only), ``exact=True``, or a fastgrad backend asked for by
        name. Returns when it may (an automatic or torch choice)."""
        if self.group is not None:
            raise TypeError("process_group= supports dense real floating tensors only (no sparse or complex)")
        if exact:
            exact_reads.refuse_fallback()
        name = inputs.requested_backend(backend)
        if name not in (None, "torch"):
            raise BackendError(
                f"fastgrad backend {name!r} cannot run {fn}: sparse, complex or non-standard floating gradients "
                "are handled only by torch's own implementation (backend='torch' or automatic choice)"
            )


def plan_of(params: Sequence, process_group=None) -> ListPlan:
    """The cached plan of ``params`` (a list, or any iterable of parameters) with this ``process_group``; a new,
    unplaced one for a list not seen yet."""
    return lookup(params if type(params) is list else list(params), process_group)


def lookup(params: list, process_group) -> ListPlan:
    """:func:`plan_of` for a list. While torch.compile traces, a fresh plan (Dynamo 2.11 cannot trace every id(),
    and the routes a plan remembers are eager C++ passes): the traced call places it as a first call would."""
    if not params or torch.compiler.is_compiling():
        return ListPlan(len(params), None, process_group)  # (never looked up: no reference to trace)
    first = params[0]
    key = (len(params), 0 if process_group is None else id(process_group), id(first))  # (plan.group_key, inline)
    plan = _PLANS.get(key)
    if plan is not None and plan.first() is first and plan.group is process_group:
        if len(_PLANS) > _CAP // 2:  # the recency order matters only once the cache can fill: skip its upkeep
            mark_used(_PLANS, key)
        return plan
    plan = ListPlan(len(params), first, process_group)
    if plan.first is not None:  # (not a tensor: never cached, the entry's input check names it)
        bounded_put(_PLANS, key, plan, _CAP)
    return plan


def _weak(obj):
    """A weak reference to ``obj``, or None for what takes none (None itself, a number in a bad list)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


def plan_for(tensors: list, process_group) -> ListPlan:
    """A fresh, uncached plan for a list of gradients themselves (see the module's docstring)."""
    return ListPlan(len(tensors), None, process_group)  # (never looked up: no identity kept)


def clear() -> None:
    """Forget every list's plan (``fastgrad.distributed.clear_cache`` calls it too)."""
    _PLANS.clear()


distributed.on_clear(clear)


# ------------------------------------------------------------------------------------------ the readings
def one_call_backend(read: str, grads: list[Tensor], backend: str | None, p: float) -> Backend | None:
    """The backend that reads, decides and writes a plain list in ONE call (its fused ``clip_norm_`` or
    ``amp_clip_``, ``read`` naming its read primitive: ``norm`` or ``amp_norm``): when the grads are on one device
    and the same backend serves the read and the scale; else None (the caller composes the passes)."""
    if len(inputs.split_by_device(grads)) != 1:
        return None
    b = inputs.pick(read, grads, backend, norm_type=p)
    return b if inputs.pick("scale", grads, backend) is b else None


def total_norm(sh: distributed.Sharded | None, tensors: list[Tensor], p: float, backend: str | None,
               foreach: bool | None, exact: bool, dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """The total norm of a placed list (``sh``: its sharded view, one collective; None: plain):
    ``(total, out)``, the total in the accumulation dtype (for a coefficient) and the value returned, in ``dtype``
    (``fastgrad._inputs.out_dtype``). ``exact``: both correctly rounded from one exact sum (fastgrad.exact)."""
    if exact:
        return exact_reads.totals(sh, tensors, p, backend, dtype)
    if sh is not None:
        total, _ = passes.sharded_norm(sh, p, backend, foreach)
    else:
        total, _ = passes.list_norm(tensors, p, backend, foreach)
    return total, total if dtype is None else total.to(dtype)


def norms(sh: distributed.Sharded | None, tensors: list[Tensor], p: float, backend: str | None, exact: bool,
          per_tensor: bool, poison: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The total and, with ``per_tensor``, per-tensor norms of a placed list in the accumulation dtype (``sh``
    and ``exact`` as :func:`total_norm`; ``poison``: a sharded list's flag of uncounted copies,
    ``fastgrad.distributed.nonfinite_poison``)."""
    if exact:
        return exact_reads.acc_norms(tensors, p, backend, per_tensor, sh, poison)
    if sh is not None:
        return passes.sharded_norm(sh, p, backend, None, per_tensor, poison)
    return passes.list_norm(tensors, p, backend, None, per_tensor)


# ------------------------------------------------------------------------------------------ the clip
def clip_params(params: list, max_norm: float, p: float, check: bool, foreach: bool | None, backend: str | None,
                exact: bool, process_group) -> Tensor:
    """``clip_grad_norm_`` of a parameter list whose arguments are checked: the plan's one-pass C++ routes, else
    the list placed and clipped (:func:`clip_`), or torch's own implementation where the plan allows it."""
    plan = lookup(params, process_group)
    total = plan.one_pass_clip(params, max_norm, p, check, backend, exact)
    if total is not None:
        return total
    with torch.no_grad():
        grads = passes.grads_of(params)
        if not grads and process_group is None:
            return torch.tensor(0.0)
        sh = plan.place(grads)
        if plan.route == "torch":
            plan.refuse_fallback("clip_grad_norm_", backend, exact)
            return TORCH.clip_grad_norm_(params, max_norm, p, check, foreach)
        return clip_(sh, grads, max_norm, p, check, foreach, backend, exact)


def clip_(sh: distributed.Sharded | None, grads: list[Tensor], max_norm: float, p: float, check: bool,
          foreach: bool | None, backend: str | None, exact: bool, unscale: scaler_state.Unscale | None = None,
          hand_over=None) -> Tensor:
    """Clip a placed list (``sh``: its sharded view; None: plain) by its total norm, a GradScaler's unscale
    folded in (``unscale``), and return the total (in the list's dtype; sharded: as ``wrap_like``).

    One read: the total norm (of the unscaled values), with a scaler its overflow flags too (``exact``: unscale_'s
    own pass first, then the exact norm of the unscaled values). Then the scaler's state as ``unscale_`` leaves
    it; ``check`` (``error_if_nonfinite``) before anything is written (the gradients not unscaled yet are unscaled
    before it raises, as ``unscale_`` had written them when torch's clip raises); then one write of the factor
    (``fastgrad.decide``), or the factor handed over (``hand_over(grad_scale)``: to an optimizer that applies it
    inside its step). A plain list on one device that one backend serves (:func:`one_call_backend`) takes the
    read, the factor and the write in ONE call: its fused ``clip_norm_`` (which always writes), or ``amp_clip_``."""
    one = None
    if sh is None and not exact and not check and (unscale is None or not unscale.sharded):
        one = one_call_backend("norm" if unscale is None else "amp_norm", grads, backend, p)
        if one is not None and unscale is None and hand_over is not None:
            one = None  # (its clip_norm_ always writes: a factor to hand over takes the passes below)
    # the local tensors to write, by device (none left to write after one fused call), and the returned dtype
    groups = [] if one is not None else inputs.split_by_device(grads if sh is None else sh.writes)
    dtype = inputs.out_dtype(grads, None if sh is None else sh.writes)
    if one is not None and unscale is None:
        return one.clip_norm_(grads, max_norm, p, foreach=foreach).to(dtype)
    unscaled = False
    factor = None
    if one is not None:  # under a scaler: the read, the flag, the factor and (unless handed over) the write
        dev = grads[0].device
        total, flag, factor = one.amp_clip_(grads, unscale.inv.to(dev, non_blocking=True), max_norm, p,
                                            hand_over is None)
        out, found, reduce_flags = total.to(dtype), {dev: flag.reshape(())}, False
    else:
        if unscale is None:
            total, out = total_norm(sh, grads, p, backend, foreach, exact, dtype)
        else:
            total, out, found, reduce_flags, unscaled = scaler_state.read(unscale, sh, grads, groups, p, backend,
                                                                          exact, dtype)
    if unscale is not None:
        scaler_state.record_unscaled(unscale.scaler, unscale.state, found, reduce_flags)
    if groups:  # (computed before the check: a device op, nothing written)
        total_here = total.to(groups[0][0].device)
        factor = (clip_coef(total_here, max_norm) if unscale is None or unscaled
                  else amp_factor(total_here, max_norm, unscale.inv))
    if check:
        try:
            inputs.check_finite(total, p)  # sharded: the same value on every rank, so all of them raise alike
        except RuntimeError:
            if unscale is not None and not unscaled:
                passes.scale_groups(groups, unscale.inv, backend)
            raise
    if factor is not None and hand_over is not None:
        hand_over(grad_scale(factor))
    elif factor is not None and groups:  # (none left after one fused call, which wrote)
        passes.scale_groups(groups, factor, backend, foreach)
    return out if sh is None else distributed.wrap_like(out, sh)
