// Read-only range kernels: norms, the AMP read pass and gradient statistics.
//
// Accuracy: a long sequential fp32 sum loses digits, so each run is reduced in blocks of 256 elements
// spread over 16 lanes (the compiler turns the lane loops into SIMD), the lanes are folded pairwise and
// each block total is added in double. Results are identical on every x86/ARM CPU because the lane
// count is fixed here, not taken from the vector width.
#include "kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <type_traits>

namespace fastgrad {
namespace cpu {
namespace {

constexpr int kLanes = 16;
constexpr int kBlock = 256;

template <typename T>
using opmath_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Element as A. 16-bit values are widened on their bits (kernels.h) so the lane loops vectorise.
template <typename A, typename T>
inline A to_acc(T x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return static_cast<A>(bf16_to_f32(x.x));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return static_cast<A>(fp16_to_f32(x.x));
  } else {
    return static_cast<A>(x);
  }
}

// float -> T -> float: the value a 16-bit store of v reads back as; identity for float/double.
template <typename T, typename O>
inline O round_trip(O v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return f32_round_bf16(v);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return fp16_to_f32(f32_to_fp16(v));
  } else {
    return v;
  }
}

template <typename A>
inline double fold(A* acc) {
  // Unrolled explicitly: GCC kept these loops rolled, and on thousands of one-element tensors the fold's
  // loop control was a third of the norm's instructions (callgrind). Same additions, same order.
#pragma GCC unroll 8
  for (int w = kLanes / 2; w > 0; w /= 2) {
#pragma GCC unroll 8
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return static_cast<double>(acc[0]);
}

template <Mode M, typename A>
inline A term(A v, A p) {
  if constexpr (M == Mode::Sum) {
    return v;
  } else if constexpr (M == Mode::L1) {
    return std::abs(v);
  } else if constexpr (M == Mode::L2) {
    return v * v;
  } else {
    return std::pow(std::abs(v), p);
  }
}

// Max |v| over lanes with NaN propagation kept in a separate flag so the max loop stays branch-free.
template <typename A>
struct MaxLanes {
  A mx[kLanes] = {};
  int nan[kLanes] = {};
  inline void add(int l, A v) {
    A a = std::abs(v);
    mx[l] = a > mx[l] ? a : mx[l];
    nan[l] |= (a != a);
  }
  inline double result() const {
    A m = 0;
    int any_nan = 0;
    for (int l = 0; l < kLanes; ++l) {
      m = mx[l] > m ? mx[l] : m;
      any_nan |= nan[l];
    }
    return any_nan ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(m);
  }
};

// Generic read pass in blocks of kBlock: `fill(i, m, buf)` writes elements [i, i + m) as A into buf
// (a simple loop that vectorises however involved the conversion), then the block is reduced over
// fixed lanes. Sum-like modes add each block total in double; Inf uses MaxLanes.
template <Mode M, typename A, typename Fill>
inline double reduce_loop(int64_t n, A p, const Fill& fill) {
  A buf[kBlock];
  CompensatedSum total;
  MaxLanes<A> ml;
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = std::min<int64_t>(kBlock, n - i);
    fill(i, m, buf);
    if constexpr (M == Mode::Inf) {
      if (m == kBlock) {
        for (int j = 0; j < kBlock; j += kLanes)
          for (int l = 0; l < kLanes; ++l) ml.add(l, buf[j + l]);
      } else {  // lane k % kLanes, element by element in order, as below
        int64_t k = 0;
        for (; k + kLanes <= m; k += kLanes)
          for (int l = 0; l < kLanes; ++l) ml.add(l, buf[k + l]);
        for (int l = 0; k + l < m; ++l) ml.add(l, buf[k + l]);
      }
    } else {
      A acc[kLanes] = {};
      if (m == kBlock) {
        for (int j = 0; j < kBlock; j += kLanes)
          for (int l = 0; l < kLanes; ++l) acc[l] += term<M, A>(buf[j + l], p);
      } else {
        // Element k into lane k % kLanes, each lane in order (whole rows of lanes, then the rest): the same
        // additions as one loop over k, but the row loop vectorises (a lane index computed per element kept
        // the lanes in memory, several cycles per element on lists of small tensors).
        int64_t k = 0;
        for (; k + kLanes <= m; k += kLanes)
          for (int l = 0; l < kLanes; ++l) acc[l] += term<M, A>(buf[k + l], p);
        for (int l = 0; k + l < m; ++l) acc[l] += term<M, A>(buf[k + l], p);
      }
      total.add(fold(acc));
    }
  }
  if constexpr (M == Mode::Inf) {
    return ml.result();
  } else {
    return total.value();
  }
}

// fp32 fast path for Sum/L1/L2 with float lanes (the common gradient case). The generic loop stages
// each block in a buffer and was compute-bound at ~16 GB/s even in cache; here the 16 lanes live in
// two 8-wide vector registers and are fed straight from memory. Same lanes, same order of adds, same
// fold and block totals as reduce_loop: bitwise-identical results. GCC/Clang vector extensions lower to
// one AVX op per statement in the avx2 clone and two SSE ops in the baseline one.
#if defined(__GNUC__)
#define FASTGRAD_VEC8 1
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

template <Mode M>
constexpr bool kFast32 = M == Mode::Sum || M == Mode::L1 || M == Mode::L2;

// fold() of the lanes a (0-7) and b (8-15), in fold()'s order.
#define FASTGRAD_FOLD8(a, b, out)                    \
  do {                                               \
    const v8f s_ = (a) + (b);                        \
    const float s0_ = s_[0] + s_[4], s1_ = s_[1] + s_[5]; \
    const float s2_ = s_[2] + s_[6], s3_ = s_[3] + s_[7]; \
    out = static_cast<double>((s0_ + s2_) + (s1_ + s3_)); \
  } while (0)

// term<M> on 8 lanes (a macro, not a function: no 32-byte vector crosses a call in the SSE2 clone).
#define FASTGRAD_TERM8(M, v) \
  ((M) == Mode::L2 ? (v) * (v) : (M) == Mode::L1 ? (v8f)((v8i)(v) & 0x7FFFFFFF) : (v))

// One full block's folded total, lanes in two 8-wide registers; SCALED multiplies by inv first (AMP).
// Only a double leaves the function, so no vector crosses a call even if it is not inlined.
template <Mode M, bool SCALED>
inline double block32(const float* x, float inv) {
  v8f a = {}, b = {};
  for (int j = 0; j < kBlock; j += kLanes) {
    v8f u, w;
    std::memcpy(&u, x + j, sizeof(u));
    std::memcpy(&w, x + j + 8, sizeof(w));
    if constexpr (SCALED) {
      u *= inv;
      w *= inv;
    }
    a += FASTGRAD_TERM8(M, u);
    b += FASTGRAD_TERM8(M, w);
  }
  double blk;
  FASTGRAD_FOLD8(a, b, blk);
  return blk;
}

// The block-wise read pass shared by the fp32 and bf16 fast paths: block(i) is the folded total of the
// full block at element i, value(k) element k as the float whose term the tail adds (lanes and fold as
// reduce_loop), and with nonfinite set, bad(i, m) says exactly whether stored elements [i, i + m) hold a
// NaN/inf. AMP (nonfinite set): a NaN/inf element makes its lane's term NaN/inf whatever inv is
// (inf * 0 = NaN), and a float lane sum never returns to finite, so a finite block total proves its block
// finite; only a non-finite total (rare: a bad element, or x * inv overflowing) costs a second, exact look
// at the block, which is still in L1.
template <Mode M, typename Block, typename Value, typename Bad>
inline double block_pass(int64_t n, const Block& block, const Value& value, const Bad& bad_at, bool* nonfinite) {
  CompensatedSum total;
  bool bad = false;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const double blk = block(i);
    if (nonfinite != nullptr && !bad && !std::isfinite(blk)) bad = bad_at(i, kBlock);
    total.add(blk);
  }
  if (i < n) {
    if (nonfinite != nullptr && !bad) bad = bad_at(i, n - i);
    float acc[kLanes] = {};
    // element k into lane k % kLanes, each lane in order, as reduce_loop's last block
    int64_t k = i;
    for (; k + kLanes <= n; k += kLanes)
      for (int l = 0; l < kLanes; ++l) acc[l] += term<M, float>(value(k + l), 0.0f);
    for (int l = 0; k + l < n; ++l) acc[l] += term<M, float>(value(k + l), 0.0f);
    total.add(fold(acc));
  }
  if (bad) *nonfinite = true;
  return total.value();
}

