"""One-pass gradient health statistics (docs/diagnostics.md).

``grad_stats`` is the public entry point (the kernels are the backends' ``grad_stats`` primitive); it
returns a :class:`GradStats` whose tensors stay on the device, so computing it never syncs the host.
Rendering a report from it (one sync) is the job of ``fastgrad.diagnose.report``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import _inputs as inputs
from . import distributed
from . import exact_reads
from . import route
from .backends import acc_dtype

__all__ = ["GradStats", "grad_stats", "tensor_stats", "row_sparse_names", "named_params", "stats_of", "stats_of_all"]


@dataclass
class GradStats:
    """Per-tensor gradient statistics, in the order of the inputs that had a gradient.

    Tensor fields live on the first gradient's device: ``norm`` and ``max_abs`` in float32 (float64 if any
    gradient is float64), the counts in int64. ``total_norm`` is the L2 norm over all gradients.
    ``no_grad`` names the inputs whose ``.grad`` was None (frozen or unused parameters).
    ``row_sparse`` names the inputs whose gradient only reaches the rows a batch looked up: a sparse-layout
    gradient, or the weight of an ``nn.Embedding``/``nn.EmbeddingBag`` when a module was given. Their norm
    depends on how many rows were touched, not on depth, so the report's depth rule leaves them out.

    Sparse gradients are read through their stored values (duplicates of a COO gradient summed first):
    ``norm``/``max_abs``/``nan``/``inf`` are those of the values, ``numel`` is the dense shape's and ``zero``
    counts the implicit zeros too (the rows not looked up have a zero gradient), so a sparse and a dense
    embedding gradient of the same batch give the same statistics.
    """

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    norm: Tensor
    max_abs: Tensor
    nan: Tensor
    inf: Tensor
    zero: Tensor
    numel: Tensor
    total_norm: Tensor
    no_grad: list[str] = field(default_factory=list)
    row_sparse: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)

    def to_dict(self) -> dict:
        """Plain Python values (one host sync), e.g. for a logger."""
        cols = {k: getattr(self, k).tolist() for k in ("norm", "max_abs", "nan", "inf", "zero", "numel")}
        per = {
            name: {k: cols[k][i] for k in cols} | {"shape": list(self.shapes[i]), "dtype": str(self.dtypes[i])}
            for i, name in enumerate(self.names)
        }
        return {"total_norm": float(self.total_norm), "parameters": per, "no_grad": list(self.no_grad)}


_ROW_SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def row_sparse_names(model, prefix: str = "") -> list[str]:
    """Names (as ``named_parameters()`` gives them, after ``prefix``) of the weights of ``model``'s
    ``nn.Embedding``/``nn.EmbeddingBag`` modules: their gradient reaches only the rows a batch looked up."""
    if not isinstance(model, torch.nn.Module):
        return []
    ids = {id(m.weight) for m in model.modules() if isinstance(m, _ROW_SPARSE_MODULES)}
    return [prefix + n for n, p in model.named_parameters() if id(p) in ids] if ids else []


def named_params(obj) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` pairs of what ``grad_stats`` accepts: a module's ``named_parameters()``, pairs as given,
    or tensors named by their position."""
    if isinstance(obj, torch.nn.Module):
        return list(obj.named_parameters())
    items = inputs.as_list(obj)
    named = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            named.append(item)
        elif isinstance(item, Tensor):
            named.append((str(i), item))
        else:
            raise TypeError(
                "grad_stats takes a module, parameters, or (name, parameter) pairs; "
                f"got an item of type {type(item).__name__}"
            )
    return named


@torch.no_grad()
def grad_stats(parameters_or_named_parameters_or_module, *, backend: str | None = None,
               process_group=None, exact: bool = False) -> GradStats:
    """Read each gradient once and return, per tensor, its L2 norm, max |g|, and counts of NaN, Inf and
    exact zeros, plus numel and the total L2 norm, all on the device (no host sync).

    Accepts an ``nn.Module`` (its ``named_parameters()``), an iterable of ``(name, parameter)`` pairs, an
    iterable of parameters (named by position), or one tensor.

    Sharded gradients (DTensors on any meshes, mixed with plain tensors, or plain tensors with
    ``process_group=``; see ``fastgrad.distributed``): every column describes the WHOLE tensors (shapes are
    the DTensors' global shapes), the same on every rank holding them; a collective, so every rank must call,
    with the same parameter list (per pipeline stage: ``total_norm`` then covers every stage, the columns the
    stage's own tensors; plain tensors with a bare group are each rank's own tensors, with
    ``fastgrad.distributed.Shards(group)`` pieces of the same tensors). Three collectives (the total with the
    ranks' agreement check, then a sum and a max of the columns); one for plain pipeline stages.

    ``exact=True``: ``total_norm`` is the correctly rounded L2 norm of all the gradient values (fastgrad.exact;
    sharded gradients: one more collective, which carries its digits).
    """
    obj = parameters_or_named_parameters_or_module
    named = named_params(obj)
    st = stats_of([n for n, _ in named], [p for _, p in named], backend, process_group=process_group, exact=exact)
    hint = row_sparse_names(obj)
    if hint:
        seen = set(st.row_sparse)
        st.row_sparse = st.row_sparse + [n for n in hint if n not in seen]
    return st


