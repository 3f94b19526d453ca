"""Mode ``"norm"``: the fixed ``max_norm`` threshold (``clip_grad_norm_``'s coefficient), and with
``skip_factor=k`` a spike rule against the run's own norm level. State (only with ``skip_factor``): ``n``
(finite norms seen) and ``mean`` (the reference), 0-dim on the norm's device."""

from __future__ import annotations

import torch
from torch import Tensor

from ... import decide
from .base import Mode, Norms, ema_weight, warmup_steps, zeros


class NormMode(Mode):
    name = "norm"
    # (the spike reference's: taken only with skip_factor)
    OPTIONS = (ema_weight("alpha", 0.97, spike_only=True), warmup_steps(25, spike_only=True))
    kernel_clip = True
    norm_types = None  # any, as clip_grad_norm_
    max_norm_is = "the clip threshold"
    max_norm_required = True
    max_norm_zero = None  # clip_grad_norm_'s meaning: every gradient clipped to zero

    def init(self, total: Tensor, n_params: int) -> None:
        self.state = dict(n=zeros(total), mean=zeros(total)) if self.skip_factor is not None else {}

    def fits(self, n_params: int) -> bool:
        return self.skip_factor is None or "mean" in self.state

    def update(self, norms: Norms) -> tuple[Tensor | None, Tensor | None]:
        coef = None if norms.clipped else decide.clip_coef(norms.total, self.max_norm)
        return coef, (self._spike(norms.total, norms.finite) if self.skip_factor is not None else None)

    def _spike(self, norm: Tensor, finite: Tensor) -> Tensor:
        """Is this finite norm more than k times the run's usual norm?

        The reference is the mean of the first ``warmup_steps`` finite norms (no spike is declared before it
        exists: a run's first norms are often far above max_norm and legitimate), then their EMA (``alpha``).
        A spike feeds the EMA k times the reference instead of its own value, so one huge norm moves it a
        bounded amount while a lasting shift of the norm's level is followed within a few skipped steps (with
        alpha=0.97 and k=10 the reference grows 1.27x per skipped step) rather than skipped forever. A
        non-finite norm changes nothing. Device ops only."""
        s, k, alpha = self.state, self.skip_factor, self.options["alpha"]
        ready = s["n"] >= self.options["warmup_steps"]
        ref = s["mean"]
        spike = decide.spike(norm, k, ref, finite, ready)
        x = torch.where(spike, k * ref, norm)
        warm_mean = ref + (norm - ref) / (s["n"] + 1)
        new = torch.where(ready, alpha * ref + (1 - alpha) * x, warm_mean)
        s["mean"] = torch.where(finite, new, ref)
        s["n"] = s["n"] + finite.to(s["n"].dtype)
        return spike
