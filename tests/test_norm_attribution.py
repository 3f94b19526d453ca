"""``norm_miscounted``'s attribution on hand-built records: the smallest set of parameters, with how many times
each is counted, whose miscounting gives a script's norm within float32 rounding.

Each script norm here is computed in float64 from the values themselves the way the buggy script counts them
(not from the rule's own sums), and the truth from the values each counted once. The multi-process scripts
that produce such records for real are in tests/test_check_partial.py."""

import math

import pytest
import torch

from fastgrad.diagnose.rules.base import RunView
from fastgrad.diagnose.rules.norm_miscounted import NORM_MISCOUNTED, Entry, attribute, copy_weights, tolerance


def _e(name, values, kind=None):
    t = torch.tensor(values, dtype=torch.float32)
    return Entry(name, None, float(t.double().pow(2).sum()), t.numel(),
                 (tuple(t.shape), str(t.dtype), hash(t.numpy().tobytes())), kind)


def _vals(seed, n):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.3).tolist()


def _sq(values) -> float:
    return math.fsum(v * v for v in torch.tensor(values, dtype=torch.float32).double().tolist())


def _norm(*parts) -> float:
    """sqrt of (values, times) pairs: each value list's square counted ``times`` times."""
    return math.sqrt(math.fsum(k * _sq(v) for v, k in parts))


def _tol(ranks):
    return tolerance(sum(e.numel for r in ranks for e in r), sum(len(r) for r in ranks) + len(ranks))


def _finding(ranks, s, groups, max_norm=None):
    call = {"step": 1, "ranks": [{"entries": r, "norm": s, "dtype": "torch.float32", "max_norm": max_norm,
                                  "groups": g} for r, g in zip(ranks, groups)]}
    out = NORM_MISCOUNTED.evaluate(RunView(steps=[], ctx={"ranks": [call]}))
    assert len(out) == 1
    return out[0]


def _tp2():
    """tp=2 on 2 ranks: a LayerNorm and a row-parallel bias whole on both, a column-parallel weight split."""
    v = {"ln.weight": _vals(1, 6), "ln.bias": _vals(2, 6), "fc2.bias": _vals(3, 4),
         "fc1.weight.0": _vals(4, 12), "fc1.weight.1": _vals(5, 12), "fc2.weight.0": _vals(6, 8),
         "fc2.weight.1": _vals(7, 8)}
    kinds = {"ln": "LayerNorm", "fc1": "Linear", "fc2": "Linear"}
    ranks = [[_e(n, v[n], kinds[n.split(".")[0]]) for n in ("ln.weight", "ln.bias", "fc2.bias")]
             + [_e("fc1.weight", v[f"fc1.weight.{r}"], "Linear"), _e("fc2.weight", v[f"fc2.weight.{r}"], "Linear")]
             for r in range(2)]
    return ranks, v, [[[0, 1]]] * 2


def test_one_replicated_bias_counted_twice_is_named_alone():
    ranks, v, groups = _tp2()
    s = _norm((v["ln.weight"], 1), (v["ln.bias"], 1), (v["fc2.bias"], 2), *[(v[k], 1) for k in v if k[-1].isdigit()])  # the shards once
    f = _finding(ranks, s, groups, max_norm=0.01)
    assert f.layers == ["fc2.bias"] and f.severity == "warning"
    (x,) = f.evidence["explanations"]
    assert x["units"]["fc2.bias"]["times"] == pytest.approx(2.0)
    true = _norm(*[(v[k], 1) for k in v])
    assert f.evidence["factor"] == pytest.approx(s / true, rel=1e-12)
    # the factor this bias alone accounts for: the norm with only it counted twice, over the truth
    assert x["units"]["fc2.bias"]["factor"] == pytest.approx(s / true, rel=1e-12)
    assert "fc2.bias counted 2 times" in f.detail and not f.evidence["ambiguous"]


def test_one_sharded_weight_counted_on_rank_0_only_names_the_missing_shard():
    ranks, v, groups = _tp2()
    s = _norm(*[(v[k], 1) for k in v if k != "fc1.weight.1"])  # the weight marked replicated by mistake
    f = _finding(ranks, s, groups)
    assert f.layers == ["fc1.weight"] and f.evidence["under"] == {"fc1.weight": pytest.approx(
        _sq(v["fc1.weight.0"]) / (_sq(v["fc1.weight.0"]) + _sq(v["fc1.weight.1"])))}
    assert f.evidence["missing_ranks"] == {"fc1.weight": [1]} and f.severity == "notice"


def test_two_parameters_mis_counted_two_ways_are_found_together():
    ranks, v, groups = _tp2()
    # the bias twice AND the column-parallel weight's rank-1 shard missing: no single parameter, no structure
    s = _norm(*[(v[k], 2 if k == "fc2.bias" else 1) for k in v if k != "fc1.weight.1"])
    f = _finding(ranks, s, groups)
    assert sorted(f.layers) == ["fc1.weight", "fc2.bias"]
    (x,) = f.evidence["explanations"]
    assert x["units"]["fc2.bias"]["times"] == pytest.approx(2.0) and x["units"]["fc1.weight"]["missing"] == [1]


