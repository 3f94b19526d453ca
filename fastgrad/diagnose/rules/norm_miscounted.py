"""``norm_miscounted``: in a multi-process run, the norm the script clipped with is not the norm of its
gradients with each element counted once.

What every rank recorded at a clip (``fastgrad.diagnose.collect.ranks``: per gradient its name, its squared
norm in float64, its element count, and either the placements' verdict for a DTensor or a fingerprint of a
plain tensor's bytes) is gathered to rank 0 once, after the script. Here, on the host:

* the truth (:func:`copy_weights`, the one counting rule): a DTensor's local shard counts where its placements
  say (``fastgrad.distributed``); a plain gradient that several ranks hold with the same shape, dtype and bytes
  is one tensor held in copies (data-parallel replicas, a tied embedding on the first and last pipeline stage,
  a replicated bias under hand-written tensor parallelism) and counts once, on the lowest rank; different bytes
  are different elements (shards) and each counts. The true norm is the float64 square root of the sum;
* the tolerance (:func:`tolerance`): the rounding a float32 norm of that many elements and terms can carry;
* the explanation (:func:`explain`): the counting the script did, among "its own gradients only" and "every
  gradient summed over one of its process groups", and per parameter (by module path) what that counting
  over- or under-counts.

Severity: a warning when the clip coefficient computed from the script's norm differs from the one the true
norm gives (the run applied a wrong coefficient: harm it shows), else a notice (the number is wrong, the
clip did not act on it: a logged norm, or both norms below ``max_norm``)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from ...decide import clip_coef
from ..finding import Finding, fmt
from .base import Rule, RunView

__all__ = ["NormMiscounted", "NORM_MISCOUNTED", "copy_weights", "tolerance", "explain", "attribute", "Entry",
           "ROUNDOFF", "MAX_LISTED"]

#: unit roundoff of the dtype a script's norm is returned in (the rounding of the result itself)
ROUNDOFF = {"torch.float64": 2.0 ** -53, "torch.float32": 2.0 ** -24, "torch.bfloat16": 2.0 ** -8,
            "torch.float16": 2.0 ** -11}
_U32 = 2.0 ** -24


@dataclass(frozen=True)
class Entry:
    """One gradient as one rank recorded it: ``counted`` is the placements' verdict for a DTensor's local shard
    (None for a plain tensor, which :func:`copy_weights` decides by its ``key``: shape, dtype, fingerprint)."""

    name: str
    counted: bool | None
    sq: float
    numel: int
    key: tuple | None = None
    kind: str | None = None  # the type of the module that holds the parameter (e.g. "LayerNorm"), when known
    flat: bool = False  # a flat buffer's elements whose layout is not declared (fastgrad.distributed.Partition)


def copy_weights(ranks: list[list[Entry]]) -> list[list[int]]:
    """THE counting rule: per rank (index = rank) and entry, 1 where the entry's elements enter the true norm,
    0 where another rank's entry holds the same elements. A DTensor's weight is its placements' verdict. A
    plain tensor is the same tensor as another rank's when both have the same key (shape, dtype, bytes); the
    j-th entry with a key on one rank is the j-th entry with that key on another (two equal tensors on one rank
    are two tensors), and only the lowest rank holding it counts it."""
    seen: set = set()
    out = []
    for entries in ranks:
        occ: dict = {}
        w = []
        for e in entries:
            if e.counted is not None:
                w.append(1 if e.counted else 0)
                continue
            j = occ.get(e.key, 0)
            occ[e.key] = j + 1
            ident = (e.key, j)
            w.append(0 if ident in seen else 1)
            seen.add(ident)
        out.append(w)
    return out


def tolerance(numel: int, terms: int, dtype: str = "torch.float32") -> float:
    """The relative difference a correct float32 norm may show against the float64 truth: the sum of squares of
    ``numel`` elements accumulated blockwise (pairwise or cascaded, as torch's reductions do: at most
    ``log2(numel)`` roundings on any element's path), then ``terms`` partial sums (per tensor, per rank) added one
    after another (at most ``terms`` roundings), each square rounded once; the square root halves the relative
    error, kept whole here as margin; plus twice the rounding of the result to ``dtype`` (the norm a bfloat16
    list returns is a bfloat16 number)."""
    steps = math.ceil(math.log2(max(numel, 2))) + terms + 1
    return _U32 * steps + 2 * ROUNDOFF.get(dtype, _U32)


def _units(ranks: list[list[Entry]], weights: list[list[int]]) -> dict[str, list[tuple[int, int]]]:
    """The parameters the finding names, each a list of (rank, entry): a DTensor by its name; a plain tensor
    by the names of its copies (``a = b`` for a tied pair named differently on two stages), the shards of
    one name together."""
    cls: dict = {}
    for r, entries in enumerate(ranks):
        occ: dict = {}
        for i, e in enumerate(entries):
            if e.counted is not None:
                ident = ("dt", e.name)
            else:
                j = occ.get(e.key, 0)
                occ[e.key] = j + 1
                ident = (e.key, j)
            cls.setdefault(ident, []).append((r, i))
    units: dict[str, list] = {}
    for members in cls.values():
        label = " = ".join(sorted({ranks[r][i].name for r, i in members}))
        units.setdefault(label, []).extend(members)
    return units


def _models(rank: int, groups: list[list[int]], world: int) -> list[tuple[str, frozenset]]:
    """The countings a script's norm on ``rank`` may have done: its own gradients only, or every gradient (as
    each rank holds it) summed over one of the process groups this rank belongs to."""
    out = [("its own gradients only", frozenset([rank]))]
    seen = {frozenset([rank])}
    for g in sorted(groups, key=lambda g: (len(g), g)):
        s = frozenset(g)
        if rank in s and s not in seen and s <= frozenset(range(world)):
            seen.add(s)
            out.append((f"every rank's gradients summed over ranks {sorted(s)}", s))
    return out


# ------------------------------------------------------------------------------ attribution
# A candidate is a counting: a multiplicity per (rank, entry), given where it differs from the truth's weight.
# Its norm is sqrt(true square + sum((m - w) * square)). Candidates come in levels, the first level holding one
# that gives the script's norm within the tolerance wins, and within it the sets naming the fewest parameters:
#   0. the structure: whole countings (its own gradients only, every gradient summed over one group), the
#      replicated tensors, one process group's sharded tensors, one module type's tensors;
#   1. one parameter counted 0, 2, ..., world times, or some of its shards (those of other ranks) missing;
#   2. two such parameters (a sorted search: what the first leaves, the second must give).
#: at most this many sets are listed when several explain the norm equally well
MAX_LISTED = 6


@dataclass
class _Unit:
    label: str
    members: list          # [(rank, entry)]
    true_sq: float         # its square as the truth counts it
    kind: str | None       # the module type of its parameter(s), when one


def _unit_list(ranks: list[list[Entry]], weights: list[list[int]]) -> list[_Unit]:
    out = []
    for label, items in _units(ranks, weights).items():
        kinds = {ranks[r][i].kind for r, i in items}
        out.append(_Unit(label, items, math.fsum(ranks[r][i].sq * weights[r][i] for r, i in items),
                         kinds.pop() if len(kinds) == 1 else None))
    return out


def _counted_ranks(u: _Unit, weights) -> list[int]:
    return sorted({r for r, i in u.members if weights[r][i]})


def _structure(ranks, weights, units: list[_Unit], groups: list[list[int]], world: int) -> list[tuple[str, dict]]:
    """Level 0: ``[(words, {(rank, entry): multiplicity})]``, each multiplicity where it differs from the truth."""
    cands = []
    every = [(r, i) for r, entries in enumerate(ranks) for i in range(len(entries))]
    for words, members in _models(0, groups, world):
        cands.append((words, {(r, i): (1 if r in members else 0) for r, i in every}))
    spans = [frozenset(g) for g in sorted(groups, key=lambda g: (len(g), g)) if 0 in g]
    spans = list(dict.fromkeys(spans + [frozenset(range(world))]))
    replicated = [u for u in units if any(not weights[r][i] for r, i in u.members)]
    if replicated:
        for s in spans:
            cands.append((f"every replicated tensor counted once per copy on ranks {sorted(s)}",
                          {(r, i): (1 if r in s else weights[r][i]) for u in replicated for r, i in u.members}))
        cands.append(("every replicated tensor left out", {m: 0 for u in replicated for m in u.members}))
    for s in spans:
        sharded = [u for u in units if len(_counted_ranks(u, weights)) > 1 and set(_counted_ranks(u, weights)) <= s]
        if sharded:
            cands.append((f"the tensors sharded over ranks {sorted(s)} counted on rank 0 only (the other ranks' "
                          "shards missing)", {(r, i): (weights[r][i] if r == 0 else 0)
                                              for u in sharded for r, i in u.members}))
    kinds: dict = {}
    for u in units:
        if u.kind:
            kinds.setdefault(u.kind, []).append(u)
    for kind, us in kinds.items():
        for k in _times_range(world):
            cands.append((f"every {kind} tensor counted {k} times",
                          {(r, i): k * weights[r][i] for u in us for r, i in u.members}))
        reps = [u for u in us if any(not weights[r][i] for r, i in u.members)]
        for s in spans if reps else ():
            cands.append((f"every replicated {kind} tensor counted once per copy on ranks {sorted(s)}",
                          {(r, i): (1 if r in s else weights[r][i]) for u in reps for r, i in u.members}))
    return cands


def _times_range(world: int) -> list[int]:
    """The multiplicities a miscounted tensor may have: left out (0), or counted 2 to ``world`` times."""
    return [0] + list(range(2, max(world, 2) + 1))


def _singles(weights, units: list[_Unit], world: int) -> list[tuple[str, int, dict]]:
    """Level 1: ``[(words, unit index, multiplicities)]``: one parameter counted k times, or only some of the
    ranks' shards of a sharded parameter counted."""
    out = []
    for ui, u in enumerate(units):
        if u.true_sq <= 0:
            continue
        for k in _times_range(world):
            out.append((f"{u.label} counted {k} times", ui, {(r, i): k * weights[r][i] for r, i in u.members}))
        holders = _counted_ranks(u, weights)
        if 1 < len(holders) <= 8:
            for h in holders:
                out.append((f"{u.label} counted on rank {h} only", ui,
                            {(r, i): (weights[r][i] if r == h else 0) for r, i in u.members}))
                if len(holders) > 2:
                    out.append((f"{u.label} without rank {h}'s shard", ui,
                                {(r, i): (0 if r == h else weights[r][i]) for r, i in u.members}))
    return out


