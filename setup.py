"""Build script. The pure-Python package always installs, with the C++/CUDA sources inside it (fastgrad/_csrc);
the compiled extension fastgrad._C is optional here (see docs/install.md).

The extension needs torch at build time, which is deliberately not a build requirement (pip would fetch a
multi-GB CUDA torch into its isolated build env), so it is built here only with ``pip install
--no-build-isolation ...`` into an environment that has torch. A plain isolated ``pip install .`` finds no
torch and installs the pure-Python package quickly; fastgrad then compiles its kernels for the torch it runs
with at first use, into a cache (fastgrad/_build.py; ``python -m fastgrad.build`` does it ahead of time).
What is compiled and with which flags is fastgrad/_buildplan.py, shared by both builds.

Environment switches (unset or "auto": build what the toolchain allows, warn and skip on failure):

* ``FASTGRAD_BUILD_EXT=0|1``   never build the extension / build it and fail the install if it cannot be
* ``FASTGRAD_BUILD_CUDA=0|1``  leave out the CUDA kernels / require them (needs CUDA torch and nvcc)
* ``TORCH_CUDA_ARCH_LIST``     archs for the CUDA kernels, as torch's own extensions read it ("8.0;8.6;9.0+PTX",
  names like "Hopper" allowed, "native" for the visible GPUs): built exactly as given
* ``FASTGRAD_CUDA_ARCHS``      the same, for fastgrad alone; wins over TORCH_CUDA_ARCH_LIST
  Default: SASS for sm_75 sm_80 sm_86 sm_89 sm_90 sm_100 sm_120 (those the installed nvcc can build) plus PTX
  of the newest, so any newer GPU still runs after a one-time JIT (fastgrad/_archs.py).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys
import time

from setuptools import setup
from setuptools.command.build_ext import build_ext as _setuptools_build_ext
from setuptools.command.build_py import build_py as _setuptools_build_py

HERE = os.path.dirname(os.path.abspath(__file__))
EXT_NAME = "fastgrad._C"
INFO_NAME = "_build_info.json"  # _buildplan.INFO_NAME (not importable before _buildplan is loaded below)


def _note(msg: str) -> None:
    print(f"fastgrad setup: {msg}", file=sys.stderr)


def _load(name: str):
    """fastgrad/<name>.py, loaded by path: the package itself is not importable before it is installed (these
    modules import nothing from fastgrad)."""
    spec = importlib.util.spec_from_file_location(f"_fastgrad{name}", os.path.join(HERE, "fastgrad", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_buildplan = _load("_buildplan")


def _visible_caps():
    import torch

    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def _plan():
    """(ext_modules, cmdclass, build description) for this environment."""
    want = _buildplan.switch(os.environ, "FASTGRAD_BUILD_EXT")
    if want is False:
        _note("FASTGRAD_BUILD_EXT=0: installing without the compiled extension")
        return [], {}, None
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # isolated build env: no torch, pure-Python install
        if want:
            raise RuntimeError("FASTGRAD_BUILD_EXT=1 but torch cannot be imported in the build "
                               "environment; use pip install --no-build-isolation") from exc
        _note(f"torch not importable ({exc.__class__.__name__}, e.g. pip's isolated build env): installing the "
              "pure-Python package with its C++ sources; fastgrad compiles its kernels for the installed torch at "
              "first use (or ahead of time: python -m fastgrad.build)")
        return [], {}, None

    csrc = os.path.join(HERE, "csrc")
    # Errors here (an arch this nvcc cannot build, a malformed list, FASTGRAD_BUILD_CUDA=1 without CUDA) fail the
    # install with the reason, also in automatic mode: an explicit arch list that is silently ignored would crash
    # at run time.
    build = _buildplan.plan(torch, cpp_extension, _load("_archs"), csrc, os.environ, _visible_caps)
    info = build["record"]
    with_cuda = build["with_cuda"]
    if with_cuda:
        _note(f"CUDA archs ({info['arch_source']}): {_load('_archs').describe(build['sass'], build['ptx'])}")
    srcs = [f"csrc/{p}" for p in build["cpu_sources"] + build["cuda_sources"]]
    if with_cuda:
        ext = cpp_extension.CUDAExtension(EXT_NAME, srcs, extra_compile_args={"cxx": build["cxx"], "nvcc": build["nvcc"]})
    else:
        ext = cpp_extension.CppExtension(EXT_NAME, srcs, extra_compile_args={"cxx": build["cxx"]})
    compilers = _buildplan.compilers(os.environ)

    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class BuildExt(base):
        """torch's BuildExtension that never fails the install unless the build was forced on, and
        records what was built next to the module for `python -m fastgrad.info`."""

        def run(self):
            n = sum(len(e.sources) for e in self.extensions)
            _note(f"compiling the C++ extension ({n} files{', CUDA kernels included' if with_cuda else ''}; "
                  f"{compilers}): a few minutes on 2 CPU cores")
            # ninja starts each compiler line it prints with this: the files done of the total and the seconds
            # so far, so a person watching a long build sees it advance.
            os.environ.setdefault("NINJA_STATUS", "fastgrad build [%f/%t files, %e s] ")
            start = time.monotonic()
            error = None
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any compiler/toolchain failure
                # The compiler's own messages are above; one line says what it means for the install.
                error = f"{exc.__class__.__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                if want:
                    raise RuntimeError(f"FASTGRAD_BUILD_EXT=1 but the C++ extension did not build ({error})") from exc
                _note(f"WARNING: the C++ extension did not build ({error}): this install has NO compiled kernels "
                      "(fastgrad runs on its Triton and torch backends); FASTGRAD_BUILD_EXT=1 makes this an error")
            else:
                _note(f"compiled the C++ extension in {time.monotonic() - start:.0f} s")
            smoke = None if error else self._smoke()
            self._write_info(error, smoke)

        def _smoke(self):
            """Load the built module in a child process, run an op and make an input check with a number in its
            message fail (fastgrad/_smoke.py): a compiler whose C++ runtime does not match torch's gives a module
            that builds and imports, then crashes there. Recorded in the build info; the module checks itself
            again at its first load, where the result is cached per build."""
            smoke = _load("_smoke")
            path = self.get_ext_fullpath(EXT_NAME)
            if not os.path.exists(path):
                return None
            if smoke.mode() == "skip":
                result = {"ok": True, "reason": None, "skipped": True}
            else:
                result = smoke.run(path, compilers=compilers)
            record = {"ok": result["ok"], "reason": result["reason"], "skipped": bool(result.get("skipped"))}
            if result["ok"]:
                _note("smoke test of the built extension: " + ("skipped" if record["skipped"] else "passed"))
            else:
                _note(f"WARNING: {result['reason']}. fastgrad will not load this build (it falls back to its Triton "
                      "and torch backends with a warning).")
                if want:
                    raise RuntimeError(f"FASTGRAD_BUILD_EXT=1 but the built extension is not usable: {result['reason']}")
            return record

        def _info_path(self):
            return os.path.join(os.path.dirname(self.get_ext_fullpath(EXT_NAME)), INFO_NAME)

        def _write_info(self, error, smoke=None):
            data = dict(info, built=error is None, build_error=error, smoke=smoke)
            path = self._info_path()
            targets = [path]
            if self.inplace or getattr(self, "editable_mode", False):
                # In-place/editable builds import the module from the source tree: record it there too.
                targets.append(os.path.join(HERE, "fastgrad", INFO_NAME))
            for target in dict.fromkeys(os.path.abspath(t) for t in targets):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "w") as fh:
                    json.dump(data, fh, indent=1, sort_keys=True)

        def get_outputs(self):
            return super().get_outputs() + [self._info_path()]

        def get_output_mapping(self):
            # Editable installs copy the built files into the source tree through this mapping.
            mapping = dict(super().get_output_mapping())
            build_lib_info = os.path.join(os.path.dirname(
                os.path.join(self.build_lib, self.get_ext_filename(EXT_NAME))), INFO_NAME)
            mapping[build_lib_info] = os.path.join(HERE, "fastgrad", INFO_NAME)
            return mapping

    return [ext], {"build_ext": BuildExt}, info


class BuildPy(_setuptools_build_py):
    """Copies csrc/ into the package as fastgrad/_csrc, so every install (a pure-Python wheel from an isolated
    build among them) can compile the kernels for the torch it finds at run time (fastgrad/_build.py). An
    editable install builds from the checkout's csrc/ instead."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        csrc = os.path.join(HERE, "csrc")
        target = os.path.join(self.build_lib, "fastgrad", _buildplan.PACKAGED)
        for path in sorted(glob.glob(os.path.join(csrc, "**", "*"), recursive=True)):
            if os.path.isfile(path) and path.endswith((".cpp", ".cu", ".h", ".cuh")):
                dest = os.path.join(target, os.path.relpath(path, csrc))
                self.mkpath(os.path.dirname(dest))
                self.copy_file(path, dest, preserve_mode=False)


_ext_modules, _cmdclass, _ = _plan()
setup(ext_modules=_ext_modules, cmdclass=dict(_cmdclass, build_py=BuildPy))
