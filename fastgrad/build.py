"""``python -m fastgrad.build``: compile fastgrad's C++ (and CUDA) kernels for the running torch now, instead of at
first use, into the build cache (fastgrad/_build.py), and say which extension fastgrad will use and why.

Exit status 0 when fastgrad has usable compiled kernels afterwards, 1 when not (the reason is printed). Nothing
is compiled when the extension installed with fastgrad fits the running torch, unless ``--force``.
"""

from __future__ import annotations

import argparse
import sys

from . import _build, _ext


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastgrad.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true",
                    help="compile into the cache even when a build for this torch exists (installed or cached), and "
                         "retry a build that failed before")
    ap.add_argument("--verbose", "-v", action="store_true", help="show the compiler's output as it runs")
    ap.add_argument("--where", action="store_true", help="print the build cache folder for this torch and exit")
    args = ap.parse_args(argv)

    import torch

    path, _, why = _ext.installed()
    if args.where:
        try:
            print(_build.target(_ext.PACKAGE_DIR).folder)
        except _build.Unavailable as exc:
            print(f"no build possible: {exc}", file=sys.stderr)
            return 1
        return 0
    if why is None and not args.force:
        print(f"fastgrad._C installed at {path} was built for this torch ({torch.__version__}): nothing to compile "
              "(--force compiles a copy into the build cache anyway)")
    else:
        try:
            target = _build.target(_ext.PACKAGE_DIR)
            before = None if args.force else _build.find(target)
            record = before or _build.ensure(target, why or "a build was asked for (--force)", force=args.force,
                                             retry=True, verbose=args.verbose)
        except _build.Unavailable as exc:
            print(f"fastgrad: no build for torch {torch.__version__}: {exc}", file=sys.stderr)
            return 1
        when = "in the cache already, compiled" if before else "compiled"
        print(f"build for torch {torch.__version__}: {target.module} ({when} in {record.get('seconds', '?')} s)")
        if why is None:
            print("note: the installed fastgrad._C fits this torch and is the one fastgrad loads")
    mod = _ext.load()
    if mod is None:
        print(f"fastgrad has no usable compiled kernels: {_ext.load_error()}", file=sys.stderr)
        return 1
    info = _ext.build_info()
    kinds = "C++" + (" and CUDA" if info["cuda_kernels"] else "")
    smoke = "smoke test skipped" if (info["smoke"] or {}).get("skipped") else "smoke test passed"
    print(f"fastgrad uses {kinds} kernels from {info['path']} ({info['origin']}; {smoke})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
