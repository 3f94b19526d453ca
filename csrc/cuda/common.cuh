// Shared device and host helpers of the CUDA kernels (reduce.cu: norms and grad_stats; amp.cu: the AMP
// read pass; apply.cu: scale, clamp, AGC, GC). Framework-free: raw pointers in, launcher API in
// fastgrad_cuda.h.
//
// One block per chunk of at most kChunk elements, 16-byte vector loads (after peeling to the first
// 16-byte boundary), int64 offsets. Threads accumulate in float (double for float64 lists); the block
// reduces its threads in a fixed tree and writes one partial; later kernels combine partials in chunk
// order. No atomics. Everything here has internal linkage and is inline or a template, so each .cu file
// compiles only what it uses, and the three build in parallel.
#pragma once
#include "fastgrad_cuda.h"
#include "../round_odd.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace fgcuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// ------------------------------------------------------------------------------------------ helpers
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ double to_float(double x) { return x; }

template <typename T>
__device__ __forceinline__ T from_op(float v);
template <>
__device__ __forceinline__ float from_op<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_op<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_op<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Store a double result into T with exactly one rounding (to nearest even). Going through float first
// would round twice: a double just above a 16-bit tie rounds to the tie in float and then to even, 1 ulp
// off the correctly rounded value (seen on a GPU: benchmarks/results/gpu/2026-11-25-h100/RUN_NOTES.md).
// 16-bit goes through the float rounded to odd (csrc/round_odd.h): the operations the CPU kernels run and
// the CPU tests check, then one float -> T conversion that cannot round a second time. (It replaced
// __double2half / __double2bfloat16, whose lowering by ptxas, cvt.rn.f16.f64 / cvt.rn.bf16.f64 on each arch,
// no CPU test can see.)
// Host-callable too: tests/cuda/round_check.cu runs these very functions on the CPU.
template <typename T>
__host__ __device__ __forceinline__ T from_double(double v);
template <>
__host__ __device__ __forceinline__ float from_double<float>(double v) { return static_cast<float>(v); }
template <>
__host__ __device__ __forceinline__ __half from_double<__half>(double v) {
  return __float2half_rn(fastgrad::f64_to_f32_odd(v));
}
template <>
__host__ __device__ __forceinline__ __nv_bfloat16 from_double<__nv_bfloat16>(double v) {
  return __float2bfloat16_rn(fastgrad::f64_to_f32_odd(v));
}
template <>
__host__ __device__ __forceinline__ double from_double<double>(double v) { return v; }

// Store an op-math value (float for 16-bit and float data, double for double data or a double formula) into
// T, rounded once either way.
template <typename T>
__device__ __forceinline__ T store(float v) { return from_op<T>(v); }
template <typename T>
__device__ __forceinline__ T store(double v) { return from_double<T>(v); }

// Neumaier-compensated double sum, the device twin of csrc/cpu/kernels.h CompensatedSum: the CPU kernels
// add every partial (block totals, chunks, tensors) this way, and plain double adds over a 128-element
// thread run and thousands of partials cost the fp64 p-norms several ulps (amplified 1/p times by the
// root, also seen there). Needs --fmad=false, which
// setup.py passes: a contracted (sum - t) + x would lose the error term.
struct Comp {
  double sum = 0.0, comp = 0.0;
  __device__ __forceinline__ void add(double x) {
    const double t = sum + x;
    comp += fabs(sum) >= fabs(x) ? (sum - t) + x : (x - t) + sum;
    sum = t;
  }
  // Another compensated sum: its sum added exactly, its compensation carried along.
  __device__ __forceinline__ void add(const Comp& o) {
    add(o.sum);
    comp += o.comp;
  }
  __device__ __forceinline__ double value() const { return isfinite(sum) ? sum + comp : sum; }
};

