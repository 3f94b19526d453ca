"""Mode ``"zclip"`` (Kumar et al. 2025, arXiv 2504.02507): after a warm-up of ``warmup_steps`` norms, a norm
whose z-score against the EMA mean/std exceeds ``z_thresh`` is clipped to the paper's adaptive threshold.
State: ``n``, the warm-up ``buf``, ``mean``, ``var`` (and the constant ``slots``), on the norm's device."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ... import decide
from .base import Mode, Norms, Option, ema_weight, epsilon, warmup_steps, zeros


class ZClipMode(Mode):
    name = "zclip"
    OPTIONS = (ema_weight("alpha", 0.97), Option("z_thresh", 2.5, "the z-score above which a norm is an outlier"),
               warmup_steps(25), epsilon(1e-6),
               Option("clip_factor", 1.0, "the factor on ZClip's adaptive threshold (0 would clip every outlier "
                                          "to zero)"))

    def init(self, total: Tensor, n_params: int) -> None:
        size = self.options["warmup_steps"]
        self.state = dict(n=zeros(total), buf=zeros(total, size), mean=zeros(total), var=zeros(total),
                          slots=torch.arange(size, device=total.device))

    def fits(self, n_params: int) -> bool:
        return bool(self.state)

    def update(self, norms: Norms) -> tuple[Tensor, Tensor | None]:
        o, s = self.options, self.state
        norm, finite = norms.total, norms.finite
        warmup, alpha, z_thresh = o["warmup_steps"], o["alpha"], o["z_thresh"]
        ready = s["n"] >= warmup
        std = s["var"].sqrt()
        z = (norm - s["mean"]) / (std + o["eps"])
        outlier = ready & (z > z_thresh) & finite
        # ZClip's "adaptive scaling": mean + z_thresh * std / (z / z_thresh), times clip_factor
        threshold = (s["mean"] + (z_thresh * std) / (z / z_thresh)) * o["clip_factor"]
        limit = torch.where(outlier, threshold, torch.full_like(norm, math.inf))  # only an outlier is clipped
        if self.max_norm is not None:
            limit = torch.clamp(limit, max=self.max_norm)
        coef = decide.clip_coef_above(norm, limit)
        spike = None if self.skip_factor is None else decide.spike(norm, self.skip_factor, s["mean"], finite,
                                                                    ready)
        # statistics: warm-up buffer, then the EMA of the (ZClip-clipped) norm; a non-finite norm changes nothing
        take = finite & ~ready
        s["buf"] = torch.where((s["slots"] == s["n"]) & take, norm, s["buf"])
        n_new = s["n"] + take.to(norm.dtype)
        init_mean = s["buf"].mean()
        init_var = (s["buf"] - init_mean).square().mean()
        x = torch.where(outlier, threshold, norm)
        ema_mean = alpha * s["mean"] + (1 - alpha) * x
        ema_var = alpha * s["var"] + (1 - alpha) * (x - ema_mean).square()
        upd = ready & finite
        just = take & (n_new >= warmup)
        s["mean"] = torch.where(upd, ema_mean, torch.where(just, init_mean, s["mean"]))
        s["var"] = torch.where(upd, ema_var, torch.where(just, init_var, s["var"]))
        s["n"] = n_new
        return coef, spike