def _delta(ranks, weights, mult: dict) -> float:
    return math.fsum((m - weights[r][i]) * ranks[r][i].sq for (r, i), m in mult.items())


def _signature(ranks, weights, units: list[_Unit], mult: dict, true_sq: float) -> dict:
    """Per parameter the candidate counts differently: ``{label: {"times", "factor", "missing"}}`` (``times``: its
    counted square over its true square; ``factor``: the norm's factor this parameter alone accounts for;
    ``missing``: the ranks whose shards of it are left out)."""
    by_member = {m: ui for ui, u in enumerate(units) for m in u.members}
    touched = sorted({by_member[m] for m in mult})
    out = {}
    for ui in touched:
        u = units[ui]
        got = math.fsum(ranks[r][i].sq * mult.get((r, i), weights[r][i]) for r, i in u.members)
        t = u.true_sq
        if t == got or abs(got - t) <= 1e-9 * max(t, got):
            continue
        times = got / t if t > 0 else math.inf
        missing = sorted({r for r, i in u.members if weights[r][i] and mult.get((r, i), 1) == 0})
        out[u.label] = {"times": times, "factor": math.sqrt(max(true_sq + got - t, 0.0) / true_sq),
                        "missing": missing}
    return out


def _explains(true_sq: float, delta: float, s0: float, tol: float) -> bool:
    m = math.sqrt(max(true_sq + delta, 0.0))
    return abs(m - s0) <= tol * s0


