"""What a plain `pip install .` gives (`make first-use-check`, run by CI): in a fresh venv whose fastgrad came from
an isolated build (a pure-Python wheel carrying the C++ sources), the first use compiles the kernels for the
installed torch, saying so on one line with the time it took, and the kernels then work (.ci/wheel_smoke.py
--ext cache); a second process loads them from the cache without compiling. Run with the venv's python from
outside the checkout, FASTGRAD_CACHE_DIR set to an empty folder. Exits non-zero with the failing check named."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def check(ok: bool, what: str) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        sys.exit(f"first-use check failed: {what}")


def smoke() -> tuple[float, str]:
    """.ci/wheel_smoke.py --ext cache in a fresh process: (seconds, its stderr)."""
    start = time.monotonic()
    res = subprocess.run([sys.executable, os.path.join(HERE, "wheel_smoke.py"), "--ext", "cache"], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=3600)
    took = time.monotonic() - start
    sys.stdout.write(res.stdout)
    check(res.returncode == 0, f"the wheel smoke test with the kernels from the cache (exit {res.returncode}): "
                               f"{res.stderr[-3000:] if res.returncode else ''}")
    return took, res.stderr


def main() -> None:
    check(bool(os.environ.get("FASTGRAD_CACHE_DIR")), "FASTGRAD_CACHE_DIR names the (empty) build cache")
    pkg = os.path.join(sysconfig.get_paths()["purelib"], "fastgrad")
    check(not glob.glob(os.path.join(pkg, "_C*")), f"the install has no compiled extension ({pkg})")
    check(os.path.isfile(os.path.join(pkg, "_csrc", "ops.cpp")), "the install carries the C++ sources (fastgrad/_csrc)")

    first, err = smoke()
    lines = [ln for ln in err.splitlines() if ln.startswith("fastgrad: ")]
    for ln in lines:
        print(f"  | {ln}")
    check(any("compiling fastgrad's C++ kernels for torch" in ln for ln in lines),
          "the first use says it is compiling the kernels")
    done = [ln for ln in lines if ln.startswith("fastgrad: compiled the C++ kernels in ")]
    check(len(done) == 1, "and how long it took")
    print(f"== first use, compile included: {first:.0f} s")

    second, err = smoke()
    check("compiling" not in err and "compiled" not in err, "a second process loads them without compiling")
    # numpy comes with fastgrad (torch's CPU wheel does not require it, and warns at every start without it)
    check("Failed to initialize NumPy" not in err, "torch starts without its warning about a missing NumPy")
    print(f"== second use, from the cache: {second:.1f} s")


if __name__ == "__main__":
    main()
