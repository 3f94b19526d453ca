// CUDA kernels of fastgrad (framework-free: raw pointers in, launcher API in fastgrad_cuda.h).
//
// One block per chunk of at most kChunk elements, 16-byte vector loads when the run is aligned, int64
// offsets. Threads accumulate in float (double for float64 lists); the block reduces its threads in a
// fixed tree and writes one partial; later kernels combine partials in chunk order. No atomics.
#include "fastgrad_cuda.h"

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

// Store a double result into T with one rounding for float/double; 16-bit types go through float.
template <typename T>
__device__ __forceinline__ T from_double(double v) {
  return from_op<T>(static_cast<float>(v));
}
template <>
__device__ __forceinline__ double from_double<double>(double v) { return v; }

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
  for (int64_t i = threadIdx.x; i < head; i += kThreads) fn(p[i]);
  const T* q = p + head;
  const int64_t nv = (n - head) / E;
  const uint4* qv = reinterpret_cast<const uint4*>(q);
#pragma unroll 4
  for (int64_t v = threadIdx.x; v < nv; v += kThreads) {
    uint4 raw = qv[v];
    T e[E];
    memcpy(e, &raw, 16);
#pragma unroll
    for (int k = 0; k < E; ++k) fn(e[k]);
  }
  for (int64_t i = head + nv * E + threadIdx.x; i < n; i += kThreads) fn(p[i]);
}

// In place x = fn(x) over the n elements at p.
template <typename T, typename F>
__device__ __forceinline__ void transform(T* p, int64_t n, const F& fn) {
  constexpr int E = 16 / sizeof(T);
  const int64_t head = head_of(p, n);
  for (int64_t i = threadIdx.x; i < head; i += kThreads) p[i] = fn(p[i]);
  T* q = p + head;
  const int64_t nv = (n - head) / E;
  uint4* qv = reinterpret_cast<uint4*>(q);
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
  for (int64_t i = head + nv * E + threadIdx.x; i < n; i += kThreads) p[i] = fn(p[i]);
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
template <int M, typename A, bool AMP>
struct ReduceFn {
  A acc = 0;
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
      v = static_cast<O>(to_float(from_double<T>(static_cast<double>(u))));  // the value unscale_ stores
    }
    const A a = fabs(static_cast<A>(v));
    if (M == kInf) {
      mx = (a > mx || a != a) ? a : mx;
    } else if (M == kL2) {
      acc += a * a;
    } else if (M == kL1) {
      acc += a;
    } else if (M == kP) {
      acc += pow(a, p);
    } else {
      acc += static_cast<A>(v);
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
  const double r = (M == kInf) ? block_max(static_cast<double>(fn.mx), sh) : block_sum(static_cast<double>(fn.acc), sh);
  int bad = 0;
  if (AMP) bad = __syncthreads_or(fn.bad);
  if (threadIdx.x == 0) {
    part[blockIdx.x] = r;
    if (AMP) flags[blockIdx.x] = bad;
  }
}

// One warp per row: lane l combines the row's chunk partials l, l + 32, ... in order, then a fixed shuffle
// tree combines the lanes. Deterministic, and a long row (65,536 partials for a 2^31-element tensor) is not
// left to one thread's serial loop. r is uniform across a warp, so whole warps return together and the
// full-mask shuffles are legal.
constexpr int kRowLanes = 32;

__global__ void k_rows(const Seg* segs, int64_t nseg, int64_t nrows, int mode, const double* part, int stride,
                       int k, double* out) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  if (r >= nrows) return;
  const Seg* s = &segs[find_row_seg(segs, nseg, r)];
  const int64_t c0 = s->first_chunk + (r - s->first_row) * s->cpr;
  double v = 0.0;
  for (int64_t c = lane; c < s->cpr; c += kRowLanes) {
    const double q = part[(c0 + c) * stride + k];
    v = mode == kInf ? nan_max(v, q) : v + q;
  }
  for (int o = kRowLanes / 2; o > 0; o >>= 1) {
    const double u = __shfl_down_sync(0xffffffffu, v, o);
    v = mode == kInf ? nan_max(v, u) : v + u;
  }
  if (lane == 0) out[r] = v;
}