def attribute(ranks: list[list[Entry]], s0: float, groups: list[list[int]], tol: float,
              weights: list[list[int]] | None = None) -> list[dict]:
    """The smallest sets of parameters, with their multiplicities, whose miscounting gives ``s0`` (rank 0's
    norm) within ``tol`` (relative): ``[{"how": words, "units": {label: {"times", "factor", "missing"}}}]``,
    several when several explain it equally well (at most :data:`MAX_LISTED`), empty when none does. Never a
    set whose norm is off ``s0`` by more than ``tol``."""
    weights = copy_weights(ranks) if weights is None else weights
    world = len(ranks)
    true_sq = math.fsum(e.sq * w for entries, ws in zip(ranks, weights) for e, w in zip(entries, ws))
    if not true_sq > 0 or not s0 > 0:
        return []
    units = _unit_list(ranks, weights)

    def best(found: list[tuple[str, dict]]) -> list[dict]:
        sigs: dict = {}
        for words, mult in found:
            sig = _signature(ranks, weights, units, mult, true_sq)
            if not sig:
                continue
            key = tuple(sorted((k, round(v["times"], 9), tuple(v["missing"])) for k, v in sig.items()))
            if key in sigs:
                sigs[key]["also"].append(words)
            else:
                sigs[key] = {"how": words, "units": sig, "also": []}
        if not sigs:
            return []
        least = min(len(x["units"]) for x in sigs.values())
        return [x for x in sigs.values() if len(x["units"]) == least][:MAX_LISTED]

    level0 = [(w, m) for w, m in _structure(ranks, weights, units, groups, world)
              if _explains(true_sq, _delta(ranks, weights, m), s0, tol)]
    if level0 and (found := best(level0)):
        return found
    singles = _singles(weights, units, world)
    deltas = [_delta(ranks, weights, m) for _, _, m in singles]
    level1 = [(w, m) for (w, _, m), d in zip(singles, deltas) if _explains(true_sq, d, s0, tol)]
    if level1 and (found := best(level1)):
        return found
    # pairs: the second's delta must lie in the window the first leaves (checked again exactly below)
    lo = (s0 * (1 - tol)) ** 2 - true_sq
    hi = (s0 * (1 + tol)) ** 2 - true_sq
    order = sorted(range(len(singles)), key=deltas.__getitem__)
    keys = [deltas[j] for j in order]
    slack = 1e-12 * (true_sq + abs(lo) + abs(hi))
    level2, seen = [], set()
    for a, (wa, ua, ma) in enumerate(singles):
        left = bisect.bisect_left(keys, lo - deltas[a] - slack)
        right = bisect.bisect_right(keys, hi - deltas[a] + slack)
        for b in order[left:right]:
            wb, ub, mb = singles[b]
            if ub == ua or (min(a, b), max(a, b)) in seen:
                continue
            seen.add((min(a, b), max(a, b)))
            mult = {**ma, **mb}
            if _explains(true_sq, _delta(ranks, weights, mult), s0, tol):
                level2.append((f"{wa} and {wb}" if a < b else f"{wb} and {wa}", mult))
        if len(level2) > 4 * MAX_LISTED:
            break
    return best(level2) if level2 else []


