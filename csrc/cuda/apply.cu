// CUDA kernels: scale, clamp, AGC and GC (helpers in common.cuh).
#include "common.cuh"

#include <algorithm>

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

// GC's subtraction, as torch's g.sub_(mean) with a float32 mean and the CPU kernels' sub_range compute it: the
// mean rounded to float and x - mean in float (both in double for double data), rounded once to T. (In double
// with a double -> T rounding per element it put two fp64 conversions on every element, on the GPU's slow
// fp64 conversion path.)
template <typename T>
__device__ __forceinline__ T sub_mean(T x, double mean) {
  using O = typename OpMath<T>::type;
  return store<T>(static_cast<O>(to_float(x)) - static_cast<O>(mean));
}

// Per-row transform over the split rows' chunk blocks b0, b0 + 1, ...: kind 0 scales by val[row] (rows with
// skip[row] set are left alone) in double, rounded once to T (from_double), as the Triton backend's AGC apply
// kernel does; kind 1 subtracts val[row] (sub_mean).
template <int KIND>
__global__ void __launch_bounds__(kThreads) k_row_apply(const Seg* segs, int64_t nseg, int64_t b0, const double* val,
                                                       const int* skip) {
  const Loc L = locate(segs, nseg, b0 + blockIdx.x);
  if (KIND == 0 && skip[L.row]) return;
  const double v = val[L.row];
  with_type(L.s->dtype, L.s->ptr, L.offset, [&](auto* q) {
    using T = typename std::remove_pointer<decltype(q)>::type;
    transform(q, L.n, [v](T x) {
      return KIND == 0 ? from_double<T>(static_cast<double>(to_float(x)) * v) : sub_mean<T>(x, v);
    });
  });
}

// ------------------------------------------------------------------------------------- AGC and GC rows
// The AGC coefficient of one unit from its power sums (timm's formula in double): `keep` when
// ||G|| < clip_factor * max(||W||, eps), else G *= max_norm / max(||G||, 1e-6). NaN norms clip (to NaN).
__device__ __forceinline__ double agc_ratio(double wsum, double gsum, int mode, double p, double clip_factor, double eps,
                                            bool& keep) {
  const double wn = root(mode, wsum, p), gn = root(mode, gsum, p);
  const double max_norm = (wn != wn ? wn : (wn < eps ? eps : wn)) * clip_factor;
  keep = gn < max_norm;
  const double den = gn != gn ? gn : (gn < 1e-6 ? 1e-6 : gn);
  return keep ? 1.0 : max_norm / den;
}

// A packed row is cut into "virtual vectors": the 16-byte-aligned windows of memory it overlaps. Window s
// holds row elements [s * E - mis, s * E - mis + E), where mis is how far the row starts past a 16-byte
// boundary; inner windows are one aligned 16-byte access, the (at most two) windows at the ends are read
// and written element by element inside the row. Row starts at any element offset thus keep vector access.
template <typename T>
struct Windows {
  static constexpr int E = 16 / sizeof(T);
  int mis;
  int64_t count;
  __device__ __forceinline__ Windows(const T* p, int64_t n) {
    mis = static_cast<int>((reinterpret_cast<uintptr_t>(p) & 15) / sizeof(T));
    count = (n + mis + E - 1) / E;
  }
  __device__ __forceinline__ int64_t first(int64_t s) const { return s * E - mis; }  // row index of element 0
};

// Elements [lo, hi) of window i0 (its first row index) lie inside the row of n elements.
__device__ __forceinline__ int win_lo(int64_t i0) { return i0 < 0 ? static_cast<int>(-i0) : 0; }
template <int E>
__device__ __forceinline__ int win_hi(int64_t i0, int64_t n) { return n - i0 < E ? static_cast<int>(n - i0) : E; }