constexpr auto kNoCheck = [](int64_t, int64_t) { return false; };

template <Mode M>
double reduce_f32(const float* x, int64_t n) {
  return block_pass<M>(n, [x](int64_t i) { return block32<M, false>(x + i, 1.0f); },
                       [x](int64_t k) { return x[k]; }, kNoCheck, nullptr);
}

// AMP read pass on fp32 in one sweep: the norm of x * inv (what unscale_ would store) and finiteness of
// the stored x (x - x is 0 for finite x and NaN for NaN/inf).
template <Mode M>
double amp_f32(const float* x, int64_t n, float inv, bool* nonfinite) {
  const auto bad_at = [x](int64_t i, int64_t m) {
    float f = 0;
    for (int64_t k = i; k < i + m; ++k) f += x[k] - x[k];
    return f != f;
  };
  return block_pass<M>(n, [x, inv](int64_t i) { return block32<M, true>(x + i, inv); },
                       [x, inv](int64_t k) { return x[k] * inv; }, bad_at, nonfinite);
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define FASTGRAD_BF16_SPLIT 1
// bf16 fast paths (Sum/L1/L2, plain and AMP). bf16 is the top half of a float, so 16 bf16 values loaded as
// eight 32-bit words give two float vectors with one integer op each: w << 16 holds the even elements,
// w & 0xFFFF0000 the odd ones (little-endian). Widening through a buffer (the generic loop) or a vector
// conversion (which GCC splits into 128-bit halves and shuffles) made the pass compute-bound at ~11 GB/s.
// Lanes are the 8 even and 8 odd positions of each 16-element step; blocks, fold and double totals as
// above.

// f32_round_bf16 (kernels.h) on 8 lanes: bf16(v) as a float (NaN -> the quiet NaN 0x7FC0).
inline v8f round_bf16_v8(v8f v) {
  const v8u u = (v8u)v;
  const v8u r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const v8u nan = (v8u)((u & 0x7FFFFFFFu) > 0x7F800000u);
  return (v8f)((0x7FC00000u & nan) | (r & ~nan));
}

// SCALED (the AMP read pass): the term of bf16(x * inv), the value unscale_ would store.
template <Mode M, bool SCALED>
inline double block_bf16(const uint16_t* x, float inv) {
  v8f a = {}, b = {};
  for (int j = 0; j < kBlock; j += kLanes) {
    v8u w;
    std::memcpy(&w, x + j, sizeof(w));
    v8f even = (v8f)(w << 16);
    v8f odd = (v8f)(w & 0xFFFF0000u);
    if constexpr (SCALED) {
      even = round_bf16_v8(even * inv);
      odd = round_bf16_v8(odd * inv);
    }
    a += FASTGRAD_TERM8(M, even);
    b += FASTGRAD_TERM8(M, odd);
  }
  double blk;
  FASTGRAD_FOLD8(a, b, blk);
  return blk;
}

template <Mode M>
double reduce_bf16(const uint16_t* x, int64_t n) {
  return block_pass<M>(n, [x](int64_t i) { return block_bf16<M, false>(x + i, 1.0f); },
                       [x](int64_t k) { return bf16_to_f32(x[k]); }, kNoCheck, nullptr);
}

template <Mode M>
double amp_bf16(const uint16_t* x, int64_t n, float inv, bool* nonfinite) {
  const auto bad_at = [x](int64_t i, int64_t m) {
    bool bad = false;
    for (int64_t k = i; k < i + m; ++k) bad |= (x[k] & 0x7F80u) == 0x7F80u;  // exponent all ones: inf/NaN
    return bad;
  };
  return block_pass<M>(n, [x, inv](int64_t i) { return block_bf16<M, true>(x + i, inv); },
                       [x, inv](int64_t k) { return f32_round_bf16(bf16_to_f32(x[k]) * inv); }, bad_at,
                       nonfinite);
}
#endif
#else
template <Mode M>
constexpr bool kFast32 = false;
#endif

template <Mode M, typename T, typename A>
double reduce_impl(const void* ptr, int64_t n, double p) {
  const T* x = static_cast<const T*>(ptr);
#ifdef FASTGRAD_VEC8
  if constexpr (kFast32<M> && std::is_same_v<T, float> && std::is_same_v<A, float>) return reduce_f32<M>(x, n);
#ifdef FASTGRAD_BF16_SPLIT
  if constexpr (kFast32<M> && std::is_same_v<T, c10::BFloat16> && std::is_same_v<A, float>)
    return reduce_bf16<M>(reinterpret_cast<const uint16_t*>(x), n);
#endif
#endif
  return reduce_loop<M, A>(n, static_cast<A>(p), [x](int64_t i, int64_t m, A* buf) {
    for (int64_t k = 0; k < m; ++k) buf[k] = to_acc<A>(x[i + k]);
  });
}

template <Mode M, typename T, typename A>
double amp_impl(const void* ptr, int64_t n, double p, double inv_d, bool* nonfinite) {
  using O = opmath_t<T>;
  const T* x = static_cast<const T*>(ptr);
  const O inv = static_cast<O>(static_cast<float>(inv_d));  // inv_scale is a float32 tensor
#ifdef FASTGRAD_VEC8
  if constexpr (kFast32<M> && std::is_same_v<T, float> && std::is_same_v<A, float>)
    return amp_f32<M>(x, n, inv, nonfinite);
#ifdef FASTGRAD_BF16_SPLIT
  if constexpr (kFast32<M> && std::is_same_v<T, c10::BFloat16> && std::is_same_v<A, float>)
    return amp_bf16<M>(reinterpret_cast<const uint16_t*>(x), n, inv, nonfinite);
#endif
#endif
  // Finiteness is checked in the same sweep as the norm: x - x is 0 for finite x and NaN for NaN/inf,
  // summed per buffer slot (no branches, vectorises).
  O fin[kBlock] = {};
  // The norm of the values unscale_ would have stored (rounded to T), as unscale_ + clip would see them.
  const double r = reduce_loop<M, A>(n, static_cast<A>(p), [x, inv, &fin](int64_t i0, int64_t m, A* buf) {
    for (int64_t k = 0; k < m; ++k) {
      const O v = to_acc<O>(x[i0 + k]);
      fin[k] += v - v;
      buf[k] = static_cast<A>(round_trip<T>(v * inv));
    }
  });
  O f = 0;
  for (int k = 0; k < kBlock; ++k) f += fin[k];
  if (f != 0 || f != f) *nonfinite = true;
  return r;
}

// ------------------------------------------------------------------------------------------ grad_stats
// One read of a run: the sum of squares exactly as the L2 norm kernels above accumulate it (same lanes,
// fold and compensated block totals, so grad_stats' per-tensor norms equal the norm op's bit for bit), max
// |x|, and counts of zeros, NaNs and infs. Max and zero count are branch-free lane updates. NaN/inf are
// counted only where they can be: a NaN or inf element makes its lane's square NaN/inf and a float sum of
// squares never returns to finite, so a finite block total proves its block free of both; a non-finite
// total (a bad element, or a square that overflowed) costs an exact count of that block, still in L1.

// Exact NaN/inf counts of x[0, m).
template <typename A, typename T>
inline void count_bad(const T* x, int64_t m, Stats& s) {
  for (int64_t k = 0; k < m; ++k) {
    const A a = std::abs(to_acc<A>(x[k]));
    s.nan += (a != a);
    s.inf += (a == std::numeric_limits<A>::infinity());
  }
}

// The last, partial block (m < kBlock): lanes k % kLanes as reduce_loop and block_pass add a tail; every
// count exact. Returns its max |x| (NaN ignored: counted instead).
template <typename A, typename T>
inline A stats_tail(const T* x, int64_t m, CompensatedSum& total, Stats& s) {
  A acc[kLanes] = {};
  A mx = 0;
  for (int64_t k = 0; k < m; ++k) {
    const A v = to_acc<A>(x[k]);
    const A a = std::abs(v);
    acc[k % kLanes] += v * v;
    mx = a > mx ? a : mx;
    s.zero += (v == 0);
    s.nan += (a != a);
    s.inf += (a == std::numeric_limits<A>::infinity());
  }
  total.add(fold(acc));
  return mx;
}

inline double max_or_nan(const Stats& s, double m) {
  return s.nan ? std::numeric_limits<double>::quiet_NaN() : m;
}

// Any element type and accumulation type: each block staged as A in a buffer (the widening loop
// vectorises whatever the conversion), then fixed lanes as reduce_loop<Mode::L2, A>.
template <typename T, typename A>
Stats stats_generic(const T* x, int64_t n) {
  Stats s;
  CompensatedSum total;
  A mx[kLanes] = {};
  int64_t zero[kLanes] = {};
  A buf[kBlock];
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const A* v = buf;
    if constexpr (std::is_same_v<T, A>) {
      v = x + i;  // no conversion: read in place
    } else {
      for (int k = 0; k < kBlock; ++k) buf[k] = to_acc<A>(x[i + k]);
    }
    A acc[kLanes] = {};
    for (int j = 0; j < kBlock; j += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const A e = v[j + l];
        const A a = std::abs(e);
        acc[l] += e * e;
        mx[l] = a > mx[l] ? a : mx[l];
        zero[l] += (e == 0);
      }
    const double blk = fold(acc);
    if (!std::isfinite(blk)) count_bad<A>(x + i, kBlock, s);
    total.add(blk);
  }
  A m = i < n ? stats_tail<A>(x + i, n - i, total, s) : A(0);
  for (int l = 0; l < kLanes; ++l) {
    m = mx[l] > m ? mx[l] : m;
    s.zero += zero[l];
  }
  s.sumsq = total.value();
  s.maxabs = max_or_nan(s, static_cast<double>(m));
  return s;
}

