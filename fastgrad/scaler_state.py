"""A GradScaler's state as ``scaler.unscale_(optimizer)`` reads and leaves it: what kind of scaler it is, its
checks (in torch's order, with torch's texts), its inverse scale, and the per-optimizer state a fused read pass
records in place of ``unscale_`` (the overflow flags per device, stage UNSCALED, a ShardedGradScaler's
reduction of the flags), so that ``scaler.step`` and ``scaler.update`` need no change; and whether its ``step``
can hand a factor to an optimizer that unscales inside its own step (:func:`zero_write_applies`).

Shared by ``fastgrad.scaler_unscale_and_clip`` and the step guard's ``clip_(scaler)``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Sequence

import torch
from torch import Tensor

from . import _inputs as inputs
from . import distributed
from . import exact_reads
from . import passes
from .backends import acc_dtype
from .decide import nonfinite

try:
    from torch.amp.grad_scaler import GradScaler, OptState
except ImportError:  # pragma: no cover - torch < 2.3 kept the scaler under torch.cuda.amp
    from torch.cuda.amp.grad_scaler import GradScaler, OptState  # type: ignore[no-redef]

__all__ = ["GradScaler", "OptState", "sharded_scaler_class", "is_sharded", "traced_plain", "enabled",
           "optimizer_state", "known_unscale", "check_ready", "inv_scale", "zero_write_applies", "Unscale",
           "folds_flags", "read", "flags_of", "all_reduce_found_inf", "record_unscaled", "record_read_pass"]

_SHARDED_MODULE = "torch.distributed.fsdp.sharded_grad_scaler"


# ---------------------------------------------------------------- what kind of scaler
def sharded_scaler_class():
    """torch's ShardedGradScaler class, or None when the program has not imported it."""
    # Only look the class up if the user's program imported it: a ShardedGradScaler instance implies that,
    # and importing torch.distributed.fsdp just to answer "no" would cost every call.
    mod = sys.modules.get(_SHARDED_MODULE)
    return getattr(mod, "ShardedGradScaler", None) if mod is not None else None


def is_sharded(scaler) -> bool:
    """Whether ``scaler`` is a ShardedGradScaler (its flags are reduced over its process group)."""
    cls = sharded_scaler_class()
    return cls is not None and isinstance(scaler, cls)


def traced_plain(scaler) -> bool:
    """True while dynamo traces a call on a plain ``GradScaler`` (exactly that class): dynamo will not trace
    into torch/amp's methods, so that path reads the scaler's fields instead (what those methods read).
    Eager calls, subclasses and ShardedGradScaler keep calling the methods (those graph-break if compiled)."""
    return torch.compiler.is_compiling() and type(scaler) is GradScaler


def enabled(scaler, traced: bool) -> bool:
    return scaler._enabled if traced else scaler.is_enabled()


def optimizer_state(scaler, optimizer, traced: bool) -> dict:
    """The scaler's per-optimizer state (a fresh one made as torch makes it, also while traced)."""
    states = scaler._per_optimizer_states
    if not traced:
        return states[id(optimizer)]
    # The defaultdict's factory lives in torch/amp (not traceable): build the same fresh state here.
    key = id(optimizer)
    state = states.get(key)
    if state is None:
        state = {"stage": OptState.READY, "found_inf_per_device": {}}
        states[key] = state
    return state


def known_unscale(scaler) -> bool:
    """True when ``scaler.unscale_`` is torch's own (plain or sharded), i.e. the behaviour reproduced here. A
    subclass that overrides unscale_ or _unscale_grads_ gets its own code run instead."""
    t = type(scaler)
    if t.unscale_ is GradScaler.unscale_ and t._unscale_grads_ is GradScaler._unscale_grads_:
        return True
    sharded = sharded_scaler_class()
    return sharded is not None and t.unscale_ is sharded.unscale_ and t._unscale_grads_ is sharded._unscale_grads_


def check_ready(scaler, state: dict, traced: bool = False) -> None:
    """torch's checks in unscale_, in torch's order and with its texts."""
    if traced:  # _check_scale_growth_tracker's checks, inlined (its method cannot be traced)
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if scaler._scale is None:
            raise AssertionError("Attempted unscale_ but _scale is None.  " + fix)
        if scaler._growth_tracker is None:
            raise AssertionError("Attempted unscale_ but _growth_tracker is None.  " + fix)
    else:
        scaler._check_scale_growth_tracker("unscale_")
    if state["stage"] is OptState.UNSCALED:
        raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
    if state["stage"] is OptState.STEPPED:
        raise RuntimeError("unscale_() is being called after step().")


def inv_scale(scaler) -> Tensor:
    """The inverse scale as unscale_ computes it: the reciprocal in fp64 then fp32 (fp32 division is imprecise
    under some compile options); MPS has no fp64."""
    s = scaler._scale
    return s.reciprocal() if s.device.type == "mps" else s.double().reciprocal().float()


