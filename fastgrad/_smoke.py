"""Smoke check of a built ``fastgrad._C``, in a separate process, before a training process loads it.

A ``_C.so`` built with a C++ compiler whose runtime does not match torch's can import fine and then crash the
process (SIGSEGV) the first time a ``TORCH_CHECK`` message formats a number (a GPU image's own g++ did:
benchmarks/results/gpu/2026-11-25-h100/RUN_NOTES.md, finding 1). A crash cannot be caught, so the check runs in a child
process: it loads the module by path, runs an op, and makes a CPU op (and, where the build has CUDA kernels and
a GPU is visible, a CUDA op) fail a check whose message formats a number. The parent learns "usable" or the
reason it is not. The result is cached per build (module path, size and mtime, torch version), so the check
costs one child process per build, not one per training run.

Loaded by ``setup.py`` by path (the package is not importable before it is installed) and by ``fastgrad._ext``;
it imports nothing from fastgrad. Environment:

* ``FASTGRAD_EXT_SMOKE``: ``0`` skips the check (the module is trusted as built), ``force`` runs it even when a
  cached result exists; anything else (default): the cached check.
* ``FASTGRAD_CACHE_DIR``: where the result is cached (default: next to the module when that folder is
  writable, else ``$XDG_CACHE_HOME/fastgrad`` or ``~/.cache/fastgrad``).
* ``FASTGRAD_EXT_SMOKE_FAULT`` (tests only): a signal name the child sends itself after loading the module, to
  simulate a broken build; part of the cache key, so it never marks a good build bad for other processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

ENV = "FASTGRAD_EXT_SMOKE"
CACHE_ENV = "FASTGRAD_CACHE_DIR"
FAULT_ENV = "FASTGRAD_EXT_SMOKE_FAULT"
CACHE_NAME = "_C.smoke.json"
#: seconds the child may take (it imports torch, and initialises CUDA where the build has CUDA kernels)
TIMEOUT = 180

FIX = ("rebuild it with the distribution's compilers, e.g. CC=/usr/bin/gcc CXX=/usr/bin/g++ pip install "
       "--no-build-isolation -e .  (from a source checkout; without -e for a normal install)")

OK_MARK = "fastgrad-smoke-ok"

# The child. Kept to what every build has: ops registered at load, has_cpu/has_cuda, cuda_probe.
SCRIPT = r"""
import importlib.util, os, signal, sys
import torch
spec = importlib.util.spec_from_file_location("fastgrad._C", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
fault = os.environ.get("FASTGRAD_EXT_SMOKE_FAULT")
if fault:
    os.kill(os.getpid(), getattr(signal, fault))
ops = torch.ops.fastgrad

def failing_check(fn, number):
    try:
        fn()
    except RuntimeError as exc:
        if number not in str(exc):
            sys.exit("the check's message lacks its number: " + str(exc)[:300])
    else:
        sys.exit("a failing input check did not raise")

def norm_of_3_4(device):
    total, _ = ops.norm([torch.tensor([3.0, 4.0], device=device)], 2.0)
    if float(total) != 5.0:
        sys.exit("the L2 norm of [3, 4] on %s came out as %r" % (device, float(total)))

if getattr(mod, "has_cpu", 0):
    norm_of_3_4("cpu")
    failing_check(lambda: ops.scale_([torch.ones(3)], torch.ones(7)), "7")
cuda = bool(getattr(mod, "has_cuda", 0)) and torch.cuda.is_available()
if cuda:
    # the input check runs before any launch; a launch needs code for this GPU, which the backend checks itself
    failing_check(lambda: ops.scale_([torch.ones(3, device="cuda")], torch.ones(7, device="cuda")), "7")
    if not ops.cuda_probe(torch.cuda.current_device()):
        norm_of_3_4("cuda")
print("%s %s" % ("fastgrad-smoke-ok", "cpu+cuda" if cuda else "cpu"))
"""


def mode() -> str:
    """``skip``, ``force`` or ``cached``, from FASTGRAD_EXT_SMOKE."""
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("0", "off", "no", "false", "skip"):
        return "skip"
    return "force" if v == "force" else "cached"


def build_key(so_path: str, torch_version: str) -> dict:
    st = os.stat(so_path)
    return {"path": os.path.abspath(so_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "torch": torch_version, "fault": os.environ.get(FAULT_ENV) or None}


def cache_path(so_path: str) -> str:
    """Where the result for this module is cached."""
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        here = os.path.dirname(os.path.abspath(so_path))
        if os.access(here, os.W_OK):
            return os.path.join(here, CACHE_NAME)
        folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                              "fastgrad")
    digest = hashlib.sha1(os.path.abspath(so_path).encode()).hexdigest()[:16]
    return os.path.join(folder, f"smoke-{digest}.json")


def _read(path: str, key: dict) -> dict | None:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == key and isinstance(data.get("ok"), bool) else None


def _write(path: str, record: dict) -> None:
    """Atomically (processes starting together may race); a folder we cannot write only costs a re-check."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(record, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def run(so_path: str, python: str | None = None, timeout: float = TIMEOUT, compilers: str | None = None) -> dict:
    """Run the smoke check of the module at ``so_path`` in a child process (no cache): ``{"ok": bool, "reason":
    str | None, "cacheable": bool}``. ``compilers`` (e.g. "CC=... CXX=...") is named in a crash's reason."""
    cmd = [python or sys.executable, "-c", SCRIPT, so_path]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        # a loaded machine, or a hang at load: decline for this process, ask again next time
        return {"ok": False, "cacheable": False,
                "reason": f"the smoke test of fastgrad._C did not finish in {timeout:.0f} s (not cached: it runs "
                          f"again in the next process; {ENV}=0 skips it)"}
    except OSError as exc:
        return {"ok": False, "cacheable": False, "reason": f"the smoke test of fastgrad._C could not start: {exc}"}
    if res.returncode == 0 and OK_MARK in res.stdout:
        return {"ok": True, "cacheable": True, "reason": None}
    built_with = f" ({compilers})" if compilers else ""
    if res.returncode < 0:
        try:
            name = signal.Signals(-res.returncode).name
        except ValueError:
            name = f"signal {-res.returncode}"
        reason = (f"the smoke test of fastgrad._C crashed with {name}: the extension was likely built with a C++ "
                  f"compiler{built_with} whose runtime does not match torch's; {FIX}")
    else:
        tail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-1:] or ["no output"]
        reason = (f"the smoke test of fastgrad._C failed (exit status {res.returncode}: {tail[0][:300]}); the "
                  f"build{built_with} is not usable as it is: {FIX}")
    return {"ok": False, "cacheable": True, "reason": reason}


def check(so_path: str, torch_version: str, compilers: str | None = None) -> dict:
    """The cached smoke check: ``{"ok", "reason", "cached", "cache"}``; ``ok`` True without a child process when
    FASTGRAD_EXT_SMOKE=0."""
    how = mode()
    if how == "skip":
        return {"ok": True, "reason": None, "cached": False, "cache": None, "skipped": True, "path": so_path}
    key = build_key(so_path, torch_version)
    path = cache_path(so_path)
    if how == "cached":
        hit = _read(path, key)
        if hit is not None:
            return {"ok": hit["ok"], "reason": hit.get("reason"), "cached": True, "cache": path, "path": so_path}
    out = run(so_path, compilers=compilers)
    if out["cacheable"]:
        _write(path, {"key": key, "ok": out["ok"], "reason": out["reason"]})
    return {"ok": out["ok"], "reason": out["reason"], "cached": False, "cache": path if out["cacheable"] else None,
            "path": so_path}