def test_every_layernorm_counted_twice_is_named_by_module_type():
    # sequence parallelism: two LayerNorms' gradients summed over tp, then counted on both tp ranks; the
    # replicated bias right. Four parameters: only the module-type candidate names them (pairs stop at two).
    v = {n: _vals(10 + k, 6) for k, n in enumerate(["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"])}
    v["fc2.bias"] = _vals(20, 4)
    shard = {r: _vals(30 + r, 16) for r in range(2)}
    ranks = [[_e(n, x, "LayerNorm" if n.startswith("ln") else "Linear") for n, x in v.items()]
             + [_e("fc1.weight", shard[r], "Linear")] for r in range(2)]
    s = _norm(*[(x, 2 if n.startswith("ln") else 1) for n, x in v.items()], (shard[0], 1), (shard[1], 1))
    f = _finding(ranks, s, [[[0, 1]]] * 2)
    assert f.layers == ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"]
    assert f.evidence["model"] == "every LayerNorm tensor counted 2 times"
    assert f.evidence["over"] == {n: pytest.approx(2.0) for n in f.layers}


def _ep4():
    """4 ranks, world: experts sharded over every rank, a router and a shared expert's two weights replicated
    on every rank; groups: tp pairs [0, 1], [2, 3]."""
    rep = {"router.weight": _vals(40, 8), "shared.w1": _vals(41, 12), "shared.w2": _vals(42, 12)}
    exp = {r: _vals(50 + r, 10) for r in range(4)}
    kinds = {"router.weight": "Router", "shared.w1": "Linear", "shared.w2": "Linear"}
    ranks = [[_e(n, x, kinds[n]) for n, x in rep.items()] + [_e("experts.0.w1", exp[r], "Expert")]
             for r in range(4)]
    groups = [[[0, 1, 2, 3], [0, 1] if r < 2 else [2, 3]] for r in range(4)]
    return ranks, rep, exp, groups


def test_replicated_tensors_counted_on_every_tp_rank_is_the_replicated_family():
    ranks, rep, exp, groups = _ep4()
    # the experts summed right over the world, every replicated tensor counted on both ranks of the tp pair
    s = _norm(*[(x, 2) for x in rep.values()], *[(x, 1) for x in exp.values()])
    f = _finding(ranks, s, groups)
    assert f.layers == list(rep) and f.evidence["model"] == (
        "every replicated tensor counted once per copy on ranks [0, 1]")
    assert f.evidence["over"] == {n: pytest.approx(2.0) for n in rep}


