// CUDA kernels: norms, the AMP read pass and grad_stats (helpers in common.cuh).
#include "common.cuh"

namespace fgcuda {
namespace {

template <typename A>
__global__ void __launch_bounds__(kThreads) k_norm_finish(const double* rows, int64_t nrows, int mode, double p,
                                                         A* total, A* per, const int* flags, int64_t nchunks,
                                                         float* found) {
  __shared__ double sh[2 * kWarps];
  double mx = 0.0;
  Comp sum;  // the CPU adds tensors' power sums compensated too
  for (int64_t r = threadIdx.x; r < nrows; r += kThreads) {
    const double s = rows[r];
    per[r] = static_cast<A>(root(mode, s, p));
    if (mode == kInf) mx = nan_max(mx, s);
    else sum.add(s);
  }
  const double t = mode == kInf ? block_max(mx, sh) : block_sum_comp(sum, sh);
  int bad = 0;
  if (found != nullptr)
    for (int64_t c = threadIdx.x; c < nchunks; c += kThreads) bad |= flags[c];
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) {
    *total = static_cast<A>(root(mode, t, p));
    if (found != nullptr) *found = bad ? 1.0f : 0.0f;
  }
}

// ------------------------------------------------------------------------------------------ clip
// torch.clamp(max_norm / (total + 1e-6), max=1.0) on a 0-dim tensor of dtype A, op by op as torch evaluates
// it (and as csrc/cpu/ops.cpp clip_coef does): add (the scalar rounded to A first), Tensor.__rtruediv__ as
// reciprocal then multiply by max_norm rounded to A, clamp with NaN passing through. IEEE division and no
// contraction (--fmad=false, no fast-math), as torch's own kernels compute these, so the bits are the same.
template <typename A>
__device__ __forceinline__ A clip_coef(A total, double max_norm) {
  const A d = total + static_cast<A>(1e-6);
  const A c = (static_cast<A>(1) / d) * static_cast<A>(max_norm);
  return (c != c || c < static_cast<A>(1)) ? c : static_cast<A>(1);
}

// The total-only finish of a whole-tensor norm (row r is Seg r) and the clip coefficient. It adds the same
// row values in the same order as k_norm_finish, so *total has the bits the norm op returns: thread t takes
// rows t, t + kThreads, ... With `rows` set they come from k_rows; without, k_rows is folded in: a row of one
// chunk is that chunk's partial (what warp_row returns for it: adding the other lanes' zeros to a one-term
// compensated sum changes nothing, and nan_max(0, x) = x for partials, which are >= +0 or NaN), an empty row
// is 0, and the warp computes each row of several chunks in turn with warp_row itself. Rows are taken kBatch
// per thread at a time so that their table and partial loads are in flight together: one block walks every
// row, and a chain of dependent loads per row would cost more than the launch it saves.
constexpr int kBatch = 8;

//
// AMP (the fused unscale + clip, amp_clip below): the partials are of the unscaled values, *found is the OR of
// the per-chunk overflow flags as k_norm_finish computes it, and *coef receives the factor inv * coef rounded to
// A (as torch multiplies the 0-dim inv_scale, converted to A, by the coefficient).
template <typename A, bool AMP>
__global__ void __launch_bounds__(kThreads) k_norm_clip(const Seg* segs, int64_t nrows, int mode, double p,
                                                       const double* part, const double* rows, double max_norm,
                                                       A* total, A* coef, const int* flags, int64_t nchunks,
                                                       const float* inv, float* found) {
  __shared__ double sh[2 * kWarps];
  const int lane = threadIdx.x & 31;
  double mx = 0.0;
  Comp sum;
  for (int64_t base = threadIdx.x - lane; base < nrows; base += kBatch * kThreads) {  // warp-uniform bound
    double v[kBatch];
    if (rows != nullptr) {
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int64_t r = base + j * kThreads + lane;
        v[j] = r < nrows ? rows[r] : 0.0;
      }
    } else {
      int64_t c0[kBatch], cpr[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int64_t r = base + j * kThreads + lane;
        c0[j] = r < nrows ? segs[r].first_chunk : 0;
        cpr[j] = r < nrows ? segs[r].cpr : 0;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) v[j] = cpr[j] == 1 ? part[c0[j]] : 0.0;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        for (unsigned many = __ballot_sync(0xffffffffu, cpr[j] > 1); many != 0; many &= many - 1) {
          const int src = __ffs(static_cast<int>(many)) - 1;
          const double rv = warp_row(part, __shfl_sync(0xffffffffu, c0[j], src), __shfl_sync(0xffffffffu, cpr[j], src),
                                     1, 0, mode, lane);
          const double got = __shfl_sync(0xffffffffu, rv, 0);
          if (lane == src) v[j] = got;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (base + j * kThreads + lane >= nrows) break;  // rows past the end add nothing (k_norm_finish's loop)
      if (mode == kInf) mx = nan_max(mx, v[j]);
      else sum.add(v[j]);
    }
  }
  const double t = mode == kInf ? block_max(mx, sh) : block_sum_comp(sum, sh);
  int bad = 0;
  if (AMP) {
    for (int64_t c = threadIdx.x; c < nchunks; c += kThreads) bad |= flags[c];
    bad = __syncthreads_or(bad);
  }
  if (threadIdx.x == 0) {
    const A tot = static_cast<A>(root(mode, t, p));
    *total = tot;
    const A c = clip_coef<A>(tot, max_norm);
    *coef = AMP ? static_cast<A>(*inv) * c : c;
    if (AMP) *found = bad ? 1.0f : 0.0f;
  }
}

// Up to this many chunks the clip's finish combines the rows itself (the fold above). Beyond, k_rows (a warp
// per row, all rows at once) runs first: one block walking hundreds of thousands of partials would take longer
// than a launch, and at that size (2^28 elements and up) the read pass dwarfs one more launch.
constexpr int64_t kFoldMaxChunks = 8192;

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
  const int err = d_inv != nullptr
                      ? row_reduce_amp(d_segs, nseg, nchunks, nrows, mode, p, acc64, d_inv, w.part, w.flags, w.rows, st)
                      : row_reduce<false>(d_segs, nseg, nchunks, nrows, mode, p, acc64, nullptr, 0, w, w.rows, st);
  if (err != 0) return err;
  float* found = d_inv != nullptr ? d_found : nullptr;
  if (acc64)
    k_norm_finish<double><<<1, kThreads, 0, st>>>(w.rows, nrows, mode, p, static_cast<double*>(d_total),
                                                  static_cast<double*>(d_per), w.flags, nchunks, found);
  else
    k_norm_finish<float><<<1, kThreads, 0, st>>>(w.rows, nrows, mode, p, static_cast<float*>(d_total),
                                                 static_cast<float*>(d_per), w.flags, nchunks, found);
  return static_cast<int>(cudaGetLastError());
}