#ifdef FASTGRAD_VEC8
// float, bf16 and fp16 runs with float lanes (every gradient but float64): the 16 lanes in two 8-wide
// registers as block32/block_bf16, fed from memory (fp32), split into even/odd lanes on the bits (bf16, as
// block_bf16), or from the block widened into a buffer (fp16, as reduce_loop stages it).
//
// Per 8 elements the pass adds to the norm's work only a max and a min of the squares it computes anyway.
// (An exact max |x| and zero count per element, four more vector ops, ran at ~70% of the norm loop's speed
// in L1 on the 2-core EPYC VM; this loop at ~80%.) A block then takes an exact second look at its own
// data, still in L1, only where that can change a result:
//  - max |x|: rounding a square is monotonic, so fl(y^2) < fl(z^2) implies |y| < |z|. A block whose squares
//    are all below the largest square of the earlier blocks cannot hold a new max; any other block (in
//    random data a handful per run) is scanned exactly. Ties (e.g. all-zero or tiny data, whose squares
//    underflow alike) scan too, so the max is exact whatever the rounding.
//  - zeros: a zero squares to 0, so a block whose smallest square is not 0 holds none; else its zeros are
//    counted exactly (a square also underflows to 0 for |x| < 2^-75: that only costs the block its count).
//  - NaN/inf: a finite block total proves the block free of both (see above); else they are counted and
//    the block's max is scanned (the min/max ignore a NaN square; an inf square makes the total inf).
template <typename T>
constexpr bool kStatsFast = std::is_same_v<T, float> || std::is_same_v<T, c10::Half>
#ifdef FASTGRAD_BF16_SPLIT
                            || std::is_same_v<T, c10::BFloat16>
