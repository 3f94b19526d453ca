"""``python -m fastgrad.check`` on multi-process scripts (gloo, CPU): the norm a script clips with against the
true norm of its gradients, each element counted once (``norm_miscounted``).

The counting rule and the tolerance are tested on hand-built records against their nearest wrong variants;
the scripts of tests/check_scripts/dist_*.py (each one launch: ``--nproc`` or ``torchrun``) against the truth
each computes on rank 0 from the whole model's gradients gathered there, in float64."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastgrad.diagnose.rules.base import RunView
from fastgrad.diagnose.rules.norm_miscounted import NORM_MISCOUNTED, Entry, copy_weights, explain, tolerance

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "check_scripts"


# ------------------------------------------------------------------------------ the rule on hand-built records
def _plain(name, values, dtype=torch.float32):
    t = torch.tensor(values, dtype=dtype)
    return Entry(name, None, float(t.double().pow(2).sum()), t.numel(),
                 (tuple(t.shape), str(t.dtype), hash(t.numpy().tobytes())))


def _dt(name, values, counted):
    t = torch.tensor(values)
    return Entry(name, counted, float(t.double().pow(2).sum()), t.numel(), None)


def _call(ranks, norms, groups=None, max_norm=None, step=1):
    world = len(ranks)
    groups = groups or [[list(range(world))]] * world
    return {"step": step, "ranks": [{"entries": e, "norm": n, "dtype": "torch.float32", "max_norm": max_norm,
                                     "groups": g} for e, n, g in zip(ranks, norms, groups)]}


def _findings(calls):
    run = RunView(steps=[], ctx={"ranks": calls})
    return NORM_MISCOUNTED.evaluate(run), run


def test_copy_weights_counts_each_tensor_once():
    # 3 ranks: a replica on every rank, shards that differ, two equal tensors on one rank (two tensors) whose
    # copies sit on rank 1, a DTensor whose placements count it on rank 0 only
    rep = [0.5, -1.5]
    ranks = [[_plain("rep", rep), _plain("shard", [1.0, 2.0]), _plain("twin", [3.0]), _plain("twin2", [3.0]),
              _dt("dt", [2.0], True)],
             [_plain("rep", rep), _plain("shard", [4.0, 5.0]), _plain("twin", [3.0]), _plain("twin2", [3.0]),
              _dt("dt", [2.0], False)],
             [_plain("rep", rep), _plain("shard", [6.0, 7.0]), _dt("dt", [2.0], False)]]
    w = copy_weights(ranks)
    assert w == [[1, 1, 1, 1, 1], [0, 1, 0, 0, 0], [0, 1, 0]]
    # the true norm: the gathered model once, in float64
    whole = torch.tensor(rep + [1.0, 2.0, 4.0, 5.0, 6.0, 7.0, 3.0, 3.0, 2.0], dtype=torch.float64)
    e = explain(ranks, [1.0, 1.0, 1.0], [[[0, 1, 2]]] * 3)
    assert e["true"] == pytest.approx(float(whole.norm()), rel=1e-15)
    # its nearest wrong variants give other numbers: every copy counted, rank 0's alone
    every = math.sqrt(sum(x.sq for r in ranks for x in r))
    first = math.sqrt(sum(x.sq for x in ranks[0]))
    assert abs(every - e["true"]) > 0.1 and abs(first - e["true"]) > 0.1


def test_over_and_under_counting_are_named_with_their_factor():
    # tp=2: a LayerNorm whole on both ranks, a weight split in two
    ln = [0.75, -0.5, 0.25]  # (exact in float32: 0.875 squared)
    ranks = [[_plain("ln.weight", ln), _plain("fc.weight", [1.0, 2.0])],
             [_plain("ln.weight", ln), _plain("fc.weight", [3.0, -1.0])]]
    true = math.sqrt(0.875 + 1 + 4 + 9 + 1)
    summed = math.sqrt(2 * 0.875 + 15)  # every rank's squares, all-reduced: the LayerNorm twice
    (f,), run = _findings([_call(ranks, [summed, summed], max_norm=1.0)])
    assert f.code == "norm_miscounted" and f.severity == "warning" and f.layers == ["ln.weight"]
    assert f.evidence["factor"] == pytest.approx(summed / true, rel=1e-12)
    assert f.evidence["over"] == {"ln.weight": pytest.approx(2.0)} and not f.evidence["under"]
    assert run.ctx["rank_norms"][0]["differs"]
    local = [math.sqrt(0.875 + 5), math.sqrt(0.875 + 10)]  # each rank's own: the other shard missing
    (f,), _ = _findings([_call(ranks, local, max_norm=100.0)])
    assert f.severity == "notice" and f.layers == ["fc.weight"] and not f.evidence["over"]
    assert f.evidence["under"] == {"fc.weight": pytest.approx(5 / 15)} and f.evidence["missing_ranks"] == {"fc.weight": [1]}
    assert f.evidence["factors"] == pytest.approx([local[0] / true, local[1] / true], rel=1e-12)
    # the truth: nothing
    assert _findings([_call(ranks, [true, true], max_norm=1.0)])[0] == []


def test_a_tied_pair_named_apart_is_one_parameter():
    emb = [0.5, 0.25, -1.0]
    ranks = [[_plain("embed.weight", emb), _plain("inner.weight", [1.0])],
             [_plain("outer.weight", [2.0]), _plain("head.weight", emb)]]
    s = math.sqrt(2 * 1.3125 + 5)
    (f,), _ = _findings([_call(ranks, [s, s])])
    assert f.layers == ["embed.weight = head.weight"] and f.severity == "notice"  # no bound: nothing clipped


def _sequential_f32_norm(values) -> float:
    """A hand-written float32 norm: each tensor's square added to a float32 running sum, one after another."""
    sq = torch.zeros((), dtype=torch.float32)
    for v in values:
        sq = sq + torch.tensor([v], dtype=torch.float32).pow(2).sum()
    return float(sq.sqrt())


