"""Runs the benchmark matrix (workload x op x implementation) and returns rows plus run metadata.

Implementations per (workload, op): ``torch eager`` (the headline baseline: the code a user reaches for,
see ``ops.OPS[op].baselines``), other torch baselines of the op (``torch: own loop``: this benchmark's own
loop, kept as a labelled row), ``torch.compile`` of the headline baseline (CUDA only by default: on the CPU
it needs a C++ toolchain and minutes of compile time per case), ``fastgrad auto`` (the call with
``backend=None``: what a user gets, the backend fastgrad picks automatically) and, for reference,
``fastgrad:<backend>`` for every other fastgrad backend usable on the device. The Triton backend is never
benchmarked on the CPU: there it runs through the Triton interpreter, a testing tool.

Each case also times the op's floor pass (``ops.Floor.run``: the op's bytes as contiguous streams over
buffers of its working set's size) in the same rounds, for its % of the floor; and, after the timed rounds,
counts one call of every implementation (``counting``: torch operators, and on a GPU kernels and host
syncs).

The implementations of one (workload, op) are timed in interleaved rounds (``Timer.rounds``): the headline
is fastgrad auto's speedup over torch eager (and over torch.compile where run), the median of the per-round
ratios with a confidence interval and a verdict; rounds continue until those are settled or the case's
time budget is spent. Reference backends run in the first rounds only. The ``host-*`` workloads run
``clip_grad_norm_`` over thousands of one-element or 148 tiny tensors, where the figure that matters is the
host time per call.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib
import importlib.util
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import fastgrad
from fastgrad import backends as _backends

from . import counting
from . import ops as benchmark_ops
from . import workloads as benchmark_workloads
from .timing import (BAND, CONFIDENCE, PROBLEM, Ratio, Timer, copy_bandwidth, inplace_bandwidth, judged,
                     paired_ratio, read_bandwidth)

EAGER, COMPILE, AUTO = "torch eager", "torch.compile", "fastgrad auto"
#: Row roles: the headline baseline, another torch baseline of the op (a labelled row beside it), the
#: torch.compile baseline, fastgrad's automatic choice (the headline), and the other fastgrad backends (shown
#: for reference: a user gets them only by naming them).
BASELINE, ALTERNATIVE, COMPILED, AUTOMATIC, REFERENCE = "baseline", "other baseline", "compile", "auto", "reference"
#: Where an op's floor pass runs from: the CPU's last-level cache (its working set fits there) or memory.
CACHE_FLOOR, MEMORY_FLOOR = "cache", "memory"
#: Calls of the floor pass per round on the CPU, the fastest kept: on a busy machine most calls of a few ms are
#: preempted, and the floor should be an uninterrupted pass (a GPU's device time is not preempted).
FLOOR_INNER = 5
#: A % of the floor above this is no result: the op ran faster than its own floor pass in the same rounds, so
#: the floor model or the pass does not fit the case (or the op's timing is wrong); the row says so instead.
OVER_FLOOR_PCT = 100.0
#: Working sets below this get no floor figure: there the floor pass's own fixed cost per call (a few torch
#: operators), not its bytes, sets its time, so it is no floor.
MIN_FLOOR_BYTES = 1 << 20


@dataclass
class Config:
    device: torch.device
    workloads: list[str]
    ops: list[str]
    backends: list[str] | None = None  # None: every usable one
    quick: bool = False
    max_bytes: int | None = None  # None: derived from the device's memory (and time on the CPU)
    compile: bool = False
    compile_workloads: list[str] | None = None  # None: every benchmarked workload
    #: seconds of timed rounds per (workload, op) before it stops unsettled
    budget_s: float = 2.0
    min_rounds: int = 8
    max_rounds: int = 200
    #: rounds the reference backends run in (None: min_rounds)
    ref_rounds: int | None = None
    #: rounds the other torch baselines (the own loops, slow by design) run in (None: as ref_rounds)
    other_rounds: int | None = None
    warmup: int = 2
    seed: int = 0
    command: str = ""
    confidence: float = CONFIDENCE
    band: float = BAND
    #: calls per implementation per round, the round keeping the fastest (None: 3 for short calls, else 1)
    inner: int | None = None
    #: a warning about the machine's load, already shown to the user (recorded in the notes)
    busy_before: str | None = None
    #: count torch operators (and on a GPU kernels and host syncs) of one call per implementation
    counts: bool = True


@dataclass
class Result:
    rows: list[dict]
    meta: dict
    notes: list[str] = field(default_factory=list)


def usable_backends(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """fastgrad backends that can run on ``device``'s tensors, and why the others are left out."""
    usable, why_not = [], {}
    for name, b in _backends.registered().items():
        reason = b.unavailable_reason()
        if reason is None and b.devices and device.type not in b.devices:
            reason = f"does not run on {device.type} tensors"
        if reason is None and name == "triton" and device.type == "cpu":
            reason = "on CPU tensors only the Triton interpreter runs it (a testing tool, not benchmarked)"
        if reason is None:
            usable.append(name)
        else:
            why_not[name] = reason
    return usable, why_not