def explain(ranks: list[list[Entry]], norms: list[float], groups: list[list[list[int]]],
            tol: float | None = None) -> dict:
    """The truth and the script's counting at one clip of a run of ``len(ranks)`` ranks. ``norms[r]``: the
    norm rank r's script clipped with; ``groups[r]``: the process groups (lists of global ranks) rank r
    belongs to; ``tol``: the relative tolerance (default: :func:`tolerance` for a float32 norm). Returns
    ``true`` (float64), ``factors`` per rank, ``numel``, ``terms``, ``explanations`` (:func:`attribute` for
    rank 0's norm) and, from the first of them, its words (``model``, None when no set explains the norm), the
    parameters it ``over``-counts (label -> times counted) and ``under``-counts (label -> (fraction of its
    square counted, the ranks whose shards are left out))."""
    weights = copy_weights(ranks)
    true_sq = math.fsum(e.sq * w for entries, ws in zip(ranks, weights) for e, w in zip(entries, ws))
    true = math.sqrt(true_sq)
    factors = [n / true if true > 0 else math.nan for n in norms]
    numel = sum(e.numel for entries in ranks for e in entries)
    terms = sum(len(entries) for entries in ranks) + len(ranks)
    tol = tolerance(numel, terms) if tol is None else tol
    out = {"true": true, "factors": factors, "numel": numel, "terms": terms, "model": None, "over": {},
           "under": {}, "explanations": []}
    if not true > 0 or all(abs(f - 1) <= tol for f in factors):
        return out
    found = attribute(ranks, norms[0], groups[0] if groups else [], tol, weights)
    out["explanations"] = found
    if found:
        first = found[0]
        out["model"] = first["how"]
        for label, v in first["units"].items():
            if v["times"] > 1:
                out["over"][label] = v["times"]
            else:
                out["under"][label] = (v["times"], v["missing"])
    return out


