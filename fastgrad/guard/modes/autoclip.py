"""Mode ``"autoclip"`` (Seetharaman et al. 2020, arXiv 2007.14469): clip at the ``percentile``-th percentile
of the norm history, this step's norm included. State: ``n`` and a device ``ring`` of ``history_size``
norms (NaN where not filled yet)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import decide
from ._state import Mode


class AutoClipMode(Mode):
    name = "autoclip"
    options = {"percentile": 10.0, "history_size": 1000}

    def init(self, total: Tensor, n_params: int) -> None:
        self.state = dict(n=torch.zeros((), dtype=torch.long, device=total.device),
                          ring=torch.full((self.o["history_size"],), math.nan, dtype=total.dtype,
                                          device=total.device))

    def fits(self, n_params: int) -> bool:
        return bool(self.state)

    def update(self, g: Tensor, finite: Tensor) -> tuple[Tensor, Tensor | None]:
        """(coefficient, spike-or-None) on the norm's device; the history updated."""
        o, s = self.o, self.state
        H = o["history_size"]
        idx = (s["n"] % H).reshape(1)
        old = s["ring"].gather(0, idx)
        s["ring"] = s["ring"].scatter(0, idx, torch.where(finite, g.reshape(1), old))
        s["n"] = s["n"] + finite.long()
        # the paper's threshold: the percentile of every norm seen so far, this one included (np.percentile's
        # linear interpolation = torch's); unfilled slots are NaN and ignored
        thr = torch.nanquantile(s["ring"], o["percentile"] / 100.0)
        limit = thr if self.max_norm is None else torch.clamp(thr, max=self.max_norm)
        coef = decide.clip_coef(g, limit)  # clip_grad_norm_(params, limit)'s coefficient
        spike = None if self.skip_factor is None else decide.spike(g, self.skip_factor, thr, finite)
        return coef, spike
