"""Runs the benchmark matrix (workload x op x implementation) and returns rows plus run metadata.

Implementations per (workload, op): ``torch eager`` (the baseline), ``torch.compile`` of the same torch
function (CUDA only: on the CPU it needs a C++ toolchain and minutes of compile time per case), and
``fastgrad:<backend>`` for every fastgrad backend usable on the device. The Triton backend is never
benchmarked on the CPU: there it runs through the Triton interpreter, a testing tool.

The implementations of one (workload, op) are timed interleaved (``Timer.measure_interleaved``); each row
gets its spread and an unstable mark. The ``host-*`` workloads run ``clip_grad_norm_`` over thousands of
one-element or 148 tiny tensors, where the figure that matters is the host time per call.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import fastgrad
from fastgrad import backends as _backends

from . import ops as O
from . import workloads as W
from .timing import UNSTABLE_SPREAD, Timer, copy_bandwidth

EAGER, COMPILE = "torch eager", "torch.compile"


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
    budget_s: float = 1.0
    min_reps: int = 3
    max_reps: int = 50
    warmup: int = 2
    seed: int = 0
    command: str = ""


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
    saved copy of the gradients (for restoring between repetitions) + temporaries of the baselines."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap = int(free * 0.85 / 3.5)
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
    try:
        import triton

        triton_v = triton.__version__
    except Exception:  # noqa: BLE001 - any import failure means "no triton"
        triton_v = "not installed"
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
    }


def _load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def _compiled(fn: Callable[[], object]) -> Callable[[], object]:
    return torch.compile(fn)


def ops_for(workload: str, ops: list[str]) -> list[str]:
    """The requested ops that ``workload`` runs (the host-overhead workloads run clip only)."""
    only = W.WORKLOADS[workload].ops
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
    return (f"machine busy {when} the run: load average {load:.2f} over {cores} cores; timings are slowed and "
            "noisy (see the spread column), compare ratios within one (workload, op) only")


def _row(wname: str, op: str, impl: str, backend: str | None, w: W.Workload, floor: int) -> dict:
    return {"workload": wname, "op": op, "impl": impl, "backend": backend or "", "tensors": w.n_tensors,
            "grad_mb": w.grad_bytes / 2**20, "floor_mb": floor / 2**20, "median_ms": float("nan"),
            "min_ms": float("nan"), "host_ms": float("nan"), "reps": 0, "spread_pct": float("nan"),
            "host_spread_pct": float("nan"), "unstable": False, "gbps": float("nan"), "pct_copy": float("nan"),
            "x_eager": float("nan"), "x_compile": float("nan"), "note": ""}


def headline_ms(r: dict, host: bool) -> float:
    return r["host_ms"] if host else r["median_ms"]


def run(cfg: Config, progress: Callable[[str], None] | None = None,
        on_workload: Callable[[Result], None] | None = None) -> Result:
    """Benchmark every requested (workload, op, implementation); ``progress`` is called once per case and
    ``on_workload`` with the results so far after each workload (to save partial results)."""
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
    warn = busy_warning("before")
    if warn:
        notes.append(warn)
        print(f"warning: {warn}", file=sys.stderr, flush=True)
    timer = Timer(device, warmup=cfg.warmup, min_reps=cfg.min_reps, max_reps=cfg.max_reps,
                  budget_s=cfg.budget_s)
    copy_bytes = (1 << 30 if device.type == "cuda" else 256 << 20) if not cfg.quick else (
        256 << 20 if device.type == "cuda" else 64 << 20)
    meta["copy_gbps"] = copy_bandwidth(timer, copy_bytes)
    meta["copy_bytes"] = copy_bytes
    max_bytes = cfg.max_bytes if cfg.max_bytes is not None else default_max_bytes(device, cfg.quick)
    meta["max_workload_bytes"] = max_bytes
    meta["unstable_spread_pct"] = 100 * UNSTABLE_SPREAD
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
        w = W.prepare(wname, max_bytes)
        if w.note:
            notes.append(f"{wname}: {w.note}")
        workload_meta[wname] = {"title": w.title, "tensors": w.n_tensors, "grad_bytes": w.grad_bytes,
                                "full_grad_bytes": w.full_bytes, "scale": w.scale, "note": w.note,
                                "host": w.host}
        params = W.materialize(w, device, seed=cfg.seed)
        st = O.OpState(params)
        p_bytes = sum(p.numel() * p.element_size() for p in params)
        if any(O.OPS[o].mutates for o in ops):
            st.save()
        use_compile = cfg.compile and (cfg.compile_workloads is None or wname in cfg.compile_workloads)
        for op in ops:
            rows.extend(_run_case(cfg, timer, w, st, op, usable, use_compile, p_bytes, meta["copy_gbps"],
                                  progress))
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
        notes.append(warn)  # printed by the CLI under the table
    meta["load_average_after"] = _load_average()
    return res


def _run_case(cfg: Config, timer: Timer, w: W.Workload, st: O.OpState, op: str, usable: list[str],
              use_compile: bool, p_bytes: int, copy_gbps: float,
              progress: Callable[[str], None] | None) -> list[dict]:
    """Every implementation of one (workload, op), timed interleaved; rows with speedups and marks."""
    spec = O.OPS[op]
    reset = st.restore if spec.mutates else None
    impls: list[tuple[str, str | None, Callable[[], Callable[[], object]]]] = [
        (EAGER, None, lambda: O.torch_fn(op, st))]
    if use_compile:
        impls.append((COMPILE, None, lambda: _compiled(O.torch_fn(op, st))))
    for b in usable:
        impls.append((f"fastgrad:{b}", b, lambda b=b: O.fastgrad_fn(op, st, b)))
    floor = spec.floor(w.grad_bytes, p_bytes)
    rows = [_row(w.name, op, impl, backend, w, floor) for impl, backend, _ in impls]
    fns: list[Callable[[], object]] = []
    idx: list[int] = []
    for k, (_, _, make) in enumerate(impls):
        try:
            fns.append(make())
            idx.append(k)
        except Exception as exc:  # noqa: BLE001 - a failing case is reported, the run goes on
            rows[k]["note"] = _failed(exc)
    # Host-overhead calls take microseconds: allow more repetitions, still within the time budget.
    max_reps = cfg.max_reps * 10 if w.host else None
    for k, m in zip(idx, timer.measure_interleaved(fns, reset, max_reps=max_reps)):
        r = rows[k]
        if isinstance(m, BaseException):
            r["note"] = _failed(m)
            continue
        r.update(median_ms=m.median_ms, min_ms=m.min_ms, host_ms=m.host_ms, reps=m.reps,
                 spread_pct=100 * m.spread, host_spread_pct=100 * m.host_spread)
        sp = m.host_spread if w.host else m.spread
        # No spread to judge (one repetition) counts as unstable too: nothing shows the figure is steady.
        r["unstable"] = not (sp <= UNSTABLE_SPREAD)
        if not w.host:
            gbps = floor / (m.median_ms * 1e-3) / 1e9
            r.update(gbps=gbps, pct_copy=100 * gbps / copy_gbps)
    st.restore()
    if progress:
        for impl, _, _ in impls:
            progress(f"{w.name} {op} {impl}")
    base = {r["impl"]: headline_ms(r, w.host) for r in rows}
    for r in rows:
        t = headline_ms(r, w.host)
        if r["impl"] != EAGER:
            r["x_eager"] = base[EAGER] / t
        if COMPILE in base and r["impl"] not in (EAGER, COMPILE):
            r["x_compile"] = base[COMPILE] / t
    return rows


def _failed(exc: BaseException) -> str:
    first = str(exc).splitlines()[0][:160] if str(exc) else ""
    return f"failed: {type(exc).__name__}: {first}"