def stats_of(names: list[str], params: list[Tensor], backend: str | None, cache: dict | None = None,
             grads: list[Tensor] | None = None, process_group=None, exact: bool = False) -> GradStats:
    """grad_stats over validated ``names``/``params``. When every parameter has a gradient (the usual step)
    the gradients come from the one compiled scan and the names, shapes and dtypes are the parameters' own
    (torch keeps a grad's shape and dtype equal to its parameter's); a caller that keeps the same parameter
    list (a monitor) passes ``cache``, a dict that keeps them and the device copy of the numels across calls,
    and ``grads`` when it has just collected ``inputs.grads_of(params)`` itself (a second scan costs ~1 us per
    tensor). Else the Python loop. ``exact``: the total as ``grad_stats(..., exact=True)``."""
    if grads is None:
        grads = inputs.grads_of(params)
    plan = route.lookup(params, process_group)
    if plan.sharded(grads):
        return _sharded_stats(names, params, backend, plan, exact)
    if len(grads) == len(params) and grads and (type(grads) is inputs.Checked or _all_strided(grads)):
        numel = cache["numel"] if cache else None
        st = stats_of_all(names, params, tensor_stats(grads, backend=backend, numel=numel), cache)
    else:
        st = _stats_of_some(names, params, backend)
    if exact:
        if plan.place(grads) is None and plan.route == "torch":
            plan.refuse_fallback("grad_stats", backend, exact=True)
        st.total_norm = exact_reads.grad_stats_total(grads, backend, None, st.total_norm)
    return st


def _stats_of_some(names: list[str], params: list[Tensor], backend: str | None) -> GradStats:
    """:func:`stats_of` by the Python loop: some parameters without a gradient, or sparse ones among them."""
    named = list(zip(names, params))
    with_grad = [(n, p.grad) for n, p in named if p.grad is not None]
    no_grad = [n for n, p in named if p.grad is None]
    if not with_grad:
        empty_f = torch.zeros(0)
        empty_i = torch.zeros(0, dtype=torch.int64)
        return GradStats([], [], [], empty_f, empty_f, empty_i, empty_i, empty_i, empty_i, torch.tensor(0.0),
                         no_grad)
    names = [n for n, _ in with_grad]
    grads = [g for _, g in with_grad]
    cols = _mixed_stats(grads, backend)
    sparse = [n for n, g in with_grad if g.layout != torch.strided]
    return GradStats(names, [tuple(g.shape) for g in grads], [g.dtype for g in grads], cols["norm"],
                     cols["max_abs"], cols["nan"], cols["inf"], cols["zero"], cols["numel"], cols["total_norm"],
                     no_grad, sparse)


def _all_strided(grads) -> bool:
    for g in grads:
        if g.layout != torch.strided:
            return False
    return True


def _sparse_values(g: Tensor) -> Tensor:
    """The stored values of a sparse gradient, each element of the dense tensor at most once (COO duplicates
    summed by ``coalesce``; compressed layouts store each element once)."""
    if g.layout == torch.sparse_coo:
        return g.coalesce().values()
    return g.values()


def _sparse_stats(grads: list[Tensor], dtype: torch.dtype, dev) -> dict[str, Tensor]:
    """The statistics columns of sparse gradients, from their values with torch ops (no host sync)."""
    cols: dict[str, list[Tensor]] = {k: [] for k in ("norm", "max_abs", "nan", "inf", "zero")}
    for g in grads:
        if not g.dtype.is_floating_point:
            raise TypeError(f"gradients must be real floating point; got a sparse gradient of dtype {g.dtype}")
        v = _sparse_values(g).to(dev)
        a = v.abs().to(dtype)
        cols["norm"].append(torch.linalg.vector_norm(a) if v.numel() else torch.zeros((), dtype=dtype, device=dev))
        # max |g| over the dense tensor: NaN wins, as in the dense kernels; implicit zeros floor it at 0
        mx = a.max() if v.numel() else torch.zeros((), dtype=dtype, device=dev)
        cols["max_abs"].append(torch.where(torch.isnan(a).any(), torch.nan, mx.clamp_min(0)) if v.numel() else mx)
        cols["nan"].append(torch.isnan(v).sum())
        cols["inf"].append(torch.isinf(v).sum())
        cols["zero"].append((v == 0).sum() + (g.numel() - v.numel()))
    out = {k: torch.stack(v) for k, v in cols.items()}
    for k in ("nan", "inf", "zero"):
        out[k] = out[k].to(torch.int64)
    return out


