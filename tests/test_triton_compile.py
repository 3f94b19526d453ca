"""Ahead-of-time compilation of every Triton kernel for real NVIDIA targets (sm_80, sm_90), no GPU needed.

CI runs the kernels only in the interpreter, which never lowers them: a kernel can pass every interpreted
test and still fail to compile on a GPU. Here each kernel is compiled down to PTX and cubin (Triton bundles
ptxas) for exactly the specialisations the launchers produce: worker processes drive every launcher on
small CPU tensors with ``JITFunction.run`` replaced by a recorder, let Triton's own binder specialise the
recorded arguments (signature, constexprs, alignment attributes, options), and compile that.

The workers run this file as a script with TRITON_INTERPRET removed from the environment: under the
interpreter ``triton.jit`` returns interpreted functions at decoration time, so nothing could be compiled
in the test process itself (conftest sets TRITON_INTERPRET=1 when there is no GPU).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

ARCHS = (80, 90)
# 128-bit global loads: 4 x 32-bit or 2 x 64-bit lanes, with or without cache qualifiers (.nc, .L1::...)
V128_LOAD = re.compile(r"ld\.global(?:\.[\w:]+)*?\.(?:v4\.[bfus]32|v2\.[bfus]64)\b")
# A predicated (masked) 128/64-bit global access: one predicate for 2-8 elements. In a gradient pass that is
# only sound where the mask is provably uniform per vector, which the tails never are (tensor lengths are
# arbitrary); Triton emits it when an alignment hint wrongly lands on the block length.
PRED_VEC = re.compile(r"@!?%p\d+\s+(?:ld|st)\.global(?:\.[\w:]+)*?\.v[24]\.")
# A fused multiply-add in the PTX (fma.rn.f32, fma.rn.ftz.f32, fma.rn.f64, packed variants)
FMA = re.compile(r"\bfma\.rn(?:\.\w+)*\s")
WORKER_TIMEOUT_S = 540


# ================================================================================================ worker
def _api():
    """Everything version-sensitive about Triton, in one place: ``(compile_case, None)`` or
    ``(None, why not)``.

    ``compile_case(kernel, args, kwargs, arch, do_compile=True)`` specialises one recorded launch as
    ``JITFunction.run`` does (Triton 3.6 to 3.9: ``create_function_from_signature``, then ``_pack_args``)
    but for ``GPUTarget("cuda", arch, 32)`` instead of the current device, and returns ``(dedup key,
    constexprs by name, runtime argument types, compiled kernel or None)``."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except Exception as e:  # noqa: BLE001 - any import failure means: no AOT path in this Triton
        return None, f"Triton AOT API not importable ({type(e).__name__}: {e})"
    if not hasattr(JITFunction, "_pack_args"):
        return None, f"triton {triton.__version__}: JITFunction._pack_args is missing (API changed)"
    backends = {}

    def specialise(kernel, args, kwargs, arch):
        target = GPUTarget("cuda", arch, 32)
        if arch not in backends:
            backends[arch] = make_backend(target)
        backend = backends[arch]
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, spec, opts = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
        return target, options, signature, constexprs, attrs

    def compile_case(kernel, args, kwargs, arch, do_compile=True):
        target, options, signature, constexprs, attrs = specialise(kernel, args, kwargs, arch)
        names = kernel.arg_names
        cx = {}
        for k, v in constexprs.items():
            name = k if isinstance(k, str) else names[k[0]]
            cx[name] = str(v)
        # runtime argument types that vary between launches (e.g. an fp32 or fp64 factor pointer)
        rt = {k: v for k, v in signature.items() if v != "constexpr"}
        key = (repr(sorted(cx.items())), repr(sorted(rt.items())), repr(sorted(attrs.items())),
               repr(sorted(options.__dict__.items())))
        if not do_compile:
            return key, cx, rt, None
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
        return key, cx, rt, compiled

    return compile_case, None


