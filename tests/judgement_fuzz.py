"""The judgement fuzz of ``python -m fastgrad.check`` (issue 55): generated training scripts, each run once
WITHOUT fastgrad to record its float64 truth and once under check, whose report is judged against the defect
the generator wrote into the script.

- ``tests/judgement_fuzz_gen.py`` writes a script from a seed (family, loop, at most one defect) and fixes the
  split: development families and seeds, held-out families and seeds (reported, never tuned against).
- :class:`Truth` records, with plain torch hooks in the same process (``runpy``; many scripts per process), each
  optimizer step's loss (what was backpropagated since that optimizer's previous step), its lr in force, the
  global and per-tensor gradient norms, the tensors whose gradient was zero or absent, whether the gradients still
  held a previous step's (never zeroed), the update/weight ratio, and at the end the buffers that are NaN/Inf.
- :func:`manifests` says whether the injected defect shows in that truth (against the healthy twin, the same
  script without the defect, where it needs one). A defect that does not show is not scored.
- ``CLASS_MAP`` (written with the generator, before any check result was read) lists the finding codes that name
  each defect's cause; :func:`judge` reads check's ``report.json``: a healthy script has no finding above notice
  and exit 0; a defective one's first finding is in its class (or, where the script crashes without fastgrad
  too, ``script_crashed`` naming that crash); the code to add calls only the script's own
  objects; no two statements contradict; no summary row rates a non-finite or harmful value "healthy".

Replay one script: ``python -m tests.judgement_fuzz --seeds 17 --show``. The full run:
``python -m tests.judgement_fuzz --seeds 0:240 100000:100120 --out benchmarks/results/judgement-fuzz/DATE``."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import math
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .judgement_fuzz_gen import DEFECTS, HELD_OUT_SEED0, Spec, script_of, spec_of, twin

SEVERITY = {"healthy": 0, "notice": 1, "warning": 2, "critical": 3}

# defect -> the finding codes that name its cause (exact codes, then substrings any new code may carry). Effects
# are not causes: a `stall` does not name a learning rate collapsed by its schedule, a `loss_diverging` does not
# name a sign flip. Where check's documented advice for a code leads to the cause (`stall` at chance for labels
# that do not depend on the input, `nonfinite_loss` for a NaN batch), that code is the class's.
CLASS_MAP: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "lr_high": (("exploding", "loss_diverging", "nonfinite_loss", "nonfinite", "nonfinite_history"),
                ("lr_high", "lr_too_high", "update_")),
    "lr_low": (("stall",), ("lr_low", "lr_too_low", "update_tiny", "update_small")),
    "sched_collapse": (("lr_zero",), ("lr_collapse", "lr_schedule", "schedule", "lr_collapsed")),
    "sched_negative": (("lr_zero",), ("lr_negative", "negative_lr", "lr_schedule", "schedule")),
    "no_zero_grad": (("no_zero_grad",), ()),
    "zero_grad_every_k": (("no_zero_grad",), ("zero_grad",)),
    "loss_not_divided": ((), ("accum", "not_divided")),
    "clip_before_backward": (("clip_after_step",), ("clip_before_backward",)),
    "clip_before_unscale": (("clip_scaled",), ()),
    "detach_subnet": (("never_learns", "zero_grads", "dead", "no_learning"), ("detach",)),
    "frozen_body": (("never_learns", "stall"), ("frozen",)),
    "dead_relu_init": (("dead", "never_learns", "zero_grads", "no_learning", "mostly_zero"), ("dead_",)),
    "zero_init": (("dead", "never_learns", "zero_grads", "no_learning", "mostly_zero"), ("zero_init", "symmetr")),
    "sign_flip": ((), ("ascent", "sign", "maximi")),
    "softmax_ce": ((), ("softmax", "probabilit")),
    "nan_batch": (("nonfinite_loss", "nonfinite", "nonfinite_history"), ("nonfinite",)),
    "bn_nan_batch": (("nonfinite_loss", "nonfinite", "nonfinite_history"), ("nonfinite", "buffer")),
    "log_zero": (("nonfinite_loss", "nonfinite", "nonfinite_history"), ("nonfinite",)),
    "exploding_init": (("exploding",), ("init",)),
    "random_labels": (("stall",), ("chance", "label")),
    "weight_decay_drag": ((), ("weight_decay", "decay_drag", "shrink")),
    "unused_param": (("never_learns",), ("unused",)),
    "update_rewrite": ((), ("update_", "rewr")),
}
assert set(CLASS_MAP) == set(DEFECTS)


def in_class(defect: str, code: str) -> bool:
    exact, subs = CLASS_MAP[defect]
    return code in exact or any(s in code for s in subs)


# ----------------------------------------------------------------------------------------------------- the truth
def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors a backward from ``t`` writes gradients into (its graph's AccumulateGrad nodes)."""
    out, seen, todo = [], set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            out.append(var)
        todo.extend(n for n, _ in fn.next_functions)
    return out