# ---------------------------------------------------------------- zero-write: the factor handed to the step
_STEP_PROBES: dict = {}


def _step_keeps_grad_scale(step_fn) -> bool:
    """Does this ``GradScaler.step`` hand a ``grad_scale`` set on the optimizer through to a
    ``_step_supports_amp_scaling`` optimizer after unscale_? torch >= 2.5 or so does (it multiplies scales);
    older releases overwrite it with None, which would silently skip our factor. Asked once per step
    function by running it on a dummy CPU optimizer."""
    known = _STEP_PROBES.get(step_fn)
    if known is not None:
        return known
    sentinel = torch.tensor(3.0)

    class _Probe:
        _step_supports_amp_scaling = True
        param_groups: list = []
        seen = None

        def step(self):
            self.seen = getattr(self, "grad_scale", None)

    ok = False
    try:
        probe = _Probe()
        s = GradScaler("cpu", init_scale=2.0)
        s._lazy_init_scale_growth_tracker(torch.device("cpu"))
        s._per_optimizer_states[id(probe)] = {"stage": OptState.UNSCALED,
                                             "found_inf_per_device": {torch.device("cpu"): torch.zeros(())}}
        probe.grad_scale = sentinel
        step_fn(s, probe)
        ok = probe.seen is sentinel and not hasattr(probe, "grad_scale")
    except Exception:  # any incompatibility means: do not rely on it
        ok = False
    _STEP_PROBES[step_fn] = ok
    return ok


def zero_write_applies(scaler, optimizer, grads: Sequence[Tensor] | None = None) -> bool:
    """Whether ``scaler_unscale_and_clip(..., zero_write=True)`` can hand its factor to ``optimizer``
    instead of writing the gradients: an enabled torch GradScaler (or ShardedGradScaler) whose ``step``
    passes ``optimizer.grad_scale`` through, an optimizer that unscales inside its step
    (``_step_supports_amp_scaling``, e.g. torch's ``fused=True`` Adam/AdamW/SGD) without the legacy
    ``grad_scaler`` keyword and without a ``grad_scale`` of its own already set, and no float64 gradients
    (the fused kernels take a float32 scale)."""
    if not scaler.is_enabled() or not known_unscale(scaler):
        return False
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if getattr(optimizer, "grad_scale", None) is not None:
        return False
    try:
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            return False
    except (TypeError, ValueError):
        return False
    if grads is None:
        grads = inputs.grads_of(inputs.optimizer_params(optimizer))
    if inputs.has_dtype(grads, torch.float64):
        return False
    return _step_keeps_grad_scale(type(scaler).step)


class Unscale:
    """What a GradScaler adds to a clip (``fastgrad.route.clip_``): its ``inv`` (:func:`inv_scale`), the
    per-optimizer ``state`` the read records its overflow flags in, whether it is a ShardedGradScaler
    (``sharded``: flags of shape ``(1,)``, reduced over its process group), and the optimizer that asked for
    ``zero_write`` (``zero_write_to``; None: the gradients are written)."""

    __slots__ = ("scaler", "state", "inv", "sharded", "flag_shape", "zero_write_to")

    def __init__(self, scaler, state: dict, sharded: bool, zero_write_to=None):
        self.scaler = scaler
        self.state = state
        self.inv = inv_scale(scaler)
        self.sharded = sharded
        self.flag_shape = (1,) if sharded else ()  # torch's flags: 0-dim per device, (1,) for ShardedGradScaler
        self.zero_write_to = zero_write_to

    def hand_over(self, grads: list[Tensor]):
        """Where :func:`zero_write_applies` to a plain list's ``grads``: the hand-over of the factor to the
        optimizer (the fused optimizers divide by ``grad_scale``, and store the quotient into ``.grad``, inside
        their step); else None (the gradients are written)."""
        opt = self.zero_write_to
        if opt is None or not zero_write_applies(self.scaler, opt, grads):
            return None
        return functools.partial(setattr, opt, "grad_scale")


def folds_flags(scaler, sh) -> bool:
    """Whether a ShardedGradScaler's process group is exactly the ranks a sharded norm's reduction reached, so
    that the overflow flag reduced with the norm IS the scaler's own reduction of the flags."""
    import torch.distributed as dist

    span = distributed.span_ranks(sh)
    if span is None:
        return False
    pg = getattr(scaler, "process_group", None)
    if pg is None or pg is dist.group.WORLD:
        ranks = frozenset(range(dist.get_world_size()))
    else:
        ranks = frozenset(dist.get_process_group_ranks(pg))
    return ranks == span


