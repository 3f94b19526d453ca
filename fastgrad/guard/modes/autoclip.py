"""Mode ``"autoclip"`` (Seetharaman et al. 2020, arXiv 2007.14469): clip at the ``percentile``-th percentile
of the norm history, this step's norm included. State: ``n`` and a device ``ring`` of ``history_size``
norms (NaN where not filled yet)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ... import decide
from .base import Mode, Norms, Option


class AutoClipMode(Mode):
    name = "autoclip"
    OPTIONS = (Option("percentile", 10.0, "the percentile of the norm history used as the threshold", low=0.0,
                      high=100.0, low_open=False, high_open=False),
               Option("history_size", 1000, "how many past norms the percentile is taken over", integer=True))

    def init(self, total: Tensor, n_params: int) -> None:
        self.state = dict(n=torch.zeros((), dtype=torch.long, device=total.device),
                          ring=torch.full((self.options["history_size"],), math.nan, dtype=total.dtype,
                                          device=total.device))

    def fits(self, n_params: int) -> bool:
        return bool(self.state)

    def update(self, norms: Norms) -> tuple[Tensor, Tensor | None]:
        s = self.state
        norm, finite = norms.total, norms.finite
        slot = (s["n"] % self.options["history_size"]).reshape(1)
        old = s["ring"].gather(0, slot)
        s["ring"] = s["ring"].scatter(0, slot, torch.where(finite, norm.reshape(1), old))
        s["n"] = s["n"] + finite.long()
        # the paper's threshold: the percentile of every norm seen so far, this one included (np.percentile's
        # linear interpolation = torch's); unfilled slots are NaN and ignored
        threshold = torch.nanquantile(s["ring"], self.options["percentile"] / 100.0)
        limit = threshold if self.max_norm is None else torch.clamp(threshold, max=self.max_norm)
        coef = decide.clip_coef(norm, limit)  # clip_grad_norm_(params, limit)'s coefficient
        spike = None if self.skip_factor is None else decide.spike(norm, self.skip_factor, threshold, finite)
        return coef, spike