#endif
    ;

typedef uint64_t v4u __attribute__((vector_size(32)));

// Left to itself GCC unrolls stats_fast's three block loops completely and keeps the first loop's loads
// for the other two in spilled registers (a store and a reload per vector): slower than not unrolling.
#define FASTGRAD_NO_UNROLL _Pragma("GCC unroll 1")

// Whether any lane of a vector comparison's result is true (no AVX-only builtin: the baseline clone has
// SSE2 only).
inline bool any_lane(const v8i& m) {
  const v4u q = (v4u)m;
  return ((q[0] | q[1]) | (q[2] | q[3])) != 0;
}

// Elements [j, j + 16) of a full block as the two 8-lane vectors of block32/block_bf16: in memory order
// (fp32, and fp16 from the widened buffer fb) or as even/odd elements (bf16 on its bits).
template <typename T>
inline void lanes16(const T* xb, const float* fb, int j, v8f& u, v8f& w) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    v8u q;
    std::memcpy(&q, xb + j, sizeof(q));
    u = (v8f)(q << 16);
    w = (v8f)(q & 0xFFFF0000u);
  } else {
    const float* p = std::is_same_v<T, float> ? reinterpret_cast<const float*>(xb) : fb;
    std::memcpy(&u, p + j, sizeof(u));
    std::memcpy(&w, p + j + 8, sizeof(w));
  }
}

