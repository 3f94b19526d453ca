"""The first-use build of ``fastgrad._C``: when the install has no extension that fits the running torch (a
pure-Python ``pip install .``, or a wheel built for another torch), fastgrad compiles one for it with
``torch.utils.cpp_extension`` and ninja, once, into a cache folder, and every later process loads it from there.

A cached build is keyed by what a compiled extension depends on: torch's version, CUDA and C++ ABI, the Python
ABI and platform, the sources (a hash of csrc/) and the flags (fastgrad/_buildplan.py, shared with setup.py).
A lock file makes processes that start together (ranks of a job) build once: one compiles, the others wait for
it and load its result. A build is compiled in a private folder and published by renaming it into place, so a
reader never sees half a build. A failed build is recorded with its reason and log and not retried by every
process (``python -m fastgrad.build`` retries it). The loader (fastgrad/_ext.py) smoke-checks a cached build as
it does an installed one before loading it.

Environment:

* ``FASTGRAD_AUTO_BUILD=0``: never compile on first use (``python -m fastgrad.build`` still does).
* ``FASTGRAD_CACHE_DIR``: the cache folder (builds go to its ``ext/``); default ``$XDG_CACHE_HOME/fastgrad``,
  else ``~/.cache/fastgrad``.
* ``CC``, ``CXX``, ``MAX_JOBS``, ``FASTGRAD_BUILD_CUDA``, ``TORCH_CUDA_ARCH_LIST``, ``FASTGRAD_CUDA_ARCHS``: as for
  setup.py (docs/install.md).

Imports nothing from fastgrad but the build facts below it (``_archs``, ``_buildplan``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field

from . import _archs, _buildplan

OFF_ENV = "FASTGRAD_AUTO_BUILD"
CACHE_ENV = "FASTGRAD_CACHE_DIR"  # the same folder as the smoke check's cache (fastgrad/_smoke.py)
#: seconds a process waits for another one's build before giving up (a build on a loaded 2-core machine took
#: up to 850 s)
WAIT_LIMIT = 3600.0

OK_MARK = "fastgrad-build-ok"

# The child that compiles. A separate process: the compiler output goes to the log, a crash of the toolchain
# or of the module's load cannot take the caller down, and the caller's torch.ops registry is left alone.
# torch's load() names objects by the source's base name (csrc/ops.cpp and csrc/cpu/ops.cpp would both be
# ops.o), so each source is compiled through a one-line file of a unique name that includes it; its own
# #include "..." lines still resolve beside the real file.
CHILD = r"""
import json, os, signal, sys, time
args = json.loads(sys.argv[1])
if os.name == "posix":
    # The build dies with its caller: a killed training process leaves no compiler running. This process leads
    # its own process group, with ninja in it; ninja runs each compiler in a group of its own and ends them
    # itself on SIGTERM, so the group gets SIGTERM (SIGKILL would leave the compilers running).
    def end(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        os._exit(1)
    signal.signal(signal.SIGTERM, end)
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except (AttributeError, OSError):
        pass
    if os.getppid() != args["parent"]:
        sys.exit("the process that asked for this build is gone")
from torch.utils import cpp_extension
wrappers = []
os.makedirs(os.path.join(args["dir"], "src"), exist_ok=True)
for rel in args["sources"]:
    name = rel.replace("/", "_")
    path = os.path.join(args["dir"], "src", name)
    with open(path, "w") as fh:
        fh.write('#include "%s"\n' % os.path.join(args["csrc"], rel).replace(os.sep, "/"))
    wrappers.append(path)
start = time.monotonic()
cpp_extension.load(name="_C", sources=wrappers, extra_cflags=args["cxx"], extra_cuda_cflags=args["nvcc"] or None,
                   build_directory=args["dir"], with_cuda=args["with_cuda"], is_python_module=False, verbose=True)
print("%s %.1f" % (args["ok_mark"], time.monotonic() - start), flush=True)
"""


class Unavailable(Exception):
    """No build for the running torch can be had: the message is the one-line reason (and what fixes it)."""


@dataclass
class Target:
    """The build for the running torch: where it goes and what it is."""

    csrc: str
    plan: dict
    key: dict
    tag: str
    root: str  # the cache's ext/ folder
    folder: str = field(init=False)

    def __post_init__(self):
        self.folder = os.path.join(self.root, self.tag)

    @property
    def module(self) -> str:
        return os.path.join(self.folder, "_C" + _lib_suffix())

    @property
    def failure(self) -> str:
        return os.path.join(self.root, self.tag + ".failed.json")

    @property
    def lock(self) -> str:
        return os.path.join(self.root, self.tag + ".lock")

    @property
    def files(self) -> int:
        return len(self.plan["cpu_sources"]) + len(self.plan["cuda_sources"])


def enabled() -> bool:
    """Whether a process may compile on first use (FASTGRAD_AUTO_BUILD, default on)."""
    return _buildplan.switch(os.environ, OFF_ENV) is not False


def cache_root() -> str:
    """The folder cached builds go to: ``$FASTGRAD_CACHE_DIR/ext``, default ``~/.cache/fastgrad/ext``."""
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fastgrad")
    return os.path.join(os.path.abspath(base), "ext")


def _lib_suffix() -> str:
    return ".pyd" if sys.platform == "win32" else ".so"


def _visible_caps():
    import torch

    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def target(package_dir: str) -> Target:
    """The build this fastgrad (its package folder) needs for the running torch. Raises :class:`Unavailable`
    when there are no sources to build from, or the CUDA choice cannot be built (FASTGRAD_BUILD_CUDA=1 without
    nvcc, an arch list the nvcc cannot build)."""
    import torch
    from torch.utils import cpp_extension

    csrc = _buildplan.source_dir(package_dir)
    if csrc is None:
        raise Unavailable("this install carries no C++ sources to build it from (install fastgrad from its sdist, "
                          "a wheel of this version or a source checkout)")
    try:
        plan = _buildplan.plan(torch, cpp_extension, _archs, csrc, os.environ, _visible_caps)
    except (RuntimeError, _archs.ArchError) as exc:
        raise Unavailable(str(exc)) from exc
    record = plan["record"]
    key = {k: record[k] for k in ("torch", "torch_cuda", "cxx11_abi", "sources", "compilers")}
    key.update(python=sys.implementation.cache_tag, platform=sysconfig.get_platform(), cxx=plan["cxx"],
               nvcc=plan["nvcc"], with_cuda=plan["with_cuda"])
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    kind = f"cu{record['torch_cuda']}" if plan["with_cuda"] else "cpu"
    tag = re.sub(r"[^A-Za-z0-9._-]", "_", f"torch{record['torch']}-{kind}-{key['python']}-{digest}")
    return Target(csrc=csrc, plan=plan, key=key, tag=tag, root=cache_root())


def find(t: Target) -> dict | None:
    """The record of the published build of ``t``, or None when there is none (yet)."""
    try:
        with open(os.path.join(t.folder, _buildplan.INFO_NAME)) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    if record.get("key") != t.key or not os.path.isfile(t.module):
        return None
    return record


def failed(t: Target) -> dict | None:
    """The record of an earlier failed build of ``t`` (``reason``, ``log``), or None."""
    try:
        with open(t.failure) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    return record if record.get("key") == t.key else None


def _say(msg: str) -> None:
    print(f"fastgrad: {msg}", file=sys.stderr, flush=True)


def _toolchain(t: Target) -> None:
    """Raise :class:`Unavailable` naming what is missing to compile (checked before any lock or folder)."""
    cxx = os.environ.get("CXX") or "c++"
    try:
        cxx_cmd = shlex.split(cxx)[0]
    except (ValueError, IndexError):
        cxx_cmd = cxx
    if shutil.which(cxx_cmd) is None:
        raise Unavailable(f"no C++ compiler was found ({'CXX=' + cxx if os.environ.get('CXX') else 'c++'} is not "
                          "on PATH): install one (e.g. apt install g++) or set CXX")
    if _ninja_dir() is None and shutil.which("ninja") is None:
        raise Unavailable(f"ninja is not installed for {sys.executable} (pip install ninja)")


def _ninja_dir() -> str | None:
    """The folder of the pip ``ninja`` package's binary (a venv's bin/ is not on PATH unless it is activated)."""
    try:
        import ninja
    except ImportError:
        return None
    folder = getattr(ninja, "BIN_DIR", None)
    return folder if folder and os.path.isdir(folder) else None


def _child_env() -> dict:
    env = dict(os.environ)
    extra = [d for d in (_ninja_dir(), os.path.dirname(sys.executable)) if d]
    env["PATH"] = os.pathsep.join(extra + [env.get("PATH", "")])
    # ninja starts each compiler line with this: the files done of the total and the seconds so far
    env.setdefault("NINJA_STATUS", "fastgrad build [%f/%t files, %e s] ")
    return env


def first_error(log: str) -> str:
    """The line of a build log that says why it failed: the first compiler error, else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in lines:
        if re.search(r"\berror\b", ln, re.I) and not ln.startswith(("fastgrad build [", "FAILED:")):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def compile_into(t: Target, folder: str, log_path: str, verbose: bool = False) -> float:
    """Compile ``t`` into ``folder`` (a child process; its output goes to ``log_path``, and to stderr too when
    ``verbose``); returns the seconds it took. Raises :class:`Unavailable` with the first error on failure."""
    args = {"dir": folder, "csrc": t.csrc, "sources": t.plan["cpu_sources"] + t.plan["cuda_sources"],
            "cxx": t.plan["cxx"], "nvcc": t.plan["nvcc"], "with_cuda": t.plan["with_cuda"], "ok_mark": OK_MARK,
            "parent": os.getpid()}
    start = time.monotonic()
    posix = os.name == "posix"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_child_env(), text=True,
                                errors="replace", **({"start_new_session": True} if posix else {}))
        try:
            for line in proc.stdout:
                log.write(line)
                if verbose:
                    sys.stderr.write(line)
            proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: no orphan compiler left behind (SIGTERM: ninja ends its own)
                try:
                    os.killpg(proc.pid, signal.SIGTERM) if posix else proc.kill()
                    proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                proc.wait()
    with open(log_path, errors="replace") as fh:
        text = fh.read()
    if proc.returncode != 0 or OK_MARK not in text or not os.path.isfile(os.path.join(folder, "_C" + _lib_suffix())):
        raise Unavailable(f"its build for this torch failed: {first_error(text)} (log: {log_path})")
    return time.monotonic() - start


