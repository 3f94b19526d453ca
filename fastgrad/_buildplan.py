"""What ``fastgrad._C`` is built from and with which flags, for the running torch, and which torch a build fits.

Written once for both builds: ``setup.py``'s (``pip install --no-build-isolation``, a wheel) and the first-use
build of :mod:`fastgrad._build` (an install without a usable extension, e.g. a plain ``pip install .``). Pure
Python with no fastgrad import and no torch import of its own (torch is passed in): ``setup.py`` loads this file
by path before the package is installed, as it loads ``_archs.py``.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
from typing import Callable, Mapping, Sequence

#: Where a wheel carries csrc/ inside the package (setup.py's build_py copies it there), so an installed
#: fastgrad can compile its kernels for a torch it was not built with.
PACKAGED = "_csrc"

#: The build record written next to each built module (``python -m fastgrad.info`` shows it).
INFO_NAME = "_build_info.json"

_SOURCE_FILES = (".cpp", ".cu", ".h", ".cuh")


def switch(env: Mapping[str, str], name: str) -> bool | None:
    """True/False when the variable forces a choice, None for automatic (unset or "auto")."""
    v = env.get(name, "").strip().lower()
    if v in ("", "auto"):
        return None
    return v not in ("0", "false", "no", "off")


def source_dir(package_dir: str) -> str | None:
    """The csrc/ folder this fastgrad's kernels are built from: the wheel's copy inside the package, else the
    source checkout's beside it (an editable install, or PYTHONPATH on a clone); None when neither is there."""
    packaged = os.path.join(package_dir, PACKAGED)
    if os.path.isfile(os.path.join(packaged, "ops.cpp")):
        return packaged
    checkout = os.path.dirname(os.path.abspath(package_dir))
    # setup.py beside it too: a folder named csrc next to site-packages/fastgrad is someone else's
    if os.path.isfile(os.path.join(checkout, "csrc", "ops.cpp")) and os.path.isfile(os.path.join(checkout, "setup.py")):
        return os.path.join(checkout, "csrc")
    return None


def sources(csrc: str) -> tuple[list[str], list[str]]:
    """(C++ sources, CUDA sources) of the extension, as paths relative to ``csrc``, posix-style, sorted."""
    def rel(pattern: str) -> list[str]:
        return sorted(os.path.relpath(p, csrc).replace(os.sep, "/") for p in glob.glob(os.path.join(csrc, pattern)))

    return rel("ops.cpp") + rel("host.cpp") + rel(os.path.join("cpu", "*.cpp")), \
        rel(os.path.join("cuda", "*.cu")) + rel(os.path.join("cuda", "*.cpp"))


