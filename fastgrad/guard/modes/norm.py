"""Mode ``"norm"``: the fixed ``max_norm`` threshold (``clip_grad_norm_``'s coefficient), and with
``skip_factor=k`` a spike rule against the run's own norm level. State (only with ``skip_factor``): ``n``
(finite norms seen) and ``mean`` (the reference), 0-dim on the norm's device."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import decide
from ._state import Mode, zeros


class NormMode(Mode):
    name = "norm"
    options = {"alpha": 0.97, "warmup_steps": 25}  # only with skip_factor (the spike reference)

    def init(self, total: Tensor, n_params: int) -> None:
        self.state = dict(n=zeros(total), mean=zeros(total)) if self.skip_factor is not None else {}

    def fits(self, n_params: int) -> bool:
        return self.skip_factor is None or "mean" in self.state

    def update(self, total: Tensor, finite: Tensor) -> tuple[Tensor, Tensor | None]:
        """(coefficient, spike-or-None) on the total's device."""
        coef = decide.clip_coef(total, self.max_norm)
        return coef, (self.spike(total, finite) if self.skip_factor is not None else None)

    def spike(self, g: Tensor, finite: Tensor) -> Tensor:
        """Is this finite norm more than k times the run's usual norm?

        The reference is the mean of the first ``warmup_steps`` finite norms (no spike is declared before it
        exists: a run's first norms are often far above max_norm and legitimate), then their EMA (``alpha``).
        A spike feeds the EMA k times the reference instead of its own value, so one huge norm moves it a
        bounded amount while a lasting shift of the norm's level is followed within a few skipped steps (with
        alpha=0.97 and k=10 the reference grows 1.27x per skipped step) rather than skipped forever. A
        non-finite norm changes nothing. Device ops only."""
        o, s = self.o, self.state
        k, a = self.skip_factor, o["alpha"]
        ready = s["n"] >= o["warmup_steps"]
        ref = s["mean"]
        spike = decide.spike(g, k, ref, finite, ready)
        x = torch.where(spike, k * ref, g)
        warm_mean = ref + (g - ref) / (s["n"] + 1)
        new = torch.where(ready, a * ref + (1 - a) * x, warm_mean)
        s["mean"] = torch.where(finite, new, ref)
        s["n"] = s["n"] + finite.to(s["n"].dtype)
        return spike