def ensure(t: Target, why: str, *, force: bool = False, retry: bool = False, verbose: bool = False) -> dict:
    """The record of a published build of ``t``, compiling it first when there is none (``force``: compile it
    again anyway; ``retry``: compile even when an earlier build failed, which otherwise raises at once). ``why``
    (why the installed extension is not used) opens the progress line. Raises :class:`Unavailable` with the
    reason when no build can be had."""
    known = _published_or_failed(t, force, retry)
    if known is not None:
        return known
    _toolchain(t)
    try:
        os.makedirs(t.root, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=t.root)  # unique per thread and process
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise Unavailable(f"the build cache {t.root} is not writable ({exc.strerror or exc}): set {CACHE_ENV} to a "
                          "writable folder") from exc
    from filelock import FileLock, Timeout  # a dependency of torch

    lock = FileLock(t.lock)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(f"waiting for another process that is compiling the C++ kernels into {t.folder} (lock: {t.lock})")
        try:
            lock.acquire(timeout=WAIT_LIMIT)
        except Timeout as exc:
            raise Unavailable(f"another process has held the build lock {t.lock} for over {WAIT_LIMIT:.0f} s; "
                              "remove it if no build is running") from exc
    try:
        # the process we waited for may have built it, or failed
        return _published_or_failed(t, force, retry) or _build_and_publish(t, why, verbose)
    finally:
        lock.release()