def test_tolerance_passes_float32_rounding_and_catches_a_small_miscount():
    # float32 at its worst: 1, then 199 squares just below half an ulp of 1, each lost by the running sum
    # (the script is right; its float32 sum is not): half the tolerance
    tiny = math.sqrt(0.99 * 2.0 ** -24)
    values = [1.0] + [tiny] * 199
    ranks = [[_plain(f"p{i}", [v]) for i, v in enumerate(values)], [_plain(f"p{i}", [v]) for i, v in enumerate(values)]]
    s = _sequential_f32_norm(values)
    e = explain(ranks, [s, s], [[[0, 1]]] * 2)
    off = abs(s / e["true"] - 1)
    tol = tolerance(e["numel"], e["terms"])
    assert tol / 10 < off < tol  # a tolerance 10x tighter would call this right script wrong
    assert _findings([_call(ranks, [s, s])])[0] == []
    # a small real over-count: a tiny tensor held on both ranks, summed twice, 3 tolerances off the truth
    big = [[_plain("w", [3.0, 4.0])], [_plain("w", [5.0, 12.0])]]
    t2 = 25.0 + 169.0
    eps = 6 * tolerance(6, 6) * t2  # (1 + eps / t2) ** 0.5 - 1 = 3 tolerances
    b = [math.sqrt(eps)]
    ranks = [big[0] + [_plain("b", b)], big[1] + [_plain("b", b)]]
    s = math.sqrt(t2 + 2 * eps)
    (f,), _ = _findings([_call(ranks, [s, s])])
    assert f.layers == ["b"] and 2 * f.evidence["tolerance"] < f.evidence["factor"] - 1 < 10 * f.evidence["tolerance"]


def test_tolerance_grows_with_elements_terms_and_the_norms_dtype():
    assert tolerance(2 ** 20, 10) == pytest.approx(2.0 ** -24 * (20 + 10 + 1) + 2 * 2.0 ** -24)
    assert tolerance(2 ** 20, 10) < tolerance(2 ** 30, 10) < tolerance(2 ** 30, 1000)
    assert tolerance(100, 4, "torch.bfloat16") > 2 * 2.0 ** -8