// The tail of a float-lane run (m < kBlock elements, as floats in memory order): lanes k % kLanes as
// block_pass and reduce_loop add a tail, whole groups of 16 in the two vectors (the same adds per lane),
// the rest one by one; max |x| and zeros exact, NaN/inf counted when the total is not finite.
inline float stats_tail_f32(const float* x, int64_t m, CompensatedSum& total, Stats& s) {
  v8f a = {}, b = {}, mx = {};
  v8i z = {};
  int64_t k = 0;
  for (; k + kLanes <= m; k += kLanes) {
    v8f u, w;
    std::memcpy(&u, x + k, sizeof(u));
    std::memcpy(&w, x + k + 8, sizeof(w));
    a += u * u;
    b += w * w;
    const v8f au = (v8f)((v8i)u & 0x7FFFFFFF), aw = (v8f)((v8i)w & 0x7FFFFFFF);
    mx = au > mx ? au : mx;  // NaN compares false: never enters the max
    mx = aw > mx ? aw : mx;
    z -= (u == 0.0f);
    z -= (w == 0.0f);
  }
  float acc[kLanes], mxs[8];
  std::memcpy(acc, &a, sizeof(a));
  std::memcpy(acc + 8, &b, sizeof(b));
  std::memcpy(mxs, &mx, sizeof(mx));
  float r = 0.0f;
  for (int l = 0; l < 8; ++l) {
    r = mxs[l] > r ? mxs[l] : r;
    s.zero += z[l];
  }
  for (; k < m; ++k) {
    const float v = x[k];
    const float av = std::abs(v);
    acc[k % kLanes] += v * v;
    r = av > r ? av : r;
    s.zero += (v == 0.0f);
  }
  const double t = fold(acc);
  if (!std::isfinite(t)) count_bad<float>(x, m, s);
  total.add(t);
  return r;
}

