"""Smoke test of an installed fastgrad wheel, run from outside the checkout (`make wheel-check`,
`make first-use-check`): the package comes from the environment the wheel went into, its compiled extension from
there too (``--ext installed``, a wheel built with its extension) or from the build cache (``--ext cache``, a
pure-Python install whose kernels were compiled at first use), its C++ cpu backend clips as torch does, and the
command-line entry points start. Exits non-zero with the failing check named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import warnings

# torch without numpy warns at import; that says nothing about the wheel.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

import fastgrad  # noqa: E402
from fastgrad import _ext  # noqa: E402

CHECKOUT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def check(ok: bool, what: str) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        sys.exit(f"wheel smoke test failed: {what}")


def grads(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.empty(s)) for s in [(257, 129), (1000,), (3, 5, 7), (1,)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 3
    return params


def same(a, b) -> bool:
    return all(torch.equal(p.grad, q.grad) for p, q in zip(a, b))


def main() -> None:
    ext_from = sys.argv[sys.argv.index("--ext") + 1] if "--ext" in sys.argv else "installed"
    where = os.path.dirname(os.path.abspath(fastgrad.__file__))
    site = os.path.abspath(sysconfig.get_paths()["purelib"])
    check(os.path.dirname(where) == site and where != os.path.join(CHECKOUT, "fastgrad"),
          f"fastgrad imported from this environment's site-packages ({where}), not the checkout")
    mod = _ext.load()
    if ext_from == "cache":
        cache = os.path.abspath(os.environ["FASTGRAD_CACHE_DIR"])
        check(mod is not None and os.path.abspath(mod.__file__).startswith(cache + os.sep)
              and _ext.build_info()["origin"] == "first-use build",
              f"its compiled extension loads from the build cache {cache} ({getattr(mod, '__file__', None)}; "
              f"{_ext.load_error()})")
    else:
        check(mod is not None and os.path.dirname(os.path.abspath(mod.__file__)) == where,
              f"its compiled extension loads from there ({getattr(mod, '__file__', None)})")

    # max-norm and value clipping are exact, so the C++ kernels must give torch's bits.
    ours, theirs = grads(0), grads(0)
    n_ours = fastgrad.clip_grad_norm_(ours, 1.0, norm_type="inf", backend="cpu")
    n_torch = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type="inf")
    check(torch.equal(n_ours, n_torch) and same(ours, theirs), "clip_grad_norm_(inf) on the cpu backend == torch, bit for bit")
    fastgrad.clip_grad_value_(ours, 0.5, backend="cpu")
    torch.nn.utils.clip_grad_value_(theirs, 0.5)
    check(same(ours, theirs), "clip_grad_value_ on the cpu backend == torch, bit for bit")
    # the 2-norm sums in another order than torch: the contract's fp32 tolerance
    ours, theirs = grads(0), grads(0)
    n_ours = fastgrad.clip_grad_norm_(ours, 1.0, backend="cpu")
    n_torch = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    close = torch.allclose(n_ours, n_torch, rtol=1e-6, atol=0) and all(
        torch.allclose(p.grad, q.grad, rtol=2e-6, atol=0) for p, q in zip(ours, theirs))
    check(close, f"clip_grad_norm_(2) on the cpu backend matches torch ({n_ours.item()!r} vs {n_torch.item()!r})")

    for args, expect in ((["fastgrad.info"], r"C\+\+ kernels:\s+True"), (["fastgrad.check", "--help"], "usage:"),
                         (["fastgrad.bench", "--help"], "usage:")):
        res = subprocess.run([sys.executable, "-W", "ignore::UserWarning", "-m", *args], capture_output=True,
                             text=True, timeout=300)
        check(res.returncode == 0 and re.search(expect, res.stdout) is not None,
              f"python -m {' '.join(args)} (exit {res.returncode}){': ' + res.stderr[-2000:] if res.returncode else ''}")
    print(f"wheel smoke test passed: fastgrad {fastgrad.__version__} with its extension, torch {torch.__version__}")


if __name__ == "__main__":
    main()