def _times(x: float) -> str:
    return f"{round(x)}" if abs(x - round(x)) < 1e-6 else f"{x:.3g}"


def _also(x: dict) -> str:
    return "".join(f" (equally: {w})" for w in x["also"])


def _named(x: dict) -> str:
    """One explanation's parameters by module path: how many times each is counted, the factor it alone
    accounts for, and the ranks whose shards are missing."""
    parts = []
    for label, v in x["units"].items():
        if v["times"] > 1:
            what = f"counted {_times(v['times'])} times (one tensor held in copies, or summed again)"
        elif v["missing"] and v["times"] > 0:
            what = (f"{v['times']:.3g} of its square counted, rank(s) {', '.join(map(str, v['missing']))}' shards "
                    "missing")
        else:
            what = "counted 0 times (left out)"
        parts.append(f"{label} {what}, {v['factor']:.6g}x on its own")
    return "; ".join(parts)


class NormMiscounted(Rule):
    def unmet(self, run: RunView) -> str | None:
        """Besides the evidence every rule needs: every rank's records. A rank that sent none (``ranks_silent``)
        leaves each clip without its counterpart, so the norm cannot be judged: the reason names the rank."""
        why = super().unmet(run)
        silent = run.ctx.get("ranks_silent") or {}
        if why is None and silent:
            why = "; ".join(f"rank {r} did not report ({w})" for r, w in sorted(silent.items()))
        return why

    def evaluate(self, run: RunView) -> list[Finding]:
        calls = run.ctx.get("ranks") or []
        judged = [_judge(call) for call in calls]
        # what the report's summary and JSON show of every recorded clip, found or not
        run.ctx["rank_norms"] = [{"step": j["step"], "ranks": len(j["norms"]), "true_norm": j["explained"]["true"],
                                  "norms": j["norms"], "tolerance": j["tol"], "differs": j["bad"],
                                  "undeclared_buffers": j["unknown"]}
                                 for j in judged if j is not None]
        bad = [j for j in judged if j is not None and j["bad"]]
        if not bad:
            return []
        first = bad[0]
        harmed = [b for b in bad if b["coef_differs"]]
        steps = sorted({b["step"] for b in bad})
        run.key_steps.add(first["step"])
        e = first["explained"]
        f0 = e["factors"][0]
        if first["unknown"]:
            return [_cannot_tell(self.code, first, steps, len(calls))]
        over, under = e["over"], e["under"]
        ranks_text = ", ".join(f"rank {r}: {x:.6g}x" for r, x in enumerate(e["factors"]))
        found = e["explanations"]
        if len(found) == 1:
            how = f"Rank 0's norm is what {found[0]['how']} gives{_also(found[0])}: {_named(found[0])}."
        elif found:
            how = (f"{len(found)} sets of parameters explain rank 0's norm equally well (each within float32 "
                   "rounding), so the norm alone cannot tell which one the script mis-counts: " + "; ".join(
                       f"({k + 1}) {x['how']}{_also(x)}: {_named(x)}" for k, x in enumerate(found)) + ".")
        else:
            how = ("No counting tried (rank 0's own gradients, every gradient summed over one of its process "
                   "groups, the replicated tensors, one group's or one module type's tensors, any one or two "
                   "parameters counted 0 to "
                   f"{len(e['factors'])} times or missing shards) gives rank 0's norm, so the parameters are not "
                   "named.")
        layers = list(dict.fromkeys(k for x in found for k in x["units"]))
        if harmed:
            h = harmed[0]
            sev = "warning"
            harm = (f" The clip applied a coefficient of {fmt(h['coef'])} where the true norm gives "
                    f"{fmt(h['true_coef'])} (max_norm={fmt(h['max_norm'])}, step {h['step']}, rank {h['rank']}): "
                    f"{len({b['step'] for b in harmed})} step(s) clipped on the wrong number.")
        else:
            sev = "notice"
            harm = (" The clip's coefficient was the same as the true norm's at every recorded step (both norms "
                    "below max_norm, or no bound): the number is wrong, the update was not.")
        more = "over-counted" if f0 > 1 else "under-counted"
        return [Finding(
            self.code, sev, f"the script's gradient norm is {f0:.4g}x the true norm ({more} parameters)",
            f"At step {first['step']} the norm the script clipped with was {fmt(first['norms'][0])} on rank 0, "
            f"while its gradients over the {len(e['factors'])} ranks, each element counted once, have a norm of "
            f"{fmt(e['true'])} (float64): {f0:.6g}x the true norm ({ranks_text}). {how}{harm} "
            f"{len(steps)} of {len(calls)} recorded clip(s) differ by more than float32 rounding "
            f"({first['tol']:.2g} relative).",
            layers=layers, steps=steps,
            evidence={"factor": f0, "factors": e["factors"], "true_norm": e["true"], "script_norm": first["norms"][0],
                      "step": first["step"], "model": e["model"], "over": over,
                      "under": {k: v[0] for k, v in under.items()}, "missing_ranks": {k: v[1] for k, v in under.items()},
                      "explanations": [{"how": x["how"], "also": x["also"], "units": x["units"]} for x in found],
                      "ambiguous": len(found) > 1,
                      "tolerance": first["tol"], "harm": ["clip"] if harmed else [],
                      "coef": harmed[0]["coef"] if harmed else None,
                      "true_coef": harmed[0]["true_coef"] if harmed else None})]


