"""Mode ``"adagc"`` (Wang et al. 2025, arXiv 2502.11034): per-tensor clipping. For ``warmup_steps`` steps a
global clip at ``max_norm`` (the paper's lambda_abs) with each tensor's gamma the minimum of its clipped
norms; then each tensor is clipped to ``lambda_rel * gamma_i`` and gamma_i follows the EMA (``beta``) of its
clipped norms. State: ``n`` and ``gamma`` (one entry per optimizer parameter), on the norm's device."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ... import decide
from .base import Mode, Norms, Option, ema_weight, epsilon, warmup_steps, zeros


class AdaGCMode(Mode):
    name = "adagc"
    OPTIONS = (Option("lambda_rel", 1.05, "how far above its EMA a tensor's norm may go (0 would zero every "
                                          "tensor)"),
               ema_weight("beta", 0.98), warmup_steps(100), epsilon(1e-8))
    per_tensor = True
    max_norm_is = "AdaGC's global threshold of its warm-up (lambda_abs)"
    max_norm_default = 1.0  # the paper's lambda_abs
    max_norm_zero = "at 0 every gradient is zeroed and every tensor's reference stays 0, so the run never learns again"

    def init(self, total: Tensor, n_params: int) -> None:
        self.state = dict(n=zeros(total), gamma=torch.full((n_params,), math.inf, dtype=total.dtype,
                                                           device=total.device))

    def fits(self, n_params: int) -> bool:
        return "gamma" in self.state and (n_params == 0 or self.state["gamma"].numel() == n_params)

    def update(self, norms: Norms) -> tuple[Tensor, Tensor | None]:
        """One coefficient per tensor of ``norms.per`` (the parameters at ``norms.index`` that have a
        gradient this step)."""
        o, s = self.options, self.state
        total, per, finite = norms.total, norms.per, norms.finite
        lambda_rel, beta, eps = o["lambda_rel"], o["beta"], o["eps"]
        gamma_all = s["gamma"]
        gamma = gamma_all if norms.index is None else gamma_all.index_select(0, norms.index)
        warm = s["n"] < o["warmup_steps"]
        # warm-up: global clipping at lambda_abs (= max_norm); gamma tracks the minimum clipped norm
        h_glob = decide.clip_coef(total, self.max_norm, eps)
        # then per tensor: h_i = min(lambda_rel * gamma_i / (||g_i|| + eps), 1), gamma_i <- EMA of ||h_i g_i||
        h_loc = decide.clip_coef(per, lambda_rel * gamma, eps)
        h = torch.where(warm, h_glob.expand_as(per), h_loc)
        clipped = h * per
        seen = torch.isfinite(gamma)
        ema = torch.where(seen, beta * gamma + (1 - beta) * clipped, clipped)  # a tensor first seen late starts fresh
        new_gamma = torch.where(warm, torch.minimum(gamma, clipped), ema)
        new_gamma = torch.where(finite, new_gamma, gamma)
        spike = None if self.skip_factor is None else decide.spike(per, self.skip_factor, gamma, finite, ~warm)
        s["gamma"] = new_gamma if norms.index is None else gamma_all.index_copy(0, norms.index, new_gamma)
        s["n"] = s["n"] + finite.to(total.dtype)
        return h, spike
