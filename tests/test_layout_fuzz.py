"""The layout fuzz in the suite (tests/layout_fuzz.py: what each layout is and what it checks): 56 seeded layouts
on 2 to 8 gloo ranks, from one launch of 8 processes that re-join a group of each world size in turn, one test
per world size. A failing layout's message holds the command that replays it alone."""

from __future__ import annotations

import collections
import shutil
import tempfile

import pytest
import torch

from . import layout_fuzz as fuzz

dist = torch.distributed
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")
WALL_LIMIT_S = 780  # (below pytest-timeout's 900 s per test: the launcher reports which layouts did not run)


@pytest.fixture(scope="module")
def fuzzed():
    root = tempfile.mkdtemp(prefix="fastgrad-fuzz-")
    error = fuzz.launch(fuzz.default_plan(), root, WALL_LIMIT_S)
    yield root, error
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("world", fuzz.WORLDS)
def test_layouts_count_every_element_once(fuzzed, world):
    root, error = fuzzed
    bad = []
    for seed in fuzz.default_plan()[world]:
        state, text = fuzz.outcome(root, world, seed)
        if state != "ok":
            bad.append(f"seed {seed} {state}: {text or error or 'an earlier layout of this world failed'}\n"
                       f"  replay: {fuzz.replay_line(world, seed)}")
    assert not bad, "\n".join(bad)


def test_the_plan_covers_every_family_on_many_worlds():
    """At least 50 layouts, every world from 2 to 8, every family on at least 4 of them."""
    plan = fuzz.default_plan()
    assert sorted(plan) == list(range(2, 9)) and sum(map(len, plan.values())) >= 50
    worlds = collections.defaultdict(set)
    for world, seeds in plan.items():
        for seed in seeds:
            worlds[fuzz.family(world, seed)].add(world)
    assert set(worlds) == set(fuzz.FAMILIES)
    assert all(len(w) >= 4 for w in worlds.values()), {f.__name__: sorted(w) for f, w in worlds.items()}


def test_exact_norm_of_no_tensor():
    """A rank holding no tensor rounds zero rows of per-tensor digits (found by the fuzz: an empty rank's
    ``multi_tensor_norm(per_tensor=True, exact=True)`` raised in the rounding)."""
    from fastgrad import exact

    for p in (2.0, 1.0):
        nl = exact._WINDOWS[p][1]
        out = exact.finish(torch.zeros((0, nl), dtype=torch.int64), torch.zeros((0, 2), dtype=torch.int64), p,
                           torch.float32)
        assert out.shape == (0,) and out.dtype == torch.float32
