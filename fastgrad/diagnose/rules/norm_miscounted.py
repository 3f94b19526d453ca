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

import math
from dataclasses import dataclass

import torch

from ...decide import clip_coef
from ..finding import Finding, fmt
from .base import Rule, RunView

__all__ = ["NormMiscounted", "NORM_MISCOUNTED", "copy_weights", "tolerance", "explain", "Entry", "ROUNDOFF"]

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


def explain(ranks: list[list[Entry]], norms: list[float], groups: list[list[list[int]]]) -> dict:
    """The truth and the script's counting at one clip of a run of ``len(ranks)`` ranks. ``norms[r]``: the
    norm rank r's script clipped with; ``groups[r]``: the process groups (lists of global ranks) rank r
    belongs to. Returns ``true`` (float64), ``factors`` per rank, ``numel``, ``terms`` and, for rank 0, the
    counting that gives its norm (``model``: its words, or None when none of them does) with the parameters it
    ``over``-counts (label -> times counted) and ``under``-counts (label -> (fraction of its square counted, the
    ranks left out))."""
    weights = copy_weights(ranks)
    true_sq = math.fsum(e.sq * w for entries, ws in zip(ranks, weights) for e, w in zip(entries, ws))
    true = math.sqrt(true_sq)
    factors = [n / true if true > 0 else math.nan for n in norms]
    numel = sum(e.numel for entries in ranks for e in entries)
    terms = sum(len(entries) for entries in ranks) + len(ranks)
    out = {"true": true, "factors": factors, "numel": numel, "terms": terms, "model": None, "over": {},
           "under": {}}
    units = _units(ranks, weights)
    s0 = norms[0]
    best = None
    for words, members in _models(0, groups[0], len(ranks)):
        m = math.sqrt(math.fsum(e.sq for r in members for e in ranks[r]))
        err = abs(m - s0) / s0 if s0 > 0 else abs(m)
        if best is None or err < best[0]:
            best = (err, words, members)
    if best is None or best[0] > tolerance(numel, terms):
        return out
    _, out["model"], members = best
    for label, items in units.items():
        t = math.fsum(ranks[r][i].sq * weights[r][i] for r, i in items)
        m = math.fsum(ranks[r][i].sq for r, i in items if r in members)
        if t == m or t == 0 and m == 0:
            continue
        if m > t * (1 + 1e-9):
            out["over"][label] = m / t if t > 0 else math.inf
        elif m < t * (1 - 1e-9):
            left = sorted({r for r, i in items if r not in members and weights[r][i]})
            out["under"][label] = (m / t, left)
    return out


def _times(x: float) -> str:
    return f"{round(x)}" if abs(x - round(x)) < 1e-6 else f"{x:.3g}"


class NormMiscounted(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        calls = run.ctx.get("ranks") or []
        judged = [_judge(call) for call in calls]
        # what the report's summary and JSON show of every recorded clip, found or not
        run.ctx["rank_norms"] = [{"step": j["step"], "ranks": len(j["norms"]), "true_norm": j["explained"]["true"],
                                  "norms": j["norms"], "tolerance": j["tol"], "differs": j["bad"]}
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
        over, under = e["over"], e["under"]
        ranks_text = ", ".join(f"rank {r}: {x:.6g}x" for r, x in enumerate(e["factors"]))
        parts = []
        if over:
            parts.append("over-counted (one tensor held in copies, each copy summed): " + ", ".join(
                f"{k} (counted {_times(v)} times)" for k, v in over.items()))
        if under:
            parts.append("under-counted (shards held by other ranks missing from the sum): " + ", ".join(
                f"{k} ({v[0]:.3g} of its square counted; missing rank(s) {', '.join(map(str, v[1]))})"
                for k, v in under.items()))
        how = (f"Rank 0's norm is what {e['model']} gives: " + "; ".join(parts) + "."
               if e["model"] is not None and parts else
               "No single counting (rank 0's own gradients, or every gradient summed over one of its process "
               "groups) gives rank 0's norm, so the parameters are not named.")
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
            layers=list(over) + list(under), steps=steps,
            evidence={"factor": f0, "factors": e["factors"], "true_norm": e["true"], "script_norm": first["norms"][0],
                      "step": first["step"], "model": e["model"], "over": over,
                      "under": {k: v[0] for k, v in under.items()}, "missing_ranks": {k: v[1] for k, v in under.items()},
                      "tolerance": first["tol"], "harm": ["clip"] if harmed else [],
                      "coef": harmed[0]["coef"] if harmed else None,
                      "true_coef": harmed[0]["true_coef"] if harmed else None})]


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
    e = explain(ranks, norms, [r.get("groups") or [] for r in call["ranks"]])
    if not e["true"] > 0:
        return None
    dtype = call["ranks"][0].get("dtype", "torch.float32")
    tol = tolerance(e["numel"], e["terms"], dtype)
    out = {"step": call["step"], "norms": norms, "explained": e, "tol": tol, "coef_differs": False,
           "bad": any(abs(f - 1) > tol for f in e["factors"])}
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