def test_one_groups_sharded_tensors_left_to_rank_0_is_the_group_family():
    # 2 (ep) x 2 (dp): experts sharded over the ep pairs [0, 1] / [2, 3] (each pair a dp replica of the other),
    # a dense weight sharded over dp [0, 2] / [1, 3] (ep ranks hold it alike). The script forgot the ep
    # all-reduce: rank 1's experts are missing. Rank 0's own gradients miss rank 2's dense shard too.
    exp = {r: [_vals(60 + 3 * r + k, 6) for k in range(3)] for r in range(2)}
    dense = {d: _vals(70 + d, 10) for d in range(2)}
    ranks = [[_e(f"experts.0.w{k + 1}", exp[r % 2][k], "Expert") for k in range(3)]
             + [_e("dense.weight", dense[r // 2], "Linear")] for r in range(4)]
    groups = [[[0, 1, 2, 3], [0, 1] if r < 2 else [2, 3], [r % 2, r % 2 + 2]] for r in range(4)]
    s = _norm(*[(x, 1) for x in exp[0]], (dense[0], 1), (dense[1], 1))
    f = _finding(ranks, s, groups)
    assert f.layers == ["experts.0.w1", "experts.0.w2", "experts.0.w3"]
    assert f.evidence["model"].startswith("the tensors sharded over ranks [0, 1] counted on rank 0 only")
    assert f.evidence["missing_ranks"] == {n: [1] for n in f.layers}


def test_sets_that_explain_equally_well_are_all_listed():
    # two LayerNorm weights with the same square (the same values on different parameters): either one
    # counted twice gives the norm
    w = _vals(80, 6)
    other = _vals(81, 5)
    ranks = [[_e("a.weight", w), _e("b.weight", list(reversed(w))), _e("c.weight", other)] for _ in range(2)]
    s = _norm((w, 3), (other, 1))
    f = _finding(ranks, s, [[[0, 1]]] * 2)
    assert f.evidence["ambiguous"] and {tuple(x["units"]) for x in f.evidence["explanations"]} == {
        ("a.weight",), ("b.weight",)}
    assert "equally well" in f.detail and sorted(f.layers) == ["a.weight", "b.weight"]


def test_of_two_sets_that_give_the_norm_the_smaller_is_named():
    # a.weight (a Scale module's) is sharded over the 2 ranks; b.weight and d.weight, replicated, hold the
    # same squares as its two shards. "Every Scale tensor counted twice" (a alone) and "every replicated tensor
    # counted once per copy" (b and d) give the same norm: the one naming fewer parameters is reported.
    shard = [_vals(82, 6), _vals(83, 6)]
    ranks = [[_e("a.weight", shard[r], "Scale"), _e("b.weight", shard[0][::-1], "Linear"),
              _e("d.weight", shard[1][::-1], "Linear")] for r in range(2)]
    s = _norm((shard[0], 2), (shard[1], 2), (shard[0], 1), (shard[1], 1))
    f = _finding(ranks, s, [[[0, 1]]] * 2)
    assert f.layers == ["a.weight"] and f.evidence["model"] == "every Scale tensor counted 2 times"


def test_a_number_nothing_explains_names_nothing():
    ranks, v, groups = _tp2()
    s = 1.37 * _norm(*[(v[k], 1) for k in v])
    f = _finding(ranks, s, groups)
    assert f.layers == [] and not f.evidence["explanations"] and "not named" in f.detail


def test_a_near_miss_within_ten_tolerances_is_never_named():
    # the script counts p twice and leaves q out. A third parameter r, counted twice, lands 5 tolerances away
    # from the same norm: a rule taking 10x its tolerance would name r alone (a smaller set) instead of p and q.
    p, q, b0, b1 = _vals(90, 6), _vals(91, 3), _vals(92, 40), _vals(93, 40)
    ranks = [[_e("p", p), _e("q", q), _e("base", b)] for b in (b0, b1)]
    tol = _tol([x + [_e("r", [1.0])] for x in ranks])
    t0, d = _sq(p) + _sq(q) + _sq(b0) + _sq(b1), _sq(p) - _sq(q)
    c = (1 + 5 * tol) ** 2 - 1
    r = [math.sqrt((c * t0 + (1 + c) * d) / (1 - c))]  # t0 + 2 r^2 = (1 + 5 tol)^2 (t0 + r^2 + d)
    ranks = [x + [_e("r", r)] for x in ranks]
    true_sq = t0 + _sq(r)
    s = math.sqrt(true_sq + d)
    off = math.sqrt(true_sq + _sq(r)) / s - 1
    assert 4 * tol < off < 6 * tol  # r counted twice: within 10 tolerances, not within one
    f = _finding(ranks, s, [[[0, 1]]] * 2)
    assert sorted(f.layers) == ["p", "q"]
    x = f.evidence["explanations"][0]["units"]
    assert x["p"]["times"] == pytest.approx(2.0) and x["q"]["times"] == 0


def test_attribute_never_returns_a_set_off_the_norm():
    ranks, v, groups = _tp2()
    w = copy_weights(ranks)
    true_sq = math.fsum(e.sq * k for r, ws in zip(ranks, w) for e, k in zip(r, ws))
    for factor in (0.5, 0.93, 1.01, 1.2, 1.5, 2.0):
        s = factor * math.sqrt(true_sq)
        for x in attribute(ranks, s, groups[0], 1e-6, w):
            got = true_sq + math.fsum(
                (u["times"] - 1) * math.fsum(e.sq * k for r, ws in zip(ranks, w) for e, k in zip(r, ws)
                                             if e.name == name) for name, u in x["units"].items())
            assert abs(math.sqrt(got) / s - 1) <= 1e-6


def _flat(name, values):
    e = _e(name, values)
    return Entry(e.name, None, e.sq, e.numel, e.key, None, True)


def test_an_undeclared_flat_partition_is_a_named_cannot_tell_never_a_warning():
    # ZeRO over 2 ranks of a tp model: each rank's partition holds a replicated LayerNorm's slice (the same on
    # both) next to other elements; the right norm counts the LayerNorm once, the byte rule twice
    ln, rest = _vals(100, 6), {r: _vals(101 + r, 10) for r in range(2)}
    ranks = [[_flat("flat_partition", ln + rest[r])] for r in range(2)]
    right = _norm((ln, 1), (rest[0], 1), (rest[1], 1))
    f = _finding(ranks, right, [[[0, 1]]] * 2, max_norm=0.01)
    assert f.severity == "notice" and f.layers == ["flat_partition"] and "cannot tell" in f.title
    assert f.evidence["cannot_tell"] == ["flat_partition"] and not f.evidence["explanations"]
    assert "fastgrad.distributed.Partition" in f.detail
    # the same elements as declared slices (what check records from a Partition): the right norm is silent
    split = [[_e("ln.weight", ln), _e("fc.weight", rest[r])] for r in range(2)]
    call = {"step": 1, "ranks": [{"entries": r, "norm": right, "dtype": "torch.float32", "max_norm": 0.01,
                                  "groups": [[0, 1]]} for r in split]}
    assert NORM_MISCOUNTED.evaluate(RunView(steps=[], ctx={"ranks": [call]})) == []
    # a flat buffer the ranks hold alike (a data-parallel replica) is one tensor in copies: judged as usual
    same = [[_flat("flat_grads", rest[0])] for _ in range(2)]
    f = _finding(same, _norm((rest[0], 2)), [[[0, 1]]] * 2)
    assert f.layers == ["flat_grads"] and f.evidence["over"] == {"flat_grads": pytest.approx(2.0)}
