"""The skip: how the decision ``clip_`` leaves pending reaches the optimizer's next ``step``.

A step pre/post hook pair, registered once on the optimizer, applies the 0-dim "bad step" flag and then
undoes what it changed:

* torch's ``fused=True`` Adam/AdamW/SGD/Adagrad: the flag goes in as ``optimizer.found_inf`` (OR-ed into the
  one ``GradScaler.step`` passes), so the fused kernel skips the update on the device: parameters, moments
  and step counters unchanged, no host sync. Where the clip hands its coefficient over (zero-write), it
  goes in as ``grad_scale``.
* any other optimizer, ``non_fused="sync"``: the pre-hook reads the flag (ONE host sync per step) and on a
  bad step hides the gradients from the step (``p.grad = None`` for its duration; torch's optimizers then
  leave those parameters and their state alone), restoring them afterwards.
* ``non_fused="restore"``: no host sync; the pre-hook snapshots the parameters and every state tensor, the
  post-hook puts the snapshot back where the flag says (``torch.where``). Falls back to one flag read for a
  step where the state is not on the flag's device, or where the step adds state entries.

Every path: a step on which torch would create a parameter's state lazily reads the flag once and, if bad,
hides the gradients, so a skipped step leaves no state behind (torch's fused kernels would otherwise create
it: fused SGD's momentum buffer as uninitialised memory). ``step(closure)``: the closure is wrapped, and the
decision its ``clip_`` makes is applied when it returns, still before the update. A decision holds until the
next ``clip_``: a second ``step()`` on the same gradients obeys it again. A step on gradients that no decision
covers (``clip_`` never called, a ``clip_`` that found no gradients, gradients changed since the decision)
raises in the pre-hook, before anything is written, and keeps raising until the next ``clip_``; a step with no
gradients at all passes (it changes nothing). The check (:class:`Seen`) is host work only, no device read: the
identity and the autograd version of every gradient, so a replaced ``.grad``, an in-place write into any one of
them (a backward, ``zero_grad()``, a hook, a bug) is caught. The guard's pre-hook is moved to the end of the
optimizer's pre-hooks at each ``clip_``, so a pre-hook registered later that writes a gradient is caught too.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from .. import _inputs as inputs
from .. import distributed
from .._inputs import optimizer_params
from ..optim_clip import fused_torch_optimizer as _fused_torch_optimizer

_MISSING = object()

_STALE = ("StepGuard: no guard.clip_() decided on the gradients of this optimizer.step(): {why}. Call "
          "guard.clip_() after the last backward and right before optimizer.step() / scaler.step(optimizer) "
          "(with step(closure): inside the closure, after backward). Nothing was stepped.")

# why no decision covers the gradients a step is about to use (the {why} of _STALE)
NEVER = ("guard.clip_() has not been called since the guard was built, and the guard lets no step use "
         "gradients it did not decide on")
NO_GRADS = ("the last guard.clip_() found no gradients, so it decided nothing (it ran before backward(), or "
            "between zero_grad() and backward())")
RAISED = "the last guard.clip_() raised before it decided"
CHANGED = "the gradients changed after the clip (a backward, zero_grad() or an in-place write)"
_VERSION = operator.attrgetter("_version")


class Seen:
    """The gradients a decision saw: each one's identity and autograd version, read on the host.

    A replaced ``.grad`` changes an identity; an in-place write into a gradient (autograd accumulating, a
    hook's ``nan_to_num_``, ``zero_()``, ``mul_`` under ``no_grad``) bumps its version counter. Every gradient
    is checked, not a sample: a write into the middle of the list is as unsafe as one at the ends. The list is
    held, so no identity can be reused by a new tensor while the decision stands. Not seen: writes that bypass
    autograd's version counter (through ``.data``, a NumPy view, or the storage)."""

    __slots__ = ("grads", "versions")

    def __init__(self, grads: list[Tensor]):
        self.grads = grads
        self.versions = list(map(_VERSION, grads))

    def refresh(self) -> None:
        """After a step that may write the gradients itself (a fused zero-write step divides them)."""
        self.versions = list(map(_VERSION, self.grads))

    def same(self, grads: list[Tensor]) -> bool:
        return (len(grads) == len(self.grads) and all(map(operator.is_, grads, self.grads))
                and list(map(_VERSION, grads)) == self.versions)

    def which(self, grads: list[Tensor]) -> str:
        """Where ``grads`` first differ from what was seen, for the refusal (the failure path only)."""
        if len(grads) != len(self.grads):
            return f"{len(self.grads)} gradients were decided on, the step has {len(grads)}"
        for i, (g, s, v) in enumerate(zip(grads, self.grads, self.versions)):
            if g is not s:
                return f"gradient {i} of {len(grads)} (shape {list(g.shape)}) is another tensor"
            if g._version != v:
                return f"gradient {i} of {len(grads)} (shape {list(g.shape)}) was written in place"
        return "the gradients are the same"
UNSEEN = "this step's gradients were not seen by a clip_ (a new backward since the last clip_ and step)"


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if distributed.is_dtensor(t) else t


class Pending:
    """A decision: the flag, the zero-write factor (or None, and consumed by the first step), the gradients
    it saw (:class:`Seen`; None on a rank that owns no shard: nothing to check)."""

    __slots__ = ("bad", "scale", "seen")

    def __init__(self, bad: Tensor, scale: Tensor | None, grads: list[Tensor]):
        self.bad = bad
        self.scale = scale
        self.seen = Seen(grads) if grads else None


def _closure_of(opt, args, kwargs):
    rest = args[1:] if args and args[0] is opt else args  # torch passes (self, *step_args)
    if rest:
        return rest[0], "arg"
    return kwargs.get("closure"), "kw"


def _lacks_state(opt, group, st) -> bool:
    if isinstance(opt, torch.optim.SGD):  # SGD keeps state only for momentum (an empty dict otherwise)
        return group.get("momentum", 0) != 0 and (st is None or st.get("momentum_buffer") is None)
    return not st


class Skipper:
    """The optimizer side of one guard: holds the decision and makes the optimizer's steps obey it.

    ``pending``: the decision of the last ``clip_``, not yet applied. ``sticky``: the decision after its
    first step: a further ``step()`` on the same gradients (no new ``clip_``) obeys it again (a skipped
    step stays skipped); a step on gradients it did not see raises (it would step unguarded)."""

    def __init__(self, non_fused: str):
        self.non_fused = non_fused
        self.pending: Pending | None = None
        self.sticky: Pending | None = None
        self.undecided = NEVER  # while neither holds a decision: why (the refusal's text)
        self.undo = None  # what the pre-hook must undo in the post-hook
        self._stated = None  # (opt.state, number of parameters) once every parameter has its state

    def creates_state(self, opt) -> bool:
        """Whether ``opt.step()`` would create optimizer state for a parameter that has a gradient (torch
        creates it lazily, on a parameter's first step). O(1) once every parameter has its state (torch never
        deletes state; ``load_state_dict`` replaces ``opt.state``, which starts the scan again)."""
        n = sum(len(group["params"]) for group in opt.param_groups)
        if self._stated is not None and self._stated[0] is opt.state and self._stated[1] == n:
            return False
        complete = True
        for group in opt.param_groups:
            for q in group["params"]:
                if _lacks_state(opt, group, opt.state.get(q)):
                    if q.grad is not None:
                        return True
                    complete = False
        if complete:
            self._stated = (opt.state, n)
        return False

    def pend(self, bad: Tensor, scale: Tensor | None, grads: list) -> None:
        self.sticky = None
        self.pending = Pending(bad, scale, grads)

    def clear(self, why: str = RAISED) -> None:
        """Drop the decision (a new ``clip_`` starts, or it found no gradients: ``why`` a later step on
        gradients is refused)."""
        self.pending = self.sticky = None
        self.undecided = why

    def _retire(self, why: str) -> None:
        self.pending = self.sticky = None
        self.undecided = why

    # ---------------------------------------------------------------- the step hooks
    def pre_step(self, opt, args, kwargs):
        if self.undo is not None:  # a previous step raised before its post-hook ran
            self.post_step(opt)
        closure, where = _closure_of(opt, args, kwargs)
        if closure is not None:
            if self.pending is not None:
                raise RuntimeError(_STALE.format(
                    why="step(closure) recomputes the gradients; with a closure, call guard.clip_() inside it, "
                        "after backward"))
            self.sticky = None
            return self._wrap(opt, closure, where, args, kwargs)
        self._apply(opt)
        return None

    def _wrap(self, opt, closure, where, args, kwargs):
        """step(closure): the closure runs inside the step, before the update; the decision its clip_ makes is
        applied right after it (torch's optimizers read found_inf / grad_scale / the gradients after the
        closure returns), so the fused path stays sync-free here too."""
        def guarded_closure():
            out = closure()
            if self.pending is None and inputs.grads_of(optimizer_params(opt)):
                raise RuntimeError(
                    "optimizer.step(closure) on an optimizer with a StepGuard: the closure made gradients but did "
                    "not call guard.clip_(), so nothing decided whether this step is safe. Call guard.clip_() "
                    "inside the closure, after backward. Nothing was stepped.")
            self._apply(opt)
            return out

        if where == "kw":
            return args, {**kwargs, "closure": guarded_closure}
        rest = list(args)
        i = 1 if args and args[0] is opt else 0
        rest[i] = guarded_closure
        return tuple(rest), kwargs

    def _apply(self, opt) -> None:
        grads = inputs.grads_of(optimizer_params(opt))
        pend = self.pending if self.pending is not None else self.sticky
        if pend is None:
            if grads:  # gradients no decision covers: refused (host work only, no device read)
                raise RuntimeError(_STALE.format(why=self.undecided))
            return  # nothing to step on: the step changes nothing, nothing to guard
        if pend is self.sticky and not grads:
            self._retire(UNSEEN)  # nothing to step on (zero_grad(set_to_none=True)): nothing to guard
            return
        if pend.seen is not None and not pend.seen.same(grads):
            # a retried step() raises again, with the same reason, rather than step unguarded
            where = pend.seen.which(grads)
            self._retire(f"{CHANGED}: {where}" if pend is self.pending else UNSEEN)
            raise RuntimeError(_STALE.format(why=self.undecided))
        self.pending = None
        self.sticky = pend
        fused = _fused_torch_optimizer(opt)
        if self.creates_state(opt):
            # torch creates this step's state lazily; a skipped step must not leave any (fused SGD's momentum
            # buffer would be uninitialised memory, Adam's a zero state that a step never made): one read of
            # the flag decides, and a bad step sees no gradients
            self.undo = self._hide_if_bad(opt, pend.bad)
            if self.undo is None and fused:
                self.undo = ("fused", self._hand_to_fused(opt, pend))
        elif fused:
            self.undo = ("fused", self._hand_to_fused(opt, pend))
        elif self.non_fused == "restore":
            with torch.no_grad():
                snap = self._snapshot(opt, pend.bad)
            self.undo = ("restore", snap) if snap is not None else self._hide_if_bad(opt, pend.bad)
        else:
            self.undo = self._hide_if_bad(opt, pend.bad)
        pend.scale = None  # the zero-write factor is applied once: the step divides the gradients by it

    def post_step(self, opt) -> None:
        undo, self.undo = self.undo, None
        st = self.sticky
        if st is not None and st.seen is not None and writes_grads(opt):
            st.seen.refresh()  # the step's own write is not one after the decision
        if undo is None:
            return
        kind, data = undo
        if kind == "fused":
            for name, applied, prev in data:
                if getattr(opt, name, None) is applied:
                    if prev is _MISSING:
                        delattr(opt, name)
                    else:
                        setattr(opt, name, prev)
        elif kind == "hidden":
            for q, grad in data:
                q.grad = grad
        elif kind == "restore":
            with torch.no_grad():
                self._merge(opt, *data)

    def _hand_to_fused(self, opt, pend: Pending) -> list:
        """found_inf (and the zero-write grad_scale) for torch's fused kernels, combined with what a
        GradScaler.step already set; undone by the post-hook."""
        done = []
        prev = getattr(opt, "found_inf", _MISSING)
        flag = pend.bad.to(torch.float32)
        if prev is not _MISSING and prev is not None:
            flag = torch.maximum(prev, flag.to(prev.device, non_blocking=True))
        done.append(("found_inf", flag, prev))
        setattr(opt, "found_inf", flag)
        if pend.scale is not None:
            prev = getattr(opt, "grad_scale", _MISSING)
            gs = pend.scale if prev is _MISSING or prev is None else prev * pend.scale.to(prev.device,
                                                                                          non_blocking=True)
            done.append(("grad_scale", gs, prev))
            setattr(opt, "grad_scale", gs)
        return done

    @staticmethod
    def _hide_if_bad(opt, bad: Tensor):
        """The sync path: one host read of the flag; on a bad step the step sees no gradients."""
        if not bool(bad):
            return None
        hidden = []
        for group in opt.param_groups:
            for q in group["params"]:
                if q.grad is not None:
                    hidden.append((q, q.grad))
                    q.grad = None
        return ("hidden", hidden)

    @staticmethod
    def _snapshot(opt, bad: Tensor):
        """Clones of every parameter with a gradient and of its state tensors, or None when a sync-free
        restore cannot be exact (state not created yet, or on another device than the flag)."""
        bad = bad > 0
        dev = bad.device
        tensors, others, keys = [], [], {}
        for group in opt.param_groups:
            for q in group["params"]:
                if q.grad is None:
                    continue
                st = opt.state.get(q)
                if _lacks_state(opt, group, st):
                    return None
                lq = _local(q)
                if lq.device != dev:
                    return None
                tensors.append((None, q, lq, lq.clone()))
                if st is None:  # an optimizer that keeps no state for it (SGD without momentum)
                    continue
                keys[id(st)] = set(st)
                for k, v in st.items():
                    if isinstance(v, Tensor):
                        lv = _local(v)
                        if lv.device != dev:
                            return None
                        tensors.append((st, k, v, lv.clone()))
                    else:
                        others.append((st, k, v))
        return bad, tensors, others, keys

    @staticmethod
    def _merge(opt, bad, tensors, others, keys) -> None:
        """Post-hook of the restore path: where ``bad``, put the snapshot back."""
        for st, key, orig, snap in tensors:
            if st is None:  # a parameter
                lq = orig
                lq.copy_(torch.where(bad, snap, lq))
                continue
            cur = st.get(key)
            if cur is orig:
                lv = _local(cur)
                lv.copy_(torch.where(bad, snap, lv))
            elif isinstance(cur, Tensor) and not distributed.is_dtensor(cur):
                st[key] = torch.where(bad, snap.to(cur.dtype), cur)
            else:  # replaced by something we cannot merge on the device: decide on the host
                if bool(bad):
                    st[key] = orig
                    _local(orig).copy_(snap)
        changed = [(st, k, v) for st, k, v in others if st.get(k, _MISSING) is not v]
        added = [(st, k) for group in opt.param_groups for q in group["params"]
                 if q.grad is not None for st in [opt.state.get(q)] if st is not None
                 for k in st if k not in keys.get(id(st), ())]
        if (changed or added) and bool(bad):  # host state moved: one read of the flag decides
            for st, k, v in changed:
                st[k] = v
            for st, k in added:
                del st[k]


def writes_grads(opt) -> bool:
    """Whether ``opt.step()`` may write its gradients in place: torch's own optimizers never do (read-only
    gradients in every implementation, fused, foreach and for-loop), so the seen versions stand after their
    step; any other class's step (e.g. weight decay added into ``p.grad``) is read again after it."""
    return not type(opt).__module__.startswith("torch.optim.")


def is_fused(opt) -> bool:
    return _fused_torch_optimizer(opt)
