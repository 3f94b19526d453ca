"""Which GPU architectures the CUDA kernels are built for, and whether a build can run on a given GPU.

Pure Python with no torch import: ``setup.py`` loads this file by path (before fastgrad is installed) to
choose the nvcc ``-gencode`` flags, and the cuda backend uses the same rules at run time to decide, per
device, whether the compiled module carries code that device can execute.

An arch is written as nvcc writes its number: ``"80"``, ``"90a"``, ``"120"`` (compute capability 8.0, 9.0
with the arch-specific features, 12.0). A build carries SASS (machine code, ``sm_XY``) for some archs and
PTX (``compute_XY``, JIT-compiled by the driver on first use) for others.

Rules of the CUDA compatibility model that :func:`runs_on` applies:

* SASS ``sm_XY`` runs on a GPU of the same major version and minor >= Y (``sm_80`` on 8.6 and 8.9, never on
  9.0); ``sm_XYa`` only on exactly X.Y; ``sm_XYf`` (family) like plain SASS;
* PTX ``compute_XY`` JIT-compiles for any GPU of compute capability >= X.Y; ``compute_XYa`` only for X.Y.
"""

from __future__ import annotations

import re
import subprocess
from typing import Callable, Iterable, Mapping, Sequence

#: SASS built by default (filtered by what the installed nvcc can emit): Turing, Ampere (A100, RTX 30),
#: Ada (L4, L40, RTX 40), Hopper (H100/H200), Blackwell datacenter (B200) and consumer (RTX 50). PTX of
#: the newest of them is added, so GPUs newer than the build still run (after a one-time JIT).
COMMON = ("75", "80", "86", "89", "90", "100", "120")

#: torch's TORCH_CUDA_ARCH_LIST names (torch.utils.cpp_extension), expanded the same way.
NAMED = {
    "Kepler+Tesla": "3.7",
    "Kepler": "3.5+PTX",
    "Maxwell+Tegra": "5.3",
    "Maxwell": "5.0;5.2+PTX",
    "Pascal": "6.0;6.1+PTX",
    "Volta+Tegra": "7.2",
    "Volta": "7.0+PTX",
    "Turing": "7.5+PTX",
    "Ampere+Tegra": "8.7",
    "Ampere": "8.0;8.6+PTX",
    "Ada": "8.9+PTX",
    "Hopper": "9.0+PTX",
    "Blackwell+Tegra": "11.0",
    "Blackwell": "10.0;10.3;12.0;12.1+PTX",
}

_ARCH = re.compile(r"^(?:sm_|compute_)?(\d+)(?:\.(\d))?([af]?)$")


class ArchError(ValueError):
    """An arch list that cannot be built; the message names the bad entry and what is accepted."""


def parse_arch(token: str) -> str:
    """``"8.6"``, ``"86"``, ``"sm_86"``, ``"9.0a"`` -> nvcc's number (``"86"``, ``"90a"``)."""
    m = _ARCH.match(token.strip())
    if not m:
        raise ArchError(f"bad CUDA arch {token!r}: write it as 8.6, 86, sm_86 or 9.0a")
    major, minor, suffix = m.groups()
    if minor is None:  # nvcc's form: last digit is the minor version
        if len(major) < 2:
            raise ArchError(f"bad CUDA arch {token!r}: write it as 8.6, 86, sm_86 or 9.0a")
        return f"{major}{suffix}"
    return f"{major}{minor}{suffix}"


def split(arch: str) -> tuple[int, int, str]:
    """``"90a"`` -> (9, 0, "a")."""
    m = re.match(r"^(\d+)(\d)([af]?)$", arch)
    if not m:
        raise ArchError(f"bad CUDA arch {arch!r}")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def _key(arch: str) -> tuple[int, int, str]:
    return split(arch)


def parse_arch_list(spec: str) -> tuple[list[str], list[str]]:
    """A TORCH_CUDA_ARCH_LIST-style string -> (SASS archs, PTX archs), each sorted and without repeats.

    Entries are separated by ``;``, ``,`` or spaces; ``+PTX`` adds PTX of that arch besides its SASS
    (torch's meaning); torch's names (``Ampere``, ``Hopper``...) expand as torch expands them."""
    for name, value in NAMED.items():  # combined names first (dict order), as torch does
        spec = spec.replace(name, value)
    sass: set[str] = set()
    ptx: set[str] = set()
    for tok in re.split(r"[;,\s]+", spec.strip()):
        if not tok:
            continue
        with_ptx = tok.upper().endswith("+PTX")
        arch = parse_arch(tok[:-4] if with_ptx else tok)
        sass.add(arch)
        if with_ptx:
            ptx.add(arch)
    if not sass:
        raise ArchError(f"empty CUDA arch list {spec!r}")
    return sorted(sass, key=_key), sorted(ptx, key=_key)


