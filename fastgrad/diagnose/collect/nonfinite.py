"""NaN/Inf localisation: is the loss already non-finite, which gradients are, which parameters are.

One fused statistics pass over the gradients, one over the parameters, and ONE host sync for everything
(loss included). Call it right after ``backward()``, or before it with only the loss and the parameters."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from ...stats import named_params, tensor_stats

__all__ = ["NonFiniteEntry", "NonFiniteReport", "find_nonfinite"]


@dataclass
class NonFiniteEntry:
    name: str
    nan: int
    inf: int
    numel: int


@dataclass
class NonFiniteReport:
    """``loss_finite`` is None when no loss was given. ``grads``/``params`` list only the non-finite ones, in
    parameter order. Truthy when anything non-finite was found."""

    loss_finite: bool | None
    loss_value: float | None
    grads: list[NonFiniteEntry] = field(default_factory=list)
    params: list[NonFiniteEntry] = field(default_factory=list)
    checked_grads: int = 0
    checked_params: int = 0
    #: the first module output that went non-finite, from a ``fastgrad.diagnose.collect.watch.ForwardWatcher`` when one was
    #: passed (None: none given, or every watched output stayed finite)
    origin: object | None = None

    @property
    def found(self) -> bool:
        return self.loss_finite is False or bool(self.grads) or bool(self.params)

    def __bool__(self) -> bool:
        return self.found

    @property
    def grad_names(self) -> list[str]:
        return [e.name for e in self.grads]

    @property
    def param_names(self) -> list[str]:
        return [e.name for e in self.params]

    @property
    def diagnosis(self) -> str:
        """Where the non-finite values most likely came from, earliest cause first."""
        if self.params:
            return ("Parameters are already non-finite: an earlier optimizer step applied a non-finite update "
                    "(check the gradients before optimizer.step(), clip them, or let a GradScaler skip the step).")
        if self.origin is not None:
            o = self.origin
            return (f"The forward pass produced it: the first non-finite module output was {o.module} "
                    f"({o.module_type}) at step {o.step}; inspect that module's inputs and its log/exp/division "
                    "or fp16-range operations.")
        if self.loss_finite is False:
            return ("The loss is non-finite before backward(): the forward pass produced it (inputs, log/exp/"
                    "division overflow, fp16 range); inspect the inputs and the loss computation.")
        if self.grads:
            return ("The loss and the parameters are finite, so backward() produced the non-finite gradients "
                    "(an op with an unstable derivative, e.g. sqrt/log at 0, or fp16 overflow); locate it with "
                    "torch.autograd.detect_anomaly().")
        return "Everything checked is finite."

    def to_dict(self) -> dict:
        return {
            "found": self.found, "loss_finite": self.loss_finite, "loss_value": self.loss_value,
            "grads": [asdict(e) for e in self.grads], "params": [asdict(e) for e in self.params],
            "checked_grads": self.checked_grads, "checked_params": self.checked_params,
            "origin": asdict(self.origin) if self.origin is not None else None,
            "diagnosis": self.diagnosis,
        }

    def __str__(self) -> str:
        lines = []
        if self.loss_finite is not None:
            lines.append(f"loss: {'finite' if self.loss_finite else 'NON-FINITE'}"
                         + (f" ({self.loss_value})" if self.loss_value is not None else ""))
        lines.append(f"gradients: {len(self.grads)} of {self.checked_grads} non-finite")
        for e in self.grads:
            lines.append(f"  {e.name}: {e.nan} NaN, {e.inf} Inf of {e.numel}")
        lines.append(f"parameters: {len(self.params)} of {self.checked_params} non-finite")
        for e in self.params:
            lines.append(f"  {e.name}: {e.nan} NaN, {e.inf} Inf of {e.numel}")
        if self.origin is not None:
            lines.append(str(self.origin))
        lines.append(self.diagnosis)
        return "\n".join(lines)


def _dense(t: Tensor) -> bool:
    return t.layout == torch.strided and t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _counts(tensors: list[Tensor], backend: str | None, device) -> Tensor:
    """(len, 2) int64 [nan, inf] counts on ``device`` without a sync: the fused stats pass for dense real
    floating tensors, plain torch for the rest (complex, sparse, float8)."""
    out = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    if not tensors:
        return out
    fused = [i for i, t in enumerate(tensors) if _dense(t)]
    if fused:
        cols = tensor_stats([tensors[i] for i in fused], backend=backend)
        pair = torch.stack([cols["nan"], cols["inf"]], 1).to(device, non_blocking=True)
        if len(fused) == len(tensors):
            return pair
        # the index list goes over with non_blocking: torch.tensor(..., device=cuda) would sync here, before
        # the one designed read
        out.index_copy_(0, torch.tensor(fused).to(device, non_blocking=True), pair)
    for i, t in enumerate(tensors):
        if not _dense(t):
            v = t.coalesce().values() if t.layout == torch.sparse_coo else t
            v = torch.view_as_real(v) if v.is_complex() else v
            out[i, 0] = torch.isnan(v).sum().to(device)
            out[i, 1] = torch.isinf(v).sum().to(device)
    return out


@torch.no_grad()
def find_nonfinite(model_or_parameters, loss=None, *, check_params: bool = True, watcher=None,
                   backend: str | None = None) -> NonFiniteReport:
    """Locate NaN/Inf: whether ``loss`` (tensor or number) is non-finite, which parameters' gradients hold
    NaN/Inf, and (with ``check_params``) which parameters themselves do. Accepts a module, parameters, or
    ``(name, param)`` pairs; parameters without a gradient are still checked as parameters. One pass over the
    gradients, one over the parameters, one host sync. ``watcher``: a ``fastgrad.diagnose.collect.watch.ForwardWatcher`` that
    watched the forward passes; the first module output it saw go non-finite is reported as ``origin`` and
    leads the diagnosis (one more sync, the watcher's)."""
    named = named_params(model_or_parameters)
    with_grad = [(n, p.grad) for n, p in named if p.grad is not None]
    params = [(n, p.detach()) for n, p in named] if check_params else []
    dev = None
    for t in [g for _, g in with_grad] + [p for _, p in params] + ([loss] if isinstance(loss, Tensor) else []):
        dev = t.device
        break
    dev = dev or torch.device("cpu")
    pieces = [_counts([g for _, g in with_grad], backend, dev).reshape(-1),
              _counts([p for _, p in params], backend, dev).reshape(-1)]
    loss_host = None
    if isinstance(loss, Tensor):
        lt = loss.detach()
        lt = torch.view_as_real(lt) if lt.is_complex() else lt
        flag = torch.isfinite(lt).all().reshape(1).to(dev, torch.int64)
        pieces.append(flag)
        if lt.numel() == 1:
            # the value rides along in the same transfer (float64 keeps it exact enough to print)
            pieces.append(lt.reshape(1).to(dev, torch.float64))
    elif loss is not None:
        loss_host = float(loss)
    cat_dtype = torch.float64 if dev.type != "mps" else torch.float32
    vals = torch.cat([p.to(cat_dtype) for p in pieces]).tolist()  # the one host sync
    ng, npar = len(with_grad), len(params)
    gcounts, pcounts = vals[:2 * ng], vals[2 * ng:2 * ng + 2 * npar]
    tail = vals[2 * ng + 2 * npar:]
    if isinstance(loss, Tensor):
        loss_finite = bool(tail[0])
        loss_value = tail[1] if len(tail) > 1 else None
    elif loss is not None:
        loss_finite, loss_value = math.isfinite(loss_host), loss_host
    else:
        loss_finite = loss_value = None

    def entries(items, counts):
        out = []
        for i, (n, t) in enumerate(items):
            nan, inf = int(counts[2 * i]), int(counts[2 * i + 1])
            if nan or inf:
                out.append(NonFiniteEntry(n, nan, inf, t.numel()))
        return out

    origin = watcher.first_nonfinite() if watcher is not None else None
    return NonFiniteReport(loss_finite, loss_value, entries(with_grad, gcounts), entries(params, pcounts),
                           checked_grads=ng, checked_params=npar, origin=origin)