def _cannot_tell(code: str, first: dict, steps: list, calls: int) -> Finding:
    """The finding for a clip whose gradients hold flat buffers of undeclared layout: a notice naming them,
    never a warning (a correct norm over a ZeRO partition of a tensor-parallel model differs from the count
    that takes every rank's slice as its own)."""
    e, bufs = first["explained"], first["unknown"]
    names = ", ".join(bufs)
    return Finding(
        code, "notice", f"cannot tell whether the script's gradient norm counts each element once: flat buffer(s) "
        f"{names} of undeclared layout",
        f"At step {first['step']} the norm the script clipped with was {fmt(first['norms'][0])} on rank 0. The "
        f"gradients of {names} differ between ranks, as a ZeRO partition's do: counting every rank's slice as its "
        f"own elements gives a norm of {fmt(e['true'])} (the script's is {e['factors'][0]:.6g}x that), but where the buffer holds slices of a tensor that several "
        "tensor-parallel ranks keep whole, those slices count once and the true norm is smaller. Which of its "
        "elements are replicated only a declaration says: fastgrad.distributed.Partition(buffer, [(offset, "
        "length, owner, replicated_over), ...]) on every rank, then check counts each element once. "
        f"{len(steps)} of {calls} recorded clip(s) differ from the count that takes every slice as its own.",
        layers=list(bufs), steps=steps,
        evidence={"cannot_tell": list(bufs), "factor": e["factors"][0], "factors": e["factors"],
                  "slices_as_own_norm": e["true"], "script_norm": first["norms"][0], "step": first["step"],
                  "tolerance": first["tol"], "harm": [], "explanations": [], "ambiguous": False})


