"""The benchmarked operations: for each, the byte floor (docs/contract.md section 9), the fastgrad call, and the torch
baseline a user runs today (eager, and the same function under ``torch.compile``).

Every op is set up once per workload by :func:`setup`, which fixes its arguments from the actual gradients
(e.g. ``max_norm`` half the true norm for "clip triggered", ten times it for "not triggered"), so each call
does the intended work. Ops that write gradients are timed from a restored copy of the original gradients
(restoring is not timed), so every repetition sees the same data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import fastgrad

#: Loss scale for the fused AMP op: a power of two as GradScaler uses, grads stored "scaled" by it.
AMP_SCALE = 2.0 ** 16
AGC_CLIP_FACTOR, AGC_EPS = 0.01, 1e-3


@dataclass(frozen=True)
class OpSpec:
    name: str
    title: str
    #: floor (docs/contract.md section 9) in bytes, from (grad bytes N, param bytes P)
    floor: Callable[[int, int], int]
    #: whether the op writes gradients (then each repetition starts from restored gradients)
    mutates: bool
    #: what the speedup is measured against
    baseline: str


OPS: dict[str, OpSpec] = {o.name: o for o in (
    OpSpec("norm", "total norm", lambda n, p: n, False, "torch.nn.utils.get_total_norm"),
    OpSpec("clip", "clip_grad_norm_, not triggered", lambda n, p: n, True, "torch.nn.utils.clip_grad_norm_"),
    OpSpec("clip_trig", "clip_grad_norm_, triggered", lambda n, p: 3 * n, True, "torch.nn.utils.clip_grad_norm_"),
    OpSpec("clip_value", "clip_grad_value_", lambda n, p: 2 * n, True, "torch.nn.utils.clip_grad_value_"),
    OpSpec("amp_clip", "fused unscale + inf check + clip", lambda n, p: 3 * n, True,
           "scaler.unscale_ + clip_grad_norm_"),
    OpSpec("agc", "adaptive gradient clipping", lambda n, p: p + 2 * n, True, "timm-style per-parameter loop"),
    OpSpec("gc", "gradient centralization", lambda n, p: 2 * n, True, "per-parameter loop (official GC)"),
    OpSpec("grad_stats", "grad_stats", lambda n, p: n, False, "per-parameter torch loop"),
)}


# ------------------------------------------------------------------------------------ torch baselines
def torch_total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    f = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if f is not None:
        return f(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def _unit_norm(x: torch.Tensor) -> torch.Tensor:
    if x.ndim <= 1:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)


def agc_loop(params: list[torch.Tensor], clip_factor: float = AGC_CLIP_FACTOR, eps: float = AGC_EPS) -> None:
    """What timm users run today: per parameter, unit norms of W and G, then a masked rescale."""
    with torch.no_grad():
        for p in params:
            g = p.grad
            limit = _unit_norm(p.detach()).clamp_(min=eps).mul_(clip_factor)
            g_norm = _unit_norm(g)
            rescaled = g * (limit / g_norm.clamp(min=1e-6))
            g.copy_(torch.where(g_norm < limit, g, rescaled))


def gc_loop(params: list[torch.Tensor]) -> None:
    """The official gradient centralization step: subtract the mean over dims 1..n-1 of each >1-D grad."""
    with torch.no_grad():
        for p in params:
            g = p.grad
            if g.ndim > 1:
                g.sub_(g.mean(dim=tuple(range(1, g.ndim)), keepdim=True))


def stats_loop(params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """grad_stats written the obvious way: five torch reductions per parameter."""
    with torch.no_grad():
        norms, maxes, nans, infs, zeros = [], [], [], [], []
        for p in params:
            g = p.grad
            norms.append(torch.linalg.vector_norm(g, dtype=torch.float32))
            maxes.append(g.abs().amax().float())
            nans.append(torch.isnan(g).sum())
            infs.append(torch.isinf(g).sum())
            zeros.append((g == 0).sum())
        norm = torch.stack(norms)
        return {"norm": norm, "max_abs": torch.stack(maxes), "nan": torch.stack(nans), "inf": torch.stack(infs),
                "zero": torch.stack(zeros), "total_norm": torch.linalg.vector_norm(norm)}


# ------------------------------------------------------------------------------------ per-workload setup
class OpState:
    """Arguments and helper objects of every op for one materialized workload."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.grads = [p.grad for p in params]
        self.device = self.grads[0].device
        with torch.no_grad():
            per = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in self.grads])
            self.total_norm = float(torch.linalg.vector_norm(per))
        # Clip by value at the values' root mean square: about a third of the elements clip.
        self.clip_value = self.total_norm / max(sum(g.numel() for g in self.grads), 1) ** 0.5
        self.max_norm_trig = 0.5 * self.total_norm
        self.max_norm_free = 10.0 * self.total_norm
        # Fused AMP: the stored grads are the scaled ones, so the unscaled norm is total / AMP_SCALE.
        self.max_norm_amp = 0.5 * self.total_norm / AMP_SCALE
        self.optimizer = _ParamsOnly(params)
        self.scaler = _make_scaler(self.device)
        self._saved: list[torch.Tensor] | None = None

    # Restoring the gradients between repetitions of ops that write them (not timed).
    def save(self) -> None:
        if self._saved is None:
            self._saved = [g.clone() for g in self.grads]

    def restore(self) -> None:
        if self._saved is not None:
            with torch.no_grad():
                if hasattr(torch, "_foreach_copy_"):
                    torch._foreach_copy_(self.grads, self._saved)
                else:
                    for g, s in zip(self.grads, self._saved):
                        g.copy_(s)
        self.scaler_reset()

    def scaler_reset(self) -> None:
        # unscale_ marks the optimizer UNSCALED for this step; forget that so the next call is a fresh step.
        self.scaler._per_optimizer_states.clear()

    def drop(self) -> None:
        self._saved = None


