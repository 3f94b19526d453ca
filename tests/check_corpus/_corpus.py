"""What the corpus scripts share: their float64 ground truth, recorded by plain torch hooks (no fastgrad), and the
synthetic environment the reinforcement-learning scripts play in (CartPole's physics, written out here so that
no script needs gym).

The truth is tests/check_scripts/_truth.py's convention (a JSON of per-step rows at $FG_TRUTH), reused, not
copied: ``Recorder`` adds one row per optimizer step from a step pre-hook (the float64 norm of the gradients
the step consumes, after any clip; the loss the script noted since the previous step, summed as check sums the
losses of several backward() calls; the learning rate; the tensors whose gradient was absent or all zero) and a
post-hook (the whole model's update/weight ratio of that step). Loops without torch.optim and LBFGS (whose
step hook runs before the closure) add their rows with ``Recorder.row``."""
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "check_scripts"))
from _truth import Truth, flat_params, grad_norm, update_ratio  # noqa: E402

__all__ = ["Recorder", "CartPole", "grad_norm"]


def _names(model):
    return {id(p): n for n, p in model.named_parameters()} if model is not None else {}


class Recorder:
    """One script's truth. ``watch(optimizer, name, model)`` once per optimizer; ``loss(x, name)`` where the
    script computes a loss it backpropagates; ``before_clip(params, name)`` right before a clip (the norm the
    clip reads); ``layers=True`` also records each tensor's norm (for the depth cases)."""

    def __init__(self, layers=False):
        self.truth = Truth()
        self.layers = layers
        self._loss, self._raw, self._state = {}, {}, {}

    # ------------------------------------------------------------------ what the script notes
    def loss(self, value, name=""):
        v = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        self._loss[name] = self._loss.get(name, 0.0) + v

    def before_clip(self, params, name=""):
        self._raw[name] = grad_norm(list(params))

    # ------------------------------------------------------------------ the rows
    def _tensors(self, params, names):
        row = {}
        absent = [names.get(id(p), "?") for p in params if p.grad is None]
        zero = [names.get(id(p), "?") for p in params if p.grad is not None and not bool(p.grad.any())]
        finite = all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
        row["finite"] = int(finite)
        if absent:
            row["absent"] = absent
        if zero:
            row["zero"] = zero
        if self.layers:
            row["layers"] = {names.get(id(p), "?"): (float(p.grad.detach().double().norm()) if p.grad is not None
                                                      else None) for p in params}
        return row

    def row(self, params, name="", model=None, lr=None, names=None, **extra):
        """One step's row, taken where the update is about to read the gradients."""
        params = list(params)
        names = names if names is not None else _names(model)
        r = {"opt": name, "norm": grad_norm(params), "loss": self._loss.pop(name, None)}
        if name in self._raw:
            r["raw"] = self._raw.pop(name)
        if lr is not None:
            r["lr"] = lr
        r.update(self._tensors(params, names))
        r.update(extra)
        self.truth.add(**{k: v for k, v in r.items() if v is not None})
        return r

    def watch(self, optimizer, name="", model=None):
        names = _names(model)
        params = [p for g in optimizer.param_groups for p in g["params"]]

        def pre(opt, args, kwargs):
            self._state[name] = flat_params(params)
            self.row(params, name, lr=opt.param_groups[0]["lr"], names=names)

        def post(opt, args, kwargs):
            before = self._state.pop(name)
            after = flat_params(params)
            self.truth.steps[-1]["ratio"] = update_ratio(before, after) if torch.isfinite(after).all() else "nan"
            self.truth.write()

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)
        return optimizer

    def note(self, **extra):
        """More facts about the last step (an episode's length, LBFGS's evaluations), written at once: an
        in-process run's truth file is not rewritten at exit."""
        self.truth.steps[-1].update(extra)
        self.truth.write()

    def skipped(self, name="", **extra):
        """A step the script's GradScaler skipped (inf/NaN gradients): no optimizer.step ran, so no hook did."""
        raw = self._raw.pop(name, None)
        self.truth.add(opt=name, skipped=1, loss=self._loss.pop(name, math.nan), **({"raw": raw} if raw else {}),
                       **extra)


class CartPole:
    """``n`` independent cart-poles (the classic control problem: push the cart left or right to keep the pole
    up), numpy-batched, each reset when it falls or reaches ``max_steps``. ``step`` returns (obs, reward, done)
    with reward 1 per step survived, as gym's CartPole-v1."""

    def __init__(self, n=1, seed=0, max_steps=200):
        self.n, self.max_steps = n, max_steps
        self.rng = np.random.default_rng(seed)
        self.s = np.zeros((n, 4))
        self.t = np.zeros(n, dtype=np.int64)
        self.reset()

    def reset(self, idx=None):
        idx = np.arange(self.n) if idx is None else idx
        self.s[idx] = self.rng.uniform(-0.05, 0.05, size=(len(idx), 4))
        self.t[idx] = 0
        return self.s.astype(np.float32).copy()

    def step(self, action):
        g, mc, mp, length, fmag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
        x, xd, th, thd = self.s.T
        force = np.where(np.asarray(action) == 1, fmag, -fmag)
        cos, sin = np.cos(th), np.sin(th)
        tmp = (force + mp * length * thd ** 2 * sin) / (mc + mp)
        thacc = (g * sin - cos * tmp) / (length * (4.0 / 3.0 - mp * cos ** 2 / (mc + mp)))
        xacc = tmp - mp * length * thacc * cos / (mc + mp)
        self.s = np.stack([x + tau * xd, xd + tau * xacc, th + tau * thd, thd + tau * thacc], axis=1)
        self.t += 1
        fell = (np.abs(self.s[:, 0]) > 2.4) | (np.abs(self.s[:, 2]) > 12 * 2 * math.pi / 360)
        done = fell | (self.t >= self.max_steps)
        obs = self.s.astype(np.float32).copy()
        if done.any():
            self.reset(np.flatnonzero(done))
        return obs, np.ones(self.n, dtype=np.float32), done