def undeclared_buffers(ranks: list[list[Entry]]) -> list[str]:
    """The flat buffers whose layout is not declared and whose bytes differ between ranks (a ZeRO partition:
    each rank holds another slice of the flattened model). The byte rule counts such a buffer on every rank, which
    is right for slices of shards and wrong for slices of a tensor every tensor-parallel rank keeps whole: which
    one it holds, only a declaration says."""
    weights = copy_weights(ranks)
    holders: dict = {}
    for r, (entries, ws) in enumerate(zip(ranks, weights)):
        for e, w in zip(entries, ws):
            if e.flat and w:
                holders.setdefault(e.name, set()).add(r)
    return sorted(n for n, rs in holders.items() if len(rs) > 1)


def _coef(norm: float, max_norm: float) -> float:
    return float(clip_coef(torch.tensor(norm, dtype=torch.float64), max_norm))


def _judge(call: dict) -> dict | None:
    """One clip over every rank: None when it cannot be compared (a norm that is not finite, all-zero
    gradients), else the comparison, ``bad`` when some rank's norm is off the truth by more than
    :func:`tolerance`."""
    ranks = [[Entry(*x) if not isinstance(x, Entry) else x for x in r["entries"]] for r in call["ranks"]]
    norms = [r["norm"] for r in call["ranks"]]
    if any(n is None or not math.isfinite(n) for n in norms):
        return None
    if not all(math.isfinite(e.sq) for entries in ranks for e in entries):
        return None
    dtype = call["ranks"][0].get("dtype", "torch.float32")
    numel = sum(e.numel for entries in ranks for e in entries)
    tol = tolerance(numel, sum(len(entries) for entries in ranks) + len(ranks), dtype)
    e = explain(ranks, norms, [r.get("groups") or [] for r in call["ranks"]], tol)
    if not e["true"] > 0:
        return None
    out = {"step": call["step"], "norms": norms, "explained": e, "tol": tol, "coef_differs": False,
           "bad": any(abs(f - 1) > tol for f in e["factors"]), "unknown": undeclared_buffers(ranks)}
    if not out["bad"]:
        return out
    for r, (n, rec) in enumerate(zip(norms, call["ranks"])):
        mx = rec.get("max_norm")
        if mx is None or not math.isfinite(mx):
            continue
        c, t = _coef(n, mx), _coef(e["true"], mx)
        if abs(c - t) > tol * t:
            out.update(coef_differs=True, coef=c, true_coef=t, max_norm=mx, rank=r)
            break
    return out


NORM_MISCOUNTED = NormMiscounted(
    "norm_miscounted", "warning",
    "per recorded clip of a multi-process run: every rank's gradients (float64 squares, DTensor placements, "
    "fingerprints of plain tensors) and the norm the script clipped with",
    "the norm a multi-process script clipped with differs from the true norm of its gradients (each element "
    "counted once: DTensors by their placements, a plain tensor with the same bytes on several ranks once) by "
    "more than float32 rounding; a warning when the clip coefficient differs because of it", needs=("script",))