template <typename T>
__device__ __forceinline__ uint4 load_window(const T* p, int64_t n, int64_t i0) {
  constexpr int E = 16 / sizeof(T);
  if (i0 >= 0 && i0 + E <= n) return *reinterpret_cast<const uint4*>(p + i0);  // p + i0 is 16-byte aligned
  uint4 raw = make_uint4(0u, 0u, 0u, 0u);
  T e[E];
  memcpy(e, &raw, 16);
  const int lo = win_lo(i0), hi = win_hi<E>(i0, n);
#pragma unroll
  for (int k = 0; k < E; ++k)
    if (k >= lo && k < hi) e[k] = p[i0 + k];
  memcpy(&raw, e, 16);
  return raw;
}

// Rows of up to kThreads * kHold windows are held in registers: kHold 16-byte windows per thread, 32 KB
// per block. Lane l of a team of S lanes holds windows l, l + S, ..., l + (kHold - 1) S (neighbouring lanes
// touch neighbouring windows). Fully unrolled, so h[] stays in registers.
constexpr int kHold = 8;

template <typename T>
__device__ __forceinline__ void hold_row(const T* p, int64_t n, int l, int S, bool valid, uint4 (&h)[kHold]) {
  const Windows<T> w(p, n);
#pragma unroll
  for (int j = 0; j < kHold; ++j) {
    const int64_t s = static_cast<int64_t>(j) * S + l;
    h[j] = (valid && s < w.count) ? load_window(p, n, w.first(s)) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// h[j] for a j the compiler cannot see: selects, so that h[] stays in registers while the loops below over
// j are not unrolled (unrolled, each would inline fn kHold * E times: the pow of p-norms 64 times per dtype,
// and ptxas took minutes per file).
__device__ __forceinline__ uint4 pick(const uint4 (&h)[kHold], int j) {
  uint4 v = h[0];
#pragma unroll
  for (int i = 1; i < kHold; ++i)
    if (i == j) v = h[i];
  return v;
}

// fn(x) for each element of window i0 (raw: its 16 bytes) that lies inside the row of n elements.
template <typename T, typename F>
__device__ __forceinline__ void visit_window(uint4 raw, int64_t i0, int64_t n, F& fn) {
  constexpr int E = Windows<T>::E;
  T e[E];
  memcpy(e, &raw, 16);
  const int lo = win_lo(i0), hi = win_hi<E>(i0, n);
#pragma unroll
  for (int k = 0; k < E; ++k)
    if (k >= lo && k < hi) fn(e[k]);
}

// fn(x) for each element of the row this lane holds.
template <typename T, typename F>
__device__ __forceinline__ void visit_held(const T* p, int64_t n, int l, int S, bool valid, const uint4 (&h)[kHold],
                                           F& fn) {
  const Windows<T> w(p, n);
#pragma unroll 1
  for (int j = 0; j < kHold; ++j) {
    const int64_t s = static_cast<int64_t>(j) * S + l;
    if (!valid || s >= w.count) break;  // windows l + jS grow with j
    visit_window<T>(pick(h, j), w.first(s), n, fn);
  }
}

// Writes fn(x) of the held elements back to their places: no second read of the row.
template <typename T, typename F>
__device__ __forceinline__ void store_held(T* p, int64_t n, int l, int S, const uint4 (&h)[kHold], const F& fn) {
  constexpr int E = Windows<T>::E;
  const Windows<T> w(p, n);
#pragma unroll 1
  for (int j = 0; j < kHold; ++j) {
    const int64_t s = static_cast<int64_t>(j) * S + l;
    if (s >= w.count) break;
    const int64_t i0 = w.first(s);
    const uint4 raw = pick(h, j);
    T e[E];
    memcpy(e, &raw, 16);
#pragma unroll
    for (int k = 0; k < E; ++k) e[k] = fn(e[k]);
    if (i0 >= 0 && i0 + E <= n) {
      uint4 out;
      memcpy(&out, e, 16);
      *reinterpret_cast<uint4*>(p + i0) = out;
    } else {
      const int lo = win_lo(i0), hi = win_hi<E>(i0, n);
#pragma unroll
      for (int k = 0; k < E; ++k)
        if (k >= lo && k < hi) p[i0 + k] = e[k];
    }
  }
}

// fn(x) over a row this team reads once and does not keep (AGC's parameter row): windows l, l + S, ...,
// loaded kStream at a time (independent loads in flight together), then visited one by one.
constexpr int kStream = 4;

template <typename T, typename F>
__device__ __forceinline__ void visit_team(const T* p, int64_t n, int l, int S, F& fn) {
  const Windows<T> w(p, n);
  for (int64_t s0 = l; s0 < w.count; s0 += static_cast<int64_t>(kStream) * S) {
    uint4 v[kStream];
#pragma unroll
    for (int q = 0; q < kStream; ++q) {
      const int64_t s = s0 + static_cast<int64_t>(q) * S;
      v[q] = s < w.count ? load_window(p, n, w.first(s)) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll 1
    for (int q = 0; q < kStream; ++q) {
      const int64_t s = s0 + static_cast<int64_t>(q) * S;
      if (s >= w.count) break;
      uint4 raw = v[0];
#pragma unroll
      for (int i = 1; i < kStream; ++i)
        if (i == q) raw = v[i];
      visit_window<T>(raw, w.first(s), n, fn);
    }
  }
}

// Sum (or NaN-keeping max) of v over a team, returned to all its lanes, in a fixed order. S is 1..32 (teams
// are aligned groups of S lanes of one warp; every lane of the warp calls this, with the same S, so the
// full-mask shuffles are legal; the width-S shuffles stay inside each team; the value is formed in the
// team's first lane by a shfl_down tree and then broadcast, so every lane gets the same bits) or kThreads
// (the whole block calls this, block-uniformly: block_sum's __syncthreads; sh holds kWarps + 1 doubles,
// the last for the broadcast, which the next call's first __syncthreads orders after every read).
__device__ __forceinline__ double team_reduce(double v, bool is_max, int S, double* sh) {
  if (S == kThreads) {
    v = is_max ? block_max(v, sh) : block_sum(v, sh);
    if (threadIdx.x == 0) sh[kWarps] = v;
    __syncthreads();
    return sh[kWarps];
  }
  for (int o = S >> 1; o > 0; o >>= 1) {
    const double u = __shfl_down_sync(0xffffffffu, v, o, S);
    v = is_max ? nan_max(v, u) : v + u;
  }
  return __shfl_sync(0xffffffffu, v, 0, S);
}

// k_reduce's per-element step (ReduceFn), with the p-norm's pow called rather than inlined: the row pass
// visits elements at several places per dtype, and inlined pow there made this file take minutes to build
// (3x reduce.cu). Same operations, so the same bits as ReduceFn.
template <typename A>
__device__ __noinline__ A pow_called(A a, A p) { return pow_term(a, p); }

template <int M, typename A>
struct RowFn : ReduceFn<M, A, false> {
  __device__ __forceinline__ explicit RowFn(double p) {
    this->p = static_cast<A>(p);
    this->inv = 1.0f;
  }
  template <typename T>
  __device__ __forceinline__ void operator()(T x) {
    if constexpr (M == kP) this->acc.add(pow_called(fabs(static_cast<A>(to_float(x))), this->p));
    else ReduceFn<M, A, false>::operator()(x);
  }
  __device__ __forceinline__ double value() const {
    return M == kInf ? static_cast<double>(this->mx) : this->acc.value();
  }
};

// Block of a Seg in a row plan: the last Seg whose first_chunk <= b (Segs without blocks share their
// first_chunk with the next one and lose to it).
__device__ __forceinline__ const Seg* block_seg(const Seg* segs, int64_t nseg, int64_t b) {
  int64_t lo = 0, hi = nseg - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (segs[mid].first_chunk <= b) lo = mid; else hi = mid - 1;
  }
  return &segs[lo];
}

// The row pass of AGC (GC = false; M the norm, A the thread accumulator) and GC (GC = true, kSum, double).
// A packed block takes rpb whole rows of its Seg: each team of S lanes (S = Seg.team) holds one row in
// registers, reduces it (AGC also streams the parameter row: its norm only), computes the coefficient or
// the mean in double, and writes the row from the registers; one read and at most one write per element.
// A block of a split row writes its chunk's partial(s) (as k_reduce computes them) to part: AGC the
// parameter's at 2b and the gradient's at 2b + 1, GC the sum at b.
// Everything that decides control flow around team_reduce (the Seg, S, the pass count) is block-uniform;
// only memory accesses depend on `valid` (a row past the Seg's end in its last block).
template <int M, typename A, bool GC>
__global__ void __launch_bounds__(kThreads) k_row_pass(const Seg* segs, int64_t nseg, double p, double clip_factor,
                                                      double eps, double* part) {
  __shared__ double sh[kWarps + 1];
  const int64_t b = blockIdx.x;
  const Seg* s = block_seg(segs, nseg, b);
  if (s->team == 0) {  // a chunk of a split row
    const Loc L = locate(segs, nseg, b);
    double r[2] = {0.0, 0.0};
#pragma unroll 1  // one inlined copy of visit for both tensors
    for (int k = GC ? 1 : 0; k < 2; ++k) {
      RowFn<M, A> fn(p);
      void* base = k == 0 ? const_cast<void*>(L.s->ptr2) : L.s->ptr;
      with_type(k == 0 ? L.s->dtype2 : L.s->dtype, base, L.offset, [&](auto* q) { visit(q, L.n, fn); });
      r[k] = M == kInf ? block_max(fn.value(), sh) : block_sum(fn.value(), sh);
    }
    if (threadIdx.x == 0) {
      if (GC) {
        part[b] = r[1];
      } else {
        part[2 * b] = r[0];
        part[2 * b + 1] = r[1];
      }
    }
    return;
  }
  const int S = s->team;
  const int l = static_cast<int>(threadIdx.x) & (S - 1);  // S is a power of two
  const int nt = kThreads / S;                             // teams per block
  const int t = static_cast<int>(threadIdx.x) / S;
  const int64_t n = s->len;
  const int64_t row0 = (b - s->first_chunk) * s->rpb;
  const int passes = s->rpb / nt;
  for (int k = 0; k < passes; ++k) {
    const int64_t r = row0 + static_cast<int64_t>(k) * nt + t;
    const bool valid = r < s->rows;
    const int64_t off = valid ? r * n : 0;
    uint4 h[kHold];
    with_type(s->dtype, s->ptr, off, [&](auto* q) { hold_row(q, n, l, S, valid, h); });  // loads in flight...
    double wsum = 0.0;
    if (!GC) {  // ...while the parameter row streams through
      RowFn<M, A> fw(p);
      if (valid)
        with_type(s->dtype2, const_cast<void*>(s->ptr2), off, [&](auto* q) { visit_team(q, n, l, S, fw); });
      wsum = team_reduce(fw.value(), M == kInf, S, sh);
    }
    with_type(s->dtype, s->ptr, off, [&](auto* q) {
      using T = typename std::remove_pointer<decltype(q)>::type;
      RowFn<M, A> fg(p);
      visit_held(q, n, l, S, valid, h, fg);
      const double gsum = team_reduce(fg.value(), M == kInf, S, sh);
      if (GC) {
        const double mean = gsum / static_cast<double>(n);
        if (valid) store_held(q, n, l, S, h, [mean](T x) { return sub_mean<T>(x, mean); });
      } else {
        bool keep;
        const double ratio = agc_ratio(wsum, gsum, M, p, clip_factor, eps, keep);
        if (valid && !keep)  // rows that keep their gradient are not written
          store_held(q, n, l, S, h, [ratio](T x) { return from_double<T>(static_cast<double>(to_float(x)) * ratio); });
      }
    });
  }
}

// Split rows' coefficient (AGC: val the ratio, skip set where the row keeps its gradient) or mean (GC), a warp
// per row combining the row's chunk partials in chunk order (warp_row, as k_rows). r is warp-uniform, so
// whole warps return together and warp_row's full-mask shuffles are legal.
template <bool GC>
__global__ void k_split_rows(const Seg* segs, int64_t seg0, int64_t nseg, int64_t nrows, int mode, double p,
                             double clip_factor, double eps, const double* part, double* val, int* skip) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  if (r >= nrows) return;
  const Seg* s = &segs[seg0 + find_row_seg(segs + seg0, nseg - seg0, r)];
  const int64_t c0 = s->first_chunk + (r - s->first_row) * s->cpr;
  if (GC) {
    const double sum = warp_row(part, c0, s->cpr, 1, 0, kSum, lane);
    if (lane == 0) val[r] = sum / static_cast<double>(s->len);
  } else {
    const double ws = warp_row(part, c0, s->cpr, 2, 0, mode, lane);
    const double gs = warp_row(part, c0, s->cpr, 2, 1, mode, lane);
    if (lane == 0) {
      bool keep;
      val[r] = agc_ratio(ws, gs, mode, p, clip_factor, eps, keep);
      skip[r] = keep ? 1 : 0;
    }
  }
}

template <typename A>
void launch_agc_pass(int mode, unsigned grid, cudaStream_t st, const Seg* segs, int64_t nseg, double p,
                     double clip_factor, double eps, double* part) {
  switch (mode) {
    case kL1: k_row_pass<kL1, A, false><<<grid, kThreads, 0, st>>>(segs, nseg, p, clip_factor, eps, part); break;
    case kL2: k_row_pass<kL2, A, false><<<grid, kThreads, 0, st>>>(segs, nseg, p, clip_factor, eps, part); break;
    case kInf: k_row_pass<kInf, A, false><<<grid, kThreads, 0, st>>>(segs, nseg, p, clip_factor, eps, part); break;
    default: k_row_pass<kP, A, false><<<grid, kThreads, 0, st>>>(segs, nseg, p, clip_factor, eps, part); break;
  }
}

// Host: bytes of one element of a Seg dtype.
inline int64_t elem_size(int32_t dt) { return dt == kF64 ? 8 : (dt == kF32 ? 4 : 2); }

// Rows per block aim at this many bytes of gradient (several passes of a block's teams) so that blocks of
// short rows are not all launch overhead; at most kMaxPasses, since each pass waits for its own loads.
constexpr int64_t kPackBytes = 32768;
constexpr int64_t kMaxPasses = 4;

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

int64_t plan_rows(Seg* segs, int64_t nseg, RowPlan* rp) {
  // Most windows (see Windows<T>) a row of the Seg spans. Row r starts (mis0 + r * len) mod e elements into
  // a 16-byte window (the pointer is element-aligned), a sequence of period at most e: its first e rows
  // show every start offset the Seg has.
  auto windows = [](const Seg& s) {
    const int64_t size = elem_size(s.dtype), e = 16 / size;
    const int64_t mis0 = static_cast<int64_t>((reinterpret_cast<uintptr_t>(s.ptr) & 15) / static_cast<uintptr_t>(size));
    int64_t most = 0;
    for (int64_t r = 0; r < std::min<int64_t>(s.rows, e); ++r)
      most = std::max(most, (s.len + (mis0 + r * s.len) % e + e - 1) / e);
    return most;
  };
  auto packed = [&](const Seg& s) { return s.len == 0 || s.rows == 0 || windows(s) <= int64_t(kThreads) * kHold; };
  Seg* split = std::stable_partition(segs, segs + nseg, packed);
  *rp = RowPlan();
  rp->split_seg0 = split - segs;
  int64_t blocks = 0;
  for (int64_t i = 0; i < nseg; ++i) {
    Seg& s = segs[i];
    s.first_chunk = blocks;
    if (i < rp->split_seg0) {
      s.cpr = 0;
      s.first_row = 0;
      s.team = kThreads;
      const int64_t nw = windows(s);
      for (int32_t S = 1; S <= 32; S <<= 1)
        if (int64_t(S) * kHold >= nw) {
          s.team = S;
          break;
        }
      const int64_t nt = kThreads / s.team;
      const int64_t row_bytes = s.len * elem_size(s.dtype);
      int64_t passes = row_bytes > 0 ? kPackBytes / (nt * row_bytes) : 1;
      passes = std::max<int64_t>(1, std::min<int64_t>({passes, kMaxPasses, (s.rows + nt - 1) / nt}));
      s.rpb = static_cast<int32_t>(nt * passes);
      blocks += (s.len > 0 && s.rows > 0) ? (s.rows + s.rpb - 1) / s.rpb : 0;
      rp->npacked = blocks;
    } else {
      s.cpr = (s.len + kChunk - 1) / kChunk;
      s.first_row = rp->nsplit_rows;
      s.team = 0;
      s.rpb = 0;
      blocks += s.rows * s.cpr;
      rp->nsplit_rows += s.rows;
    }
  }
  rp->nblocks = blocks;
  return blocks;
}

int agc(const Seg* d_segs, int64_t nseg, const RowPlan& rp, int mode, double p, int acc64, double clip_factor,
        double eps, void* d_ws, Stream stream) {
  cudaStream_t st = stream;
  const Ws w = carve(d_ws, rp.nblocks, rp.nsplit_rows);
  if (rp.nblocks == 0) return static_cast<int>(cudaGetLastError());
  const unsigned grid = static_cast<unsigned>(rp.nblocks);
  if (acc64) launch_agc_pass<double>(mode, grid, st, d_segs, nseg, p, clip_factor, eps, w.part);
  else launch_agc_pass<float>(mode, grid, st, d_segs, nseg, p, clip_factor, eps, w.part);
  int err = static_cast<int>(cudaGetLastError());
  if (err != 0 || rp.nsplit_rows == 0) return err;
  k_split_rows<false><<<grid_for(rp.nsplit_rows * kRowLanes, 256), 256, 0, st>>>(
      d_segs, rp.split_seg0, nseg, rp.nsplit_rows, mode, p, clip_factor, eps, w.part, w.rows, w.rflag);
  err = static_cast<int>(cudaGetLastError());
  if (err != 0) return err;
  k_row_apply<0><<<static_cast<unsigned>(rp.nblocks - rp.npacked), kThreads, 0, st>>>(d_segs, nseg, rp.npacked, w.rows,
                                                                                     w.rflag);
  return static_cast<int>(cudaGetLastError());
}

int centralize(const Seg* d_segs, int64_t nseg, const RowPlan& rp, void* d_ws, Stream stream) {
  cudaStream_t st = stream;
  const Ws w = carve(d_ws, rp.nblocks, rp.nsplit_rows);
  if (rp.nblocks == 0) return static_cast<int>(cudaGetLastError());
  // Double lanes for every dtype: float lanes (as AGC's) took ptxas to 111 registers for this pass on sm_80, against
  // 76 with the compensated double lanes (2 blocks per SM instead of 3), for rows already held in registers.
  k_row_pass<kSum, double, true><<<static_cast<unsigned>(rp.nblocks), kThreads, 0, st>>>(d_segs, nseg, 1.0, 0.0, 0.0,
                                                                                        w.part);
  int err = static_cast<int>(cudaGetLastError());
  if (err != 0 || rp.nsplit_rows == 0) return err;
  k_split_rows<true><<<grid_for(rp.nsplit_rows * kRowLanes, 256), 256, 0, st>>>(
      d_segs, rp.split_seg0, nseg, rp.nsplit_rows, kSum, 1.0, 0.0, 0.0, w.part, w.rows, nullptr);
  err = static_cast<int>(cudaGetLastError());
  if (err != 0) return err;
  k_row_apply<1><<<static_cast<unsigned>(rp.nblocks - rp.npacked), kThreads, 0, st>>>(d_segs, nseg, rp.npacked, w.rows,
                                                                                     nullptr);
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
