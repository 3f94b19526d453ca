"""Mode ``"zclip"`` (Kumar et al. 2025, arXiv 2504.02507): after a warm-up of ``warmup_steps`` norms, a norm
whose z-score against the EMA mean/std exceeds ``z_thresh`` is clipped to the paper's adaptive threshold.
State: ``n``, the warm-up ``buf``, ``mean``, ``var`` (and the constant ``slots``), on the norm's device."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import decide
from ._state import Mode, zeros


class ZClipMode(Mode):
    # max_norm, when given: a hard cap on top of the adaptive threshold
    name = "zclip"
    options = {"alpha": 0.97, "z_thresh": 2.5, "warmup_steps": 25, "eps": 1e-6, "clip_factor": 1.0}

    def init(self, total: Tensor, n_params: int) -> None:
        W = self.o["warmup_steps"]
        self.state = dict(n=zeros(total), buf=zeros(total, W), mean=zeros(total), var=zeros(total),
                          slots=torch.arange(W, device=total.device))

    def fits(self, n_params: int) -> bool:
        return bool(self.state)

    def update(self, g: Tensor, finite: Tensor) -> tuple[Tensor, Tensor | None]:
        """(coefficient, spike-or-None) on the norm's device; the statistics updated."""
        o, s = self.o, self.state
        W, a, zt = o["warmup_steps"], o["alpha"], o["z_thresh"]
        ready = s["n"] >= W
        std = s["var"].sqrt()
        z = (g - s["mean"]) / (std + o["eps"])
        outlier = ready & (z > zt) & finite
        # ZClip's "adaptive scaling": mean + z_thresh * std / (z / z_thresh), times clip_factor
        thr = (s["mean"] + (zt * std) / (z / zt)) * o["clip_factor"]
        inf = torch.full_like(g, math.inf)
        limit = torch.where(outlier, thr, torch.where(ready, g, inf))
        if self.max_norm is not None:
            limit = torch.clamp(limit, max=self.max_norm)
        coef = torch.where(g > limit, limit / (g + 1e-6), torch.ones_like(g))
        spike = None if self.skip_factor is None else decide.spike(g, self.skip_factor, s["mean"], finite, ready)
        # statistics: warm-up buffer, then the EMA of the (ZClip-clipped) norm; a non-finite norm changes nothing
        take = finite & ~ready
        s["buf"] = torch.where((s["slots"] == s["n"]) & take, g, s["buf"])
        n_new = s["n"] + take.to(g.dtype)
        init_mean = s["buf"].mean()
        init_var = (s["buf"] - init_mean).square().mean()
        x = torch.where(outlier, thr, g)
        ema_mean = a * s["mean"] + (1 - a) * x
        ema_var = a * s["var"] + (1 - a) * (x - ema_mean).square()
        upd = ready & finite
        just = take & (n_new >= W)
        s["mean"] = torch.where(upd, ema_mean, torch.where(just, init_mean, s["mean"]))
        s["var"] = torch.where(upd, ema_var, torch.where(just, init_var, s["var"]))
        s["n"] = n_new
        return coef, spike