def read(unscale: Unscale, sh, grads: list[Tensor], groups: list[list[Tensor]], p: float, backend: str | None,
         exact: bool, dtype: torch.dtype | None) -> tuple[Tensor, Tensor, dict, bool, bool]:
    """The read of a clip under a GradScaler, ``unscale_``'s work included, over a placed list (``sh``: its sharded
    view, else None; ``groups``: the local tensors to write, by device): ``(total, out, found, reduce_flags,
    unscaled)``: the total norm of the unscaled values in the accumulation dtype, the value returned (in ``dtype``),
    the overflow flags to record by device, whether the ShardedGradScaler's own reduction of them is still to run,
    and whether the gradients were unscaled in place already (``exact``: ``unscale_``'s own pass first, then the
    exact norm of the unscaled values). Sharded: one all-reduce carries the norm and the overflow flag."""
    inv, flag_shape = unscale.inv, unscale.flag_shape
    # A ShardedGradScaler reduces the ranks' flags over its own process group. When that group is exactly the
    # ranks a sharded default read's all-reduce reached, the global flag that came back with the norm IS that
    # reduction (as 0/1 where torch records the number of ranks that overflowed; step and update read both as
    # "overflow or not"): no second collective. Otherwise (own) the scaler's own reduction of the local flags.
    own = sh is not None and not exact and unscale.sharded and not folds_flags(unscale.scaler, sh)
    if exact:
        for g in groups:  # the backends that will write, checked before anything is
            inputs.pick("scale", g, backend)
        found = passes.unscale_first(groups, inv, flag_shape)
        total, out = exact_reads.totals(sh, grads, p, backend, dtype)  # (of the gradients unscaled just above)
        if sh is None:
            return total, out, found, unscale.sharded, True
        # every rank's verdict from the reduced norm (an overflowed scaled value is non-finite unscaled): the same
        # found_inf everywhere without a second collective
        flag, devices = nonfinite(total).to(torch.float32), found
    elif sh is not None:
        total, local_flag, global_flag = distributed.reduced_amp_norm(sh, p, passes.local_amp(inv, p, backend))
        out = total if dtype is None else total.to(dtype)
        flag, devices = (local_flag if own else global_flag), {g[0].device: None for g in groups}
    else:
        total, found = passes.amp_total(groups, inv, p, backend, flag_shape, acc_dtype(grads))
        return total, total.to(dtype), found, unscale.sharded, False
    return total, out, flags_of(unscale, flag, devices), own, exact


def flags_of(unscale: Unscale, flag: Tensor, devices: dict) -> dict:
    """One overflow flag to record on every device of ``devices`` (and, for a ShardedGradScaler, on its scale's
    device when there is none: it records a flag even with nothing to check)."""
    found = {dev: flag.to(dev).reshape(unscale.flag_shape) for dev in devices}
    if unscale.sharded and not found:
        dev = unscale.scaler._scale.device
        found[dev] = flag.to(dev).reshape(unscale.flag_shape)
    return found


# ---------------------------------------------------------------- the state a read pass leaves
def all_reduce_found_inf(scaler, found: dict[torch.device, Tensor]) -> None:
    """ShardedGradScaler.unscale_'s cross-rank reduction of the per-device flags (SUM over its process
    group), including its detour through the scaler's device for flags on the CPU."""
    import torch.distributed as dist

    works, on_cpu, moved = [], [], []
    for f in found.values():
        if scaler._device != "cpu" and f.device.type == "cpu":
            m = f.to(scaler._device)
            on_cpu.append(f)
            moved.append(m)
            works.append(dist.all_reduce(m, async_op=True, group=scaler.process_group))
        else:
            works.append(dist.all_reduce(f, async_op=True, group=scaler.process_group))
    for w in works:
        w.wait()
    if on_cpu:
        torch._foreach_copy_(on_cpu, moved)


def record_unscaled(scaler, state: dict, found: dict, sharded: bool, flag_shape=()) -> None:
    """The state unscale_ leaves: the flags per device, stage UNSCALED; a ShardedGradScaler's flags all-reduced
    over its process group (``sharded``), which records a flag on the scale's device even with no gradient."""
    if sharded and not found:
        found[scaler._scale.device] = torch.zeros(flag_shape, dtype=torch.float32, device=scaler._scale.device)
    state["found_inf_per_device"] = found
    state["stage"] = OptState.UNSCALED
    if sharded:
        all_reduce_found_inf(scaler, found)


def record_read_pass(scaler, state, sharded, found, total, p, error_if_nonfinite, groups, inv, backend) -> None:
    """After a read pass: :func:`record_unscaled`, then, if asked, the non-finite check, which raises after
    writing the unscaled values (``groups`` times ``inv``, the inverse scale), as unscale_ had already done when
    torch's clip_grad_norm_ raises."""
    record_unscaled(scaler, state, found, sharded)
    if error_if_nonfinite:
        try:
            inputs.check_finite(total, p)
        except RuntimeError:
            passes.scale_groups(groups, inv, backend)
            raise