def _published_or_failed(t: Target, force: bool, retry: bool) -> dict | None:
    """The published build's record; raises the recorded failure (unless ``retry``); None: compile it."""
    if force:
        return None
    record = find(t)
    if record is not None:
        return record
    earlier = None if retry else failed(t)
    if earlier is not None:
        raise Unavailable(f"its build for this torch failed ({earlier['when']}): {earlier['reason']} (log: "
                          f"{earlier['log']}); python -m fastgrad.build tries again")
    return None


def _build_and_publish(t: Target, why: str, verbose: bool) -> dict:
    import torch

    private = os.path.join(t.root, f".{t.tag}.{os.getpid()}.tmp")
    # Under the lock no other process builds this target: any private folder of it is a killed build's.
    for stale in glob.glob(os.path.join(t.root, f".{glob.escape(t.tag)}.*.tmp")):
        shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(private)
    log = os.path.join(private, "build.log")
    cuda = f", CUDA kernels for {_archs.describe(t.plan['sass'], t.plan['ptx'])}" if t.plan["with_cuda"] else ""
    _say(f"{why}; compiling fastgrad's C++ kernels for torch {torch.__version__} now, once ({t.files} files{cuda}, "
         f"a few minutes; log: {log}; {OFF_ENV}=0 turns this off)")
    try:
        try:
            seconds = compile_into(t, private, log, verbose)
        except Unavailable as exc:
            kept = os.path.join(t.root, t.tag + ".failed.log")
            shutil.copyfile(log, kept)
            reason = str(exc).replace(log, kept)
            _write_json(t.failure, {"key": t.key, "reason": first_error(open(kept, errors="replace").read()),
                                    "log": kept, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            raise Unavailable(reason) from None
        record = dict(t.plan["record"], built=True, build_error=None, smoke=None, key=t.key,
                      made_by="first-use build", seconds=round(seconds, 1), log=os.path.join(t.folder, "build.log"))
        _write_json(os.path.join(private, _buildplan.INFO_NAME), record)
        old = None
        if os.path.exists(t.folder):  # a forced rebuild: move the old one aside first
            old = os.path.join(t.root, f".{t.tag}.{os.getpid()}.old")
            os.replace(t.folder, old)
        os.replace(private, t.folder)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.remove(t.failure)
        except OSError:
            pass
    finally:
        shutil.rmtree(private, ignore_errors=True)
    _say(f"compiled the C++ kernels in {seconds:.0f} s into {t.folder} (later processes load them from there)")
    return record


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)