def nvcc_archs(nvcc: str) -> set[str] | None:
    """Archs the installed nvcc can emit (``nvcc --list-gpu-code``), None when it cannot be asked."""
    try:
        out = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    found = {m.group(1) for m in re.finditer(r"sm_(\d+[af]?)", out.stdout)}
    return found or None


def select(env: Mapping[str, str], supported: set[str] | None,
           visible: Callable[[], Sequence[tuple[int, int]]] | None = None) -> tuple[list[str], list[str], str]:
    """(SASS archs, PTX archs, where the choice came from) for a build.

    ``FASTGRAD_CUDA_ARCHS`` (fastgrad's own override) wins, then ``TORCH_CUDA_ARCH_LIST`` (exactly as
    given; ``native`` means the visible GPUs, newest with PTX, as torch does), else the default: SASS for
    :data:`COMMON` that ``supported`` (the nvcc's archs; None = unknown) allows, plus PTX of the newest.
    An explicit list naming an arch the nvcc cannot emit is an error, not silently dropped."""
    for var in ("FASTGRAD_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST"):
        spec = env.get(var, "").strip()
        if not spec:
            continue
        if spec.lower() == "native":
            caps = sorted(set(visible() if visible else ()))
            if not caps:
                raise ArchError(f"{var}=native but no GPU is visible; name the archs, e.g. {var}='8.0;9.0+PTX'")
            spec = ";".join(f"{a}.{b}" for a, b in caps) + "+PTX"
        sass, ptx = parse_arch_list(spec)
        if supported is not None:
            bad = [a for a in sass if a.rstrip("af") not in supported]
            if bad:
                raise ArchError(
                    f"{var}={spec!r} asks for {', '.join('sm_' + a for a in bad)}, which this nvcc cannot "
                    f"build (it supports: {' '.join('sm_' + a for a in sorted(supported, key=_key))})")
        return sass, ptx, var
    sass = [a for a in COMMON if supported is None or a in supported]
    if not sass:
        raise ArchError("this nvcc supports none of fastgrad's default archs "
                        f"({', '.join('sm_' + a for a in COMMON)}); set TORCH_CUDA_ARCH_LIST")
    return sass, [sass[-1]], "default"


def gencode_flags(sass: Iterable[str], ptx: Iterable[str]) -> list[str]:
    """nvcc flags embedding SASS for ``sass`` and PTX for ``ptx``."""
    flags: list[str] = []
    for a in sass:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    for a in ptx:
        flags += ["-gencode", f"arch=compute_{a},code=compute_{a}"]
    return flags


def define_value(archs: Sequence[str]) -> str:
    """The archs as one preprocessor token (``80_86_90a``; ``none`` when empty) for a ``-D`` flag: a single
    pp-number needs no quoting through setuptools, ninja and the shell, and the C++ side stringifies it."""
    return "_".join(archs) if archs else "none"


def from_define(value: str) -> list[str]:
    """Inverse of :func:`define_value`."""
    return [] if value in ("", "none") else [a for a in value.split("_") if a]


def runs_on(cc: tuple[int, int], sass: Iterable[str], ptx: Iterable[str]) -> str | None:
    """How a build with these archs runs on a GPU of compute capability ``cc``: ``"sm_XY"`` (SASS),
    ``"compute_XY (JIT)"`` (PTX), or None when it carries nothing that GPU can execute."""
    major, minor = cc
    best = None
    for a in sass:
        am, an, suf = split(a)
        ok = (am, an) == (major, minor) if suf == "a" else (am == major and an <= minor)
        if ok and (best is None or _key(a) > _key(best)):
            best = a
    if best is not None:
        return f"sm_{best}"
    best = None
    for a in ptx:
        am, an, suf = split(a)
        ok = (am, an) == (major, minor) if suf == "a" else (am, an) <= (major, minor)
        if ok and (best is None or _key(a) > _key(best)):
            best = a
    if best is not None:
        return f"compute_{best} (JIT)"
    return None


def describe(sass: Sequence[str], ptx: Sequence[str]) -> str:
    """``"sm_80 sm_86 sm_90 SASS, PTX compute_90 for newer"``."""
    s = " ".join(f"sm_{a}" for a in sass) + " SASS" if sass else "no SASS"
    p = ", PTX " + " ".join(f"compute_{a}" for a in ptx) + " for newer GPUs" if ptx else ", no PTX"
    return s + p


def decline_reason(cc: tuple[int, int], sass: Sequence[str], ptx: Sequence[str]) -> str | None:
    """None when the build runs on ``cc``, else the reason and the command that fixes it."""
    if runs_on(cc, sass, ptx) is not None:
        return None
    return (f"the compiled CUDA kernels carry {describe(sass, ptx)}: nothing a compute capability "
            f"{cc[0]}.{cc[1]} GPU can run; rebuild with TORCH_CUDA_ARCH_LIST=\"{cc[0]}.{cc[1]}+PTX\" "
            "pip install --no-build-isolation -e .")