def default_max_bytes(device: torch.device, quick: bool) -> int:
    """Gradient bytes per workload that the device holds with room to spare: parameters + gradients + a
    saved copy of the gradients (for restoring between repetitions; the floor pass streams over it) + the
    AGC floor pass's parameter-sized buffer + temporaries of the baselines."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap = int(free * 0.85 / 4.5)
        return min(cap, 2**30) if quick else cap
    avail = _mem_available()
    cap = int(avail * 0.5 / 4)
    # The CPU also runs out of time long before memory: torch eager clips ~0.4 GB/s on a 2-core machine.
    return min(cap, (24 if quick else 128) * 2**20)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def last_level_cache_bytes() -> int:
    """Size of the CPU's largest cache (Linux sysfs; 0 when unknown): workloads smaller than it can run
    from the cache between repetitions, faster than memory."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = 0
    try:
        for d in base.glob("index*"):
            size = (d / "size").read_text().strip().upper()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
            best = max(best, int(size.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        return 0
    return best


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})"


def _git_commit() -> str:
    # fastgrad/benchmark/runner.py -> the checkout's root; an installed package has no git history.
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return "unknown (installed package)"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (rev + ("+dirty" if dirty else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def metadata(cfg: Config, backends: list[str], why_not: dict[str, str]) -> dict:
    triton_v = "not installed"
    if importlib.util.find_spec("triton") is not None:
        # The version without importing triton (an import costs seconds and is not needed on the CPU).
        try:
            from importlib.metadata import version

            triton_v = version("triton")
        except Exception:  # noqa: BLE001 - any metadata failure means "unknown"
            triton_v = "installed (version unknown)"
    return {
        "device": device_name(cfg.device),
        "device_type": cfg.device.type,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": cfg.command,
        "fastgrad": fastgrad.__version__,
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": triton_v,
        "python": platform.python_version(),
        "quick": cfg.quick,
        "backends": backends,
        "backends_not_benchmarked": why_not,
        "compile": cfg.compile,
        "cpu_threads": torch.get_num_threads(),
        # A busy machine slows everything down unevenly: keep the load next to the numbers.
        "load_average": _load_average(),
        "confidence": cfg.confidence,
        "noise_band": cfg.band,
        "min_rounds": cfg.min_rounds,
        "max_rounds": cfg.max_rounds,
        "budget_s_per_case": cfg.budget_s,
    }


def _load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def _compiled(fn: Callable[[], object]) -> Callable[[], object]:
    return torch.compile(fn)


def ops_for(workload: str, ops: list[str]) -> list[str]:
    """The requested ops that ``workload`` runs (the host-overhead workloads run clip only)."""
    only = benchmark_workloads.WORKLOADS[workload].ops
    return [o for o in ops if only is None or o in only]


def cpu_count() -> int:
    """Cores this process may run on (a container's affinity, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_warning(when: str) -> str | None:
    """A warning when the 1-minute load average is over the core count: other work then competes for the
    cores and makes the timings slower and erratic."""
    if not hasattr(os, "getloadavg"):
        return None
    load, cores = os.getloadavg()[0], cpu_count()
    if load <= cores:
        return None
    return (f"machine busy {when} the run: load average {load:.2f} over {cores} cores; times are slowed "
            "and noisy, so the intervals are wider and more rows may read 'within noise'")


def auto_backend(op: str, st: benchmark_ops.OpState) -> str:
    """The backend fastgrad's automatic choice runs ``op``'s main primitive with on this workload."""
    spec = benchmark_ops.OPS[op]
    by_dev: dict[str, list[torch.Tensor]] = {}
    for g in st.grads:
        by_dev.setdefault(str(g.device), []).append(g)
    names = []
    for grads in by_dev.values():
        try:
            names.append(_backends.select_automatic(spec.primitive, grads, norm_type=2.0).name)
        except Exception:  # noqa: BLE001 - only a label; the timed call itself reports real failures
            names.append("?")
    return ",".join(dict.fromkeys(names))


def _row(wname: str, op: str, impl: str, role: str, backend: str | None, w: benchmark_workloads.Workload) -> dict:
    nan = float("nan")
    return {"workload": wname, "op": op, "impl": impl, "role": role, "backend": backend or "", "baseline": "",
            "tensors": w.n_tensors, "grad_mb": w.grad_bytes / 2**20, "median_ms": nan, "min_ms": nan,
            "host_ms": nan, "rounds": 0, "inner": 0, "spread_pct": nan,
            "speedup": nan, "speedup_lo": nan, "speedup_hi": nan, "verdict": "", "verdict_why": "",
            "vs_compile": nan, "vs_compile_lo": nan, "vs_compile_hi": nan, "compile_verdict": "",
            "compile_verdict_why": "", "vs_other": nan, "vs_other_lo": nan, "vs_other_hi": nan, "other_impl": "",
            "read_mb": nan, "written_mb": nan, "gbps": nan, "floor_ms": nan, "pct_floor": nan, "floor_kind": "",
            "floor_problem": False, "median_ratio": nan, "ops_per_call": nan, "kernels_per_call": nan,
            "syncs_per_call": nan, "note": ""}


#: The note of a run that timed no fastgrad backend by name. (torch.compile and the other torch baselines may
#: still run beside the headline: the note denies only what no table then holds.)
ONLY_AUTOMATIC_NOTE = ("no other fastgrad backend timed: fastgrad's automatic choice is the only fastgrad row "
                       "(--backends all adds the other usable backends)")


def run(cfg: Config, progress: Callable[[str], None] | None = None,
        on_workload: Callable[[Result], None] | None = None) -> Result:
    """Benchmark every requested (workload, op, implementation); ``progress`` is called once per case and
    ``on_workload`` with the results so far after each workload (to save partial results). Prints nothing:
    the caller shows the busy-machine warning (``cfg.busy_before``), once."""
    device = cfg.device
    usable, why_not = usable_backends(device)
    if cfg.backends is not None:
        for b in cfg.backends:
            if b not in usable:
                why_not.setdefault(b, "not usable")
        usable = [b for b in usable if b in cfg.backends]
    meta = metadata(cfg, usable, why_not)
    notes: list[str] = []
    meta["cores"] = cpu_count()
    if cfg.busy_before:
        notes.append(cfg.busy_before)
    if cfg.backends == []:
        notes.append(ONLY_AUTOMATIC_NOTE)
    # "fastgrad auto" must be the automatic choice: FASTGRAD_BACKEND would override it for the whole run.
    env_backend = os.environ.pop("FASTGRAD_BACKEND", None)
    if env_backend is not None:
        notes.append(f"FASTGRAD_BACKEND={env_backend} was ignored for this run: 'fastgrad auto' times the "
                     "automatic choice")
    try:
        return _run(cfg, progress, on_workload, usable, meta, notes)
    finally:
        if env_backend is not None:
            os.environ["FASTGRAD_BACKEND"] = env_backend


def _run(cfg: Config, progress, on_workload, usable: list[str], meta: dict, notes: list[str]) -> Result:
    device = cfg.device
    timer = Timer(device, warmup=cfg.warmup, min_reps=5, max_reps=20, budget_s=0.5)
    # The machine's memory rates, for the reader (each case's % of the floor comes from its own floor pass):
    # on buffers well past the last-level cache (the GPU's L2 is flushed before every repetition anyway), a
    # read-only stream and read+write passes (a copy, an in-place multiply).
    llc = last_level_cache_bytes() if device.type == "cpu" else 0
    if device.type == "cuda":
        stream_bytes = (256 << 20) if cfg.quick else (1 << 30)
    else:
        stream_bytes = max(4 * llc, (64 << 20) if cfg.quick else (256 << 20))
    meta["read_gbps"] = read_bandwidth(timer, stream_bytes)
    meta["copy_gbps"] = copy_bandwidth(timer, stream_bytes)
    meta["inplace_gbps"] = inplace_bandwidth(timer, stream_bytes)
    # The read+write rate: the faster of the two ways memory does a read+write pass.
    meta["rw_gbps"] = max(meta["copy_gbps"], meta["inplace_gbps"])
    meta["stream_bytes"] = stream_bytes
    meta["cache_bytes"] = llc
    max_bytes = cfg.max_bytes if cfg.max_bytes is not None else default_max_bytes(device, cfg.quick)
    meta["max_workload_bytes"] = max_bytes
    if cfg.compile:
        # Module-level name on purpose: a function-local `import torch._dynamo` would make `torch` local
        # to this whole function (GPU finding 9: UnboundLocalError at torch.cuda.empty_cache()).
        _dynamo = importlib.import_module("torch._dynamo")
        # One compiled function per (workload, op): raise the recompile limits so none silently runs eager.
        _dynamo.config.cache_size_limit = 1024
        if hasattr(_dynamo.config, "accumulated_cache_size_limit"):
            _dynamo.config.accumulated_cache_size_limit = 4096
    rows: list[dict] = []
    workload_meta: dict[str, dict] = {}
    meta["workloads"] = workload_meta
    res = Result(rows, meta, notes)
    for wname in cfg.workloads:
        ops = ops_for(wname, cfg.ops)
        if not ops:
            continue
        w = benchmark_workloads.prepare(wname, max_bytes)
        if w.note:
            notes.append(f"{wname}: {w.note}")
        workload_meta[wname] = {"title": w.title, "tensors": w.n_tensors, "grad_bytes": w.grad_bytes,
                                "full_grad_bytes": w.full_bytes, "scale": w.scale, "note": w.note,
                                "host": w.host}
        params = benchmark_workloads.materialize(w, device, seed=cfg.seed)
        st = benchmark_ops.OpState(params)
        st.save()  # for restoring the ops that write gradients, and the floor pass's buffer
        use_compile = cfg.compile and (cfg.compile_workloads is None or wname in cfg.compile_workloads)
        for op in ops:
            rows.extend(_run_case(cfg, timer, w, st, op, usable, use_compile, llc, meta))
            if progress:
                progress(f"{wname} {op}")
        del params, st, w
        gc.collect()
        if device.type == "cuda":
            if cfg.compile:
                torch._dynamo.reset()
            torch.cuda.empty_cache()
        if on_workload is not None:
            on_workload(res)
    warn = busy_warning("after")
    if warn:
        notes.append(warn)
    meta["load_average_after"] = _load_average()
    return res


def _ratio_fields(r: Ratio, prefix: str) -> dict:
    return {prefix: r.median, prefix + "_lo": r.lo, prefix + "_hi": r.hi}


def floor_kind(device: torch.device, working_set: int, llc: int) -> str:
    """Which floor the op's floor pass measures: ``cache`` when its working set fits in the CPU's last-level
    cache (then the pass, like the op, runs largely from the cache), else ``memory``. On a GPU every
    repetition starts with the L2 flushed: memory."""
    if device.type == "cpu" and 0 < working_set <= llc:
        return CACHE_FLOOR
    return MEMORY_FLOOR


def _run_case(cfg: Config, timer: Timer, w: benchmark_workloads.Workload, st: benchmark_ops.OpState, op: str,
              usable: list[str], use_compile: bool, llc: int, meta: dict) -> list[dict]:
    """Every implementation of one (workload, op) and its floor pass, timed in interleaved rounds; rows with
    ratios, verdicts, the % of the op's floor and the counts of one call."""
    spec = benchmark_ops.OPS[op]
    reset = st.restore if spec.mutates else None
    auto = auto_backend(op, st)
    impls: list[tuple[str, str, str | None, Callable[[], Callable[[], object]], str]] = []
    for k, b in enumerate(spec.baselines):
        impls.append((b.impl, BASELINE if k == 0 else ALTERNATIVE, None, lambda b=b: b.make(st), b.what))
    if use_compile:
        impls.append((COMPILE, COMPILED, None, lambda: _compiled(benchmark_ops.torch_fn(op, st)),
                      "torch.compile of " + spec.baseline))
    impls.append((AUTO, AUTOMATIC, auto, lambda: benchmark_ops.fastgrad_fn(op, st, None), ""))
    for b in usable:
        if b not in auto.split(","):  # the automatic row already times the backend it picks
            impls.append((f"fastgrad:{b}", REFERENCE, b, lambda b=b: benchmark_ops.fastgrad_fn(op, st, b), ""))
    rows = [_row(w.name, op, impl, role, backend, w) | {"baseline": what}
            for impl, role, backend, _, what in impls]
    fns: list[Callable[[], object]] = []
    idx: list[int] = []  # rows[idx[j]] is timed by fns[j]
    for k, (_, _, _, make, _) in enumerate(impls):
        try:
            fns.append(make())
            idx.append(k)
        except Exception as exc:  # noqa: BLE001 - a failing case is reported, the run goes on
            rows[k]["note"] = _failed(exc)
    pos = {impls[k][1] if impls[k][1] not in (REFERENCE, ALTERNATIVE) else impls[k][0]: j
           for j, k in enumerate(idx)}
    alt = next((j for j, k in enumerate(idx) if impls[k][1] == ALTERNATIVE), None)
    pairs = []
    if AUTOMATIC in pos:
        pairs += [(pos[b], pos[AUTOMATIC]) for b in (BASELINE, COMPILED) if b in pos]
    # Reference backends and the other torch baselines are not part of the headline: first rounds only.
    refs = tuple(j for j, k in enumerate(idx) if impls[k][1] in (REFERENCE, ALTERNATIVE))
    resets: list[Callable[[], None] | None] = [reset] * len(fns)
    n_bytes, p_bytes = st.grad_bytes, st.param_bytes
    floor_j = None
    working_set = spec.floor.working_set(st.grad_bytes, st.param_bytes)
    if not w.host and working_set >= MIN_FLOOR_BYTES:
        # The floor pass, timed in every round beside the implementations (it is no row of its own).
        floor_fn, warm = st.floor_fn(spec.floor)
        fns.append(floor_fn)
        resets.append(warm if timer.device.type == "cpu" else None)  # the GPU's L2 is flushed anyway
        floor_j = len(fns) - 1
    # Host-overhead calls take microseconds: many more rounds fit the same budget.
    max_rounds = cfg.max_rounds * 10 if w.host else cfg.max_rounds
    # The floor pass runs in every round, as the implementations do: each % of the floor pairs the two within
    # a round. (It ran in the first rounds only, and its fastest call was set against the op's median over all
    # rounds: two statistics of different rounds, so a busy spell in those rounds read as over 100%.)
    rr = timer.rounds(fns, resets, pairs=pairs, min_rounds=cfg.min_rounds, max_rounds=max_rounds,
                      budget_s=cfg.budget_s, ref=refs, ref_rounds=cfg.ref_rounds, host=w.host, band=cfg.band,
                      confidence=cfg.confidence, inner=cfg.inner,
                      rounds_of=None if cfg.other_rounds is None else {
                          j: cfg.other_rounds for j, k in enumerate(idx) if impls[k][1] == ALTERNATIVE},
                      min_inner=None if floor_j is None or timer.device.type != "cpu" else {floor_j: FLOOR_INNER})
    st.restore()
    series = rr.host_ms if w.host else rr.dev_ms
    kind = floor_kind(timer.device, working_set, llc) if floor_j is not None else ""
    floor_ok = floor_j is not None and rr.errors[floor_j] is None
    for j, k in enumerate(idx):
        r = rows[k]
        if rr.errors[j] is not None:
            r["note"] = _failed(rr.errors[j])
            continue
        m = rr.measurement(j)
        if m is None:
            continue
        r.update(median_ms=m.median_ms, min_ms=m.min_ms, host_ms=m.host_ms, rounds=m.reps, inner=rr.inner,
                 spread_pct=100 * (m.host_spread if w.host else m.spread))
        if not w.host:
            moved = spec.floor.bytes_moved(n_bytes, p_bytes)
            r.update(read_mb=spec.floor.bytes_read(n_bytes, p_bytes) / 2**20,
                     written_mb=spec.floor.bytes_written(n_bytes, p_bytes) / 2**20,
                     gbps=moved / (m.median_ms * 1e-3) / 1e9, floor_kind=kind)
            if floor_j is not None and rr.errors[floor_j] is None:
                share = floor_share(series[floor_j], series[j])
                if share is not None:
                    r.update(floor_ms=share[0], pct_floor=share[1], floor_problem=floor_problem(share[1]))
        over = (f"{r['pct_floor']:.0f}% of its floor: faster than its floor pass in the same rounds, so the floor "
                "model or the timing does not fit this case") if r["floor_problem"] else ""
        if over:
            r["note"] = f"{PROBLEM}: {over}"
        b = pos.get(BASELINE)
        if b is not None and j != b and rr.errors[b] is None:
            ratio, v, why, mr = judged(series[b], series[j], cfg.confidence, cfg.band)
            if over:
                v, why = PROBLEM, over
            r.update(_ratio_fields(ratio, "speedup"), verdict=v, verdict_why=why, median_ratio=mr)
        c = pos.get(COMPILED)
        if r["role"] == AUTOMATIC and c is not None and rr.errors[c] is None:
            ratio, v, why, _ = judged(series[c], series[j], cfg.confidence, cfg.band)
            r.update(_ratio_fields(ratio, "vs_compile"), compile_verdict=v, compile_verdict_why=why)
        if r["role"] == AUTOMATIC and alt is not None and rr.errors[alt] is None:
            ratio = paired_ratio(series[alt], series[j], cfg.confidence)
            r.update(_ratio_fields(ratio, "vs_other"), other_impl=impls[idx[alt]][0])
        if r["role"] == AUTOMATIC and rr.stopped in ("budget", "max_rounds") and not r["note"]:
            # Its verdict is the one to re-check: the interval was still near a threshold when timing ended.
            r["note"] = (f"unsettled after {rr.n_rounds} rounds "
                         f"({'time budget' if rr.stopped == 'budget' else 'round limit'})")
    if floor_j is not None and not floor_ok:
        for r in rows:
            r["note"] = r["note"] or f"no floor: {_failed(rr.errors[floor_j])}"
    if cfg.counts:
        t0 = time.perf_counter()
        _count(timer.device, rows, idx, fns, rr, reset)
        st.restore()
        # The run's seconds spent counting (not timing), for the reader of a slow run.
        meta["count_s"] = round(meta.get("count_s", 0.0) + time.perf_counter() - t0, 2)
    st.release_floor()
    return rows


def floor_problem(pct: float) -> bool:
    """Whether a % of the floor is no result: above OVER_FLOOR_PCT (NaN, no floor, is none)."""
    return pct > OVER_FLOOR_PCT


def floor_share(floor: list[float | None], impl: list[float | None]) -> tuple[float, float] | None:
    """(the floor pass's median time, the % of the floor) over the rounds where both ran; None if there are
    none. The % is the median over those rounds of floor time / implementation time, each pair timed a few ms
    apart (the paired statistic the speedups use), so a busy spell slows both sides of a pair alike."""
    pairs = [(f, i) for f, i in zip(floor, impl) if f is not None and i is not None and i > 0]
    if not pairs:
        return None
    return statistics.median(f for f, _ in pairs), 100 * statistics.median(f / i for f, i in pairs)


def _count(device: torch.device, rows: list[dict], idx: list[int], fns, rr, reset) -> None:
    """One counted call per implementation that ran (after the timed rounds: counting slows a call)."""
    for j, k in enumerate(idx):
        r = rows[k]
        if rr.errors[j] is not None:
            continue
        try:
            c = counting.count_call(fns[j], device, reset, ops=r["role"] != COMPILED)
        except Exception as exc:  # noqa: BLE001 - a count that fails leaves the timing standing
            r["note"] = (r["note"] + "; " if r["note"] else "") + f"not counted: {type(exc).__name__}: {exc}"[:200]
            continue
        r.update(c.as_row())


def _failed(exc: BaseException) -> str:
    first = str(exc).splitlines()[0][:160] if str(exc) else ""
    return f"failed: {type(exc).__name__}: {first}"