# ------------------------------------------------------------------------------ the scripts, one launch each
# name: (launcher, ranks, script, args)
RUNS = {
    "tp_sum": ("nproc", 4, "dist_tp_mlp.py", ["--norm", "tp-sum"]),
    "tp_local": ("nproc", 2, "dist_tp_mlp.py", ["--norm", "local", "--max-norm", "1000"]),
    "pipe_stages": ("nproc", 2, "dist_pipeline_tied.py", ["--norm", "stages"]),
    "pipe_copies": ("nproc", 2, "dist_pipeline_tied.py", ["--norm", "copies"]),
    "ddp": ("torchrun", 2, "dist_ddp_clip.py", []),
    "fsdp2": ("nproc", 2, "dist_fsdp2_clip.py", []),
    # partial mis-counts (slow: one launch each)
    "tp_bias_twice": ("nproc", 2, "dist_tp_mlp.py", ["--norm", "bias-twice", "--steps", "3"]),
    "tp_bias_twice_2x2": ("nproc", 4, "dist_tp_mlp.py", ["--norm", "bias-twice", "--steps", "3"]),
    "tp_shard_missed": ("nproc", 2, "dist_tp_mlp.py", ["--norm", "shard-missed", "--steps", "3"]),
    "tp_right_2x2": ("nproc", 4, "dist_tp_mlp.py", ["--norm", "right", "--steps", "3"]),
    "sp_ln_twice": ("nproc", 2, "dist_tp_mlp.py", ["--sp", "--norm", "ln-twice", "--steps", "3"]),
    "sp_right_2x2": ("nproc", 4, "dist_tp_mlp.py", ["--sp", "--norm", "right", "--steps", "3"]),
    "ep_router": ("nproc", 2, "dist_moe_ep.py", ["--norm", "router-twice"]),
    "ep_shared": ("nproc", 2, "dist_moe_ep.py", ["--norm", "shared-twice"]),
    "ep_local": ("nproc", 2, "dist_moe_ep.py", ["--norm", "experts-local"]),
    "ep_right": ("nproc", 2, "dist_moe_ep.py", ["--norm", "right"]),
    "zero_deepspeed": ("nproc", 4, "dist_zero_tp.py", ["--norm", "deepspeed"]),
    "zero_declared": ("nproc", 4, "dist_zero_tp.py", ["--norm", "declared"]),
    "zero_declared_sum": ("nproc", 4, "dist_zero_tp.py", ["--norm", "declared-sum"]),
    "vocab_embedding": ("nproc", 2, "dist_vocab_embedding.py", []),
}


#: What a gloo rank prints when a thread of its own outlives the process group at exit: the run's work is done
#: and written, its teardown aborted. Seen once in CI on a loaded machine (a plain run, no fastgrad in it).
_TEARDOWN_ABORT = "terminate called without an active exception"