__device__ __forceinline__ double root(int mode, double s, double p) {
  if (mode == kL2) return sqrt(s);
  if (mode == kP) return pow(s, 1.0 / p);
  return s;
}

template <typename A>
__global__ void __launch_bounds__(kThreads) k_norm_finish(const double* rows, int64_t nrows, int mode, double p,
                                                         A* total, A* per, const int* flags, int64_t nchunks,
                                                         float* found) {
  __shared__ double sh[kWarps];
  double acc = 0.0;
  for (int64_t r = threadIdx.x; r < nrows; r += kThreads) {
    const double s = rows[r];
    per[r] = static_cast<A>(root(mode, s, p));
    acc = mode == kInf ? nan_max(acc, s) : acc + s;
  }
  const double t = mode == kInf ? block_max(acc, sh) : block_sum(acc, sh);
  int bad = 0;
  if (found != nullptr)
    for (int64_t c = threadIdx.x; c < nchunks; c += kThreads) bad |= flags[c];
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) {
    *total = static_cast<A>(root(mode, t, p));
    if (found != nullptr) *found = bad ? 1.0f : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------- grad_stats
template <typename A>
struct StatsFn {
  A acc = 0, mx = 0;
  int nan = 0, inf = 0, zero = 0;
  template <typename T>
  __device__ __forceinline__ void operator()(T x) {
    const A v = static_cast<A>(to_float(x));
    const A a = fabs(v);
    acc += v * v;
    mx = (a > mx || a != a) ? a : mx;
    nan += (a != a);
    inf += isinf(a) ? 1 : 0;
    zero += (v == 0);
  }
};

template <typename A>
__global__ void __launch_bounds__(kThreads) k_stats(const Seg* segs, int64_t nseg, double* part) {
  __shared__ double sh[kWarps];
  const Loc L = locate(segs, nseg, blockIdx.x);
  StatsFn<A> fn;
  with_type(L.s->dtype, L.s->ptr, L.offset, [&](auto* q) { visit(q, L.n, fn); });
  double r[5];
  r[0] = block_sum(static_cast<double>(fn.acc), sh);
  r[1] = block_max(static_cast<double>(fn.mx), sh);
  r[2] = block_sum(static_cast<double>(fn.nan), sh);
  r[3] = block_sum(static_cast<double>(fn.inf), sh);
  r[4] = block_sum(static_cast<double>(fn.zero), sh);
  if (threadIdx.x == 0)
    for (int k = 0; k < 5; ++k) part[static_cast<int64_t>(blockIdx.x) * 5 + k] = r[k];
}

// One warp per row, as k_rows.
template <typename A>
__global__ void k_stats_finish(const Seg* segs, int64_t nseg, int64_t nrows, const double* part, A* norm, A* mx,
                               int64_t* nan, int64_t* inf, int64_t* zero) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  if (r >= nrows) return;
  const Seg* s = &segs[find_row_seg(segs, nseg, r)];
  const int64_t c0 = s->first_chunk + (r - s->first_row) * s->cpr;
  double q[5] = {0, 0, 0, 0, 0};
  for (int64_t c = lane; c < s->cpr; c += kRowLanes) {
    const double* pc = part + (c0 + c) * 5;
    q[0] += pc[0];
    q[1] = nan_max(q[1], pc[1]);
    q[2] += pc[2];
    q[3] += pc[3];
    q[4] += pc[4];
  }
  for (int o = kRowLanes / 2; o > 0; o >>= 1) {
#pragma unroll
    for (int j = 0; j < 5; ++j) {
      const double u = __shfl_down_sync(0xffffffffu, q[j], o);
      q[j] = j == 1 ? nan_max(q[j], u) : q[j] + u;
    }
  }
  if (lane != 0) return;
  norm[r] = static_cast<A>(sqrt(q[0]));
  mx[r] = static_cast<A>(q[1]);
  nan[r] = static_cast<int64_t>(q[2]);
  inf[r] = static_cast<int64_t>(q[3]);
  zero[r] = static_cast<int64_t>(q[4]);
}