def _dense(g: torch.Tensor) -> torch.Tensor:
    return g.coalesce().to_dense() if g.is_sparse else g


def _is_zero(g) -> bool:
    return g is None or not bool(_dense(g).any())


def _f(x) -> float:
    return float(x.detach().double()) if torch.is_tensor(x) else float(x)


class Truth:
    """Plain hooks, no fastgrad: records the steps of one script run in this process (see the module's text)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.losses: list[float] = []       # every scalar backward's loss, unscaled
        self.opt_index: dict[int, int] = {}
        self.cleared: set[int] = set()      # params whose gradient was None/zero before some backward since their step
        self.stepped: set[int] = set()
        self.bw: list[tuple[float | None, set]] = []
        self.bw_start: dict[int, int] = {}
        self.pending: dict[int, dict] = {}
        self.scaled: dict[int, float] = {}
        self.manual_prev = None
        self.bsteps: list[dict] = []

    def _grads(self, params) -> dict:
        norms, zero, nonfinite = {}, [], False
        sq = 0.0
        for p in params:
            g = p.grad
            if _is_zero(g):
                zero.append(id(p))
            if g is None:
                continue
            n = float(torch.linalg.vector_norm(_dense(g).double()))
            norms[id(p)] = n
            nonfinite |= not math.isfinite(n)
            sq += n * n
        return {"total_norm": math.sqrt(sq), "norms": norms, "zero": zero, "nonfinite": nonfinite}

    def _pre(self, opt, args, kwargs):
        idx = self.opt_index.setdefault(id(opt), len(self.opt_index))
        params = [p for g in opt.param_groups for p in g["params"]]
        # torch hands the hook the step's args with the optimizer itself first
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        rec = {"opt": idx, "lr": [float(g["lr"]) for g in opt.param_groups],
               "before": [p.detach().double().clone() for p in params], "closure": closure is not None}
        start = self.bw_start.get(id(opt), 0)
        ids = {id(p) for p in params}
        rec["loss_parts"] = [lo for lo, leaves in self.bw[start:] if leaves & ids]
        if closure is None:
            rec.update(self._grads(params))
            rec["stale"] = bool(id(opt) in self.stepped and any(
                not _is_zero(p.grad) and id(p) not in self.cleared for p in params))
        self.pending[id(opt)] = rec

    def _post(self, opt, args, kwargs):
        rec = self.pending.pop(id(opt))
        params = [p for g in opt.param_groups for p in g["params"]]
        if rec["closure"]:
            rec.update(self._grads(params))
            rec["stale"] = False
            rec["loss_parts"] = [lo for lo, leaves in self.bw[self.bw_start.get(id(opt), 0):]
                                 if leaves & {id(p) for p in params}][:1]
        before = rec.pop("before")
        after = [p.detach().double() for p in params]
        wb = math.sqrt(sum(float(b.pow(2).sum()) for b in before))
        du = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(after, before)))
        rec["ratio"] = du / wb if wb > 0 else None
        rec["param_norm"] = wb
        parts = rec.pop("loss_parts")
        rec["loss"] = sum(x for x in parts if x is not None) if parts else None
        rec["n"] = len(self.steps)
        self.steps.append(rec)
        self.stepped.add(id(opt))
        for p in params:
            self.cleared.discard(id(p))
        self.bw_start[id(opt)] = len(self.bw)

    def backward(self, orig, tensors, *args, **kwargs):
        t = tensors if torch.is_tensor(tensors) else tensors[0]
        loss = None
        if t.numel() == 1:
            loss = _f(t) / self.scaled.get(id(t), 1.0)
            self.losses.append(loss)
        leaves = _leaves(t) if t.grad_fn is not None else []
        stale = False
        for p in leaves:
            if _is_zero(p.grad):
                self.cleared.add(id(p))
            else:
                stale = True
        self.bw.append((loss, {id(p) for p in leaves}))
        # every backward is also kept as the step of a hand-written update, used when no optimizer ever steps
        self._manual(leaves, loss, stale)
        res = orig(tensors, *args, **kwargs)
        self.bsteps[-1].update(self._grads(leaves))
        return res

    def _manual(self, leaves, loss, stale):
        now = [p.detach().double().clone() for p in leaves]
        if self.manual_prev is not None and self.bsteps and len(self.manual_prev) == len(now):
            wb = math.sqrt(sum(float(b.pow(2).sum()) for b in self.manual_prev))
            du = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(now, self.manual_prev)))
            self.bsteps[-1]["ratio"] = du / wb if wb > 0 else None
        self.manual_prev = now
        self.bsteps.append({"opt": 0, "lr": [], "loss": loss, "n": len(self.bsteps), "stale": stale and bool(self.bsteps),
                           "ratio": None, "param_norm": math.sqrt(sum(float(b.pow(2).sum()) for b in now)),
                           "manual": True})


@contextlib.contextmanager
def _hooks(tr: Truth):
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    orig_bw = torch.autograd.backward
    orig_scale = torch.amp.GradScaler.scale

    def bw(tensors, *a, **k):
        return tr.backward(orig_bw, tensors, *a, **k)

    def scale(self, outputs):
        out = orig_scale(self, outputs)
        if torch.is_tensor(out):
            tr.scaled[id(out)] = float(self._scale.double()) if self._scale is not None else 1.0
        return out

    h1 = register_optimizer_step_pre_hook(tr._pre)
    h2 = register_optimizer_step_post_hook(tr._post)
    torch.autograd.backward = bw
    torch.amp.GradScaler.scale = scale
    try:
        yield
    finally:
        torch.autograd.backward = orig_bw
        torch.amp.GradScaler.scale = orig_scale
        h1.remove()
        h2.remove()


def run_truth(spec: Spec) -> dict:
    """Run ``spec``'s script here, without fastgrad, and return its truth (plain values)."""
    tr = Truth()
    err = None
    g: dict = {}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{spec.name}.py"
        path.write_text(script_of(spec))
        torch.manual_seed(0)
        with _hooks(tr), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                g = runpy.run_path(str(path), run_name="__main__")
            except Exception as e:  # noqa: BLE001 - a script that raises is recorded, not fatal
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    names, bufs = {}, []
    for k, v in g.items():
        if isinstance(v, torch.nn.Module):
            for n, p in v.named_parameters():
                names.setdefault(id(p), f"{k}.{n}")
            for n, b in v.named_buffers():
                if b.is_floating_point() and not bool(torch.isfinite(b).all()):
                    bufs.append(f"{k}.{n}")
    steps = []
    for r in (tr.steps if tr.opt_index else tr.bsteps):
        steps.append({"opt": r["opt"], "n": r["n"], "loss": r.get("loss"), "lr": r.get("lr", []),
                      "total_norm": r.get("total_norm"), "nonfinite": r.get("nonfinite", False),
                      "stale": r.get("stale", False), "ratio": r.get("ratio"), "param_norm": r.get("param_norm"),
                      "norms": {names.get(i, str(i)): n for i, n in r.get("norms", {}).items()},
                      "zero": sorted(names.get(i, str(i)) for i in r.get("zero", []))})
    all_params = sorted(set(names.values()))
    return {"steps": steps, "losses": tr.losses, "backward_norms": [b.get("total_norm") for b in tr.bsteps], "buffers_nonfinite": sorted(set(bufs)), "error": err,
            "progress": [float(x) for x in g.get("progress", [])], "params": all_params,
            "manual": not tr.opt_index}


