// In-place range kernels (scale, clamp, subtract) and the flat-view / work-splitting helpers.
#include "kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace fastgrad {
namespace cpu {
namespace {

// Float/double runs: one plain loop, which the compiler vectorises.
template <typename O, typename T, typename F>
inline void apply(T* x, int64_t n, const F& f) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<T>(f(static_cast<O>(x[i])));
}

// bf16/fp16 runs: tiles of kTile elements are widened to float, transformed, and rounded back, three
// simple loops the compiler vectorises. f maps float to float, so the result is T(f(float(x))), the
// value c10's element-wise conversions give.
constexpr int64_t kTile = 256;

template <typename F>
void apply16(bool bf16, uint16_t* x, int64_t n, const F& f) {
  float buf[kTile];
  for (int64_t i = 0; i < n; i += kTile) {
    const int64_t m = std::min(kTile, n - i);
    uint16_t* p = x + i;
    if (bf16) {
      for (int64_t j = 0; j < m; ++j) buf[j] = bf16_to_f32(p[j]);
    } else {
      for (int64_t j = 0; j < m; ++j) buf[j] = fp16_to_f32(p[j]);
    }
    for (int64_t j = 0; j < m; ++j) buf[j] = f(buf[j]);
    if (bf16) {
      for (int64_t j = 0; j < m; ++j) p[j] = f32_to_bf16(buf[j]);
    } else {
      for (int64_t j = 0; j < m; ++j) p[j] = f32_to_fp16(buf[j]);
    }
  }
}

#if defined(__GNUC__)
typedef float v8f __attribute__((vector_size(32)));
// fp32 x *= f, four 8-wide vectors per iteration: the plain loop did one per iteration (torch's kernel
// does two) and ran 5-10% behind torch with the data in cache. Same product per element.
inline void scale_f32(float* x, int64_t n, float f) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    v8f a, b, c, d;
    std::memcpy(&a, x + i, 32);
    std::memcpy(&b, x + i + 8, 32);
    std::memcpy(&c, x + i + 16, 32);
    std::memcpy(&d, x + i + 24, 32);
    a *= f;
    b *= f;
    c *= f;
    d *= f;
    std::memcpy(x + i, &a, 32);
    std::memcpy(x + i + 8, &b, 32);
    std::memcpy(x + i + 16, &c, 32);
    std::memcpy(x + i + 24, &d, 32);
  }
  for (; i < n; ++i) x[i] *= f;
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define FASTGRAD_BF16_SPLIT 1
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

// f32_round_bf16 (kernels.h) on 8 lanes: the float bits of bf16(v), low half zero; NaN -> 0x7FC0.
inline v8u round_bf16_bits(v8f v) {
  const v8u u = (v8u)v;
  const v8u r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const v8u nan = (v8u)((u & 0x7FFFFFFFu) > 0x7F800000u);
  return (0x7FC00000u & nan) | (r & ~nan);
}

// bf16 x = bf16(float(x) * f), 16 elements per step as eight 32-bit words (see reduce.cpp block_bf16):
// the even elements are w << 16, the odd ones w & 0xFFFF0000, and the rounded results go back into the
// same halves; no widening buffer, no shuffles. Same value per element as apply16.
inline void scale_bf16(uint16_t* x, int64_t n, float f) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v8u w;
    std::memcpy(&w, x + i, sizeof(w));
    const v8u even = round_bf16_bits((v8f)(w << 16) * f);
    const v8u odd = round_bf16_bits((v8f)(w & 0xFFFF0000u) * f);
    const v8u out = (even >> 16) | odd;
    std::memcpy(x + i, &out, sizeof(out));
  }
  for (; i < n; ++i) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * f);
}
#endif
#else
inline void scale_f32(float* x, int64_t n, float f) {
  for (int64_t i = 0; i < n; ++i) x[i] *= f;
}
#endif

// Dispatch on dtype: 16-bit runs go through apply16 with the float map f16; float and double runs are
// handed to fwide(T*) as typed pointers.
template <typename F16, typename FW>
void run(c10::ScalarType st, void* ptr, int64_t n, const F16& f16, const FW& fwide) {
  switch (st) {
    case c10::ScalarType::Double:
      return fwide(static_cast<double*>(ptr));
    case c10::ScalarType::Float:
      return fwide(static_cast<float*>(ptr));
    case c10::ScalarType::Half:
      return apply16(false, static_cast<uint16_t*>(ptr), n, f16);
    case c10::ScalarType::BFloat16:
      return apply16(true, static_cast<uint16_t*>(ptr), n, f16);
    default:
      TORCH_CHECK(false, "fastgrad: unsupported dtype ", st);
  }
}

}  // namespace

FASTGRAD_SIMD_CLONES void scale_range(c10::ScalarType st, void* ptr, int64_t n, double f, bool dbl) {
  const float ff = static_cast<float>(f);
  // 16-bit with dbl (AGC's per-row ratio): the double product rounded once to T, through a round-to-odd
  // float (c10 has no double -> T; the CUDA kernels use __double2half / __double2bfloat16).
  const auto f16_dbl = [f](float v) { return f64_to_f32_odd(static_cast<double>(v) * f); };
  const auto f16 = [ff](float v) { return v * ff; };
  const auto wide = [&](auto* x) {
    using T = std::remove_pointer_t<decltype(x)>;
    if (dbl || std::is_same_v<T, double>) {
      apply<double>(x, n, [f](double v) { return v * f; });
    } else {
      if constexpr (std::is_same_v<T, float>) return scale_f32(x, n, ff);
      apply<float>(x, n, [ff](float v) { return v * ff; });
    }
  };
#ifdef FASTGRAD_BF16_SPLIT
  if (!dbl && st == c10::ScalarType::BFloat16) return scale_bf16(static_cast<uint16_t*>(ptr), n, ff);
#endif
  if (dbl)
    run(st, ptr, n, f16_dbl, wide);
  else
    run(st, ptr, n, f16, wide);
}

FASTGRAD_SIMD_CLONES void clamp_range(c10::ScalarType st, void* ptr, int64_t n, double c) {
  // Comparisons are false for NaN, so NaN passes through both.
  const auto clampf = [hi = static_cast<float>(c)](float v) {
    v = v < -hi ? -hi : v;
    return v > hi ? hi : v;
  };
  run(st, ptr, n, clampf, [&](auto* x) {
    using T = std::remove_pointer_t<decltype(x)>;
    if constexpr (std::is_same_v<T, double>) {
      apply<double>(x, n, [c](double v) {
        v = v < -c ? -c : v;
        return v > c ? c : v;
      });
    } else {
      apply<float>(x, n, clampf);
    }
  });
}

FASTGRAD_SIMD_CLONES void sub_range(c10::ScalarType st, void* ptr, int64_t n, double m) {
  // float/half/bf16: x - float(m) in float, as torch's g.sub_(mean) with an fp32 mean computes it (the
  // double subtraction it replaced ran at under half the speed and made GC compute-bound); double: in double.
  const float mf = static_cast<float>(m);
  const auto subf = [mf](float v) { return v - mf; };
  run(st, ptr, n, subf, [&](auto* x) {
    using T = std::remove_pointer_t<decltype(x)>;
    if constexpr (std::is_same_v<T, double>) {
      apply<double>(x, n, [m](double v) { return v - m; });
    } else {
      apply<float>(x, n, subf);
    }
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