// ------------------------------------------------------------------------------------- elementwise
__global__ void __launch_bounds__(kThreads) k_scale(const Seg* segs, int64_t nseg, const void* factor, int fdt) {
  const double f = fdt == kF64 ? *static_cast<const double*>(factor) : *static_cast<const float*>(factor);
  if (f == 1.0) return;  // not clipping: gradient memory is not touched
  const Loc L = locate(segs, nseg, blockIdx.x);
  with_type(L.s->dtype, L.s->ptr, L.offset, [&](auto* q) {
    using T = typename std::remove_pointer<decltype(q)>::type;
    using O = typename OpMath<T>::type;
    const O ff = static_cast<O>(f);
    transform(q, L.n, [ff](T x) { return from_double<T>(static_cast<double>(static_cast<O>(to_float(x)) * ff)); });
  });
}

__global__ void __launch_bounds__(kThreads) k_clamp(const Seg* segs, int64_t nseg, double c) {
  const Loc L = locate(segs, nseg, blockIdx.x);
  with_type(L.s->dtype, L.s->ptr, L.offset, [&](auto* q) {
    using T = typename std::remove_pointer<decltype(q)>::type;
    using O = typename OpMath<T>::type;
    const O hi = static_cast<O>(c), lo = -hi;
    transform(q, L.n, [lo, hi](T x) {
      O v = to_float(x);
      v = v < lo ? lo : v;  // comparisons are false for NaN: NaN passes through
      v = v > hi ? hi : v;
      return from_double<T>(static_cast<double>(v));
    });
  });
}

// Per-row transform: kind 0 scales by val[row] (rows with skip[row] set are left alone), kind 1
// subtracts val[row]. Computed in double, one rounding to T.
template <int KIND>
__global__ void __launch_bounds__(kThreads) k_row_apply(const Seg* segs, int64_t nseg, const double* val,
                                                       const int* skip) {
  const Loc L = locate(segs, nseg, blockIdx.x);
  if (KIND == 0 && skip[L.row]) return;
  const double v = val[L.row];
  with_type(L.s->dtype, L.s->ptr, L.offset, [&](auto* q) {
    using T = typename std::remove_pointer<decltype(q)>::type;
    transform(q, L.n, [v](T x) {
      const double d = static_cast<double>(to_float(x));
      return from_double<T>(KIND == 0 ? d * v : d - v);
    });
  });
}

__global__ void k_agc_ratio(int64_t nrows, const double* gs, const double* ws, int mode, double p, double clip_factor,
                            double eps, double* ratio, int* skip) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= nrows) return;
  const double wn = root(mode, ws[r], p), gn = root(mode, gs[r], p);
  const double max_norm = (wn != wn ? wn : (wn < eps ? eps : wn)) * clip_factor;
  const bool keep = gn < max_norm;  // NaN norms clip (to NaN), as in timm
  const double den = gn != gn ? gn : (gn < 1e-6 ? 1e-6 : gn);
  skip[r] = keep ? 1 : 0;
  ratio[r] = keep ? 1.0 : max_norm / den;
}

__global__ void k_mean(const Seg* segs, int64_t nseg, int64_t nrows, double* rows) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= nrows) return;
  const Seg* s = &segs[find_row_seg(segs, nseg, r)];
  rows[r] = s->len > 0 ? rows[r] / static_cast<double>(s->len) : 0.0;
}

// ------------------------------------------------------------------------------------------- host
struct Ws {
  double* part;  // 5 per chunk
  int* flags;    // 1 per chunk
  double* rows;  // 3 per row
  int* rflag;    // 1 per row
};

