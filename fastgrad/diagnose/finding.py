"""A finding (one detected issue) and the small text helpers every rule's evidence is written with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Finding", "fmt", "steps_text", "layers_text", "cap", "place_causes"]


@dataclass
class Finding:
    """One detected issue: ``code`` is stable (for programs), ``title``/``detail`` are for people;
    ``layers``/``steps`` are where it was seen and ``evidence`` the numbers it fired on (plain values)."""

    code: str
    severity: str
    title: str
    detail: str = ""
    layers: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)


def fmt(x) -> str:
    """A number as the reports print it (4 significant digits, scientific outside 1e-3..1e4)."""
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.3e}" if abs(x) < 1e-3 or abs(x) >= 1e4 else f"{x:.4g}"


def steps_text(steps: list[int], limit: int = 8) -> str:
    more = len(steps) - limit
    return ", ".join(map(str, steps[:limit])) + (f", ... (+{more})" if more > 0 else "")


def layers_text(f: Finding, limit: int = 8) -> str:
    """The layers a finding names, else its steps; "-" when neither."""
    items = f.layers or [f"step {s}" for s in f.steps]
    if not items:
        return "-"
    more = len(items) - limit
    return ", ".join(items[:limit]) + (f", ... (+{more})" if more > 0 else "")


def cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def place_causes(findings: list[Finding]) -> list[Finding]:
    """``findings`` with each cause moved before the first finding that follows from it (``evidence["follows"]``:
    the cause's code); otherwise in their order. Shared by the report's order and its advice's."""
    out = list(findings)
    for f in list(out):
        c = f.evidence.get("follows")
        if not c:
            continue
        i = out.index(f)
        j = next((k for k, g in enumerate(out) if g.code == c and g is not f), None)
        if j is not None and j > i:
            out.insert(i, out.pop(j))
    return out
