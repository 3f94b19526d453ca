"""One protocol for every guard mode (fastgrad/guard/modes/base.py): a mode is one file declaring its options
and implementing ``update(norms) -> (coefficient, spike)``; the guard's read passes, options and core serve it
without naming it. Checked here: the declarations (each option once, with a default its own check accepts),
StepGuard reading them (every declared keyword taken, no other), the discovery of the mode files, the read
passes free of any mode's name, and a mode written only against the protocol (total and per-tensor) guarding
real steps through every read path: the write, the zero-write hand-over, a GradScaler, exact norms."""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import pathlib
import sys

import pytest
import torch

import fastgrad
from fastgrad import StepGuard, decide
from fastgrad.guard import MODES
from fastgrad.guard.modes import MODE_CLASSES, find_modes
from fastgrad.guard.modes.base import Mode, Norms, Option

from .guard_cases import NAN, _params, _same, _scaled, _set_grads, _snapshot

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUARD_KEYWORDS = set(inspect.signature(StepGuard).parameters) - {"mode_options"}


# ---------------------------------------------------------------- the declarations
@pytest.mark.parametrize("name", MODES)
def test_each_option_is_declared_once_with_a_default_its_check_accepts(name):
    cls = MODE_CLASSES[name]
    names = [o.name for o in cls.OPTIONS]
    assert len(names) == len(set(names)) and all(isinstance(o, Option) for o in cls.OPTIONS)
    assert not set(names) & GUARD_KEYWORDS  # a mode's keyword is not one of the guard's own
    for o in cls.OPTIONS:
        assert o.check(o.default) == o.default and type(o.check(o.default)) is type(o.default), o.name
        assert o.why and name in MODES


def test_stepguard_reads_the_declarations():
    """StepGuard's signature names no mode option: every declared one reaches it through the declaration, is
    checked by it (its reason in the error) and lands in ``guard.options``; another mode's is refused."""
    every = {o.name for cls in MODE_CLASSES.values() for o in cls.OPTIONS}
    assert not every & GUARD_KEYWORDS
    for name, cls in MODE_CLASSES.items():
        kw = dict(mode=name, skip_factor=5.0, max_norm=1.0)
        for o in cls.OPTIONS:
            value = o.default + 1 if o.integer else o.default / 2
            g = StepGuard(torch.optim.SGD(_params(), lr=0.1), **kw, **{o.name: value})
            assert g.options == {**{p.name: p.default for p in cls.OPTIONS}, o.name: value}
            g.remove()
            bad = -1 if o.integer else (math.nan if o.low_open else o.low - 1)
            with pytest.raises(ValueError, match=f"{o.name} must be .*{o.why[:20]}"):
                StepGuard(torch.optim.SGD(_params(), lr=0.1), **kw, **{o.name: bad})
        for other in sorted(every - {o.name for o in cls.OPTIONS}):
            with pytest.raises(TypeError, match=f"does not take {other}"):
                StepGuard(torch.optim.SGD(_params(), lr=0.1), **kw, **{other: 1})
    with pytest.raises(TypeError, match="does not take nonsense"):
        StepGuard(torch.optim.SGD(_params(), lr=0.1), 1.0, nonsense=3)


def test_the_docstring_lists_every_declared_option():
    for name, cls in MODE_CLASSES.items():
        line = next(ln for ln in StepGuard.__doc__.splitlines() if ln.strip().startswith(f"{name}:"))
        assert all(f"{o.name}={o.default!r}" in line for o in cls.OPTIONS) and cls.max_norm_is in line


# ---------------------------------------------------------------- the mode files
def test_every_mode_file_is_found_and_nothing_else_names_the_modes():
    folder = ROOT / "fastgrad" / "guard" / "modes"
    files = {p.stem for p in folder.glob("*.py")} - {"__init__", "base"}
    assert {MODE_CLASSES[m].__module__.rsplit(".", 1)[1] for m in MODES} == files
    assert MODES[0] == "norm" and set(MODES) == {"norm", "zclip", "autoclip", "adagc"}