template <typename T>
Stats stats_fast(const T* x, int64_t n) {
  Stats s;
  CompensatedSum total;
  v8f top = {};  // per lane, the largest square of the blocks so far
  v8f mx = {};   // exact max |x| over the blocks scanned for it
  alignas(32) float buf[kBlock];  // fp16 blocks widened; any 16-bit tail widened
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t full = n - n % kBlock;
  for (int64_t i = 0; i < full; i += kBlock) {
    const T* xb = x + i;
    if constexpr (std::is_same_v<T, c10::Half>) {
      for (int k = 0; k < kBlock; ++k) buf[k] = fp16_to_f32(xb[k].x);
    }
    v8f a = {}, b = {}, hi0 = {}, hi1 = {};
    v8f lo0 = a + inf, lo1 = lo0;
    FASTGRAD_NO_UNROLL
    for (int j = 0; j < kBlock; j += kLanes) {
      // 4 KiB ahead (one line per 16 elements; past the run's end a prefetch is harmless): with the extra
      // work per element the out-of-order window reaches less far ahead than the norm loop's, and on
      // gradients bigger than the caches this pass read memory ~10% slower than the norm without it (one
      // thread, 64 MiB, the 2-core EPYC VM); with it, no slower.
      __builtin_prefetch(reinterpret_cast<const char*>(xb + j) + 4096);
      v8f u, w;
      lanes16(xb, buf, j, u, w);
      const v8f su = u * u, sw = w * w;
      a += su;
      b += sw;
      hi0 = su > hi0 ? su : hi0;  // NaN compares false: ignored (the total catches it)
      hi1 = sw > hi1 ? sw : hi1;
      lo0 = su < lo0 ? su : lo0;
      lo1 = sw < lo1 ? sw : lo1;
    }
    double blk;
    FASTGRAD_FOLD8(a, b, blk);
    const bool bad = !std::isfinite(blk);
    if (bad) count_bad<float>(xb, kBlock, s);
    const v8f hi = hi0 > hi1 ? hi0 : hi1, lo = lo0 < lo1 ? lo0 : lo1;
    if (bad || any_lane(hi >= top)) {
      FASTGRAD_NO_UNROLL
      for (int j = 0; j < kBlock; j += kLanes) {
        v8f u, w;
        lanes16(xb, buf, j, u, w);
        const v8f au = (v8f)((v8i)u & 0x7FFFFFFF), aw = (v8f)((v8i)w & 0x7FFFFFFF);
        mx = au > mx ? au : mx;
        mx = aw > mx ? aw : mx;
      }
      // Every lane now holds the largest square so far: one lane's record then scans only when it ties or
      // beats all of them (per-lane records would scan a block whenever any of 8 lanes sets one).
      const v8f t = hi > top ? hi : top;
      float tm = 0.0f;
      for (int l = 0; l < 8; ++l) tm = t[l] > tm ? t[l] : tm;
      top = v8f{} + tm;
    }
    if (any_lane(lo == 0.0f)) {
      v8i z = {};
      FASTGRAD_NO_UNROLL
      for (int j = 0; j < kBlock; j += kLanes) {
        v8f u, w;
        lanes16(xb, buf, j, u, w);
        z -= (u == 0.0f);
        z -= (w == 0.0f);
      }
      for (int l = 0; l < 8; ++l) s.zero += z[l];
    }
    total.add(blk);
  }
  float m = 0.0f;
  if (full < n) {
    const float* t = reinterpret_cast<const float*>(x + full);
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t k = 0; k < n - full; ++k) buf[k] = to_acc<float>(x[full + k]);
      t = buf;
    }
    m = stats_tail_f32(t, n - full, total, s);
  }
  for (int l = 0; l < 8; ++l) m = mx[l] > m ? mx[l] : m;
  s.sumsq = total.value();
  s.maxabs = max_or_nan(s, static_cast<double>(m));
  return s;
}