size_t align_up(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

Ws carve(void* ws, int64_t nchunks, int64_t nrows) {
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

unsigned grid_for(int64_t n, int per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

template <typename A, bool AMP>
void launch_reduce(int mode, unsigned grid, cudaStream_t st, const Seg* segs, int64_t nseg, double p, const float* inv,
                   int use2, double* part, int* flags) {
  switch (mode) {
    case kSum: k_reduce<kSum, A, AMP><<<grid, kThreads, 0, st>>>(segs, nseg, p, inv, use2, part, flags); break;
    case kL1: k_reduce<kL1, A, AMP><<<grid, kThreads, 0, st>>>(segs, nseg, p, inv, use2, part, flags); break;
    case kL2: k_reduce<kL2, A, AMP><<<grid, kThreads, 0, st>>>(segs, nseg, p, inv, use2, part, flags); break;
    case kInf: k_reduce<kInf, A, AMP><<<grid, kThreads, 0, st>>>(segs, nseg, p, inv, use2, part, flags); break;
    default: k_reduce<kP, A, AMP><<<grid, kThreads, 0, st>>>(segs, nseg, p, inv, use2, part, flags); break;
  }
}

// Row sums of |x|^p (or max) into `out` (nrows doubles).
void row_reduce(const Seg* segs, int64_t nseg, int64_t nchunks, int64_t nrows, int mode, double p, int acc64,
                const float* inv, int use2, const Ws& w, double* out, cudaStream_t st) {
  if (nchunks > 0) {
    const unsigned grid = static_cast<unsigned>(nchunks);
    if (inv != nullptr) {
      if (acc64) launch_reduce<double, true>(mode, grid, st, segs, nseg, p, inv, use2, w.part, w.flags);
      else launch_reduce<float, true>(mode, grid, st, segs, nseg, p, inv, use2, w.part, w.flags);
    } else {
      if (acc64) launch_reduce<double, false>(mode, grid, st, segs, nseg, p, inv, use2, w.part, w.flags);
      else launch_reduce<float, false>(mode, grid, st, segs, nseg, p, inv, use2, w.part, w.flags);
    }
  }
  if (nrows > 0) k_rows<<<grid_for(nrows * kRowLanes, 256), 256, 0, st>>>(segs, nseg, nrows, mode, w.part, 1, 0, out);
}

}  // namespace

// ------------------------------------------------------------------------------------------- API
int64_t plan(Seg* segs, int64_t nseg, int64_t* total_rows) {
  int64_t chunks = 0, rows = 0;
  for (int64_t i = 0; i < nseg; ++i) {
    Seg& s = segs[i];
    s.cpr = s.len > 0 ? (s.len + kChunk - 1) / kChunk : 0;
    s.first_chunk = chunks;
    s.first_row = rows;
    chunks += s.rows * s.cpr;
    rows += s.rows;
  }
  *total_rows = rows;
  return chunks;
}

size_t workspace_bytes(int64_t nchunks, int64_t nrows) {
  return align_up(sizeof(double) * 5 * static_cast<size_t>(nchunks)) + align_up(sizeof(int) * static_cast<size_t>(nchunks)) +
         align_up(sizeof(double) * 3 * static_cast<size_t>(nrows)) + align_up(sizeof(int) * static_cast<size_t>(nrows)) + 256;
}

int norm(const Seg* d_segs, int64_t nseg, int64_t nchunks, int64_t nrows, int mode, double p, int acc64,
         const float* d_inv, void* d_total, void* d_per, float* d_found, void* d_ws, Stream stream) {
  cudaStream_t st = stream;
  const Ws w = carve(d_ws, nchunks, nrows);
  row_reduce(d_segs, nseg, nchunks, nrows, mode, p, acc64, d_inv, 0, w, w.rows, st);
  float* found = d_inv != nullptr ? d_found : nullptr;
  if (acc64)
    k_norm_finish<double><<<1, kThreads, 0, st>>>(w.rows, nrows, mode, p, static_cast<double*>(d_total),
                                                  static_cast<double*>(d_per), w.flags, nchunks, found);
  else
    k_norm_finish<float><<<1, kThreads, 0, st>>>(w.rows, nrows, mode, p, static_cast<float*>(d_total),
                                                 static_cast<float*>(d_per), w.flags, nchunks, found);
  return static_cast<int>(cudaGetLastError());
}

int stats(const Seg* d_segs, int64_t nseg, int64_t nchunks, int64_t nrows, int acc64, void* d_norm, void* d_max,
          int64_t* d_nan, int64_t* d_inf, int64_t* d_zero, void* d_ws, Stream stream) {
  cudaStream_t st = stream;
  const Ws w = carve(d_ws, nchunks, nrows);
  if (nchunks > 0) {
    if (acc64) k_stats<double><<<static_cast<unsigned>(nchunks), kThreads, 0, st>>>(d_segs, nseg, w.part);
    else k_stats<float><<<static_cast<unsigned>(nchunks), kThreads, 0, st>>>(d_segs, nseg, w.part);
  }
  if (nrows > 0) {
    if (acc64)
      k_stats_finish<double><<<grid_for(nrows * kRowLanes, 256), 256, 0, st>>>(d_segs, nseg, nrows, w.part, static_cast<double*>(d_norm),
                                                                  static_cast<double*>(d_max), d_nan, d_inf, d_zero);
    else
      k_stats_finish<float><<<grid_for(nrows * kRowLanes, 256), 256, 0, st>>>(d_segs, nseg, nrows, w.part, static_cast<float*>(d_norm),
                                                                 static_cast<float*>(d_max), d_nan, d_inf, d_zero);
  }
  return static_cast<int>(cudaGetLastError());
}

int scale(const Seg* d_segs, int64_t nseg, int64_t nchunks, const void* d_factor, int factor_dtype, Stream stream) {
  if (nchunks > 0)
    k_scale<<<static_cast<unsigned>(nchunks), kThreads, 0, stream>>>(d_segs, nseg, d_factor, factor_dtype);
  return static_cast<int>(cudaGetLastError());
}

int clamp(const Seg* d_segs, int64_t nseg, int64_t nchunks, double c, Stream stream) {
  if (nchunks > 0) k_clamp<<<static_cast<unsigned>(nchunks), kThreads, 0, stream>>>(d_segs, nseg, c);
  return static_cast<int>(cudaGetLastError());
}

int agc(const Seg* d_segs, int64_t nseg, int64_t nchunks, int64_t nrows, int mode, double p, int acc64,
        double clip_factor, double eps, void* d_ws, Stream stream) {
  cudaStream_t st = stream;
  const Ws w = carve(d_ws, nchunks, nrows);
  if (nrows == 0) return static_cast<int>(cudaGetLastError());
  double* gs = w.rows;
  double* ws = w.rows + nrows;
  double* ratio = w.rows + 2 * nrows;
  row_reduce(d_segs, nseg, nchunks, nrows, mode, p, acc64, nullptr, 0, w, gs, st);
  row_reduce(d_segs, nseg, nchunks, nrows, mode, p, acc64, nullptr, 1, w, ws, st);
  k_agc_ratio<<<grid_for(nrows, 256), 256, 0, st>>>(nrows, gs, ws, mode, p, clip_factor, eps, ratio, w.rflag);
  if (nchunks > 0) k_row_apply<0><<<static_cast<unsigned>(nchunks), kThreads, 0, st>>>(d_segs, nseg, ratio, w.rflag);
  return static_cast<int>(cudaGetLastError());
}

int centralize(const Seg* d_segs, int64_t nseg, int64_t nchunks, int64_t nrows, void* d_ws, Stream stream) {
  cudaStream_t st = stream;
  const Ws w = carve(d_ws, nchunks, nrows);
  if (nrows == 0 || nchunks == 0) return static_cast<int>(cudaGetLastError());
  row_reduce(d_segs, nseg, nchunks, nrows, kSum, 1.0, 1, nullptr, 0, w, w.rows, st);
  k_mean<<<grid_for(nrows, 256), 256, 0, st>>>(d_segs, nseg, nrows, w.rows);
  k_row_apply<1><<<static_cast<unsigned>(nchunks), kThreads, 0, st>>>(d_segs, nseg, w.rows, nullptr);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace fgcuda
