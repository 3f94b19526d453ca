"""Build script. The pure-Python package always installs; the compiled extension fastgrad._C is
optional (see README, "Building the extension").

The extension needs torch at build time, which is deliberately not a build requirement, so it is
only built with ``pip install --no-build-isolation ...`` into an environment that has torch. A plain
isolated ``pip install .`` finds no torch and installs the pure-Python package.

Environment switches (unset or "auto": build what the toolchain allows, warn and skip on failure):

* ``FASTGRAD_BUILD_EXT=0|1``   never build the extension / build it and fail the install if it cannot be
* ``FASTGRAD_BUILD_CUDA=0|1``  leave out the CUDA kernels / require them (needs CUDA torch and nvcc)
* ``FASTGRAD_CUDA_ARCHS``      compute capabilities for the CUDA kernels, default "80;90"
"""

from __future__ import annotations

import glob
import json
import os
import sys
import traceback

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


def _archs() -> list[str]:
    raw = os.environ.get("FASTGRAD_CUDA_ARCHS", "80;90")
    return [a.strip().replace(".", "") for a in raw.replace(",", ";").split(";") if a.strip()]


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

    # -ffp-contract=off: no FMA contraction, so results do not depend on the compiler's whim.
    cxx = ["-O3", "-ffp-contract=off", f"-DFASTGRAD_WITH_CUDA={int(with_cuda)}"]
    archs = _archs() if with_cuda else []
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if with_cuda else None,
        "archs": [f"sm_{a}" for a in archs],
        "cpu_kernels": True,
        "cuda_kernels": with_cuda,
        "cuda_skipped_because": cuda_why,
        "python": sys.version.split()[0],
    }
    if with_cuda:
        nvcc_flags = ["-O3", "-DFASTGRAD_WITH_CUDA=1"]
        for a in archs:
            nvcc_flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        ext = cpp_extension.CUDAExtension(EXT_NAME, cpu_sources + cuda_sources,
                                          extra_compile_args={"cxx": cxx, "nvcc": nvcc_flags})
    else:
        ext = cpp_extension.CppExtension(EXT_NAME, cpu_sources, extra_compile_args={"cxx": cxx})

    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class BuildExt(base):
        """torch's BuildExtension that never fails the install unless the build was forced on, and
        records what was built next to the module for `python -m fastgrad.info`."""

        def run(self):
            error = None
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any compiler/toolchain failure
                if want:
                    raise
                error = f"{exc.__class__.__name__}: {exc}"
                traceback.print_exc()
                _note("WARNING: building the compiled extension failed; installing without it "
                      f"(the torch backend is used instead). Error: {error}")
            self._write_info(error)

        def _info_path(self):
            return os.path.join(os.path.dirname(self.get_ext_fullpath(EXT_NAME)), INFO_NAME)

        def _write_info(self, error):
            data = dict(info, built=error is None, build_error=error)
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
