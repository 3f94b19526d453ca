#!/usr/bin/env bash
# One call on a fresh GPU machine (no network): build + install fastgrad, print its backend report, run the
# whole test suite on CUDA, then the benchmark CLI. Everything lands under OUTDIR:
#
#   bash benchmarks/run_gpu.sh "$OUT"            # from the repository root
#
#   OUTDIR/install.log  info.txt  tests.log  bench.log  bench/{results.csv,results.md,meta.json,speedup.png}
#   OUTDIR/summary.txt  (each stage's exit status and seconds)
#   OUTDIR/train_step.csv (+ .log)  the training-step benchmark (stage train-step)
#
# The device tool brings back at most 8 files from $OUT, no more than two folders down: write OUTDIR outside
# $OUT and set TARBALL=$OUT/<name>.tgz to get everything back as one file.
#
# Stages run in order and a failing stage does not stop the later ones (a failed build still leaves the
# torch and Triton backends to test and benchmark). Knobs (environment):
#   STAGES             stages to run (default "install info tests bench bench-compile train-step"; add
#                      "pytest-bench" for the pytest-benchmark cases in benchmarks/)
#   TARBALL            if set, OUTDIR is packed into this .tgz at the end (see above)
#   TOTAL_BUDGET       seconds the whole script may take (default 570, for a 10-minute call): the stages
#                      after install share what is left, and the benchmark writes its files after every
#                      workload, so a stage cut short still leaves results
#   BENCH_ARGS         extra CLI arguments for the main run (default "--budget 0.25": ~0.25 s of timing
#                      per case keeps the whole matrix within a few minutes on an H100/H200)
#   COMPILE_WORKLOADS  workloads of the bench-compile stage, which adds the torch.compile baseline
#                      (default "resnet50,gpt2-124m,llama-1b,small-4000"; compiling costs seconds to a
#                      minute per case)
#   TESTS_TIMEOUT, BENCH_TIMEOUT   upper limits for those stages in seconds (default 500 and 240); a stage
#                      only keeps time back for the later stages that STAGES asks for
# The whole suite on a GPU (Triton JIT-compiles every specialisation there) plus the CUDA build does not
# leave room for the benchmarks in one 10-minute call. Two calls back to back, each starting with install
# (a machine idle for 30 s goes back and the next call starts bare; on a warm one the rebuild is quick):
#   STAGES="install info tests" TARBALL=$OUT/tests.tgz bash benchmarks/run_gpu.sh /tmp/r1
#   STAGES="install bench bench-compile train-step" TARBALL=$OUT/bench.tgz bash benchmarks/run_gpu.sh /tmp/r2
set -u
OUTDIR="${1:?usage: benchmarks/run_gpu.sh OUTDIR}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
cd "$(dirname "$0")/.."
STAGES="${STAGES:-install info tests bench bench-compile train-step}"
DEADLINE=$((SECONDS + ${TOTAL_BUDGET:-570}))
BENCH_ARGS="${BENCH_ARGS:---budget 0.25}"
COMPILE_WORKLOADS="${COMPILE_WORKLOADS:-resnet50,gpt2-124m,llama-1b,small-4000}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-500}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-240}"
PY="${PYTHON:-python}"
: > "$OUTDIR/summary.txt"

stage() {  # stage NAME LOGFILE CMD...: run, log, record status and duration
    local name="$1" log="$2"; shift 2
    case " $STAGES " in *" $name "*) ;; *) echo "$name: skipped" >> "$OUTDIR/summary.txt"; return 0;; esac
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$OUTDIR/summary.txt"
    "$@" > "$log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - t0)) s (log: $log)" | tee -a "$OUTDIR/summary.txt"
    tail -n 5 "$log"
    return 0
}

wants() {  # wants NAME...: 0 if any of the named stages is requested
    local n
    for n in "$@"; do case " $STAGES " in *" $n "*) return 0;; esac; done
    return 1
}

limit() {  # limit MAX RESERVE: seconds for the next stage, at most MAX, leaving RESERVE for later stages
    local left=$((DEADLINE - SECONDS - $2))
    [ "$left" -gt "$1" ] && left=$1
    [ "$left" -lt 20 ] && left=20
    echo "$left"
}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: n/a"
} >> "$OUTDIR/summary.txt"

# The GPU image's default g++ is a wrapper whose libstdc++ stream code, linked into _C.so, makes any
# TORCH_CHECK message with a number segfault (H100 run, 2026-11-22, finding 7); the distribution's
# /usr/bin/gcc and g++ build a working extension. Use them unless CC/CXX are set or g++ already is them.
if [ -z "${CXX:-}" ] && [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ] \
        && [ "$(readlink -f "$(command -v g++ 2>/dev/null)" 2>/dev/null)" != "$(readlink -f /usr/bin/g++)" ]; then
    export CC=/usr/bin/gcc CXX=/usr/bin/g++
fi
echo "compilers: CC=${CC:-default} CXX=${CXX:-default}" >> "$OUTDIR/summary.txt"

# Build against the torch already installed (no isolated env, nothing downloaded).
stage install "$OUTDIR/install.log" "$PY" -m pip install --no-build-isolation --no-deps -v -e .
stage info "$OUTDIR/info.txt" "$PY" -m fastgrad.info
# The whole suite; CUDA tests run because a GPU is visible.
RESERVE_AFTER_TESTS=10
wants bench bench-compile train-step pytest-bench && RESERVE_AFTER_TESTS=240
stage tests "$OUTDIR/tests.log" timeout "$(limit "$TESTS_TIMEOUT" "$RESERVE_AFTER_TESTS")" \
    "$PY" -m pytest -q -p no:cacheprovider --durations=15 tests
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words on purpose
stage bench "$OUTDIR/bench.log" timeout "$(limit "$BENCH_TIMEOUT" 90)" "$PY" -m fastgrad.bench \
    --out "$OUTDIR/bench" --no-progress --compile off $BENCH_ARGS
# torch.compile baseline on a few workloads (every implementation is re-timed there, so the speedups
# over torch.compile in that table come from one run).
RESERVE_AFTER_COMPILE=10
wants train-step && RESERVE_AFTER_COMPILE=120
stage bench-compile "$OUTDIR/bench-compile.log" timeout "$(limit 600 "$RESERVE_AFTER_COMPILE")" "$PY" -m fastgrad.bench \
    --out "$OUTDIR/bench-compile" --no-progress --compile on --workloads "$COMPILE_WORKLOADS" --budget 0.25
# GPT-2-small and ResNet-50 shaped steps, fused AdamW, plain / AMP / zero-write / guarded, torch vs fastgrad
stage train-step "$OUTDIR/train_step.log" timeout "$(limit 300 10)" "$PY" benchmarks/train_step.py \
    --device cuda --model gpt2,resnet50 --out "$OUTDIR/train_step.csv"
stage pytest-bench "$OUTDIR/pytest-bench.log" timeout "$(limit 600 5)" "$PY" -m pytest benchmarks \
    --benchmark-only -q -p no:cacheprovider --benchmark-json "$OUTDIR/pytest-bench.json"
cat "$OUTDIR/summary.txt"
if [ -n "${TARBALL:-}" ]; then
    tar czf "$TARBALL" -C "$(dirname "$OUTDIR")" "$(basename "$OUTDIR")" && echo "packed: $TARBALL"
fi