def _package(tmp_path, monkeypatch, files: dict[str, str]) -> tuple[list[str], str]:
    pkg = tmp_path / "extra_modes"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for stem, src in files.items():
        (pkg / f"{stem}.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m.startswith("extra_modes")]:
        monkeypatch.delitem(sys.modules, m)
    importlib.invalidate_caches()
    return [str(pkg)], "extra_modes"


MODE_SRC = """
from fastgrad import decide
from fastgrad.guard.modes.base import Mode, Option

class {cls}(Mode):
    name = {name!r}
    OPTIONS = (Option("fraction", 0.5, "the share of max_norm a norm is clipped to", high=1.0, high_open=False),)

    def update(self, norms):
        return decide.clip_coef(norms.total, self.max_norm * self.options["fraction"]), None
"""


def test_a_new_mode_file_is_found_and_a_wrong_one_refused(tmp_path, monkeypatch):
    path, pkg = _package(tmp_path, monkeypatch, {"half": MODE_SRC.format(cls="Half", name="half"),
                                                 "base": "", "_helper": "x = 1"})
    found = find_modes(path, pkg)
    assert list(found) == ["half"] and found["half"].__name__ == "Half"
    two = MODE_SRC.format(cls="A", name="a") + MODE_SRC.format(cls="B", name="b").split("\n", 3)[3]
    path, pkg = _package(tmp_path / "two", monkeypatch, {"two": two})
    with pytest.raises(ImportError, match="exactly one Mode subclass"):
        find_modes(path, pkg)
    path, pkg = _package(tmp_path / "dup", monkeypatch, {"x": MODE_SRC.format(cls="X", name="same"),
                                                         "y": MODE_SRC.format(cls="Y", name="same")})
    with pytest.raises(ImportError, match="defined twice"):
        find_modes(path, pkg)


def test_the_read_passes_and_the_core_name_no_mode():
    """guard/read.py, core.py, options.py, counters.py and skip.py serve every mode through its declaration:
    no mode name in their code (docstrings aside), so nothing there branches on one."""
    for f in ("read.py", "core.py", "options.py", "counters.py", "skip.py"):
        tree = ast.parse((ROOT / "fastgrad" / "guard" / f).read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        named = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in MODES
                 and id(n) not in docs]
        assert not named, (f, named)


# ---------------------------------------------------------------- a mode written against the protocol only
class HalfMode(Mode):
    """Clips at ``fraction * max_norm``: clip_grad_norm_(params, fraction * max_norm)'s coefficient."""
    name = "test-half"
    OPTIONS = (Option("fraction", 0.5, "the share of max_norm", high=1.0, high_open=False),)

    def update(self, norms):
        return decide.clip_coef(norms.total, self.max_norm * self.options["fraction"]), None


class EachMode(Mode):
    """Each tensor clipped to ``max_norm`` on its own, with a spike rule and a count in its state."""
    name = "test-each"
    per_tensor = True

    def init(self, total, n_params):
        self.state = {"n": torch.zeros((), dtype=total.dtype, device=total.device)}

    def fits(self, n_params):
        return bool(self.state)

    def update(self, norms):
        self.state["n"] = self.state["n"] + norms.finite.to(self.state["n"].dtype)
        spike = None if self.skip_factor is None else decide.spike(norms.per, self.skip_factor,
                                                                    torch.tensor(self.max_norm), norms.finite)
        return decide.clip_coef(norms.per, self.max_norm), spike


@pytest.fixture
def test_modes(monkeypatch):
    monkeypatch.setitem(MODE_CLASSES, HalfMode.name, HalfMode)
    monkeypatch.setitem(MODE_CLASSES, EachMode.name, EachMode)


@pytest.mark.parametrize("path", ["written", "zero-write", "scaler", "exact"])
def test_a_total_mode_from_its_file_alone_guards_every_read_path(test_modes, path):
    """Twin: fastgrad's unguarded clip at fraction * max_norm; a NaN step leaves parameters and state alone."""
    fused = path == "zero-write"
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)) if fused else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True))
    ps, qs = _params(), _params()
    opt, ref = make(ps), make(qs)
    guard = StepGuard(opt, 2.0, mode="test-half", fraction=0.25, exact=path == "exact")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if path == "scaler" else None
    for step in range(4):
        bad = step == 2
        if scaler is not None:
            _scaled(ps, scaler, step, poison=NAN if bad else None)
        else:
            _set_grads(ps, step, poison=NAN if bad else None)
        before = _snapshot(ps, opt)
        total = guard.clip_(scaler) if scaler is not None else guard.clip_()
        (scaler.step(opt), scaler.update()) if scaler is not None else opt.step()
        if bad:
            assert _same(_snapshot(ps, opt), before) and guard.last_step_skipped()
            continue
        _set_grads(qs, step)
        want = fastgrad.clip_grad_norm_(qs, 0.5)
        ref.step()
        assert float(total) == pytest.approx(float(want), rel=1e-6)
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
        st = guard.state()
        assert st["coef"] == pytest.approx(min(0.5 / (float(want) + 1e-6), 1.0), rel=1e-5)
    assert guard.state()["skipped_steps"] == 1 and guard.options == {"fraction": 0.25}