def _discover():
    """Every ``@triton.jit`` kernel (name ending in ``_kernel``) of the fastgrad.triton_kernels modules."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import fastgrad.triton_kernels as pkg

    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                found[f"{obj.fn.__module__}.{obj.fn.__name__}"] = obj
    return found


class _config:
    """Temporarily override Config attributes (the scenarios run in a worker, outside pytest's monkeypatch)."""

    def __init__(self, **kw):
        self.kw = kw
        self.old = {}

    def __enter__(self):
        from fastgrad.triton_kernels import Config

        for k, v in self.kw.items():
            self.old[k] = getattr(Config, k)
            setattr(Config, k, v)

    def __exit__(self, *exc):
        from fastgrad.triton_kernels import Config

        for k, v in self.old.items():
            setattr(Config, k, v)


def _scenarios():
    """Drive every launcher over each gradient dtype, norm mode, AMP on/off, aligned/misaligned storage,
    fp32/fp64 scale factors, same- and mixed-dtype lists: yields nothing, the recorder sees the launches."""
    import torch

    import fastgrad.triton_kernels as tk

    f32, f16, bf16, f64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
    norms = (2.0, 1.0, float("inf"), 3.0)

    def make(shape, dt, aligned):
        n = 1
        for s in shape:
            n *= s
        if aligned:
            return torch.randn(shape, dtype=f64).to(dt)
        # one element in: the data pointer is not 16-byte aligned, so the launcher picks ALIGNED=False
        return torch.randn(n + 1, dtype=f64).to(dt)[1:].view(shape)

    for dt in (f32, f16, bf16, f64):
        for aligned in (True, False):
            flat = [make((3000,), dt, aligned), make((37,), dt, aligned)]
            # rows of 16 elements keep every row start 16-byte aligned for the row-wise ops
            rows = [make((4, 16), dt, aligned), make((40,), dt, aligned)]
            # rows longer than ROW_MAX take the split path (partials, finalize, second pass)
            long_rows = [make((2, 48), dt, aligned), make((40,), dt, aligned)]
            for nt in norms:
                tk.launch_norm(flat, nt)
                tk.launch_amp_norm(flat, torch.tensor(0.5), nt)
                tk.launch_clip_norm_(flat, 0.5, nt)
                tk.launch_agc_([r.clone() for r in rows], rows, 0.01, 1e-3, nt)
                with _config(ROW_MAX=32):
                    tk.launch_agc_([r.clone() for r in long_rows], long_rows, 0.01, 1e-3, nt)
            for fdt in (f32, f64):
                tk.launch_scale_(flat, torch.tensor(0.5, dtype=fdt))
            tk.launch_clip_value_(flat, 0.5)
            tk.launch_centralize_(rows)
            with _config(ROW_MAX=32):
                tk.launch_centralize_(long_rows)
            tk.launch_grad_stats(flat)
    # mixed lists: fp64 master weights or low-precision grads next to fp32 ones
    for a, b in ((f32, f16), (f32, bf16), (f16, f64)):
        params = [make((4, 16), a, True)]
        grads = [make((4, 16), b, True)]
        tk.launch_agc_(params, grads, 0.01, 1e-3, 2.0)
        tk.launch_norm([make((64,), a, True), make((64,), b, True)], 2.0)


def _worker(shard: int, nshards: int) -> int:
    """Record, specialise, and compile this shard's cases; one JSON object per line on stdout."""
    def emit(**kw):
        print(json.dumps(kw), flush=True)

    os.environ.pop("TRITON_INTERPRET", None)
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        emit(skip=f"torch/triton not importable: {type(e).__name__}: {e}")
        return 0
    compile_case, why = _api()
    if compile_case is None:
        emit(skip=why)
        return 0
    from triton.runtime.jit import JITFunction

    # Toolchain probe: a trivial kernel that must reach a cubin, so that a failure below is the kernel's
    try:
        import triton.language as tl

        @triton.jit
        def _probe_kernel(out, N: tl.constexpr):
            tl.store(out + tl.arange(0, N), tl.arange(0, N).to(tl.float32))

        probe_args = (torch.empty(16),)
        for arch in ARCHS:
            _, _, _, ck = compile_case(_probe_kernel, probe_args, {"N": 16}, arch)
            if "ptx" not in ck.asm or "cubin" not in ck.asm:
                emit(skip=f"Triton produced no PTX/cubin for sm_{arch} (stages: {sorted(ck.asm)})")
                return 0
    except Exception as e:  # noqa: BLE001
        emit(skip=f"NVIDIA toolchain unusable here (a trivial kernel fails to compile): "
                  f"{type(e).__name__}: {str(e)[:400]}")
        return 0

    kernels = _discover()
    ident = {id(k): name for name, k in kernels.items()}
    recorded = []
    real_run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        recorded.append((self, args, dict(kwargs)))
        return None

    JITFunction.run = record
    try:
        _scenarios()
    finally:
        JITFunction.run = real_run

    cases = []
    seen = set()
    for k, args, kwargs in recorded:
        name = ident.get(id(k), f"{k.fn.__module__}.{k.fn.__name__}")
        for arch in ARCHS:
            key, cx, rt, _ = compile_case(k, args, kwargs, arch, do_compile=False)
            if (name, arch, key) in seen:
                continue
            seen.add((name, arch, key))
            cases.append((name, k, args, kwargs, arch, cx, rt))
    if shard == 0:
        emit(kernels=sorted(kernels), ncases=len(cases), triton=triton.__version__)
    for i, (name, k, args, kwargs, arch, cx, rt) in enumerate(cases):
        if i % nshards != shard:
            continue
        t0 = time.perf_counter()
        res = dict(kernel=name, arch=arch, constexprs=cx, runtime=rt)
        try:
            _, _, _, ck = compile_case(k, args, kwargs, arch)
            ptx = ck.asm.get("ptx", "")
            res.update(ok=True, stages=sorted(ck.asm), cubin=bool(ck.asm.get("cubin")),
                       v128_loads=len(V128_LOAD.findall(ptx)), pred_vec=len(PRED_VEC.findall(ptx)),
                       fma=len(FMA.findall(ptx)), nv_pow="__nv_pow\"" in ck.asm.get("ttir", ""),
                       fp_fusion=bool(getattr(ck.metadata, "enable_fp_fusion", None)))
        except Exception as e:  # noqa: BLE001 - a compile error of any kind is the finding
            res.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
        res["seconds"] = round(time.perf_counter() - t0, 3)
        emit(**res)
    return 0


# ================================================================================================ tests
def _nworkers() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


@pytest.fixture(scope="module")
def aot():
    """Run the sharded workers once; returns (header, results)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    n = _nworkers()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(i), str(n)],
                              cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    header, results, skips, errors = None, [], [], []
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"AOT compile workers ran past {WORKER_TIMEOUT_S}s")
        if p.returncode != 0:
            errors.append(f"worker exited {p.returncode}:\n{err[-3000:]}")
        for line in out.splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # stray prints from imported code
            if "skip" in obj:
                skips.append(obj["skip"])
            elif "kernels" in obj:
                header = obj
            else:
                results.append(obj)
    if errors:
        pytest.fail("\n\n".join(errors))
    if skips:
        pytest.skip(skips[0])
    assert header is not None, "worker 0 reported no header"
    assert len(results) == header["ncases"], f"{len(results)} results for {header['ncases']} cases"
    return header, results


def _label(r) -> str:
    cx = ",".join(f"{k}={v}" for k, v in r["constexprs"].items())
    return f"{r['kernel'].rsplit('.', 1)[-1]}[{cx}] sm_{r['arch']}"


def test_every_kernel_compiles_for_sm80_and_sm90(aot):
    header, results = aot
    bad = [f"{_label(r)}: {r['error']}" for r in results if not r["ok"]]
    assert not bad, f"{len(bad)} of {len(results)} kernel specialisations fail to compile:\n" + "\n\n".join(bad)
    nocubin = [_label(r) for r in results if not r["cubin"]]
    assert not nocubin, "compiled without a cubin: " + ", ".join(nocubin)


def test_every_kernel_is_covered(aot):
    # a kernel that no scenario launches would silently escape: extend _scenarios() for new launchers
    header, results = aot
    for arch in ARCHS:
        hit = {r["kernel"] for r in results if r["arch"] == arch}
        missing = sorted(set(header["kernels"]) - hit)
        assert not missing, f"sm_{arch}: kernels never launched by the scenarios: {missing}"


def test_launcher_constexpr_combinations_are_covered(aot):
    # the axes the brief of this test names: check the recorder really saw them, per arch
    _, results = aot
    for arch in ARCHS:
        rs = [r for r in results if r["arch"] == arch]
        part = {(c["DT"], c["MODE"], c["HAS_SCALE"], c["FLAG"], c["ALIGNED"])
                for c in (r["constexprs"] for r in rs if r["kernel"].endswith("._norm_partial_kernel"))}
        want = {(dt, m, s, s, a) for dt in ("fp32", "fp16", "bf16", "fp64") for m in "0123"
                for s in ("True", "False") for a in ("True", "False")}
        assert want <= part, f"sm_{arch}: missing norm partial variants {sorted(want - part)}"
        fin = {(c["MODE"], c["FLAG"], c["EXACT"])
               for c in (r["constexprs"] for r in rs if r["kernel"].endswith("._norm_finalize_kernel"))}
        want = {(m, f, e) for m in "0123" for f in ("True", "False") for e in ("True", "False")}
        assert want <= fin, f"sm_{arch}: missing norm finalize variants {sorted(want - fin)}"
        clip = {(c["MODE"], c["EXACT"])
                for c in (r["constexprs"] for r in rs if r["kernel"].endswith("._norm_finalize_kernel")
                          and r["constexprs"]["COEF"] == "True")}
        want = {(m, e) for m in "0123" for e in ("True", "False")}
        assert want <= clip, f"sm_{arch}: missing clip finalize variants {sorted(want - clip)}"


def test_aligned_variants_use_128bit_loads(aot):
    # ALIGNED=True exists only to let the loads vectorise: a variant without them lost the point of the flag
    _, results = aot
    rs = [r for r in results if r["constexprs"].get("ALIGNED") == "True"]
    assert rs
    scalar = [_label(r) for r in rs if r["v128_loads"] == 0]
    assert not scalar, "ALIGNED=True but no 128-bit vector loads in: " + ", ".join(scalar)


def test_gradient_tails_are_not_vectorised_under_one_predicate(aot):
    # Every gradient pass ends in a masked tail of arbitrary length; a vector access under one predicate
    # there reads (and for in-place ops writes) past the end of a tensor on a GPU. The interpreter cannot
    # show this; the PTX can. (Triton 3.9 produced it when hints were set on a helper's results.)
    _, results = aot
    rs = [r for r in results if "ALIGNED" in r["constexprs"]]
    assert rs
    bad = [f"{_label(r)} ({r['pred_vec']})" for r in rs if r["pred_vec"]]
    assert not bad, (f"masked vector accesses (one predicate per vector) in {len(bad)} of {len(rs)} "
                     "specialisations, e.g.: " + ", ".join(bad[:4]))


def test_aligned_fp32_norm_partial_uses_128bit_loads(aot):
    _, results = aot
    rs = [r for r in results if r["kernel"].endswith("._norm_partial_kernel")
          and r["constexprs"]["DT"] == "fp32" and r["constexprs"]["ALIGNED"] == "True"]
    assert len(rs) == 8 * len(ARCHS)  # 4 modes x AMP on/off
    scalar = [_label(r) for r in rs if r["v128_loads"] == 0]
    assert not scalar, "no 128-bit vector loads (ld.global.v4) in: " + ", ".join(scalar)


def test_fractional_p_uses_libdevice_pow(aot):
    # pow built as exp2(p * log2 a) loses bits in proportion to |p ln a| (~10 ulp on the H100 for fp64 and
    # p = 0.5); every kernel that raises to a fractional power must call CUDA's accurate pow instead
    _, results = aot
    pow_kernels = ("._norm_partial_kernel", "._norm_finalize_kernel", "._agc_rows_kernel", "._agc_coef_kernel")
    rs = [r for r in results if r["kernel"].endswith(pow_kernels) and r["constexprs"].get("MODE") == "3"]
    assert len(rs) >= 4 * len(ARCHS)
    naive = [_label(r) for r in rs if not r["nv_pow"]]
    assert not naive, "MODE=3 (fractional p) without libdevice pow (__nv_pow) in: " + ", ".join(naive)


def test_no_fma_contraction(aot):
    # Norm bits must not depend on where a compiler chooses to fuse a * b + c: every launch pins
    # enable_fp_fusion=False, so the only FMAs left are the explicit ones inside libdevice's pow.
    _, results = aot
    fused = [_label(r) for r in results if r["fp_fusion"]]
    assert not fused, "compiled with enable_fp_fusion=True: " + ", ".join(fused[:4])
    rs = [r for r in results if not r["nv_pow"]]
    assert rs
    bad = [f"{_label(r)} ({r['fma']})" for r in rs if r["fma"]]
    assert not bad, f"fma.rn in the PTX of {len(bad)} specialisations, e.g.: " + ", ".join(bad[:4])


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(_worker(int(sys.argv[2]), int(sys.argv[3])))
    sys.exit("usage: test_triton_compile.py --worker SHARD NSHARDS (run the tests with pytest)")