// Double lanes (float64 runs, and every run of a list that holds one): the 16 lanes of reduce_loop<L2,
// double> in four 4-wide registers, each block staged as double (in place for float64 data).
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));

template <typename T>
Stats stats_fast64(const T* x, int64_t n) {
  Stats s;
  CompensatedSum total;
  v4d mx[4] = {};
  v4l z[4] = {};  // int64 lanes: no overflow
  alignas(32) double buf[kBlock];
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const double* v = buf;
    if constexpr (std::is_same_v<T, double>) {
      v = x + i;
    } else {
      for (int k = 0; k < kBlock; ++k) buf[k] = to_acc<double>(x[i + k]);
    }
    v4d a[4] = {};
    for (int j = 0; j < kBlock; j += kLanes)
      for (int r = 0; r < 4; ++r) {
        v4d u;
        std::memcpy(&u, v + j + 4 * r, sizeof(u));
        a[r] += u * u;
        const v4d au = (v4d)((v4l)u & 0x7FFFFFFFFFFFFFFFll);
        mx[r] = au > mx[r] ? au : mx[r];
        z[r] -= (u == 0.0);
      }
    // fold(): lanes l and l + 8 (registers r, r + 2), then l and l + 4, then pairwise within the register.
    const v4d f = (a[0] + a[2]) + (a[1] + a[3]);
    const double blk = (f[0] + f[2]) + (f[1] + f[3]);
    if (!std::isfinite(blk)) count_bad<double>(x + i, kBlock, s);
    total.add(blk);
  }
  double m = i < n ? stats_tail<double>(x + i, n - i, total, s) : 0.0;
  for (int r = 0; r < 4; ++r)
    for (int l = 0; l < 4; ++l) {
      m = mx[r][l] > m ? mx[r][l] : m;
      s.zero += z[r][l];
    }
  s.sumsq = total.value();
  s.maxabs = max_or_nan(s, m);
  return s;
}
#else
template <typename T>
constexpr bool kStatsFast = false;
template <typename T>
Stats stats_fast(const T*, int64_t) { return Stats{}; }
#endif