def _mixed_stats(grads: list[Tensor], backend: str | None) -> dict[str, Tensor]:
    """:func:`tensor_stats` columns over gradients of which some may be sparse (those are read through their
    values, see :class:`GradStats`); the dense ones take the fused pass."""
    if _all_strided(grads):
        return tensor_stats(grads, backend=backend)
    dense = [i for i, g in enumerate(grads) if g.layout == torch.strided]
    sparse = [i for i, g in enumerate(grads) if g.layout != torch.strided]
    first = grads[0].device
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    sp = _sparse_stats([grads[i] for i in sparse], dtype, first)
    if dense:
        dn = tensor_stats([grads[i] for i in dense], backend=backend)
        order = torch.argsort(torch.tensor(dense + sparse)).to(first)
        cols = {k: torch.cat([dn[k].to(first, sp[k].dtype), sp[k]]).index_select(0, order) for k in sp}
    else:
        cols = sp
    cols["numel"] = torch.tensor([g.numel() for g in grads], dtype=torch.int64).to(first, non_blocking=True)
    cols["total_norm"] = torch.linalg.vector_norm(cols["norm"])
    return cols


def _sharded_stats(names: list[str], params: list[Tensor], backend: str | None, plan: route.ListPlan,
                   exact: bool) -> GradStats:
    """grad_stats of sharded gradients (fastgrad.distributed.reduced_stats): local statistics of this rank's
    counted shards through the backends, then the collectives. A rank with no gradient still takes part.
    ``exact``: the exact total from the same sharded view (one more collective)."""
    with_grad = [(n, p.grad) for n, p in zip(names, params) if p.grad is not None]
    no_grad = [n for n, p in zip(names, params) if p.grad is None]
    grads = [g for _, g in with_grad]
    inputs.check_tensors(grads, allow_fallback=False)
    sh = plan.place(grads)
    if sh is None:  # a dtype only torch's implementation reads, which has no sharded statistics
        raise TypeError("sharded grad_stats takes float16, bfloat16, float32 and float64 gradients only")
    cols = distributed.reduced_stats(sh, lambda ts: tensor_stats(ts, backend=backend))
    if exact:
        cols["total_norm"] = exact_reads.grad_stats_total(grads, backend, sh, cols["total_norm"])
    return GradStats([n for n, _ in with_grad], [tuple(g.shape) for g in grads], [g.dtype for g in grads],
                     cols["norm"], cols["max_abs"], cols["nan"], cols["inf"], cols["zero"], cols["numel"],
                     cols["total_norm"], no_grad)


def stats_of_all(names: list[str], params: list[Tensor], cols: dict[str, Tensor], cache: dict | None
                 ) -> GradStats:
    """GradStats of a step where every parameter has a gradient, from the statistics columns ``cols`` (as
    :func:`tensor_stats` returns them; ``numel`` may be missing, for CPU gradients only). Names, shapes and
    dtypes are the parameters' own, taken from and kept in ``cache`` (see :func:`stats_of`)."""
    info = cache if cache else {"names": list(names), "shapes": [tuple(p.shape) for p in params],
                                "dtypes": [p.dtype for p in params], "numel": None}
    numel = cols.get("numel")
    if numel is None:
        numel = info["numel"]
        if numel is None:
            numel = torch.tensor(list(map(Tensor.numel, params)), dtype=torch.int64)
    if cache is not None:
        cache.update(info, numel=numel)
    return GradStats(info["names"], info["shapes"], info["dtypes"], cols["norm"], cols["max_abs"], cols["nan"],
                     cols["inf"], cols["zero"], numel, cols["total_norm"], [])


def tensor_stats(tensors: list[Tensor], *, backend: str | None = None, numel: Tensor | None = None
                 ) -> dict[str, Tensor]:
    """The statistics of ``grad_stats`` over any non-empty list of dense real floating tensors (e.g. the
    parameters themselves, for ``find_nonfinite``): a dict of 1-D tensors ``norm``, ``max_abs``, ``nan``,
    ``inf``, ``zero``, ``numel`` in input order and the 0-dim ``total_norm``, on the first tensor's device,
    with no host sync."""
    tensors = inputs.checked(tensors)
    inputs.check_tensors(tensors, allow_fallback=False)
    first = tensors[0].device
    dtype = acc_dtype(tensors)
    parts: dict[str, list[Tensor]] = {}
    groups = {first: range(len(tensors))} if type(tensors) is inputs.Checked else inputs.group_by_device(tensors)
    for idx in groups.values():
        group = tensors if len(groups) == 1 else [tensors[i] for i in idx]
        out = inputs.pick("grad_stats", group, backend).grad_stats(group)
        for k, v in out.items():
            parts.setdefault(k, []).append(v.to(first, dtype if v.is_floating_point() else torch.int64))
    cols = {k: inputs.restore_order(torch.cat(v), groups) for k, v in parts.items()}
    # numel is known on the host; the copy is asynchronous, so it costs no sync. (``numel``: a cached copy.)
    if numel is None or numel.device != first:
        numel = torch.tensor(list(map(Tensor.numel, tensors)), dtype=torch.int64).to(first, non_blocking=True)
    cols["numel"] = numel
    cols["total_norm"] = torch.linalg.vector_norm(cols["norm"])
    return cols