def sources_hash(csrc: str) -> str:
    """A hash of every source and header under ``csrc`` (names and contents): two builds with the same hash
    compiled the same code."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(csrc):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith(_SOURCE_FILES):
                continue
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, csrc).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as fh:
                h.update(fh.read())
            h.update(b"\0")
    return h.hexdigest()[:16]


def torch_identity(torch) -> dict:
    """What a compiled extension depends on in torch: its version (a C++ extension built against one torch is not
    promised to load or run under another), the CUDA it was built with, and its C++ ABI."""
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cxx11_abi": None if abi is None else bool(abi)}


def mismatch(recorded: Mapping, identity: Mapping) -> str | None:
    """Why a build with this record must not be loaded under the torch of ``identity``, or None when it fits.
    A record that names no torch fits nothing; the CUDA and ABI entries are compared where the record has
    them (builds before they were recorded have only the version, which already differs between them)."""
    if not recorded.get("torch"):
        return "it has no build record naming the torch it was built for"
    if recorded["torch"] != identity["torch"]:
        return f"it was built for torch {recorded['torch']}, not the running torch {identity['torch']}"
    for key, what in (("torch_cuda", "CUDA"), ("cxx11_abi", "C++ ABI (_GLIBCXX_USE_CXX11_ABI)")):
        if key in recorded and recorded[key] != identity[key]:
            return (f"it was built for a torch {identity['torch']} with {what} {recorded[key]}, the running one "
                    f"has {identity[key]}")
    return None


def compilers(env: Mapping[str, str]) -> str:
    """The C/C++ compilers a build uses, as set (torch's builds read CC/CXX, else cc/c++)."""
    return f"CC={env.get('CC') or 'unset (cc)'} CXX={env.get('CXX') or 'unset (c++)'}"


def plan(torch, cpp_extension, archs, csrc: str, env: Mapping[str, str],
         visible: Callable[[], Sequence[tuple[int, int]]] | None = None) -> dict:
    """The build for the running torch: ``cpu_sources``/``cuda_sources`` (relative to ``csrc``), ``with_cuda``,
    the compiler flags ``cxx`` and ``nvcc``, and ``record`` (what the build info file says of it).

    CUDA kernels are built when torch has CUDA and nvcc is found (``FASTGRAD_BUILD_CUDA=0`` leaves them out,
    ``=1`` requires them: RuntimeError when they cannot be built), for the archs :func:`archs.select` picks
    (``archs`` is fastgrad/_archs.py; an arch list the nvcc cannot build raises its ArchError)."""
    cpu_sources, cuda_sources = sources(csrc)
    want_cuda = switch(env, "FASTGRAD_BUILD_CUDA")
    cuda_home = getattr(cpp_extension, "CUDA_HOME", None)
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    cuda_why = None
    if want_cuda is False:
        cuda_why = "FASTGRAD_BUILD_CUDA=0"
    elif torch.version.cuda is None:
        cuda_why = f"torch {torch.__version__} has no CUDA"
    elif not (nvcc and os.path.exists(nvcc)):
        cuda_why = "nvcc not found (set CUDA_HOME)"
    if cuda_why and want_cuda:
        raise RuntimeError(f"FASTGRAD_BUILD_CUDA=1 but the CUDA kernels cannot be built: {cuda_why}")
    with_cuda = cuda_why is None and bool(cuda_sources)

    sass: list[str] = []
    ptx: list[str] = []
    arch_source = None
    if with_cuda:
        sass, ptx, arch_source = archs.select(env, archs.nvcc_archs(nvcc), visible)
    # -ffp-contract=off: no FMA contraction, so results do not depend on the compiler's whim. The arch
    # lists are compiled into the module (fastgrad._C.cuda_sass / cuda_ptx) so the runtime knows what it
    # carries even when the build record is missing or stale.
    cxx = ["-O3", "-ffp-contract=off", f"-DFASTGRAD_WITH_CUDA={int(with_cuda)}"]
    nvcc_flags: list[str] = []
    if with_cuda:
        cxx += [f"-DFASTGRAD_CUDA_SASS={archs.define_value(sass)}", f"-DFASTGRAD_CUDA_PTX={archs.define_value(ptx)}"]
        # --fmad=false: nvcc contracts a * b + c into one FMA by default, and which products it contracts
        # changes with the compiler version and the arch, so norm bits would too. Without contraction every
        # product and sum is rounded as written, the same on every GPU and as in the C++ build
        # (-ffp-contract=off). The kernels are memory-bound: the separate multiply costs no time.
        nvcc_flags = ["-O3", "--fmad=false", "-DFASTGRAD_WITH_CUDA=1"] + archs.gencode_flags(sass, ptx)
    record = dict(torch_identity(torch), **{
        "cuda": torch.version.cuda if with_cuda else None,
        "archs": [f"sm_{a}" for a in sass] + [f"compute_{a}" for a in ptx],
        "sass": [f"sm_{a}" for a in sass],
        "ptx": [f"compute_{a}" for a in ptx],
        "arch_source": arch_source,
        "cpu_kernels": True,
        "cuda_kernels": with_cuda,
        "cuda_skipped_because": cuda_why,
        "python": sys.version.split()[0],
        "compilers": compilers(env),
        "sources": sources_hash(csrc),
    })
    return {"cpu_sources": cpu_sources, "cuda_sources": cuda_sources if with_cuda else [], "with_cuda": with_cuda,
            "sass": sass, "ptx": ptx, "cxx": cxx, "nvcc": nvcc_flags, "record": record}