__device__ __forceinline__ Comp shfl_down(const Comp& v, int o) {
  Comp r;
  r.sum = __shfl_down_sync(0xffffffffu, v.sum, o);
  r.comp = __shfl_down_sync(0xffffffffu, v.comp, o);
  return r;
}

// Compensated fixed-order tree over a warp; the result is valid in lane 0.
__device__ __forceinline__ Comp warp_sum(Comp v) {
  for (int o = 16; o > 0; o >>= 1) v.add(shfl_down(v, o));
  return v;
}

// Compensated fixed-order block reduction (sh: 2 * kWarps doubles); the result is valid in thread 0.
__device__ double block_sum_comp(Comp v, double* sh) {
  v = warp_sum(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();
  if (l == 0) {
    sh[2 * w] = v.sum;
    sh[2 * w + 1] = v.comp;
  }
  __syncthreads();
  Comp u;
  if (threadIdx.x < kWarps) {
    u.sum = sh[2 * threadIdx.x];
    u.comp = sh[2 * threadIdx.x + 1];
  }
  if (w == 0) u = warp_sum(u);
  return u.value();
}

template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};

// Elements before the first 16-byte boundary at p (p is always sizeof(T)-aligned), at most n. Runs that
// start mid-vector (views into flat gradient buckets, odd row lengths) peel these few and keep the 16-byte
// path for the rest instead of falling back to scalar accesses for the whole run.
template <typename T>
__device__ __forceinline__ int64_t head_of(const T* p, int64_t n) {
  const int64_t h = static_cast<int64_t>((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / static_cast<int64_t>(sizeof(T));
  return h < n ? h : n;
}

// Visits the n elements at p (read-only): fn(x) per element, each thread a strided subset.
template <typename T, typename F>
__device__ __forceinline__ void visit(const T* p, int64_t n, F& fn) {
  constexpr int E = 16 / sizeof(T);
  const int64_t head = head_of(p, n);
  const int64_t nv = (n - head) / E;
  const uint4* qv = reinterpret_cast<const uint4*>(p + head);
#pragma unroll 4
  for (int64_t v = threadIdx.x; v < nv; v += kThreads) {
    uint4 raw = qv[v];
    T e[E];
    memcpy(e, &raw, 16);
#pragma unroll
    for (int k = 0; k < E; ++k) fn(e[k]);
  }
  // the head and the tail in one scalar loop (one more inlined copy of fn, not two)
  const int64_t tail0 = head + nv * E;
  for (int64_t i = threadIdx.x; i < head + (n - tail0); i += kThreads) fn(p[i < head ? i : tail0 + (i - head)]);
}

// In place x = fn(x) over the n elements at p.
template <typename T, typename F>
__device__ __forceinline__ void transform(T* p, int64_t n, const F& fn) {
  constexpr int E = 16 / sizeof(T);
  const int64_t head = head_of(p, n);
  const int64_t nv = (n - head) / E;
  uint4* qv = reinterpret_cast<uint4*>(p + head);
#pragma unroll 4
  for (int64_t v = threadIdx.x; v < nv; v += kThreads) {
    uint4 raw = qv[v];
    T e[E];
    memcpy(e, &raw, 16);
#pragma unroll
    for (int k = 0; k < E; ++k) e[k] = fn(e[k]);
    memcpy(&raw, e, 16);
    qv[v] = raw;
  }
  const int64_t tail0 = head + nv * E;
  for (int64_t i = threadIdx.x; i < head + (n - tail0); i += kThreads) {
    T& x = p[i < head ? i : tail0 + (i - head)];
    x = fn(x);
  }
}

__device__ __forceinline__ double nan_max(double a, double b) { return (b > a || b != b) ? b : a; }

// Fixed-order block reductions; the result is valid in thread 0.
__device__ double block_sum(double v, double* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();
  if (l == 0) sh[w] = v;
  __syncthreads();
  v = (threadIdx.x < kWarps) ? sh[threadIdx.x] : 0.0;
  if (w == 0)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

__device__ double block_max(double v, double* sh) {
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_down_sync(0xffffffffu, v, o));
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();
  if (l == 0) sh[w] = v;
  __syncthreads();
  v = (threadIdx.x < kWarps) ? sh[threadIdx.x] : 0.0;
  if (w == 0)
    for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}

struct Loc {
  const Seg* s;
  int64_t row;     // global row index
  int64_t offset;  // element offset of the chunk in the segment's flat run
  int64_t n;
};

__device__ __forceinline__ Loc locate(const Seg* segs, int64_t nseg, int64_t chunk) {
  int64_t lo = 0, hi = nseg - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (segs[mid].first_chunk <= chunk) lo = mid; else hi = mid - 1;
  }
  const Seg* s = &segs[lo];
  const int64_t local = chunk - s->first_chunk;
  const int64_t row = local / s->cpr, piece = local - row * s->cpr;
  const int64_t begin = piece * kChunk;
  const int64_t left = s->len - begin;
  return {s, s->first_row + row, row * s->len + begin, left < kChunk ? left : kChunk};
}

__device__ __forceinline__ int64_t find_row_seg(const Seg* segs, int64_t nseg, int64_t row) {
  int64_t lo = 0, hi = nseg - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (segs[mid].first_row <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Calls f(T*) with the run's pointer cast to its element type.
template <typename F>
__device__ __forceinline__ void with_type(int32_t dt, void* base, int64_t offset, const F& f) {
  switch (dt) {
    case kF16: f(static_cast<__half*>(base) + offset); break;
    case kBF16: f(static_cast<__nv_bfloat16*>(base) + offset); break;
    case kF64: f(static_cast<double*>(base) + offset); break;
    default: f(static_cast<float*>(base) + offset); break;
  }
}

// ---------------------------------------------------------------------------------------- reductions
// Per-thread accumulator: plain for float (as the CPU's float lanes), compensated for double.
template <typename A>
struct Acc {
  A v = 0;
  __device__ __forceinline__ void add(A x) { v += x; }
  __device__ __forceinline__ double value() const { return static_cast<double>(v); }
};
template <>
struct Acc<double> {
  Comp c;
  __device__ __forceinline__ void add(double x) { c.add(x); }
  __device__ __forceinline__ double value() const { return c.value(); }
};

// |a|^p for a >= 0 (or NaN). p = 0.5 is sqrt, correctly rounded like the CPU's pow(a, 0.5), where CUDA's
// pow is off by up to 2 ulps; other p use pow.
template <typename A>
__device__ __forceinline__ A pow_term(A a, A p) {
  return p == A(0.5) ? sqrt(a) : pow(a, p);
}

template <int M, typename A, bool AMP>
struct ReduceFn {
  Acc<A> acc;
  A mx = 0;
  A p;
  float inv;
  int bad = 0;

  template <typename T>
  __device__ __forceinline__ void operator()(T x) {
    using O = typename OpMath<T>::type;
    O v = to_float(x);
    if (AMP) {
      if (!isfinite(v)) bad = 1;
      O u = v * static_cast<O>(inv);
      v = static_cast<O>(to_float(store<T>(u)));  // the value unscale_ stores
    }
    const A a = fabs(static_cast<A>(v));
    if (M == kInf) {
      mx = (a > mx || a != a) ? a : mx;
    } else if (M == kL2) {
      acc.add(a * a);
    } else if (M == kL1) {
      acc.add(a);
    } else if (M == kP) {
      acc.add(pow_term(a, p));
    } else {
      acc.add(static_cast<A>(v));
    }
  }
};

template <int M, typename A, bool AMP>
__global__ void __launch_bounds__(kThreads) k_reduce(const Seg* segs, int64_t nseg, double p, const float* inv,
                                                    int use2, double* part, int* flags) {
  __shared__ double sh[kWarps];
  const Loc L = locate(segs, nseg, blockIdx.x);
  ReduceFn<M, A, AMP> fn;
  fn.p = static_cast<A>(p);
  fn.inv = AMP ? *inv : 1.0f;
  void* base = use2 ? const_cast<void*>(L.s->ptr2) : L.s->ptr;
  const int32_t dt = use2 ? L.s->dtype2 : L.s->dtype;
  with_type(dt, base, L.offset, [&](auto* q) { visit(q, L.n, fn); });
  const double r = (M == kInf) ? block_max(static_cast<double>(fn.mx), sh) : block_sum(fn.acc.value(), sh);
  int bad = 0;
  if (AMP) bad = __syncthreads_or(fn.bad);
  if (threadIdx.x == 0) {
    part[blockIdx.x] = r;
    if (AMP) flags[blockIdx.x] = bad;
  }
}

// One warp per row: lane l combines the row's chunk partials l, l + 32, ... in order, then a fixed shuffle
// tree combines the lanes. Deterministic, and a long row (65,536 partials for a 2^31-element tensor) is not
// left to one thread's serial loop.
constexpr int kRowLanes = 32;

// The value of one row whose cpr chunk partials are part[(c0 + c) * stride + k]: max (kInf) or compensated
// sum (other modes). Called by a whole warp (full-mask shuffles: every lane must arrive with the same row);
// valid in lane 0. k_rows and the clip's fused finish (reduce.cu) both use it, so they agree bit for bit.
__device__ __forceinline__ double warp_row(const double* part, int64_t c0, int64_t cpr, int stride, int k, int mode,
                                           int lane) {
  if (mode == kInf) {
    double v = 0.0;
#pragma unroll 4
    for (int64_t c = lane; c < cpr; c += kRowLanes) v = nan_max(v, part[(c0 + c) * stride + k]);
    for (int o = kRowLanes / 2; o > 0; o >>= 1) v = nan_max(v, __shfl_down_sync(0xffffffffu, v, o));
    return v;
  }
  Comp sum;  // the CPU adds chunk partials compensated too
#pragma unroll 4  // independent loads in flight together; the adds stay in order
  for (int64_t c = lane; c < cpr; c += kRowLanes) sum.add(part[(c0 + c) * stride + k]);
  return warp_sum(sum).value();
}

// r is uniform across a warp, so whole warps return together and warp_row's shuffles are legal.
__global__ void k_rows(const Seg* segs, int64_t nseg, int64_t nrows, int mode, const double* part, int stride,
                       int k, double* out) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  if (r >= nrows) return;
  const Seg* s = &segs[find_row_seg(segs, nseg, r)];
  const int64_t c0 = s->first_chunk + (r - s->first_row) * s->cpr;
  const double v = warp_row(part, c0, s->cpr, stride, k, mode, lane);
  if (lane == 0) out[r] = v;
}

// Norm from its power sum. The CPU takes pow(s, 1/p) in long double; here 1/p = y + y_lo as a double-double
// (y_lo from an exact fma residual) and s^(y + y_lo) = s^y * (1 + y_lo ln s) to first order, so the rounding
// of 1/p does not enter the result either. 1/p = 2 (p = 0.5) is s * s, rounded once.
__device__ __forceinline__ double root(int mode, double s, double p) {
  if (mode == kL2) return sqrt(s);
  if (mode == kP) {
    const double y = 1.0 / p;
    if (y == 2.0) return s * s;
    const double y_lo = fma(-p, y, 1.0) / p;
    const double r = pow(s, y);
    return (s > 0.0 && isfinite(r)) ? r + r * (y_lo * log(s)) : r;
  }
  return s;
}

// ------------------------------------------------------------------------------------------- host
struct Ws {
  double* part;  // 5 per chunk
  int* flags;    // 1 per chunk
  double* rows;  // 3 per row
  int* rflag;    // 1 per row
};

inline size_t align_up(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

inline Ws carve(void* ws, int64_t nchunks, int64_t nrows) {
  char* b = static_cast<char*>(ws);
  Ws w;
  w.part = reinterpret_cast<double*>(b);
  b += align_up(sizeof(double) * 5 * static_cast<size_t>(nchunks));
  w.flags = reinterpret_cast<int*>(b);
  b += align_up(sizeof(int) * static_cast<size_t>(nchunks));
  w.rows = reinterpret_cast<double*>(b);
  b += align_up(sizeof(double) * 3 * static_cast<size_t>(nrows));
  w.rflag = reinterpret_cast<int*>(b);
  return w;
}

inline unsigned grid_for(int64_t n, int per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

template <typename A, bool AMP>
void launch_reduce(int mode, unsigned grid, cudaStream_t st, const Seg* segs, int64_t nseg, double p, const float* inv,
                   int use2, double* part, int* flags) {
  switch (mode) {
    case kSum: k_reduce<kSum, A, AMP><<<grid, kThreads, 0, st>>>(segs, nseg, p, inv, use2, part, flags); break;
    case kL1: k_reduce<kL1, A, AMP><<<grid, kThreads, 0, st>>>(segs, nseg, p, inv, use2, part, flags); break;
    case kL2: k_reduce<kL2, A, AMP><<<grid, kThreads, 0, st>>>(segs, nseg, p, inv, use2, part, flags); break;
    case kInf: k_reduce<kInf, A, AMP><<<grid, kThreads, 0, st>>>(segs, nseg, p, inv, use2, part, flags); break;
    // Fractional and other p: terms and per-thread sums in double (compensated) for every dtype. In float a
    // thread's 128-term run costs a few ulps of the power sum, which the root multiplies by 1/p (seen on a GPU:
    // benchmarks/results/gpu/2026-11-25-h100/RUN_NOTES.md); in double the norm is rounded once,
    // from a sum exact to ~1e-16, as the Triton kernels (fp64 accumulators) and the CPU's pow already do.
    default: k_reduce<kP, double, AMP><<<grid, kThreads, 0, st>>>(segs, nseg, p, inv, use2, part, flags); break;
  }
}

// Row sums of |x|^p (or max) into `out` (nrows doubles). AMP (inv set): of bf16/half/float(x * inv), with
// per-chunk overflow flags. A template, so a file that never runs the AMP pass does not compile its kernels.
// Returns the error of its first launch (0 when it was fine): a GPU this build has no code for fails right
// there, and the caller returns before launching anything that writes gradients.
template <bool AMP>
int row_reduce(const Seg* segs, int64_t nseg, int64_t nchunks, int64_t nrows, int mode, double p, int acc64,
               const float* inv, int use2, const Ws& w, double* out, cudaStream_t st) {
  if (nchunks > 0) {
    const unsigned grid = static_cast<unsigned>(nchunks);
    if (acc64) launch_reduce<double, AMP>(mode, grid, st, segs, nseg, p, inv, use2, w.part, w.flags);
    else launch_reduce<float, AMP>(mode, grid, st, segs, nseg, p, inv, use2, w.part, w.flags);
    const int err = static_cast<int>(cudaGetLastError());
    if (err != 0) return err;
  }
  if (nrows > 0) k_rows<<<grid_for(nrows * kRowLanes, 256), 256, 0, st>>>(segs, nseg, nrows, mode, w.part, 1, 0, out);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

// The AMP instantiation of row_reduce, compiled in amp.cu only (the heaviest set of kernels, kept out of
// reduce.cu so the three files build in parallel and each in under half a minute).
int row_reduce_amp(const Seg* segs, int64_t nseg, int64_t nchunks, int64_t nrows, int mode, double p, int acc64,
                   const float* inv, double* part, int* flags, double* out, cudaStream_t st);

// cudaFuncGetAttributes of one kernel of each file: loads its module for the current device without a
// launch, so it reports "no kernel image" (or a PTX the driver cannot JIT) up front (see probe()).
int probe_reduce();
int probe_amp();

}  // namespace fgcuda