template <typename T, typename A>
Stats stats_impl(const void* ptr, int64_t n) {
  const T* x = static_cast<const T*>(ptr);
  if constexpr (std::is_same_v<A, float> && kStatsFast<T>) {
    return stats_fast<T>(x, n);
#ifdef FASTGRAD_VEC8
  } else if constexpr (std::is_same_v<A, double>) {
    return stats_fast64<T>(x, n);
#endif
  } else {
    return stats_generic<T, A>(x, n);
  }
}

// Calls f(T{}, A{}) for the element type of st and the accumulation type.
template <typename F>
auto dispatch(c10::ScalarType st, bool acc64, const F& f) {
  switch (st) {
    case c10::ScalarType::Double:
      return f(double{}, double{});
    case c10::ScalarType::Float:
      return acc64 ? f(float{}, double{}) : f(float{}, float{});
    case c10::ScalarType::Half:
      return acc64 ? f(c10::Half{}, double{}) : f(c10::Half{}, float{});
    case c10::ScalarType::BFloat16:
      return acc64 ? f(c10::BFloat16{}, double{}) : f(c10::BFloat16{}, float{});
    default:
      TORCH_CHECK(false, "fastgrad: unsupported dtype ", st);
  }
}

template <typename F>
auto dispatch_mode(Mode m, const F& f) {
  switch (m) {
    case Mode::Sum:
      return f(std::integral_constant<Mode, Mode::Sum>{});
    case Mode::L1:
      return f(std::integral_constant<Mode, Mode::L1>{});
    case Mode::L2:
      return f(std::integral_constant<Mode, Mode::L2>{});
    case Mode::Inf:
      return f(std::integral_constant<Mode, Mode::Inf>{});
    default:
      return f(std::integral_constant<Mode, Mode::P>{});
  }
}

}  // namespace

Mode mode_for(double p) {
  if (std::isinf(p)) return Mode::Inf;
  if (p == 2.0) return Mode::L2;
  if (p == 1.0) return Mode::L1;
  return Mode::P;
}

FASTGRAD_SIMD_CLONES double reduce_range(Mode mode, c10::ScalarType st, bool acc64, const void* ptr, int64_t n, double p) {
  if (n == 0) return 0.0;
  return dispatch_mode(mode, [&](auto mc) {
    return dispatch(st, acc64, [&](auto t, auto a) {
      return reduce_impl<decltype(mc)::value, decltype(t), decltype(a)>(ptr, n, p);
    });
  });
}

FASTGRAD_SIMD_CLONES double amp_range(Mode mode, c10::ScalarType st, bool acc64, const void* ptr, int64_t n, double p,
                 double inv, bool* nonfinite) {
  if (n == 0) return 0.0;
  return dispatch_mode(mode, [&](auto mc) {
    return dispatch(st, acc64, [&](auto t, auto a) {
      return amp_impl<decltype(mc)::value, decltype(t), decltype(a)>(ptr, n, p, inv, nonfinite);
    });
  });
}

FASTGRAD_SIMD_CLONES Stats stats_range(c10::ScalarType st, bool acc64, const void* ptr, int64_t n) {
  if (n == 0) return Stats{};
  return dispatch(st, acc64, [&](auto t, auto a) { return stats_impl<decltype(t), decltype(a)>(ptr, n); });
}

}  // namespace cpu
}  // namespace fastgrad
