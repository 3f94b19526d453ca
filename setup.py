"""Build script. The pure-Python package always installs; the compiled extension fastgrad._C is
optional (see docs/install.md, "Building the extension").

The extension needs torch at build time, which is deliberately not a build requirement, so it is
only built with ``pip install --no-build-isolation ...`` into an environment that has torch. A plain
isolated ``pip install .`` finds no torch and installs the pure-Python package.

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

HERE = os.path.dirname(os.path.abspath(__file__))
EXT_NAME = "fastgrad._C"
INFO_NAME = "_build_info.json"


def _switch(name: str) -> bool | None:
    """True/False when the variable forces a choice, None for automatic."""
    v = os.environ.get(name, "").strip().lower()
    if v in ("", "auto"):
        return None
    return v not in ("0", "false", "no", "off")


def _note(msg: str) -> None:
    print(f"fastgrad setup: {msg}", file=sys.stderr)


def _load_archs():
    """fastgrad/_archs.py, loaded by path: the package itself is not importable before it is installed."""
    spec = importlib.util.spec_from_file_location("_fastgrad_archs", os.path.join(HERE, "fastgrad", "_archs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_smoke():
    """fastgrad/_smoke.py, loaded by path as _archs.py is."""
    spec = importlib.util.spec_from_file_location("_fastgrad_smoke", os.path.join(HERE, "fastgrad", "_smoke.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compilers() -> str:
    """The C/C++ compilers this build uses, as set (torch's BuildExtension reads CC/CXX, else cc/c++)."""
    return f"CC={os.environ.get('CC') or 'unset (cc)'} CXX={os.environ.get('CXX') or 'unset (c++)'}"


def _visible_caps():
    import torch

    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def _rel(paths):
    return sorted(os.path.relpath(p, HERE) for p in paths)


def _plan():
    """(ext_modules, cmdclass, build description) for this environment."""
    want = _switch("FASTGRAD_BUILD_EXT")
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
        _note(f"torch not importable ({exc.__class__.__name__}); installing without the compiled "
              "extension (build it with: pip install --no-build-isolation -e .)")
        return [], {}, None

    cpu_sources = _rel([os.path.join(HERE, "csrc", "ops.cpp"), os.path.join(HERE, "csrc", "host.cpp")] + glob.glob(os.path.join(HERE, "csrc", "cpu", "*.cpp")))
    cuda_sources = _rel(glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cu")) + glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cpp")))

    want_cuda = _switch("FASTGRAD_BUILD_CUDA")
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

    sass, ptx, arch_source = [], [], None
    if with_cuda:
        archs = _load_archs()
        # Errors here (an arch this nvcc cannot build, a malformed list) fail the install with the reason,
        # also in automatic mode: an explicit arch list that is silently ignored would crash at run time.
        sass, ptx, arch_source = archs.select(os.environ, archs.nvcc_archs(nvcc), _visible_caps)
        _note(f"CUDA archs ({arch_source}): {archs.describe(sass, ptx)}")
    # -ffp-contract=off: no FMA contraction, so results do not depend on the compiler's whim. The arch
    # lists are compiled into the module (fastgrad._C.cuda_sass / cuda_ptx) so the runtime knows what it
    # carries even when _build_info.json is missing or stale.
    cxx = ["-O3", "-ffp-contract=off", f"-DFASTGRAD_WITH_CUDA={int(with_cuda)}"]
    if with_cuda:
        cxx += [f"-DFASTGRAD_CUDA_SASS={archs.define_value(sass)}", f"-DFASTGRAD_CUDA_PTX={archs.define_value(ptx)}"]
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if with_cuda else None,
        "archs": [f"sm_{a}" for a in sass] + [f"compute_{a}" for a in ptx],
        "sass": [f"sm_{a}" for a in sass],
        "ptx": [f"compute_{a}" for a in ptx],
        "arch_source": arch_source,
        "cpu_kernels": True,
        "cuda_kernels": with_cuda,
        "cuda_skipped_because": cuda_why,
        "python": sys.version.split()[0],
        "compilers": _compilers(),
    }
    if with_cuda:
        # --fmad=false: nvcc contracts a * b + c into one FMA by default, and which products it contracts
        # changes with the compiler version and the arch, so norm bits would too. Without contraction every
        # product and sum is rounded as written, the same on every GPU and as in the C++ build
        # (-ffp-contract=off). The kernels are memory-bound: the separate multiply costs no time.
        nvcc_flags = ["-O3", "--fmad=false", "-DFASTGRAD_WITH_CUDA=1"] + archs.gencode_flags(sass, ptx)
        ext = cpp_extension.CUDAExtension(EXT_NAME, cpu_sources + cuda_sources,
                                          extra_compile_args={"cxx": cxx, "nvcc": nvcc_flags})
    else:
        ext = cpp_extension.CppExtension(EXT_NAME, cpu_sources, extra_compile_args={"cxx": cxx})

    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class BuildExt(base):
        """torch's BuildExtension that never fails the install unless the build was forced on, and
        records what was built next to the module for `python -m fastgrad.info`."""

        def run(self):
            n = sum(len(e.sources) for e in self.extensions)
            _note(f"compiling the C++ extension ({n} files{', CUDA kernels included' if with_cuda else ''}; "
                  f"{_compilers()}): a few minutes on 2 CPU cores")
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
            smoke = _load_smoke()
            path = self.get_ext_fullpath(EXT_NAME)
            if not os.path.exists(path):
                return None
            if smoke.mode() == "skip":
                result = {"ok": True, "reason": None, "skipped": True}
            else:
                result = smoke.run(path, compilers=_compilers())
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


_ext_modules, _cmdclass, _ = _plan()
setup(ext_modules=_ext_modules, cmdclass=_cmdclass)
