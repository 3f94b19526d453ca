"""Mode ``"adagc"`` (Wang et al. 2025, arXiv 2502.11034): per-tensor clipping. For ``warmup_steps`` steps a
global clip at ``max_norm`` (the paper's lambda_abs) with each tensor's gamma the minimum of its clipped
norms; then each tensor is clipped to ``lambda_rel * gamma_i`` and gamma_i follows the EMA (``beta``) of its
clipped norms. State: ``n`` and ``gamma`` (one entry per optimizer parameter), on the norm's device."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..backends.torch_backend import combine_norms
from .. import decide
from ._state import Mode, zeros


class AdaGCMode(Mode):
    name = "adagc"
    options = {"lambda_rel": 1.05, "beta": 0.98, "warmup_steps": 100, "eps": 1e-8}
    per_tensor = True

    def init(self, total: Tensor, n_params: int) -> None:
        self.state = dict(n=zeros(total), gamma=torch.full((n_params,), math.inf, dtype=total.dtype,
                                                           device=total.device))

    def fits(self, n_params: int) -> bool:
        return "gamma" in self.state and (n_params == 0 or self.state["gamma"].numel() == n_params)

    def update(self, total: Tensor, per: Tensor, index: Tensor | None):
        """(per-tensor coefficients, post-clip total norm, spike-or-None). ``index``: the positions of
        the parameters that have a gradient this step (None: all of them)."""
        o, s = self.o, self.state
        W, lr, b, eps = o["warmup_steps"], o["lambda_rel"], o["beta"], o["eps"]
        per = per.to(total.device, total.dtype)
        finite = ~decide.nonfinite(total)
        gamma_all = s["gamma"]
        gamma = gamma_all if index is None else gamma_all.index_select(0, index)
        warm = s["n"] < W
        # warm-up: global clipping at lambda_abs (= max_norm); gamma tracks the minimum clipped norm
        h_glob = decide.clip_coef(total, self.max_norm, eps)
        # then per tensor: h_i = min(lambda_rel * gamma_i / (||g_i|| + eps), 1), gamma_i <- EMA of ||h_i g_i||
        h_loc = decide.clip_coef(per, lr * gamma, eps)
        h = torch.where(warm, h_glob.expand_as(per), h_loc)
        clipped = h * per
        seen = torch.isfinite(gamma)
        ema = torch.where(seen, b * gamma + (1 - b) * clipped, clipped)  # a tensor first seen late starts fresh
        new_gamma = torch.where(warm, torch.minimum(gamma, clipped), ema)
        new_gamma = torch.where(finite, new_gamma, gamma)
        spike = None if self.skip_factor is None else decide.spike(per, self.skip_factor, gamma, finite, ~warm)
        s["gamma"] = new_gamma if index is None else gamma_all.index_copy(0, index, new_gamma)
        s["n"] = s["n"] + finite.to(total.dtype)
        post = combine_norms(clipped, 2.0)
        return h, post, spike