def _launch(cmd, **kw):
    """Run a multi-process command; run it once more only when gloo's teardown aborted, never for any other
    failure (a real failure fails the same way twice)."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, **kw)
    if p.returncode != 0 and _TEARDOWN_ABORT in p.stderr:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, **kw)
    return p


class _Runs:
    def __init__(self, base: Path):
        self.base, self.done = base, {}

    def __getitem__(self, name):
        if name not in self.done:
            self.done[name] = self._run(name)
        return self.done[name]

    def _run(self, name):
        how, n, script, args = RUNS[name]
        base = self.base
        truth, out = base / f"{name}.truth.json", base / name
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   FG_TRUTH=str(truth), OMP_NUM_THREADS="1")
        check = ["-m", "fastgrad.check", "--out", str(out), str(SCRIPTS / script), *args]
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), *check]
               if how == "torchrun" else [sys.executable, check[0], check[1], "--nproc", str(n), *check[2:]])
        p = _launch(cmd, cwd=base, env=env)
        rep = out / "report.json"
        return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr,
                "json": json.loads(rep.read_text()) if rep.exists() else None,
                "truth": json.loads(truth.read_text()) if truth.exists() else None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _Runs(tmp_path_factory.mktemp("check_dist"))


def _miscounted(r):
    assert r["json"] is not None, r["stderr"][-3000:]
    return next((f for f in r["json"]["findings"] if f["code"] == "norm_miscounted"), None)


def _factor_at(r, step):
    row = next(x for x in r["truth"]["steps"] if x["step"] == step)
    return row["script"] / row["true"], row


def test_tp_replicated_layernorm_and_bias_summed_tp_times(runs):
    r = runs["tp_sum"]
    f = _miscounted(r)
    assert f is not None and f["severity"] == "warning" and r["rc"] == 0
    want, row = _factor_at(r, f["steps"][0])
    assert f["evidence"]["factor"] == pytest.approx(want, rel=1e-6)
    assert f["evidence"]["true_norm"] == pytest.approx(row["true"], rel=1e-6)
    assert f["evidence"]["factors"] == pytest.approx([want] * 4, rel=1e-6)  # every rank's tp sum is the same
    assert f["layers"] == ["ln.weight", "ln.bias", "fc2.bias"] and not f["evidence"]["under"]
    assert f["evidence"]["over"] == {k: pytest.approx(2.0) for k in f["layers"]}
    assert "summed over ranks [0, 1]" in f["detail"]  # the tensor-parallel group, not the world
    assert f["steps"] == [1, 2, 3, 4, 5] and f["evidence"]["harm"] == ["clip"]
    assert r["json"]["findings"][0]["code"] == "norm_miscounted"  # the cause, first
    assert "Copies(dist.group.WORLD" in r["stdout"]
    assert r["stdout"].count("## Gradient Health Report") == 1  # one report: rank 0's


def test_tp_local_norm_under_counts_the_other_ranks_shards(runs):
    r = runs["tp_local"]
    f = _miscounted(r)
    assert f is not None and f["severity"] == "notice"  # max_norm 1000: neither norm reached it
    want, row = _factor_at(r, f["steps"][0])
    assert f["evidence"]["factor"] == pytest.approx(want, rel=1e-6) and want < 1
    assert f["layers"] == ["fc1.weight", "fc1.bias", "fc2.weight"] and not f["evidence"]["over"]
    assert f["evidence"]["missing_ranks"] == {k: [1] for k in f["layers"]}
    assert "its own gradients only" in f["detail"]


def test_pipeline_tied_embedding_counted_on_both_stages(runs):
    r = runs["pipe_stages"]
    f = _miscounted(r)
    assert f is not None and f["severity"] == "warning"
    want, _ = _factor_at(r, f["steps"][0])
    assert f["evidence"]["factor"] == pytest.approx(want, rel=1e-6)
    assert f["layers"] == ["embed.weight = head.weight"]
    assert f["evidence"]["over"] == {"embed.weight = head.weight": pytest.approx(2.0)}


@pytest.mark.parametrize("name", ["pipe_copies", "ddp", "fsdp2"])
def test_correct_scripts_raise_no_alarm(runs, name):
    r = runs[name]
    assert _miscounted(r) is None and r["rc"] == 0, r["stderr"][-3000:]
    compared = r["json"]["rank_norms"]
    assert len(compared) == 5 and not any(c["differs"] for c in compared)  # every clip was compared
    for c in compared:  # and against the truth the script computed on one process
        row = next(x for x in r["truth"]["steps"] if x["step"] == c["step"])
        assert c["true_norm"] == pytest.approx(row["true"], rel=1e-12)
    row = next(x for x in r["json"]["summary"] if x["metric"].startswith("Clip norm vs true norm"))
    assert row["value"].startswith("5 of 5") and row["status"] == "healthy"


# ------------------------------------------------------------------------------ partial mis-counts, named
def _named(r, layers, times=None, missing=None):
    """The finding names exactly ``layers``, with the factor the script's truth gives and, per layer, the
    times it is counted or the ranks whose shards are missing."""
    f = _miscounted(r)
    assert f is not None and r["rc"] == 0, r["stderr"][-3000:]
    want, row = _factor_at(r, f["steps"][0])
    assert f["evidence"]["factor"] == pytest.approx(want, rel=1e-6)
    assert f["evidence"]["true_norm"] == pytest.approx(row["true"], rel=1e-6)
    assert f["layers"] == layers and not f["evidence"]["ambiguous"], f["detail"]
    (x,) = f["evidence"]["explanations"]
    for k in times or {}:
        assert x["units"][k]["times"] == pytest.approx(times[k])
    for k in missing or {}:
        assert x["units"][k]["missing"] == missing[k]
    return f


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp_bias_twice", "tp_bias_twice_2x2"])
def test_tp_one_replicated_bias_counted_on_both_tp_ranks(runs, name):
    f = _named(runs[name], ["fc2.bias"], times={"fc2.bias": 2})
    assert f["severity"] == "warning" and "fc2.bias counted 2 times" in f["detail"]


@pytest.mark.slow
def test_tp_one_sharded_weight_counted_on_tp_rank_0_only(runs):
    f = _named(runs["tp_shard_missed"], ["fc1.weight"], missing={"fc1.weight": [1]})
    assert f["evidence"]["factor"] < 1


@pytest.mark.slow
def test_sp_layernorm_counted_on_both_tp_ranks_is_named_by_module_type(runs):
    f = _named(runs["sp_ln_twice"], ["ln.weight", "ln.bias"], times={"ln.weight": 2, "ln.bias": 2})
    assert f["evidence"]["model"] == "every LayerNorm tensor counted 2 times"


@pytest.mark.slow
def test_ep_router_counted_on_every_expert_rank(runs):
    _named(runs["ep_router"], ["router.weight"], times={"router.weight": 2})


@pytest.mark.slow
def test_ep_shared_expert_counted_on_every_expert_rank(runs):
    _named(runs["ep_shared"], ["shared.w1.weight", "shared.w2.weight"],
           times={"shared.w1.weight": 2, "shared.w2.weight": 2})


@pytest.mark.slow
def test_ep_experts_never_summed_over_the_expert_ranks(runs):
    layers = ["experts.0.w1.weight", "experts.0.w2.weight", "experts.1.w1.weight", "experts.1.w2.weight"]
    _named(runs["ep_local"], layers, missing={k: [1] for k in layers})


@pytest.mark.slow
def test_zero_partition_declared_with_its_sum_over_counted_names_the_owners(runs):
    _named(runs["zero_declared_sum"], ["ln.weight", "ln.bias", "fc2.bias"],
           times={"ln.weight": 2, "ln.bias": 2, "fc2.bias": 2})


@pytest.mark.slow
def test_zero_partition_without_a_declaration_is_a_named_cannot_tell(runs):
    r = runs["zero_deepspeed"]
    f = _miscounted(r)
    assert f is not None and f["severity"] == "notice" and r["rc"] == 0
    assert f["layers"] == ["partition"] and f["evidence"]["cannot_tell"] == ["partition"]
    for row in r["truth"]["steps"]:  # the script's norm is right, which check cannot know here
        assert row["script"] == pytest.approx(row["true"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp_right_2x2", "sp_right_2x2", "ep_right", "zero_declared"])
def test_fixed_partial_scripts_are_silent(runs, name):
    r = runs[name]
    assert _miscounted(r) is None and r["rc"] == 0, r["stderr"][-3000:]
    compared = r["json"]["rank_norms"]
    assert len(compared) == 3 and not any(c["differs"] for c in compared)
    for c in compared:
        row = next(x for x in r["truth"]["steps"] if x["step"] == c["step"])
        assert c["true_norm"] == pytest.approx(row["true"], rel=1e-9)
        assert row["script"] == pytest.approx(row["true"], rel=1e-6)


def test_watching_a_vocab_parallel_embedding_changes_nothing(runs, tmp_path):
    """``RowwiseParallel`` on ``nn.Embedding``: its output is a ``Partial`` DTensor until torch's own hook sums
    it. The forward watcher reads this rank's piece, never the DTensor (whose reduction by amax asserted in
    torch's placement code: the script crashed under check only). The run under check computes what it
    computes without it: the same losses, and norms and update sizes equal to the truth rebuilt whole."""
    r = runs["vocab_embedding"]
    assert r["rc"] == 0 and r["json"] is not None and not r["json"]["crashed"], r["stderr"][-3000:]
    assert "checker_error" not in [f["code"] for f in r["json"]["findings"]]
    truth = tmp_path / "plain.json"  # the same script without check
    env = dict(os.environ, FG_TRUTH=str(truth), OMP_NUM_THREADS="1")
    p = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 str(SCRIPTS / "dist_vocab_embedding.py")], cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    plain = json.loads(truth.read_text())["steps"]
    assert [s["loss"] for s in plain] == [s["loss"] for s in r["truth"]["steps"]]  # bit for bit
    steps, upd = r["json"]["steps"], {u["step"]: u["ratio"] for u in r["json"]["updates"]}
    assert len(steps) == len(plain) == 8
    for s, t in zip(steps, plain):
        assert s["loss"] == pytest.approx(t["loss"], rel=1e-7)
        assert s["grad_norm"] == pytest.approx(t["norm"], rel=1e-5)
        assert upd[s["step"]] == pytest.approx(t["update"], rel=1e-4)