namespace {

// What clip_norm and amp_clip run after their read pass (its partials in w.part, its flags in w.flags for AMP):
// k_rows past the fold limit, then the finish, which writes *d_total and the factor *d_coef (and *d_found).
// Returns the first launch error.
template <bool AMP>
int clip_finish(const Seg* d_segs, int64_t nseg, int64_t nchunks, int mode, double p, int acc64, double max_norm,
                const Ws& w, void* d_total, void* d_coef, const float* d_inv, float* d_found, cudaStream_t st) {
  const double* rows = nullptr;
  if (nchunks > kFoldMaxChunks) {
    k_rows<<<grid_for(nseg * kRowLanes, 256), 256, 0, st>>>(d_segs, nseg, nseg, mode, w.part, 1, 0, w.rows);
    const int err = static_cast<int>(cudaGetLastError());
    if (err != 0) return err;
    rows = w.rows;
  }
  if (acc64)
    k_norm_clip<double, AMP><<<1, kThreads, 0, st>>>(d_segs, nseg, mode, p, w.part, rows, max_norm,
                                                     static_cast<double*>(d_total), static_cast<double*>(d_coef),
                                                     w.flags, nchunks, d_inv, d_found);
  else
    k_norm_clip<float, AMP><<<1, kThreads, 0, st>>>(d_segs, nseg, mode, p, w.part, rows, max_norm,
                                                    static_cast<float*>(d_total), static_cast<float*>(d_coef),
                                                    w.flags, nchunks, d_inv, d_found);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int clip_norm(const Seg* d_segs, int64_t nseg, int64_t nchunks, int mode, double p, int acc64, double max_norm,
              void* d_total, void* d_ws, Stream stream) {
  cudaStream_t st = stream;
  const Ws w = carve(d_ws, nchunks, nseg);
  // The per-row area of the workspace holds 3 doubles per row: the row values (when k_rows runs) and, after
  // them, the coefficient the scale pass reads.
  void* coef = w.rows + nseg;
  if (nchunks > 0) {
    if (acc64) launch_reduce<double, false>(mode, static_cast<unsigned>(nchunks), st, d_segs, nseg, p, nullptr, 0, w.part, nullptr);
    else launch_reduce<float, false>(mode, static_cast<unsigned>(nchunks), st, d_segs, nseg, p, nullptr, 0, w.part, nullptr);
    const int err = static_cast<int>(cudaGetLastError());
    if (err != 0) return err;  // read-only so far: nothing written
  }
  const int err = clip_finish<false>(d_segs, nseg, nchunks, mode, p, acc64, max_norm, w, d_total, coef, nullptr,
                                     nullptr, st);
  if (err != 0) return err;  // before the only launch that writes gradients
  return scale(d_segs, nseg, nchunks, coef, acc64 ? kF64 : kF32, stream);
}

int amp_clip(const Seg* d_segs, int64_t nseg, int64_t nchunks, int mode, double p, int acc64, const float* d_inv,
             double max_norm, int write, void* d_total, float* d_found, void* d_factor, void* d_ws, Stream stream) {
  cudaStream_t st = stream;
  const Ws w = carve(d_ws, nchunks, nseg);
  // The AMP read pass alone (no rows: nrows 0), from amp.cu where its kernels are compiled.
  int err = row_reduce_amp(d_segs, nseg, nchunks, 0, mode, p, acc64, d_inv, w.part, w.flags, nullptr, st);
  if (err != 0) return err;  // read-only so far: nothing written
  err = clip_finish<true>(d_segs, nseg, nchunks, mode, p, acc64, max_norm, w, d_total, d_factor, d_inv, d_found, st);
  if (err != 0 || !write) return err;  // before the only launch that writes gradients
  return scale(d_segs, nseg, nchunks, d_factor, acc64 ? kF64 : kF32, stream);
}

int stats(const Seg* d_segs, int64_t nseg, int64_t nchunks, int64_t nrows, int acc64, void* d_norm, void* d_max,
          int64_t* d_nan, int64_t* d_inf, int64_t* d_zero, void* d_ws, Stream stream) {
  cudaStream_t st = stream;
  const Ws w = carve(d_ws, nchunks, nrows);
  if (nchunks > 0) {
    if (acc64) k_stats<double><<<static_cast<unsigned>(nchunks), kThreads, 0, st>>>(d_segs, nseg, w.part);
    else k_stats<float><<<static_cast<unsigned>(nchunks), kThreads, 0, st>>>(d_segs, nseg, w.part);
    const int err = static_cast<int>(cudaGetLastError());
    if (err != 0) return err;
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

int probe_reduce() {
  cudaFuncAttributes a;
  return static_cast<int>(cudaFuncGetAttributes(&a, k_norm_finish<float>));
}

}  // namespace fgcuda