@pytest.mark.parametrize("scaled", [False, True])
def test_a_per_tensor_mode_from_its_file_alone(test_modes, scaled):
    """Each tensor written by its own coefficient, the recorded coefficient what they amount to on the total
    (decide.per_tensor_coef, in float64 here), the spike and NaN skips, the state saved and loaded."""
    ps = _params(dtype=torch.float64)
    opt = torch.optim.SGD(ps, lr=0.0)
    guard = StepGuard(opt, 0.3, mode="test-each", skip_factor=20.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if scaled else None
    for step, kw in enumerate([{}, dict(poison=NAN), dict(scale=100.0), {}]):
        _set_grads(ps, step, **kw)
        raw = [p.grad.clone() for p in ps]
        if scaler is not None:
            s = scaler.scale(torch.ones((), dtype=torch.float64))
            for p in ps:
                p.grad = p.grad * s
        guard.clip_(scaler) if scaler is not None else guard.clip_()
        (scaler.step(opt), scaler.update()) if scaler is not None else opt.step()
        st = guard.state()
        assert st["skipped"] == bool(kw)
        if kw.get("poison") is not None:
            continue
        per = [float(r.norm()) for r in raw]
        coefs = [min(0.3 / (n + 1e-6), 1.0) for n in per]
        for p, r, c in zip(ps, raw, coefs):
            torch.testing.assert_close(p.grad, r * c, rtol=1e-12, atol=0)
        total = math.sqrt(sum(n * n for n in per))
        assert st["coef"] == pytest.approx(math.sqrt(sum((c * n) ** 2 for c, n in zip(coefs, per))) / total,
                                           rel=1e-12)
    assert guard.state()["spike_steps"] == 1 and guard._mode.state["n"].item() == 3
    other = StepGuard(torch.optim.SGD(_params(), lr=0.0), 0.3, mode="test-each", skip_factor=20.0)
    other.load_state_dict(guard.state_dict())
    assert repr(other.state()) == repr(guard.state()) and other._mode.state["n"].item() == 3


def test_norms_computes_the_verdict_once_and_converts_the_per_tensor_norms():
    total = torch.tensor(NAN)
    n = Norms(total, per=torch.ones(3, dtype=torch.float64))
    assert n.per.dtype == torch.float32 and n.nonfinite.item() and not n.finite.item()
    assert n.nonfinite is n.nonfinite and n.finite is n.finite
    given = torch.tensor(False)
    assert Norms(total, nonfinite=given).nonfinite is given


@pytest.mark.parametrize("mode", ["adagc", "test-each"])
def test_a_per_tensor_mode_writes_the_gradients_even_for_a_fused_optimizer(test_modes, mode):
    """Per-tensor coefficients cannot go to a fused kernel as one grad_scale: the guard writes them, and a
    fused SGD steps as the foreach twin does (a hand-over on top would scale the gradients twice)."""
    ps, qs = _params(), _params()
    fused = torch.optim.SGD(ps, lr=0.1, fused=True)
    foreach = torch.optim.SGD(qs, lr=0.1, foreach=True)
    ga, gb = StepGuard(fused, 0.3, mode=mode), StepGuard(foreach, 0.3, mode=mode)
    for step in range(3):
        _set_grads(ps, step)
        _set_grads(qs, step)
        ga.clip_()
        gb.clip_()
        fused.step()
        foreach.step()
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert ga.state()["coef"] < 0.5  # the clip does bite