# ------------------------------------------------------------------------------------------- does it manifest
def _q(xs: list[float]) -> tuple[float, float]:
    """Medians of the first and the last quarter of ``xs``."""
    n = max(1, len(xs) // 4)
    return statistics.median(xs[:n]), statistics.median(xs[-n:])


def _opt0_losses(t: dict) -> list[float]:
    if t["manual"]:
        return [x for x in t["losses"]]
    return [s["loss"] for s in t["steps"] if s["opt"] == 0 and s["loss"] is not None]


def _finite(t: dict) -> bool:
    return all(math.isfinite(x) for x in t["losses"]) and not any(s["nonfinite"] for s in t["steps"]) \
        and not t["buffers_nonfinite"] and t["error"] is None


def _improvement(t: dict) -> float:
    """Relative fall of the loss from the first quarter to the last (1 = to zero; < 0: it rose)."""
    ls = _opt0_losses(t)
    if len(ls) < 8 or not all(math.isfinite(x) for x in ls):
        return float("nan")
    a, b = _q(ls)
    return (a - b) / abs(a) if a else 0.0


def learns(spec: Spec, t: dict) -> bool:
    """The run is healthy by its truth: finite everywhere and it makes progress."""
    if not _finite(t) or len(t["steps"]) + len(t["losses"]) == 0:
        return False
    if spec.family in ("gan", "wgan", "policy_gradient", "actor_critic"):
        p = t["progress"]
        if len(p) < 8:
            return False
        a = statistics.mean(p[: len(p) // 4])
        b = statistics.mean(p[-(len(p) // 4):])
        return b > a
    return _improvement(t) > 0.05


def _always_zero(t: dict) -> set[str]:
    """Parameters whose gradient was zero or absent at every step of their optimizer."""
    seen, nz = set(), set()
    for s in t["steps"]:
        for n in s["zero"]:
            seen.add(n)
        for n, v in s["norms"].items():
            if v and n not in s["zero"]:
                nz.add(n)
    return seen - nz


def _ratios(t: dict) -> list[float]:
    return [s["ratio"] for s in t["steps"] if s["ratio"] is not None]


def manifests(spec: Spec, t: dict, tw: dict | None) -> tuple[bool, str]:
    """Whether ``spec.defect`` shows in the truth ``t`` (``tw``: the healthy twin's); the evidence in words."""
    d = spec.defect
    if d is None:
        ok = learns(spec, t)
        return ok, "learns, all finite" if ok else "the healthy script does not learn or is not finite"
    if t["error"] is not None and d not in ("nan_batch", "log_zero", "lr_high", "bn_nan_batch"):
        return False, f"the script raised: {t['error']}"
    ls = _opt0_losses(t)
    steps0 = [s for s in t["steps"] if s["opt"] == 0]
    r = _ratios(t)
    nonfinite = not _finite(t)
    az = _always_zero(t)
    imp, imp_tw = _improvement(t), (_improvement(tw) if tw else float("nan"))
    if d == "lr_high":
        rise = len(ls) >= 8 and all(map(math.isfinite, ls)) and _q(ls)[1] > 1.5 * _q(ls)[0]
        ok = nonfinite or rise or (r and max(r) >= 1.0)
        return bool(ok), f"nonfinite={nonfinite} rise={rise} max_ratio={max(r) if r else None}"
    if d == "lr_low":
        ok = bool(r) and statistics.median(r) < 1e-6
        return ok, f"median ratio {statistics.median(r) if r else None}"
    if d == "sched_collapse":
        lrs = [s["lr"][0] for s in steps0 if s["lr"]]
        ok = len(lrs) > 4 and lrs[-1] <= 1e-4 * lrs[0]
        return ok, f"lr {lrs[0] if lrs else None} -> {lrs[-1] if lrs else None}"
    if d == "sched_negative":
        lrs = [x for s in t["steps"] for x in s["lr"]]
        ok = any(x < 0 for x in lrs)
        return ok, f"min lr {min(lrs) if lrs else None}"
    if d in ("no_zero_grad", "zero_grad_every_k"):
        later = [s for s in t["steps"] if s["n"] > 0]
        frac = sum(s["stale"] for s in later) / max(1, len(later))
        return frac >= (0.8 if d == "no_zero_grad" else 0.3), f"stale at {frac:.0%} of steps"
    if d == "loss_not_divided":
        if not tw or not tw["steps"] or not t["steps"]:
            return False, "no step"
        # the gradient of the first step's window before any clip: after its last backward
        a, b = t["backward_norms"][spec.accum - 1], tw["backward_norms"][spec.accum - 1]
        ok = b > 0 and abs(a / b - spec.accum) < 0.05 * spec.accum
        return ok, f"step-1 norm {a} vs twin {b} (x{a / b if b else float('nan'):.3g})"
    if d == "clip_before_backward":
        n = [s["total_norm"] for s in t["steps"] if s["total_norm"] is not None]
        frac = sum(x > 1.5 * spec.clip for x in n) / max(1, len(n))
        return frac >= 0.5, f"{frac:.0%} of steps above 1.5x the clip bound"
    if d == "clip_before_unscale":
        n = [s["total_norm"] for s in t["steps"] if s["total_norm"] is not None]
        m = [s["total_norm"] for s in (tw or {"steps": []})["steps"] if s["total_norm"] is not None]
        ok = bool(n) and bool(m) and statistics.median(n) < 1e-3 * statistics.median(m)
        return ok, f"median step norm {statistics.median(n) if n else None} vs twin {statistics.median(m) if m else None}"
    if d == "detach_subnet":
        pre = {"gan": "G."}.get(spec.family, "model.temb." if spec.family == "diffusion" else "model.body.")
        hit = sorted(n for n in az if n.startswith(pre))
        return bool(hit), f"always zero: {hit[:3]}"
    if d in ("dead_relu_init", "zero_init"):
        first = ("model.enc.0.weight" if spec.family == "vae" else "model.body.0.weight")
        return first in az, f"{first} always zero: {first in az}"
    if d == "frozen_body":
        ok = math.isfinite(imp) and math.isfinite(imp_tw) and imp < 0.5 * imp_tw and imp_tw > 0.05
        return ok, f"improvement {imp:.3g} vs twin {imp_tw:.3g}"
    if d == "sign_flip":
        real = [abs(x) for x in ls]   # the losses are >= 0: what the script means to minimise, whatever its sign
        ok = nonfinite or (len(real) >= 8 and _q(real)[1] > _q(real)[0] + 0.1 * abs(_q(real)[0]))
        return ok, f"true objective {_q(real) if real else None}"
    if d == "softmax_ce":
        ok = bool(tw) and learns(twin(spec), tw) and _finite(t) and \
            _q(ls)[1] > _q(_opt0_losses(tw))[1] + 0.1
        return ok, f"last-quarter loss {_q(ls)[1] if ls else None} vs twin {_q(_opt0_losses(tw))[1] if tw else None}"
    if d in ("nan_batch", "log_zero"):
        return nonfinite, f"nonfinite={nonfinite}"
    if d == "bn_nan_batch":
        return bool(t["buffers_nonfinite"]), f"non-finite buffers {t['buffers_nonfinite'][:3]}"
    if d == "exploding_init":
        a = t["steps"][0]["total_norm"] if t["steps"] else None
        b = tw["steps"][0]["total_norm"] if tw and tw["steps"] else None
        ok = nonfinite or (a is not None and b and a > 20 * b)
        return bool(ok), f"step-1 norm {a} vs twin {b}"
    if d == "random_labels":
        ok = _finite(t) and math.isfinite(imp) and imp < 0.03 and imp_tw > 0.05
        return ok, f"improvement {imp:.3g} vs twin {imp_tw:.3g}"
    if d == "weight_decay_drag":
        pn = [s["param_norm"] for s in steps0 if s["param_norm"]]
        ok = len(pn) > 4 and pn[-1] < 0.1 * pn[0]
        return ok, f"weights' norm {pn[0] if pn else None} -> {pn[-1] if pn else None}"
    if d == "unused_param":
        hit = sorted(n for n in az if ".aux." in n)
        return bool(hit), f"never a gradient: {hit}"
    if d == "update_rewrite":
        ok = bool(r) and max(r) >= 1.0
        return ok, f"max ratio {max(r) if r else None}"
    raise ValueError(d)


# --------------------------------------------------------------------------------------------------- the judge
# objects a code to add may call methods of: the root must be one of the script's own names (or a module)
_METHODS = {"step", "zero_grad", "param_groups", "parameters", "named_parameters", "unscale_", "update", "scale",
            "state_dict", "train", "eval", "modules", "register_forward_hook"}
_MODULES = {"torch", "fastgrad", "nn", "F", "math"}


def _defined(script: str) -> set[str]:
    names = set(_MODULES)
    for node in ast.walk(ast.parse(script)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def foreign_names(code: str, script: str) -> list[str]:
    """Names the code to add calls methods of (``opt.step``, ``model.parameters``) that the script never
    defines; [] when it parses and uses the script's own names. A snippet that does not parse is reported."""
    if not code.strip():
        return []
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ["<does not parse>"]
    own = _defined(script) | _defined(code)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _METHODS:
            root = node.value
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if isinstance(root, ast.Name) and root.id not in own:
                bad.append(root.id)
    return sorted(set(bad))


_LR_DOWN = ("lower the learning rate", "lower the lr", "reduce the learning rate", "*= 0.1")
_LR_UP = ("raise the learning rate", "raise the lr", "increase the learning rate", "*= 10")


def contradictions(rep: dict) -> list[str]:
    """Statements of one report that cannot both be true."""
    out = []
    worst = max([SEVERITY[f["severity"]] for f in rep["findings"]] + [0])
    status = rep.get("status")
    if status in SEVERITY and SEVERITY[status] != worst:
        out.append(f"status {status} but the worst finding is {[k for k, v in SEVERITY.items() if v == worst][0]}")
    crit = worst == 3
    rc = rep.get("exit_code")
    if rc in (0, 1) and (rc == 1) != crit:
        out.append(f"exit code {rc} with{'' if crit else 'out'} a critical finding")
    text = " ".join(r["text"] + " " + r.get("code_to_add", "") for r in rep["recommendations"]).lower()
    if any(s in text for s in _LR_DOWN) and any(s in text for s in _LR_UP):
        out.append("advises both lowering and raising the learning rate")
    return out


_NONFINITE = ("nan", "inf")


def summary_lies(rep: dict, md: str, t: dict) -> list[str]:
    """Summary rows (and the protection claim) that rate a non-finite or harmful value as healthy."""
    out = []
    lrs = [x for s in t["steps"] for x in s["lr"]]
    # per optimizer: its lr collapsed or went negative; the report has one "Learning rate" row per optimizer, in
    # its own order, so at least that many of those rows must say so (another optimizer's row may be healthy)
    per: dict = {}
    for s in t["steps"]:
        per.setdefault(s.get("opt", 0), []).extend(s["lr"])
    bad_opts = sum(1 for v in per.values() if v and (min(v) < 0 or (v[0] > 0 and min(v) <= 1e-4 * v[0])))
    lr_rows = [row for row in rep["summary"] if row["metric"].startswith("Learning rate")]
    lr_lies = bad_opts > sum(1 for row in lr_rows if row["status"] != "healthy")
    r = _ratios(t)
    for row in rep["summary"]:
        if row["status"] != "healthy":
            continue
        v = str(row["value"]).lower()
        m = row["metric"]
        if any(w in v.replace("nan/inf", "").split() or f" {w} " in f" {v} " for w in _NONFINITE) \
                and not v.startswith("0 of") and m != "NaN/Inf born in":
            out.append(f"{m} = {row['value']} rated healthy")
        if m.startswith("Learning rate") and lr_lies:
            out.append(f"{m} = {row['value']} rated healthy while the lr in force reached {min(lrs):.3g}")
        if m.startswith("Update/weight") and r and max(r) >= 1.0:
            out.append(f"{m} rated healthy while an update rewrote the weights (ratio {max(r):.3g})")
    if t["buffers_nonfinite"] and "protected" in md.lower():
        out.append(f"says the run is protected while buffers are NaN/Inf: {t['buffers_nonfinite'][:2]}")
    return out


def crash_of_the_script(t: dict, rep: dict) -> bool:
    """The script crashes without fastgrad too (its truth run raised) and check's first finding is
    ``script_crashed`` naming that exception: then the crash is the right first finding, whatever the class.
    A crash only under check is never right."""
    f = rep["findings"][0] if rep["findings"] else None
    if t.get("error") is None or f is None or f["code"] != "script_crashed":
        return False
    return t["error"].split(":", 1)[0] in f.get("title", "") + " " + f.get("detail", "")


def judge(spec: Spec, t: dict, rep: dict | None, md: str, script: str) -> dict:
    """The verdict on one report (``rep``: report.json; None when check wrote none)."""
    if rep is None:
        return {"right": False, "first": "<no report>", "why": ["check wrote no report"], "first_right": False}
    findings = rep["findings"]
    first = findings[0]["code"] if findings else "healthy"
    why = []
    if spec.defect is None:
        loud = [f["code"] for f in findings if SEVERITY[f["severity"]] >= 2]
        first_right = not loud and rep.get("exit_code") == 0
        if not first_right:
            why.append(f"healthy script: {loud} above notice, exit {rep.get('exit_code')}")
            first = loud[0] if loud else f"exit {rep.get('exit_code')}"
        else:
            first = "healthy"
    else:
        first_right = bool(findings) and (in_class(spec.defect, first) or crash_of_the_script(t, rep))
        if not first_right:
            why.append(f"first finding {first} does not name {spec.defect}")
    for r in rep["recommendations"]:
        bad = foreign_names(r.get("code_to_add", ""), script)
        if bad:
            why.append(f"{r['code']}'s code to add uses {bad}, not in the script")
    why += contradictions(rep)
    why += summary_lies(rep, md, t)
    return {"right": not why, "first_right": first_right, "first": first, "why": why,
            "codes": [f"{f['code']}:{f['severity']}" for f in findings], "exit": rep.get("exit_code")}


# ------------------------------------------------------------------------------------------------- the runs
def run_check(script: Path, out: Path, timeout: int = 300) -> tuple[dict | None, str, int]:
    """``python -m fastgrad.check --out OUT SCRIPT`` in a subprocess: its report.json, report.md, exit code."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "fastgrad.check", "--out", str(out), str(script)],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=str(script.parent))
    rj, rm = out / "report.json", out / "report.md"
    rep = json.loads(rj.read_text()) if rj.exists() else None
    return rep, rm.read_text() if rm.exists() else "", p.returncode


# the defects whose manifestation is measured against the healthy twin (the same script without the defect)
NEEDS_TWIN = {"loss_not_divided", "clip_before_unscale", "frozen_body", "softmax_ce", "exploding_init",
              "random_labels"}


def prepare(seed: int, defect="any") -> dict:
    """The script of ``seed``, its truth and whether its defect shows (no check run)."""
    spec = spec_of(seed, defect)
    torch.set_num_threads(1)
    t = run_truth(spec)
    tw = run_truth(twin(spec)) if spec.defect in NEEDS_TWIN else None
    ok, why = manifests(spec, t, tw)
    return {"spec": spec, "truth": t, "twin": tw, "manifests": ok, "evidence": why}


def fuzz(seeds, work: Path, jobs: int = 2, log=print) -> list[dict]:
    """Truth for every seed here (one process), then check on the ones whose defect shows (``jobs`` at once)."""
    work.mkdir(parents=True, exist_ok=True)

    def one(p):
        name = p["spec"].name
        if not p["manifests"]:
            p["verdict"] = None
        else:
            out = work / name
            t0 = time.perf_counter()
            if (out / "report.json").exists():   # a report from an earlier, interrupted run of the same script
                rep, md = json.loads((out / "report.json").read_text()), (out / "report.md").read_text()
            else:
                try:
                    rep, md, _ = run_check(p["script"], out)
                except subprocess.TimeoutExpired:
                    rep, md = None, ""
            p["check_s"] = time.perf_counter() - t0
            p["verdict"] = judge(p["spec"], p["truth"], rep, md, p["script"].read_text())
            v = p["verdict"]
            log(f"{name}: {'right' if v['right'] else 'WRONG'} first={v['first']} {'; '.join(v['why'])[:300]}",
                flush=True)
        # one row per script on disk, so an interrupted run can still be tabulated (--tabulate)
        (work / f"{name}.row.json").write_text(json.dumps(
            {"seed": p["spec"].seed, "defect": p["spec"].defect, "manifests": p["manifests"],
             "evidence": p["evidence"], "verdict": p["verdict"]}))
        return p

    futs = []
    with ThreadPoolExecutor(max_workers=max(1, min(2, jobs))) as ex:
        for seed in seeds:   # the next truth is recorded here while check runs the previous scripts
            p = prepare(seed)
            p["script"] = work / f"{p['spec'].name}.py"
            p["script"].write_text(script_of(p["spec"]))
            futs.append(ex.submit(one, p))
        return [f.result() for f in futs]


# ------------------------------------------------------------------------------------------------- the tables
def tables(rows: list[dict]) -> dict:
    """Per part: the confusion matrix (injected class x first finding), precision and recall per class, false
    alarms per family, and the other judgements' failures."""
    out = {}
    for part in ("dev", "held_out"):
        rs = [r for r in rows if r["spec"].part == part and r.get("verdict")]
        conf = defaultdict(Counter)
        for r in rs:
            conf[r["spec"].defect or "healthy"][r["verdict"]["first"]] += 1
        per = {}
        for cls in ["healthy", *DEFECTS]:
            mine = [r for r in rs if (r["spec"].defect or "healthy") == cls]
            if cls == "healthy":
                claimed = mine
            else:
                claimed = [r for r in rs if r["verdict"]["first"] != "healthy" and r["spec"].defect is not None
                           and in_class(cls, r["verdict"]["first"])] + \
                          [r for r in rs if r["spec"].defect is None and r["verdict"]["first"] != "healthy"
                           and in_class(cls, r["verdict"]["first"])]
            hit = sum(r["verdict"]["first_right"] for r in mine)
            tp = sum(1 for r in claimed if r["spec"].defect == cls and r["verdict"]["first_right"])
            per[cls] = {"n": len(mine), "first_right": hit, "right": sum(r["verdict"]["right"] for r in mine),
                        "recall": hit / len(mine) if mine else None,
                        "precision": (tp / len(claimed) if claimed else None) if cls != "healthy" else None}
        fam = defaultdict(lambda: [0, 0])
        for r in rs:
            if r["spec"].defect is None:
                fam[r["spec"].family][0] += 1
                fam[r["spec"].family][1] += not r["verdict"]["first_right"]
        other = Counter(w.split(":")[0].split(" ")[0] for r in rs for w in r["verdict"]["why"]
                        if not w.startswith(("first finding", "healthy script")))
        dropped = Counter((r["spec"].defect or "healthy") for r in rows
                          if r["spec"].part == part and not r["manifests"])
        out[part] = {"scored": len(rs), "right": sum(r["verdict"]["right"] for r in rs),
                     "first_right": sum(r["verdict"]["first_right"] for r in rs), "confusion": conf,
                     "per_class": per, "false_alarms": dict(fam), "other_failures": dict(other),
                     "dropped": dict(dropped)}
    return out


def write_results(rows: list[dict], out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tb = tables(rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    with open(out / "scripts.csv", "w") as f:
        f.write("seed,part,family,defect,opt,manifests,evidence,first,first_right,right,exit,codes,why\n")
        for r in rows:
            s, v = r["spec"], r.get("verdict") or {}
            cells = [s.seed, s.part, s.family, s.defect or "healthy", s.opt, r["manifests"], r["evidence"],
                     v.get("first", ""), v.get("first_right", ""), v.get("right", ""), v.get("exit", ""),
                     " ".join(v.get("codes", [])), " | ".join(v.get("why", []))]
            f.write(",".join('"' + str(c).replace('"', "'") + '"' for c in cells) + "\n")
    md = [f"# Judgement fuzz of `python -m fastgrad.check`\n", f"Command: `{command}`  ", f"Commit: {commit}  ",
          f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
          "Machine: the 2-core CPU VM (shared).\n",
          "`right`: every judgement holds (first finding, advice in the script's names, no contradiction, no "
          "harmful value rated healthy); `first right`: the first finding alone (for a healthy script: nothing "
          "above notice and exit 0). Scripts whose defect did not show in their truth are dropped, not scored.\n"]
    for part, t in tb.items():
        with open(out / f"confusion_{part}.csv", "w") as f:
            cols = sorted({c for row in t["confusion"].values() for c in row})
            f.write("injected," + ",".join(cols) + "\n")
            for cls, row in sorted(t["confusion"].items()):
                f.write(cls + "," + ",".join(str(row.get(c, 0)) for c in cols) + "\n")
        with open(out / f"per_class_{part}.csv", "w") as f:
            f.write("class,n,first_right,right,recall,precision\n")
            for cls, v in t["per_class"].items():
                f.write(f"{cls},{v['n']},{v['first_right']},{v['right']},{v['recall']},{v['precision']}\n")
        md.append(f"## {part}: {t['scored']} scored, first finding right on {t['first_right']}, "
                  f"all judgements right on {t['right']}\n")
        md.append("| class | n | first right | all right | recall | precision |\n|---|---|---|---|---|---|")
        for cls, v in t["per_class"].items():
            if v["n"]:
                p = "-" if v["precision"] is None else f"{v['precision']:.2f}"
                md.append(f"| {cls} | {v['n']} | {v['first_right']} | {v['right']} | {v['recall']:.2f} | {p} |")
        md.append("\nFalse alarms per family (healthy scripts with a warning/critical or exit != 0): " +
                  ", ".join(f"{k} {b}/{a}" for k, (a, b) in sorted(t["false_alarms"].items())) + "  ")
        md.append("Other failed judgements: " + (", ".join(f"{k} {v}" for k, v in t["other_failures"].items())
                                                or "none") + "  ")
        md.append("Dropped (defect not shown in the truth): " +
                  (", ".join(f"{k} {v}" for k, v in sorted(t["dropped"].items())) or "none") + "\n")
    (out / "README.md").write_text("\n".join(md) + "\n")


def _seeds(args: list[str]) -> list[int]:
    out = []
    for a in args:
        if ":" in a:
            lo, hi = a.split(":")
            out.extend(range(int(lo), int(hi)))
        else:
            out.append(int(a))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.judgement_fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", required=True, help="seeds or ranges LO:HI (held-out from %d)"
                    % HELD_OUT_SEED0)
    ap.add_argument("--out", type=Path, help="write the tables (CSV, README.md) into this folder")
    ap.add_argument("--work", type=Path, help="keep the scripts and reports here (default: a temporary folder)")
    ap.add_argument("--jobs", type=int, default=2, help="check runs at once (at most 2)")
    ap.add_argument("--show", action="store_true", help="print the scripts and their truth only")
    ap.add_argument("--tabulate", action="store_true", help="only tabulate the rows already in --work")
    a = ap.parse_args(argv)
    seeds = _seeds(a.seeds)
    if a.tabulate:
        rows = []
        for f in sorted(a.work.glob("*.row.json")):
            r = json.loads(f.read_text())
            if r["seed"] in seeds:
                spec = spec_of(r["seed"])   # the drawn script (forcing its defect would draw another)
                assert spec.defect == r["defect"], (r["seed"], spec.defect, r["defect"])
                rows.append(dict(r, spec=spec))
        print(f"{len(rows)} scripts tabulated from {a.work}")
        write_results(rows, a.out, "python -m tests.judgement_fuzz " + " ".join(argv or sys.argv[1:]))
        return 0
    if a.show:
        for s in seeds:
            p = prepare(s)
            print(script_of(p["spec"]))
            print(f"# manifests: {p['manifests']} ({p['evidence']})")
        return 0
    # the parts interleaved in proportion, so that a run cut short has figures for both
    dev = [x for x in seeds if x < HELD_OUT_SEED0]
    held = [x for x in seeds if x >= HELD_OUT_SEED0]
    seeds = sorted(dev + held, key=lambda x: (dev.index(x) / len(dev)) if x in dev else (held.index(x) / len(held)))
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        t0 = time.perf_counter()
        rows = fuzz(seeds, work, a.jobs)
        print(f"{len(rows)} scripts in {time.perf_counter() - t0:.0f} s")
        tb = tables(rows)
        for part, t in tb.items():
            print(f"{part}: {t['scored']} scored, first right {t['first_right']}, all right {t['right']}")
        if a.out:
            write_results(rows, a.out, "python -m tests.judgement_fuzz " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
