// In-place range kernels (scale, clamp, subtract) and the flat-view / work-splitting helpers.
#include "kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <type_traits>

namespace fastgrad {
namespace cpu {
namespace {

// Calls f(T{}) for the element type of st.
template <typename F>
void dispatch_t(c10::ScalarType st, const F& f) {
  switch (st) {
    case c10::ScalarType::Double:
      return f(double{});
    case c10::ScalarType::Float:
      return f(float{});
    case c10::ScalarType::Half:
      return f(c10::Half{});
    case c10::ScalarType::BFloat16:
      return f(c10::BFloat16{});
    default:
      TORCH_CHECK(false, "fastgrad: unsupported dtype ", st);
  }
}

template <typename O, typename T>
inline O ld(T x) {
  if constexpr (std::is_same_v<T, double>) {
    return static_cast<O>(x);
  } else {
    return static_cast<O>(static_cast<float>(x));
  }
}

template <typename O, typename T, typename F>
inline void apply(T* x, int64_t n, const F& f) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<T>(f(ld<O>(x[i])));
}

}  // namespace

void scale_range(c10::ScalarType st, void* ptr, int64_t n, double f, bool dbl) {
  dispatch_t(st, [&](auto t) {
    using T = decltype(t);
    T* x = static_cast<T*>(ptr);
    if (dbl || std::is_same_v<T, double>) {
      apply<double>(x, n, [f](double v) { return v * f; });
    } else {
      const float ff = static_cast<float>(f);
      apply<float>(x, n, [ff](float v) { return v * ff; });
    }
  });
}

void clamp_range(c10::ScalarType st, void* ptr, int64_t n, double c) {
  dispatch_t(st, [&](auto t) {
    using T = decltype(t);
    using O = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const O hi = static_cast<O>(c), lo = -hi;
    // Comparisons are false for NaN, so NaN passes through both.
    apply<O>(static_cast<T*>(ptr), n, [lo, hi](O v) {
      v = v < lo ? lo : v;
      return v > hi ? hi : v;
    });
  });
}

void sub_range(c10::ScalarType st, void* ptr, int64_t n, double m) {
  // In double whatever T: the result is rounded once to T.
  dispatch_t(st, [&](auto t) {
    using T = decltype(t);
    apply<double>(static_cast<T*>(ptr), n, [m](double v) { return v - m; });
  });
}

// ----------------------------------------------------------------------------------------------------
Flat flat(const at::Tensor& t, bool writeback) {
  Flat f;
  if (t.is_non_overlapping_and_dense()) {
    f.view = t;
  } else {
    f.view = t.contiguous();
    if (writeback) f.owner = t;
  }
  f.ptr = f.view.data_ptr();
  f.n = f.view.numel();
  f.st = f.view.scalar_type();
  return f;
}

Flat flat_rows(const at::Tensor& t, bool writeback) {
  // Dense with dim 0 outermost (contiguous, or e.g. channels_last weights): every dim-0 slice is one
  // run of numel/size(0) elements, in some order, which a sum or norm does not care about.
  const bool ok = t.is_non_overlapping_and_dense() &&
                  (t.dim() <= 1 || t.size(0) <= 1 || t.stride(0) * t.size(0) == t.numel());
  if (ok) return flat(t, writeback);
  Flat f;
  f.view = t.contiguous();
  if (writeback) f.owner = t;
  f.ptr = f.view.data_ptr();
  f.n = f.view.numel();
  f.st = f.view.scalar_type();
  return f;
}

void finish(Flat& f) {
  if (f.owner.defined()) f.owner.copy_(f.view);
}

std::vector<Item> split(const std::vector<Flat>& fl) {
  std::vector<Item> items;
  int64_t count = 0;
  for (const auto& f : fl) count += (f.n + kChunk - 1) / kChunk;
  items.reserve(static_cast<size_t>(count));
  for (int64_t t = 0; t < static_cast<int64_t>(fl.size()); ++t)
    for (int64_t b = 0; b < fl[t].n; b += kChunk) items.push_back({t, b, std::min(kChunk, fl[t].n - b)});
  return items;
}

bool any_double(const std::vector<Flat>& fl) {
  for (const auto& f : fl)
    if (f.st == c10::ScalarType::Double) return true;
  return false;
}

}  // namespace cpu
}  // namespace fastgrad
