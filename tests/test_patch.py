"""fastgrad.patch_torch / unpatch_torch (docs/contract.md section 11): routing, idempotence, exact restore, context
manager nesting, the recursion guard of fastgrad's torch fallbacks, signatures, and the info status."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

import fastgrad
from fastgrad import patch

from .helpers import clone_params, grads, make_params

UTILS = torch.nn.utils
CLIP = torch.nn.utils.clip_grad
# what torch defines in each module (clip_grad has no public get_total_norm / clip_grads_with_norm_)
TARGETS = [(m, n) for m in (UTILS, CLIP) for n in patch.NAMES if hasattr(m, n)]


def _snapshot():
    return {(m.__name__, n): getattr(m, n) for m, n in TARGETS}


@pytest.fixture(autouse=True)
def _never_leak():
    """Every test starts and ends with torch unpatched, whatever it does in between."""
    before = _snapshot()
    assert not patch.patched()
    yield
    fastgrad.unpatch_torch()
    assert _snapshot() == before


def test_patch_routes_every_function_in_both_modules_and_unpatch_restores_the_same_objects():
    before = _snapshot()
    assert ("torch.nn.utils", "clip_grad_norm_") in before and ("torch.nn.utils.clip_grad", "clip_grad_norm_") in before
    fastgrad.patch_torch()
    for m, n in TARGETS:
        routed = getattr(m, n)
        assert routed is not before[(m.__name__, n)]
        assert routed.__wrapped__ is getattr(fastgrad, n)  # functools.wraps of fastgrad's function
    assert patch.patched() == {f"{m.__name__}.{n}": f"fastgrad.{n}" for m, n in TARGETS}
    # never adds names torch lacks
    assert hasattr(CLIP, "get_total_norm") == (("torch.nn.utils.clip_grad", "get_total_norm") in before)
    fastgrad.unpatch_torch()
    after = _snapshot()
    for key, obj in before.items():
        assert after[key] is obj
    assert patch.patched() == {}


def test_patching_twice_is_one_patch_and_unpatch_once_undoes_it():
    fastgrad.patch_torch()
    first = _snapshot()
    fastgrad.patch_torch()
    assert _snapshot() == first  # the same router objects: no router wrapped in a router
    p = make_params([(7, 3)], torch.float32, "cpu", seed=1, scale=10.0)
    counts = patch.call_counts()
    UTILS.clip_grad_norm_(p, 1.0)
    assert patch.call_counts()["clip_grad_norm_"] == counts["clip_grad_norm_"] + 1  # one hop, not two
    fastgrad.unpatch_torch()
    assert not patch.patched()
    fastgrad.unpatch_torch()  # unpatching an unpatched torch is a no-op
    assert not patch.patched()


def test_context_manager_restores_the_state_found_on_entry():
    before = _snapshot()
    with fastgrad.patch_torch() as handle:
        assert patch.patched() and "routed to fastgrad" in repr(handle)
        inside = _snapshot()
        with fastgrad.patch_torch():  # nested: no change, and its exit keeps the outer patch on
            assert _snapshot() == inside
        assert _snapshot() == inside
    assert _snapshot() == before
    fastgrad.patch_torch()  # process-wide patch, then a block inside it: the block's exit leaves it on
    with fastgrad.patch_torch():
        pass
    assert patch.patched()
    fastgrad.unpatch_torch()
    with pytest.raises(ZeroDivisionError):  # an exception in the block still unpatches
        with fastgrad.patch_torch():
            1 / 0
    assert _snapshot() == before


def test_unpatch_leaves_a_later_patch_by_someone_else_alone():
    fastgrad.patch_torch()

    def theirs(*args, **kwargs):
        return None

    UTILS.clip_grad_value_ = theirs
    fastgrad.unpatch_torch()
    assert UTILS.clip_grad_value_ is theirs
    UTILS.clip_grad_value_ = patch.TORCH.clip_grad_value_  # the fixture checks the rest came back


@pytest.mark.parametrize("call", ["positional", "keyword"])
def test_patched_calls_give_fastgrads_results_with_torchs_signatures(call):
    params = make_params([(33, 5), (17,), (4, 4, 3)], torch.float32, "cpu", seed=3, scale=5.0)
    ref = clone_params(params)
    ours = clone_params(params)
    with fastgrad.patch_torch():
        if call == "positional":
            total = UTILS.clip_grad_norm_(ours, 1.0, 2.0, False, None)
            total_f = fastgrad.clip_grad_norm_(ref, 1.0, 2.0, False, None)
            norm = UTILS.get_total_norm(grads(ours), 1.0, False, None)
            UTILS.clip_grads_with_norm_(ours, 0.5, norm, None)
            CLIP.clip_grad_value_(ours, 0.01, None)
        else:
            total = CLIP.clip_grad_norm_(parameters=ours, max_norm=1.0, norm_type=2.0, error_if_nonfinite=False,
                                         foreach=None)
            total_f = fastgrad.clip_grad_norm_(ref, max_norm=1.0)
            norm = UTILS.get_total_norm(tensors=grads(ours), norm_type=1.0, error_if_nonfinite=False)
            UTILS.clip_grads_with_norm_(parameters=ours, max_norm=0.5, total_norm=norm, foreach=None)
            UTILS.clip_grad_value_(parameters=ours, clip_value=0.01, foreach=None)
        with pytest.raises(RuntimeError, match="non-finite"):  # torch's error, from fastgrad
            bad = clone_params(params)
            bad[0].grad[0, 0] = float("inf")
            UTILS.clip_grad_norm_(bad, 1.0, error_if_nonfinite=True)
    fastgrad.clip_grads_with_norm_(ref, 0.5, fastgrad.get_total_norm(grads(ref), 1.0))
    fastgrad.clip_grad_value_(ref, 0.01)
    assert torch.equal(total, total_f) and total.dtype == torch.float32 and total.dim() == 0
    for g, gr in zip(grads(ours), grads(ref)):
        assert torch.equal(g, gr)
    # and they match torch's own functions within the contract's fp32 tolerance (docs/contract.md section 3)
    theirs = clone_params(params)
    total_t = patch.TORCH.clip_grad_norm_(theirs, 1.0)
    torch.testing.assert_close(total, total_t, rtol=1e-6, atol=0)


def test_routers_count_calls_and_reach_fastgrad_clip_at_call_time(monkeypatch):
    seen = []
    real = fastgrad.clip.clip_grad_value_
    monkeypatch.setattr(fastgrad.clip, "clip_grad_value_", lambda *a, **k: seen.append((a, k)) or real(*a, **k))
    p = make_params([(5,)], torch.float32, "cpu", seed=4)
    with fastgrad.patch_torch():
        before = patch.call_counts()["clip_grad_value_"]
        UTILS.clip_grad_value_(p, 0.1)
        CLIP.clip_grad_value_(p, clip_value=0.1)
        assert patch.call_counts()["clip_grad_value_"] == before + 2
    assert len(seen) == 2 and seen[1][1] == {"clip_value": 0.1}
    with fastgrad.patch_torch(), pytest.warns(FutureWarning):
        before = patch.call_counts()["clip_grad_norm_"]
        UTILS.clip_grad_norm(p, 1.0)  # torch's deprecated alias looks clip_grad_norm_ up in clip_grad: routed too
        assert patch.call_counts()["clip_grad_norm_"] == before + 1
    UTILS.clip_grad_value_(p, 0.1)  # unpatched: torch's own, not fastgrad
    assert len(seen) == 2


def test_fallbacks_under_patch_call_torchs_originals_not_the_routers():
    """Complex grads go through fastgrad's torch fallback: under the patch that must be torch's captured
    function, or the call would recurse (router -> fastgrad -> router -> ...)."""
    p = torch.nn.Parameter(torch.randn(6, dtype=torch.complex64))
    p.grad = torch.randn(6, dtype=torch.complex64) * 4
    ref = clone_params([p])
    total_t = patch.TORCH.clip_grad_norm_(ref, 0.5)
    norm_t = patch.TORCH.get_total_norm(grads(clone_params([p])), 2.0)
    value_ref = clone_params([p])
    with fastgrad.patch_torch():
        norm = UTILS.get_total_norm(grads(clone_params([p])), 2.0)
        total = UTILS.clip_grad_norm_([p], 0.5)
        UTILS.clip_grads_with_norm_([p], 0.5, total)  # already clipped: coef ~1
        s = torch.nn.Parameter(torch.randn(5))
        s.grad = torch.randn(5).to_sparse()
        with pytest.raises(NotImplementedError):  # torch's own error for sparse COO, not RecursionError
            CLIP.clip_grad_norm_([s], 0.5)
        with pytest.raises(NotImplementedError):
            UTILS.clip_grad_value_([s], 0.1)
        with pytest.raises(NotImplementedError):
            UTILS.clip_grad_value_(value_ref, 0.1)  # clamp of complex: torch raises too
    torch.testing.assert_close(total, total_t)
    torch.testing.assert_close(norm, norm_t)
    patch.TORCH.clip_grads_with_norm_(ref, 0.5, total_t)
    torch.testing.assert_close(p.grad, ref[0].grad)


def test_fastgrad_reimported_while_patched_still_captures_torchs_functions():
    fastgrad.patch_torch()
    routed = UTILS.clip_grad_norm_
    saved = {k: v for k, v in sys.modules.items() if k == "fastgrad" or k.startswith("fastgrad.")}
    try:
        for k in saved:
            del sys.modules[k]
        fresh = importlib.import_module("fastgrad.patch")
        assert fresh.TORCH.clip_grad_norm_ is patch.TORCH.clip_grad_norm_
        assert fresh.TORCH.clip_grad_norm_ is not routed
    finally:
        for k in [k for k in sys.modules if k == "fastgrad" or k.startswith("fastgrad.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_import_time_bindings_follow_the_documented_rule():
    """A module that bound ``from torch.nn.utils import clip_grad_norm_`` before the patch keeps torch's
    function (hence: patch before importing such code); one bound while patched gets fastgrad's."""
    early = types.ModuleType("early")
    exec("from torch.nn.utils import clip_grad_norm_", early.__dict__)
    with fastgrad.patch_torch():
        late = types.ModuleType("late")
        exec("from torch.nn.utils import clip_grad_norm_", late.__dict__)
        assert early.clip_grad_norm_ is patch.TORCH.clip_grad_norm_
        assert late.clip_grad_norm_ is UTILS.clip_grad_norm_ and late.clip_grad_norm_.__wrapped__ is fastgrad.clip_grad_norm_


