// CUDA kernels: scale, clamp, AGC and GC (helpers in common.cuh).
#include "common.cuh"

namespace fgcuda {
namespace {

// ------------------------------------------------------------------------------------- elementwise
__global__ void __launch_bounds__(kThreads) k_scale(const Seg* segs, int64_t nseg, const void* factor, int fdt) {
  const double f = fdt == kF64 ? *static_cast<const double*>(factor) : *static_cast<const float*>(factor);
  if (f == 1.0) return;  // not clipping: gradient memory is not touched
  const Loc L = locate(segs, nseg, blockIdx.x);
  with_type(L.s->dtype, L.s->ptr, L.offset, [&](auto* q) {
    using T = typename std::remove_pointer<decltype(q)>::type;
    if (fdt == kF64) {
      // A float64 factor (lists holding float64 grads): product in double, rounded once to T, as the Triton
      // backend computes it.
      transform(q, L.n, [f](T x) { return from_double<T>(static_cast<double>(to_float(x)) * f); });
    } else {
      // T(x * f) with the product in float (double for double data): torch's mul_ by a float factor.
      using O = typename OpMath<T>::type;
      const O ff = static_cast<O>(f);
      transform(q, L.n, [ff](T x) { return store<T>(static_cast<O>(to_float(x)) * ff); });
    }
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
      return store<T>(v);
    });
  });
}

// Per-row transform: kind 0 scales by val[row] (rows with skip[row] set are left alone), kind 1
// subtracts val[row]. Computed in double and rounded once to T (from_double), as the Triton backend's
// fp64 AGC and GC apply kernels do.
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

}  // namespace

// ------------------------------------------------------------------------------------------- API
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
  // Stop at the first failed launch, before anything writes a gradient.
  int err = row_reduce<false>(d_segs, nseg, nchunks, nrows, mode, p, acc64, nullptr, 0, w, gs, st);
  if (err != 0) return err;
  err = row_reduce<false>(d_segs, nseg, nchunks, nrows, mode, p, acc64, nullptr, 1, w, ws, st);
  if (err != 0) return err;
  k_agc_ratio<<<grid_for(nrows, 256), 256, 0, st>>>(nrows, gs, ws, mode, p, clip_factor, eps, ratio, w.rflag);
  if (nchunks > 0) k_row_apply<0><<<static_cast<unsigned>(nchunks), kThreads, 0, st>>>(d_segs, nseg, ratio, w.rflag);
  return static_cast<int>(cudaGetLastError());
}

int centralize(const Seg* d_segs, int64_t nseg, int64_t nchunks, int64_t nrows, void* d_ws, Stream stream) {
  cudaStream_t st = stream;
  const Ws w = carve(d_ws, nchunks, nrows);
  if (nrows == 0 || nchunks == 0) return static_cast<int>(cudaGetLastError());
  const int err = row_reduce<false>(d_segs, nseg, nchunks, nrows, kSum, 1.0, 1, nullptr, 0, w, w.rows, st);
  if (err != 0) return err;  // before anything writes a gradient
  k_mean<<<grid_for(nrows, 256), 256, 0, st>>>(d_segs, nseg, nrows, w.rows);
  k_row_apply<1><<<static_cast<unsigned>(nchunks), kThreads, 0, st>>>(d_segs, nseg, w.rows, nullptr);
  return static_cast<int>(cudaGetLastError());
}

// Loads each file's module for the current device (no launch, nothing enqueued): 0 when this build has code
// the device can run, else the error its first launch would raise.
int probe() {
  cudaFuncAttributes a;
  int err = static_cast<int>(cudaFuncGetAttributes(&a, k_scale));
  if (err == 0) err = probe_reduce();
  if (err == 0) err = probe_amp();
  if (err != 0) cudaGetLastError();  // a failed runtime call is also the thread's "last error": clear it
  return err;
}

}  // namespace fgcuda
