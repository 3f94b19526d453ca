// CPU kernels of fastgrad._C: range kernels (one contiguous run of elements of one dtype) and the
// helpers that split a list of tensors into fixed-size work items.
//
// Determinism: work is cut into items of at most kChunk elements at fixed positions, every item writes
// its own partial, and partials are combined in item order afterwards. Nothing depends on how many
// threads at::parallel_for uses.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "../round_odd.h"

namespace fastgrad {

// The one wording of a wrong-device error, for every op of the CPU and CUDA kernels (fastgrad/_inputs.py
// wrong_device_message spells it the same for the Python checks): "fastgrad::<op>: <what> [<index>] is on
// <device>, expected <expected>". Called only once a check has failed, so the message costs nothing otherwise;
// index < 0 leaves the index out (a single argument such as the factor).
inline void wrong_device(const char* op, const char* what, int64_t index, const c10::Device& got,
                         const std::string& expected) {
  if (index >= 0) TORCH_CHECK(false, "fastgrad::", op, ": ", what, " ", index, " is on ", got, ", expected ", expected);
  TORCH_CHECK(false, "fastgrad::", op, ": ", what, " is on ", got, ", expected ", expected);
}

namespace cpu {

// Elements per work item. Big enough to amortise scheduling, small enough to balance two cores on
// lists of few large tensors.
constexpr int64_t kChunk = int64_t(1) << 15;

// Neumaier-compensated double sum. Used wherever partials (block totals, work items, tensors) are added
// one after another: for float64 gradients that sequence would otherwise cost several ulps on long lists,
// and docs/contract.md section 3 holds fp64 results to torch's accuracy (+1 ulp). One add per 256 elements: free.
struct CompensatedSum {
  double sum = 0.0, comp = 0.0;
  inline void add(double x) {
    const double t = sum + x;
    // The rounding error of sum + x, recovered exactly from the larger operand (Neumaier's variant of
    // Kahan's method; needs no -ffast-math, which setup.py never passes).
    comp += std::fabs(sum) >= std::fabs(x) ? (sum - t) + x : (x - t) + sum;
    sum = t;
  }
  // Once the sum is inf/NaN the compensation is meaningless (inf - inf): the plain sum is the answer.
  inline double value() const { return std::isfinite(sum) ? sum + comp : sum; }
};

// ---------------------------------------------------------------------------------------------------
// bf16/fp16 <-> float on raw bits. c10::BFloat16/Half convert one element at a time (bf16 rounding
// branches on NaN), which keeps loops over them scalar; these are branch-free, so loops over them
// vectorise. They equal c10's CPU conversions bit for bit for every input, NaNs included (checked
// exhaustively over all 2^32 floats and 2^16 halves): round to nearest even, bf16 NaN -> 0x7FC0,
// fp16 NaN -> sign | 0x7E00.
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return f32_from(uint32_t(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  // Adding 0x7FFF plus the lowest kept bit rounds the dropped 16 bits to nearest, ties to even.
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = 0u - uint32_t((u & 0x7FFFFFFFu) > 0x7F800000u);  // mask, not ?: (see below)
  return static_cast<uint16_t>((0x7FC0u & nan) | (r & ~nan));
}

// bf16_to_f32(f32_to_bf16(f)) without narrowing to 16 bits (which SSE2/AVX2 do with slow shuffles).
inline float f32_round_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const uint32_t nan = 0u - uint32_t((u & 0x7FFFFFFFu) > 0x7F800000u);
  return f32_from((0x7FC00000u & nan) | (r & ~nan));
}

inline float fp16_to_f32(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t em = w + w;  // exponent and mantissa at the top, sign shifted out
  // Normal, inf and NaN: place the fields in a float whose exponent is 112 too large, then scale.
  const float normal = f32_from((em >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  // Subnormal: the mantissa as the low bits of a float in [0.5, 1), minus 0.5, is exact.
  const float subnormal = f32_from((em >> 17) | (126u << 23)) - 0.5f;
  // Selects are masks, not ?:, so the compiler never branches around float ops and loops vectorise.
  const uint32_t is_sub = 0u - uint32_t(em < (1u << 27));
  return f32_from(sign | (f32_bits(subnormal) & is_sub) | (f32_bits(normal) & ~is_sub));
}

inline uint16_t f32_to_fp16(float f) {
  // The FP16 library's method (as c10's software path): scale |f| so that values beyond the fp16 range
  // overflow to inf, then one float add against a power of two places the rounding point at fp16's
  // last mantissa bit (or the subnormal grid), so the hardware does the round to nearest even.
  const uint32_t w = f32_bits(f);
  const uint32_t w2 = w + w;
  const uint32_t sign = w & 0x80000000u;
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t e = w2 & 0xFF000000u;
  const uint32_t small = 0u - uint32_t(e < 0x71000000u);  // masks instead of ?: (see fp16_to_f32)
  const uint32_t bias = (0x71000000u & small) | (e & ~small);
  base = f32_from((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = f32_bits(base);
  const uint32_t nonsign = ((b >> 13) & 0x7C00u) + (b & 0x0FFFu);
  const uint32_t nan = 0u - uint32_t(w2 > 0xFF000000u);
  return static_cast<uint16_t>((sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan));
}

// double -> float rounded to odd (csrc/round_odd.h, shared with the CUDA kernels): rounding it to fp16/bf16
// gives the correctly rounded 16-bit value of the double.
using fastgrad::f64_to_f32_odd;

// The range kernels below are each compiled twice, for AVX2 and for the baseline x86-64 ISA, and the
// dynamic loader binds the one the CPU supports (GCC function multiversioning, needs ifunc: Linux). The
// baseline is SSE2 only, half the width torch's own kernels use. flatten inlines the per-dtype
// templates into each clone so they vectorise with its registers. Same source, no FMA (avx2 does not
// enable it, and -ffp-contract=off), fixed lane counts: both clones give identical bits.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FASTGRAD_SIMD_CLONES __attribute__((target_clones("avx2", "default"), flatten))
#else
#define FASTGRAD_SIMD_CLONES
#endif

// Reduction kinds of reduce_range.
enum class Mode : int { Sum = 0, L1 = 1, L2 = 2, Inf = 3, P = 4 };

// Mode for a p-norm order (p > 0 or inf; the Python side only sends those).
Mode mode_for(double norm_type);

// Partial of one run: Sum -> sum x; L1 -> sum |x|; L2 -> sum x^2; P -> sum |x|^p; Inf -> max |x| (NaN if
// any element is NaN). Values are accumulated in float (blocks of 256, folded pairwise) and blocks are
// added in double; with acc64 every step is in double. Returned as double either way.
double reduce_range(Mode mode, c10::ScalarType st, bool acc64, const void* ptr, int64_t n, double p);

// AMP read pass over one run: v = T(x * inv) (the value unscale_ would store), partial of |v| as in
// reduce_range; *nonfinite set to true when a stored element is NaN or +-inf.
double amp_range(Mode mode, c10::ScalarType st, bool acc64, const void* ptr, int64_t n, double p,
                 double inv, bool* nonfinite);

struct Stats {
  double sumsq = 0.0;
  double maxabs = 0.0;  // NaN when a NaN was seen
  int64_t nan = 0, inf = 0, zero = 0;
};
// One read of a run for grad_stats; sumsq is bit for bit reduce_range(Mode::L2, ...) of the run.
Stats stats_range(c10::ScalarType st, bool acc64, const void* ptr, int64_t n);

// In place x = T(x * f), product in float (double for float64 runs or when dbl is set; then rounded once).
void scale_range(c10::ScalarType st, void* ptr, int64_t n, double f, bool dbl);
// In place x = min(max(x, -c), c) computed in float (double for float64), NaN kept.
void clamp_range(c10::ScalarType st, void* ptr, int64_t n, double c);
// In place x = T(x - m): in float with m rounded to float (double for float64 runs).
void sub_range(c10::ScalarType st, void* ptr, int64_t n, double m);

// ---------------------------------------------------------------------------------------------------
// Flat views. A dense non-overlapping tensor occupies exactly numel consecutive elements from data_ptr
// (torch strides are never negative), whatever its strides, so whole-tensor ops can treat it as a
// flat buffer. Anything else is processed through a contiguous copy, written back for in-place ops.
struct Flat {
  at::Tensor view;   // the tensor whose memory is processed
  at::Tensor owner;  // the caller's tensor when view is a copy that must be written back
  void* ptr = nullptr;
  int64_t n = 0;
  c10::ScalarType st = c10::ScalarType::Float;
};

Flat flat(const at::Tensor& t, bool writeback);
// Like flat() but also requires each dim-0 slice to be one consecutive run (for per-row ops).
Flat flat_rows(const at::Tensor& t, bool writeback);
void finish(Flat& f);  // copy back when needed

// One work item: elements [begin, begin + len) of tensor `t` (in its flat view).
struct Item {
  int64_t t;
  int64_t begin;
  int64_t len;
};
std::vector<Item> split(const std::vector<Flat>& fl);

// Runs fn(i) for every item index in [0, n); parallel when the work is large enough to pay for it.
template <typename F>
void for_items(int64_t n, int64_t total_elems, const F& fn);

bool any_double(const std::vector<Flat>& fl);

// The bodies of the norm and scale_ ops over flat views, shared with the host fast path of
// clip_grad_norm_ (csrc/host.cpp), so both give the same bits.
// Total p-norm, before rounding to the accumulation dtype.
double total_norm(const std::vector<Flat>& fl, double p, bool acc64);
// In place x = T(x * f); no memory touched when f == 1 (or f rounds to 1.0f, for non-float64 runs).
void scale_flats(const std::vector<Flat>& fl, double f);
// grad_stats over flat views: one Stats per tensor, its sumsq the compensated sum of its items' partials
// exactly as the L2 norm op adds them (so stats_total equals total_norm(fl, 2, acc64) bit for bit).
std::vector<Stats> tensor_stats(const std::vector<Flat>& fl, bool acc64);
// The L2 norm over all tensors from their sums, added as total_norm adds them.
double stats_total(const std::vector<Stats>& s);
// grad_stats' outputs: per-tensor norm and max |x| (float32, or float64 when acc64), nan/inf/zero (int64).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> stats_tensors(const std::vector<Stats>& s,
                                                                                     bool acc64);
// The clip coefficient min(max_norm / (total + 1e-6), 1) as torch computes it on a 0-dim tensor of the
// accumulation dtype (float32 unless acc64); `total` is already rounded to that dtype.
double clip_coef(double total, double max_norm, bool acc64);

}  // namespace cpu
}  // namespace fastgrad

#include <ATen/Parallel.h>

namespace fastgrad {
namespace cpu {

template <typename F>
void for_items(int64_t n, int64_t total_elems, const F& fn) {
  // Below ~half a MB of fp32 the thread wake-up costs more than it saves.
  if (n <= 1 || total_elems < (int64_t(1) << 17)) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) fn(i);
  });
}

}  // namespace cpu
}  // namespace fastgrad
