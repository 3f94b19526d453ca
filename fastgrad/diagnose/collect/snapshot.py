"""One step's gradient statistics as plain host values: what a report reads. ``gather`` copies the device
statistics (and any extras, e.g. a monitor's ring buffers) to the host in ONE transfer; the rows group them
per parameter and per layer."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ...stats import GradStats

__all__ = ["ParamRow", "LayerRow", "RowSparseRow", "gather", "group_layers", "row_sparse_rows", "ratio",
           "module_of", "depth_of"]


@dataclass
class ParamRow:
    """Statistics of one parameter's gradient (``param_norm``/``ratio`` are None when params were not read)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    norm: float
    max_abs: float
    nan: int
    inf: int
    zero: int
    numel: int
    param_norm: float | None = None
    ratio: float | None = None


@dataclass
class LayerRow:
    """Parameters grouped by owning module (the name up to the last dot), in first-seen order."""

    name: str
    params: list[str]
    norm: float
    max_abs: float
    nan: int
    inf: int
    zero: int
    numel: int
    param_norm: float | None = None
    ratio: float | None = None


@dataclass
class RowSparseRow:
    """A parameter whose gradient reaches only the rows a batch looked up (an embedding): the evidence behind
    leaving it out of the depth rule. ``touched`` is estimated from the zero count as
    ``ceil(nonzero values / row width)`` (exact unless a looked-up row has exact zeros in its gradient)."""

    name: str
    rows: int
    touched: int
    norm: float
    #: the gradient norm per touched row (RMS over the touched rows): comparable across batches and vocabularies
    per_row: float
    #: True when fewer rows than all were touched, so the layer was left out of the depth comparison
    excluded: bool


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


#: a stacked recurrent module's per-layer parameters: weight_ih_l0, bias_hh_l2_reverse, weight_hr_l1 ...
_STACKED = re.compile(r"^(?:(.*)\.)?(?:weight|bias)_(?:ih|hh|hr)_l(\d+)(?:_reverse)?$")


def depth_of(name: str) -> str:
    """The layer of depth a parameter belongs to: the first numbered entry of a container on its path (a
    ModuleList's or a Sequential's, e.g. ``encoder.layers.3``, ``blocks.0``, ``0``: a block of the stack),
    else the layer of a stacked recurrent module (``rnn.weight_ih_l2`` -> ``rnn.l2``, both directions of a
    bidirectional one: the same depth), else its owning module."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    m = _STACKED.match(name)
    if m:
        return (m.group(1) + "." if m.group(1) else "") + "l" + m.group(2)
    return module_of(name)


# ---------------------------------------------------------------------------------------------- one sync
def gather(stats: GradStats, param_norms: Tensor | None, extras: Sequence[Tensor] = ()) -> tuple[dict, list]:
    """Read everything a report needs to the host in ONE transfer: the stats, the parameter norms and any
    ``extras`` (e.g. a monitor's ring buffers) are concatenated on one device and copied together."""
    dev = stats.total_norm.device
    dt = torch.float32 if dev.type == "mps" else torch.float64  # MPS has no float64
    n = len(stats)
    if param_norms is not None and param_norms.numel() != n:
        raise ValueError(f"{param_norms.numel()} parameter norms for the statistics of {n} tensors")
    pieces = [stats.total_norm.reshape(1), stats.norm, stats.max_abs, stats.nan, stats.inf, stats.zero]
    if param_norms is not None:
        pieces.append(param_norms.reshape(-1))
    pieces += [e.reshape(-1) for e in extras]
    flat = torch.cat([p.to(dev, dt, non_blocking=True) for p in pieces])
    vals = flat.tolist()  # the one host sync of a report
    out = {"total_norm": vals[0]}
    pos = 1
    for key in ("norm", "max_abs", "nan", "inf", "zero"):
        out[key] = vals[pos:pos + n]
        pos += n
    for key in ("nan", "inf", "zero"):
        out[key] = [int(v) for v in out[key]]
    if param_norms is not None:
        out["param_norm"] = vals[pos:pos + n]
        pos += n
    rest = []
    for e in extras:
        rest.append(vals[pos:pos + e.numel()])
        pos += e.numel()
    return out, rest


def ratio(num: float, den: float | None) -> float | None:
    if den is None:
        return None
    if den == 0:
        return math.inf if num > 0 else (math.nan if math.isnan(num) else 0.0)
    return num / den


def group_layers(params: list[ParamRow], with_params: bool, key_of=module_of) -> list[LayerRow]:
    """Parameters grouped by ``key_of`` their name (the owning module; ``depth_of``: the layer of depth), in
    first-seen order."""
    layers: dict[str, LayerRow] = {}
    sq: dict[str, float] = {}
    psq: dict[str, float] = {}
    for r in params:
        key = key_of(r.name)
        row = layers.get(key)
        if row is None:
            row = layers[key] = LayerRow(key, [], 0.0, 0.0, 0, 0, 0, 0)
            sq[key] = psq[key] = 0.0
        row.params.append(r.name)
        sq[key] += r.norm * r.norm
        row.max_abs = math.nan if math.isnan(r.max_abs) or math.isnan(row.max_abs) else max(row.max_abs, r.max_abs)
        row.nan += r.nan
        row.inf += r.inf
        row.zero += r.zero
        row.numel += r.numel
        if with_params:
            psq[key] += r.param_norm * r.param_norm
    for key, row in layers.items():
        row.norm = math.sqrt(sq[key])
        if with_params:
            row.param_norm = math.sqrt(psq[key])
            row.ratio = ratio(row.norm, row.param_norm)
    return list(layers.values())


def row_sparse_rows(params: list[ParamRow], names: set[str]) -> list[RowSparseRow]:
    out = []
    for r in params:
        if r.name not in names or not r.shape or not r.numel:
            continue
        rows = r.shape[0]
        width = r.numel // rows
        touched = min(rows, -(-(r.numel - r.zero) // width)) if width else 0
        per_row = r.norm / math.sqrt(touched) if touched else 0.0
        out.append(RowSparseRow(r.name, rows, touched, r.norm, per_row, touched < rows))
    return out