def test_info_status_line():
    assert patch.describe().startswith("not patched")
    with fastgrad.patch_torch():
        p = make_params([(5,)], torch.float32, "cpu", seed=5)
        n = patch.call_counts()["clip_grad_norm_"]
        UTILS.clip_grad_norm_(p, 1.0)
        line = patch.describe()
        assert line.startswith("patched:") and f"clip_grad_norm_ ({n + 1} calls)" in line
        for name in patch.NAMES:
            assert name in line
    assert patch.describe().startswith("not patched")


def test_patched_call_traces_under_torch_compile_fullgraph():
    """A compiled training step that calls torch.nn.utils.clip_grad_norm_ keeps working when patched: the
    router adds no graph break, and the call still counts and gives fastgrad's eager result."""
    params = make_params([(7, 3), (33,)], torch.float32, "cpu", seed=6, scale=5.0)
    eager = clone_params(params)
    with fastgrad.patch_torch():
        step = torch.compile(lambda ps: UTILS.clip_grad_norm_(ps, 1.0), fullgraph=True, backend="aot_eager")
        n = patch.call_counts()["clip_grad_norm_"]
        total = step(params)
        assert patch.call_counts()["clip_grad_norm_"] == n + 1
    total_e = fastgrad.clip_grad_norm_(eager, 1.0)
    torch.testing.assert_close(total, total_e, rtol=1e-6, atol=0)
    for g, ge in zip(grads(params), grads(eager)):
        torch.testing.assert_close(g, ge, rtol=1e-6, atol=0)
