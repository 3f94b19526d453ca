"""The benchmarked operations: for each, its memory floor, the fastgrad call, and the torch baselines a user
runs today (eager, and the headline baseline under ``torch.compile``).

The floor model (:class:`Floor`), per op, in passes over N (gradient bytes) and P (parameter bytes):

======================  ============================  =============  ======
op                      passes                        bytes read     written
======================  ============================  =============  ======
norm                    read grads                    N              0
clip (not triggered)    read grads                    N              0
clip_trig (triggered)   read grads; read+write grads  2N             N
clip_value              read+write grads              N              N
amp_clip                read grads; read+write grads  2N             N
agc                     read params; read+write grads P + N          N
gc                      read+write grads              N              N
grad_stats              read grads                    N              0
======================  ============================  =============  ======

An op's floor time is measured, not computed from a rate: a *floor pass* (:meth:`Floor.run`) does exactly the
op's passes as contiguous streams over buffers the size of the op's working set (a float32 sum for a read
pass, an in-place int32 ``bitwise_or_(0)`` for a read+write pass: the identity, on the bytes as they are) and is
timed in the same interleaved rounds as the implementations. A workload whose working set fits in the CPU's
last-level cache therefore gets a cache-resident floor and one that does not a memory floor, each measured
under the same load as the op; "% of the floor" is the median over the rounds of floor time / op time.

Every op is set up once per workload by :class:`OpState`, which fixes its arguments from the actual
gradients (e.g. ``max_norm`` half the true norm for "clip triggered", ten times it for "not triggered"), so
each call does the intended work. Ops that write gradients are timed from a restored copy of the original
gradients (restoring is not timed), so every repetition sees the same data.

Baselines (:class:`Baseline`): the first of an op's baselines is the headline one, the code a user reaches for
(torch's own function where torch has one; timm's ``adaptive_clip_grad`` for AGC, the GC authors' formula for
GC, ``torch._foreach_norm`` for per-tensor statistics); further ones are other ways to do the same, labelled
rows compared with the headline one.
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
class Floor:
    """The bytes an op must move, as passes over the gradients and parameters: ``grad_reads`` passes read the
    gradients, ``grad_writes`` of them also write them back (read+write passes), ``param_reads`` passes read
    the parameters."""

    grad_reads: int
    grad_writes: int = 0
    param_reads: int = 0

    def __post_init__(self):
        assert 0 <= self.grad_writes <= self.grad_reads, "a pass that writes gradients also reads them"

    def bytes_read(self, n: int, p: int) -> int:
        return self.grad_reads * n + self.param_reads * p

    def bytes_written(self, n: int, p: int) -> int:
        return self.grad_writes * n

    def bytes_moved(self, n: int, p: int) -> int:
        return self.bytes_read(n, p) + self.bytes_written(n, p)

    def read_only_bytes(self, n: int, p: int) -> int:
        """Bytes of the read-only passes (priced at a read stream's rate)."""
        return (self.grad_reads - self.grad_writes) * n + self.param_reads * p

    def rw_bytes(self, n: int, p: int) -> int:
        """Bytes of the read+write passes, read and written counted (priced at a read+write pass's rate)."""
        return 2 * self.grad_writes * n

    def working_set(self, n: int, p: int) -> int:
        """Distinct bytes the op touches: the gradients, and the parameters when it reads them."""
        return (n if self.grad_reads else 0) + (p if self.param_reads else 0)

    def text(self) -> str:
        """The model in words, e.g. ``read 2N, write N``."""
        def term(k: int, sym: str) -> str:
            return "" if k == 0 else (sym if k == 1 else f"{k}{sym}")

        read = " + ".join(t for t in (term(self.param_reads, "P"), term(self.grad_reads, "N")) if t)
        written = term(self.grad_writes, "N") or "0"
        return f"read {read or '0'}, write {written}"

    def passes_text(self) -> str:
        parts = ["read params"] * self.param_reads + ["read grads"] * (self.grad_reads - self.grad_writes)
        parts += ["read+write grads"] * self.grad_writes
        return "; ".join(parts)

    def run(self, grad_buf: torch.Tensor, param_buf: torch.Tensor | None) -> None:
        """The floor pass: the op's passes as contiguous streams, over ``grad_buf`` (N bytes, uint8) and
        ``param_buf`` (P bytes, uint8; only when the op reads parameters). A read pass sums the bytes as
        float32, a read+write pass ORs them with 0 as int32 in place, which leaves every bit as it was (a
        float multiply by one could quiet a NaN pattern of the bytes it reinterprets)."""
        g32 = grad_buf.view(torch.float32)
        gi32 = grad_buf.view(torch.int32)
        for _ in range(self.param_reads):
            assert param_buf is not None
            param_buf.view(torch.float32).sum()
        for _ in range(self.grad_reads - self.grad_writes):
            g32.sum()
        for _ in range(self.grad_writes):
            gi32.bitwise_or_(0)


@dataclass(frozen=True)
class Baseline:
    """One torch implementation of an op: ``impl`` is its row label, ``what`` says what code it is (and
    where that code comes from), ``make(state)`` returns the no-argument call."""

    impl: str
    what: str
    make: Callable[[OpState], Callable[[], object]]


@dataclass(frozen=True)
class OpSpec:
    name: str
    title: str
    floor: Floor
    #: whether the op writes gradients (then each repetition starts from restored gradients)
    mutates: bool
    #: the backend primitive whose automatic choice serves the op (see fastgrad.backends.auto_order)
    primitive: str
    #: the torch implementations; the first is the headline baseline (row "torch eager")
    baselines: tuple[Baseline, ...] = ()

    @property
    def baseline(self) -> str:
        """What the headline speedup is measured against."""
        return self.baselines[0].what

    # The byte counts by kind of pass (kept for callers that price a floor at measured rates).
    def read_bytes(self, n: int, p: int) -> int:
        return self.floor.read_only_bytes(n, p)

    def rw_bytes(self, n: int, p: int) -> int:
        return self.floor.rw_bytes(n, p)

    def floor_s(self, n: int, p: int, read_gbps: float, rw_gbps: float) -> float:
        """Seconds the op needs at least at rates measured elsewhere: its read-only bytes at the read-stream
        rate plus its read+write bytes at the read+write rate (the benchmark itself times a floor pass)."""
        return self.read_bytes(n, p) / (read_gbps * 1e9) + self.rw_bytes(n, p) / (rw_gbps * 1e9)


# ------------------------------------------------------------------------------------ torch baselines
def torch_total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    f = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if f is not None:
        return f(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


#: Where the AGC baseline's code comes from: timm's ``timm/utils/agc.py``, the same text from its first commit
#: (4f49b94, 2021-02-15) to timm 1.0.28 (tag v1.0.28, 8ef7380) and its main branch of 2026-08-08 (aa4b585).
TIMM_AGC_SOURCE = "timm.utils.agc.adaptive_clip_grad (timm 1.0.28; unchanged since 4f49b94, 2021)"


def timm_unitwise_norm(x: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """timm's ``unitwise_norm``, operation for operation: the whole tensor's norm for ndim <= 1, else the norm
    over every dim but the first, kept for broadcasting."""
    if x.ndim <= 1:
        return x.norm(norm_type)
    return x.norm(norm_type, dim=tuple(range(1, x.ndim)), keepdim=True)


def timm_adaptive_clip_grad(parameters, clip_factor: float = 0.01, eps: float = 1e-3,
                            norm_type: float = 2.0) -> None:
    """timm's ``adaptive_clip_grad`` as shipped (see :data:`TIMM_AGC_SOURCE`), transcribed operation for
    operation so the benchmark needs no timm: per parameter, the unit-wise norms of the weight and the
    gradient, the rescaled gradient and a ``where`` as temporaries, copied back into ``.grad``. No
    ``no_grad``: timm's works on detached tensors."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    for p in parameters:
        if p.grad is None:
            continue
        p_data = p.detach()
        g_data = p.grad.detach()
        max_norm = timm_unitwise_norm(p_data, norm_type=norm_type).clamp_(min=eps).mul_(clip_factor)
        grad_norm = timm_unitwise_norm(g_data, norm_type=norm_type)
        clipped_grad = g_data * (max_norm / grad_norm.clamp(min=1e-6))
        new_grads = torch.where(grad_norm < max_norm, g_data, clipped_grad)
        p.grad.detach().copy_(new_grads)


def _unit_norm(x: torch.Tensor) -> torch.Tensor:
    if x.ndim <= 1:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)


def agc_loop(params: list[torch.Tensor], clip_factor: float = AGC_CLIP_FACTOR, eps: float = AGC_EPS) -> None:
    """This benchmark's own AGC loop (its baseline before timm's code was): the same formula through
    ``torch.linalg.vector_norm`` under ``no_grad``."""
    with torch.no_grad():
        for p in params:
            g = p.grad
            limit = _unit_norm(p.detach()).clamp_(min=eps).mul_(clip_factor)
            g_norm = _unit_norm(g)
            rescaled = g * (limit / g_norm.clamp(min=1e-6))
            g.copy_(torch.where(g_norm < limit, g, rescaled))


#: Where the GC baseline's formula comes from: the GC authors' repository.
GC_SOURCE = ("centralized_gradient of github.com/Yonghongwei/Gradient-Centralization "
             "(algorithm-GC/algorithm/Centralization.py, 57f5729), use_gc=True, gc_conv_only=False")


def official_gc(params: list[torch.Tensor]) -> None:
    """Gradient centralization with the GC authors' formula (see :data:`GC_SOURCE`), applied to every
    gradient as their optimizers do before the update: for ndim > 1, add the negated mean over dims
    1..ndim-1 in place."""
    for p in params:
        x = p.grad
        if x is None:
            continue
        if len(list(x.size())) > 1:
            x.add_(-x.mean(dim=tuple(range(1, len(list(x.size())))), keepdim=True))


def foreach_stats(params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-tensor gradient statistics the way a user gets them fastest from torch: ``torch._foreach_norm``
    for the L2 norms and max |g| (the inf-norm) of every gradient, and the total norm from those. It does NOT
    count NaN, Inf or zero elements (torch has no multi-tensor op for that; the own loop does), so it does
    less work than grad_stats: a bound in torch's favour."""
    grads = [p.grad for p in params if p.grad is not None]
    with torch.no_grad():
        norms = torch._foreach_norm(grads)
        maxes = torch._foreach_norm(grads, float("inf"))
        total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return {"norm": norms, "max_abs": maxes, "total_norm": total}


def stats_loop(params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """This benchmark's own loop computing what grad_stats does: five torch reductions per parameter."""
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


def _amp_baseline(st: OpState) -> Callable[[], object]:
    def amp():
        st.scaler.unscale_(st.optimizer)
        return torch.nn.utils.clip_grad_norm_(st.params, st.max_norm_amp)
    return amp


_nn = torch.nn.utils
OPS: dict[str, OpSpec] = {o.name: o for o in (
    OpSpec("norm", "total norm", Floor(1), False, "norm", (
        Baseline("torch eager", "torch.nn.utils.get_total_norm", lambda st: lambda: torch_total_norm(st.grads)),)),
    OpSpec("clip", "clip_grad_norm_, not triggered", Floor(1), True, "norm", (
        Baseline("torch eager", "torch.nn.utils.clip_grad_norm_",
                 lambda st: lambda: _nn.clip_grad_norm_(st.params, st.max_norm_free)),)),
    OpSpec("clip_trig", "clip_grad_norm_, triggered", Floor(2, 1), True, "norm", (
        Baseline("torch eager", "torch.nn.utils.clip_grad_norm_",
                 lambda st: lambda: _nn.clip_grad_norm_(st.params, st.max_norm_trig)),)),
    OpSpec("clip_value", "clip_grad_value_", Floor(1, 1), True, "clip_value", (
        Baseline("torch eager", "torch.nn.utils.clip_grad_value_",
                 lambda st: lambda: _nn.clip_grad_value_(st.params, st.clip_value)),)),
    OpSpec("amp_clip", "fused unscale + inf check + clip", Floor(2, 1), True, "amp_norm", (
        Baseline("torch eager", "GradScaler.unscale_ + torch.nn.utils.clip_grad_norm_", _amp_baseline),)),
    OpSpec("agc", "adaptive gradient clipping", Floor(1, 1, 1), True, "agc", (
        Baseline("torch eager", TIMM_AGC_SOURCE + ", transcribed",
                 lambda st: lambda: timm_adaptive_clip_grad(st.params, AGC_CLIP_FACTOR, AGC_EPS)),
        Baseline("torch: own loop", "this benchmark's own AGC loop (torch.linalg.vector_norm per parameter)",
                 lambda st: lambda: agc_loop(st.params)))),
    OpSpec("gc", "gradient centralization", Floor(1, 1), True, "centralize", (
        Baseline("torch eager", "the GC authors' formula, " + GC_SOURCE, lambda st: lambda: official_gc(st.params)),)),
    OpSpec("grad_stats", "grad_stats", Floor(1), False, "grad_stats", (
        Baseline("torch eager", "torch._foreach_norm: per-tensor L2 and max |g| (no NaN/Inf/zero counts)",
                 lambda st: lambda: foreach_stats(st.params)),
        Baseline("torch: own loop", "this benchmark's own loop: norm, max |g|, NaN/Inf/zero counts per tensor "
                 "(five reductions each)", lambda st: lambda: stats_loop(st.params)))),
)}


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
        #: the saved gradients' bytes, one buffer (the floor pass streams over its first N bytes)
        self._flat: torch.Tensor | None = None
        self._param_buf: torch.Tensor | None = None
        self.grad_bytes = sum(g.numel() * g.element_size() for g in self.grads)
        self.param_bytes = sum(q.numel() * q.element_size() for q in params)

    # Restoring the gradients between repetitions of ops that write them (not timed). The saved copy lives in
    # one buffer, so the floor pass can stream over N bytes without a second N-byte allocation.
    def save(self) -> None:
        if self._saved is not None:
            return
        align = 64
        offsets, pos = [], 0
        for g in self.grads:
            offsets.append(pos)
            pos += -(-(g.numel() * g.element_size()) // align) * align
        flat = torch.empty(max(pos, 4), dtype=torch.uint8, device=self.device)
        saved = []
        for g, off in zip(self.grads, offsets):
            view = flat[off:off + g.numel() * g.element_size()].view(g.dtype).view(g.shape)
            view.copy_(g)
            saved.append(view)
        self._flat, self._saved = flat, saved

    def floor_buffers(self, floor: Floor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """uint8 buffers of the op's bytes for its floor pass: N bytes (rounded down to whole 4-byte words)
        of the saved gradients' buffer, and a P-byte buffer of its own when the op reads parameters (then
        the pass's working set is N + P, as the op's)."""
        self.save()
        assert self._flat is not None
        n4 = max(4, self.grad_bytes - self.grad_bytes % 4)
        grad_buf = self._flat[:n4]
        param_buf = None
        if floor.param_reads:
            p4 = max(4, self.param_bytes - self.param_bytes % 4)
            if self._param_buf is None or self._param_buf.numel() != p4:
                self._param_buf = torch.ones(p4 // 4, dtype=torch.float32, device=self.device).view(torch.uint8)
            param_buf = self._param_buf
        return grad_buf, param_buf

    def floor_fn(self, floor: Floor) -> tuple[Callable[[], None], Callable[[], None]]:
        """(the floor pass, its untimed reset). The reset reads the pass's buffers, so on the CPU they start
        as warm in the cache as the op's gradients, which every repetition finds just restored or just read
        by the implementation before it."""
        grad_buf, param_buf = self.floor_buffers(floor)

        def warm() -> None:
            grad_buf.view(torch.float32).sum()
            if param_buf is not None:
                param_buf.view(torch.float32).sum()

        return (lambda: floor.run(grad_buf, param_buf)), warm

    def release_floor(self) -> None:
        """Frees the parameter-sized buffer of the AGC floor (on a GPU, as large as the parameters)."""
        self._param_buf = None

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
        self._saved = self._flat = self._param_buf = None


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
    """The headline torch baseline for ``op`` on ``st``'s workload, as a no-argument callable."""
    if op not in OPS:
        raise ValueError(op)
    return OPS[op].baselines[0].make(st)


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