class _ParamsOnly:
    """What GradScaler.unscale_ and the fused op use of an optimizer: its param_groups. (Building a real
    torch.optim optimizer imports torch._dynamo, seconds of start-up; the step itself is never timed.)"""

    def __init__(self, params):
        self.param_groups = [{"params": list(params)}]


def _make_scaler(device: torch.device):
    try:
        scaler = torch.amp.GradScaler(device.type, init_scale=AMP_SCALE)
    except (AttributeError, TypeError, RuntimeError):  # torch without torch.amp.GradScaler(device)
        scaler = torch.cuda.amp.GradScaler(init_scale=AMP_SCALE, enabled=device.type == "cuda")
    if scaler.is_enabled():
        # The scale tensor is created lazily by scaler.scale(); create it on the grads' device.
        scaler.scale(torch.ones((), device=device))
    return scaler


def torch_fn(op: str, st: OpState) -> Callable[[], object]:
    """The torch baseline for ``op`` on ``st``'s workload, as a no-argument callable."""
    params, grads = st.params, st.grads
    nn = torch.nn.utils
    if op == "norm":
        return lambda: torch_total_norm(grads)
    if op == "clip":
        return lambda: nn.clip_grad_norm_(params, st.max_norm_free)
    if op == "clip_trig":
        return lambda: nn.clip_grad_norm_(params, st.max_norm_trig)
    if op == "clip_value":
        return lambda: nn.clip_grad_value_(params, st.clip_value)
    if op == "amp_clip":
        def amp():
            st.scaler.unscale_(st.optimizer)
            return nn.clip_grad_norm_(params, st.max_norm_amp)
        return amp
    if op == "agc":
        return lambda: agc_loop(params)
    if op == "gc":
        return lambda: gc_loop(params)
    if op == "grad_stats":
        return lambda: stats_loop(params)
    raise ValueError(op)


def fastgrad_fn(op: str, st: OpState, backend: str) -> Callable[[], object]:
    """The fastgrad call for ``op`` with ``backend=``."""
    params, grads = st.params, st.grads
    if op == "norm":
        return lambda: fastgrad.get_total_norm(grads, backend=backend)
    if op == "clip":
        return lambda: fastgrad.clip_grad_norm_(params, st.max_norm_free, backend=backend)
    if op == "clip_trig":
        return lambda: fastgrad.clip_grad_norm_(params, st.max_norm_trig, backend=backend)
    if op == "clip_value":
        return lambda: fastgrad.clip_grad_value_(params, st.clip_value, backend=backend)
    if op == "amp_clip":
        return lambda: fastgrad.scaler_unscale_and_clip(st.scaler, st.optimizer, st.max_norm_amp, backend=backend)
    if op == "agc":
        return lambda: fastgrad.adaptive_clip_grad_(params, AGC_CLIP_FACTOR, AGC_EPS, backend=backend)
    if op == "gc":
        return lambda: fastgrad.centralize_gradient_(params, backend=backend)
    if op == "grad_stats":
        return lambda: fastgrad.grad_stats(params, backend=backend)
    raise ValueError(op)
