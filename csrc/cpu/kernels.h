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
#include <vector>

namespace fastgrad {
namespace cpu {

// Elements per work item. Big enough to amortise scheduling, small enough to balance two cores on
// lists of few large tensors.
constexpr int64_t kChunk = int64_t(1) << 15;

// Neumaier-compensated double sum. Used wherever partials (block totals, work items, tensors) are added
// one after another: for float64 gradients that sequence would otherwise cost several ulps on long lists,
// and SPEC section 3 holds fp64 results to torch's accuracy (+1 ulp). One add per 256 elements: free.
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
// One read of a run for grad_stats.
Stats stats_range(c10::ScalarType st, bool acc64, const void* ptr, int64_t n);

// In place x = T(x * f), product in float (double for float64 runs or when dbl is set).
void scale_range(c10::ScalarType st, void* ptr, int64_t n, double f, bool dbl);
// In place x = min(max(x, -c), c) computed in float (double for float64), NaN kept.
void clamp_range(c10::ScalarType st, void* ptr, int64_t n, double c);
// In place x = T(x - m), computed in double.
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
