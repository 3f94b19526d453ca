// exact_limbs: the integer accumulator of fastgrad/exact.py (the correctly rounded norms of exact=True) for CPU
// tensors. Same digits as the module's torch reference, by construction: both compute the unique base-2^32
// digits of the exact sum of |x| (p = 1) or x^2 (p = 2) in the window (base, nlimbs) the module passes.
//
// Per work item (kChunk elements of one tensor) every element is split into its integer significand M and
// biased exponent; M^2 (or M) is added into a bin per exponent, in integers, so nothing is rounded. float32
// bins hold M^2 < 2^48 in uint64 (kChunk = 2^15 additions stay below 2^63), float64 bins M^2 < 2^106 in 128 bits.
// Four bin arrays, element i going to array i % 4, keep consecutive elements of one binade from waiting on
// each other's read-modify-write. The bins are then shifted into the item's digits, carries normalised, and
// items of one tensor (then tensors) are merged by integer addition: associative, so the result does not
// depend on the number of threads or on anything else but the values.
#include "kernels.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

namespace fastgrad {
namespace cpu {
namespace {

using at::Tensor;
using u128 = unsigned __int128;
constexpr uint64_t kMask = 0xFFFFFFFFull;

// limbs += v * 2^s (s >= 0): at most three digits, each < 2^32.
inline void add_shifted(uint64_t* limbs, uint64_t v, int64_t s) {
  if (v == 0) return;
  const u128 t = static_cast<u128>(v) << (s & 31);
  const int64_t k = s >> 5;
  limbs[k] += static_cast<uint64_t>(t) & kMask;
  limbs[k + 1] += static_cast<uint64_t>(t >> 32) & kMask;
  limbs[k + 2] += static_cast<uint64_t>(t >> 64);
}

inline void add_shifted128(uint64_t* limbs, u128 v, int64_t s) {
  add_shifted(limbs, static_cast<uint64_t>(v), s);
  add_shifted(limbs, static_cast<uint64_t>(v >> 64), s + 64);
}

// Sequential carry normalisation: digits below 2^32 (the window leaves the top limbs empty).
inline void normalize(uint64_t* limbs, int64_t n) {
  uint64_t carry = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t v = limbs[i] + carry;  // limbs < 2^63 and carry < 2^32: no wrap
    limbs[i] = v & kMask;
    carry = v >> 32;
  }
}

struct Window {
  int p;
  int64_t base;
  int64_t n;
};

// float32 bits (bf16 and fp16 are widened to them exactly): bins per biased exponent, NaN/inf counted.
template <typename Load>
void item_f32(const Window& w, int64_t len, const Load& load, uint64_t* limbs, int64_t* nan, int64_t* inf) {
  uint64_t bins[4][256] = {};
  int64_t special = 0;
  int64_t i = 0;
  const bool sq = w.p == 2;
  auto one = [&](int lane, uint32_t u) {
    u &= 0x7FFFFFFFu;
    const uint32_t be = u >> 23;
    const uint64_t m = (u & 0x7FFFFFu) | (be ? 0x800000u : 0u);
    bins[lane][be] += sq ? m * m : m;
    special += be == 255;
  };
  for (; i + 4 <= len; i += 4) {
    one(0, load(i));
    one(1, load(i + 1));
    one(2, load(i + 2));
    one(3, load(i + 3));
  }
  for (; i < len; ++i) one(0, load(i));
  if (special) {  // inf/NaN elements: counted, not added (bin 255 is dropped below)
    for (int64_t j = 0; j < len; ++j) {
      const uint32_t u = load(j) & 0x7FFFFFFFu;
      if (u > 0x7F800000u) ++*nan;
      else if (u == 0x7F800000u) ++*inf;
    }
  }
  for (int be = 0; be < 255; ++be) {
    const uint64_t v = bins[0][be] + bins[1][be] + bins[2][be] + bins[3][be];  // each < 2^61 (a quarter item)
    if (v == 0) continue;
    const int64_t e = (be ? be : 1) - 150;  // x = M * 2^e
    add_shifted(limbs, v, (sq ? 2 * e : e) - w.base);
  }
}

void item_f64(const Window& w, const double* x, int64_t len, uint64_t* limbs, int64_t* nan, int64_t* inf) {
  std::vector<u128> bins(2048, 0);
  const bool sq = w.p == 2;
  for (int64_t i = 0; i < len; ++i) {
    uint64_t u;
    std::memcpy(&u, x + i, 8);
    u &= 0x7FFFFFFFFFFFFFFFull;
    const uint32_t be = static_cast<uint32_t>(u >> 52);
    const uint64_t m = (u & 0xFFFFFFFFFFFFFull) | (be ? (1ull << 52) : 0ull);
    if (be == 2047) {
      if (m != (1ull << 52)) ++*nan;
      else ++*inf;
      continue;
    }
    bins[be] += sq ? static_cast<u128>(m) * m : static_cast<u128>(m);
  }
  for (int be = 0; be < 2047; ++be) {
    if (bins[be] == 0) continue;
    const int64_t e = (be ? be : 1) - 1075;
    add_shifted128(limbs, bins[be], (sq ? 2 * e : e) - w.base);
  }
}

void item(const Window& w, const Flat& f, int64_t begin, int64_t len, uint64_t* limbs, int64_t* nan, int64_t* inf) {
  switch (f.st) {
    case c10::ScalarType::Float: {
      const uint32_t* p = static_cast<const uint32_t*>(f.ptr) + begin;
      item_f32(w, len, [p](int64_t i) { return p[i]; }, limbs, nan, inf);
      break;
    }
    case c10::ScalarType::BFloat16: {
      const uint16_t* p = static_cast<const uint16_t*>(f.ptr) + begin;
      item_f32(w, len, [p](int64_t i) { return uint32_t(p[i]) << 16; }, limbs, nan, inf);
      break;
    }
    case c10::ScalarType::Half: {
      const uint16_t* p = static_cast<const uint16_t*>(f.ptr) + begin;
      item_f32(w, len, [p](int64_t i) { return f32_bits(fp16_to_f32(p[i])); }, limbs, nan, inf);
      break;
    }
    case c10::ScalarType::Double:
      item_f64(w, static_cast<const double*>(f.ptr) + begin, len, limbs, nan, inf);
      break;
    default:
      TORCH_CHECK(false, "fastgrad::exact_limbs: unsupported dtype ", f.st);
  }
}

std::tuple<Tensor, Tensor> exact_limbs_cpu(at::TensorList tensors, int64_t p, int64_t base, int64_t nlimbs,
                                           bool per_tensor) {
  TORCH_CHECK(p == 1 || p == 2, "fastgrad::exact_limbs: p must be 1 or 2, got ", p);
  TORCH_CHECK(base % 32 == 0 && nlimbs >= 4, "fastgrad::exact_limbs: bad window");
  for (size_t i = 0; i < tensors.size(); ++i)
    if (!tensors[i].device().is_cpu()) wrong_device("exact_limbs", "tensor", static_cast<int64_t>(i), tensors[i].device(), "cpu");
  std::vector<Flat> fl;
  fl.reserve(tensors.size());
  int64_t total = 0;
  for (const auto& t : tensors) {
    fl.push_back(flat(t, false));
    total += fl.back().n;
  }
  const Window w{static_cast<int>(p), base, nlimbs};
  const auto items = split(fl);
  const int64_t ni = static_cast<int64_t>(items.size());
  std::vector<uint64_t> part(static_cast<size_t>(ni * nlimbs), 0);
  std::vector<int64_t> flags(static_cast<size_t>(ni * 2), 0);
  for_items(ni, total, [&](int64_t i) {
    const Item& it = items[i];
    uint64_t* limbs = part.data() + i * nlimbs;
    item(w, fl[it.t], it.begin, it.len, limbs, &flags[2 * i], &flags[2 * i + 1]);
    normalize(limbs, nlimbs);
  });
  const int64_t rows = per_tensor ? static_cast<int64_t>(fl.size()) : 1;
  Tensor out = at::zeros({rows, nlimbs}, at::TensorOptions().dtype(at::kLong));
  Tensor fo = at::zeros({rows, 2}, at::TensorOptions().dtype(at::kLong));
  auto* o = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  int64_t* of = fo.data_ptr<int64_t>();
  // Item digits are < 2^32, so up to 2^31 items add without overflow before the final normalisation.
  for (int64_t i = 0; i < ni; ++i) {
    const int64_t r = per_tensor ? items[i].t : 0;
    for (int64_t k = 0; k < nlimbs; ++k) o[r * nlimbs + k] += part[i * nlimbs + k];
    of[2 * r] += flags[2 * i];
    of[2 * r + 1] += flags[2 * i + 1];
  }
  for (int64_t r = 0; r < rows; ++r) normalize(o + r * nlimbs, nlimbs);
  return {out, fo};
}

// ------------------------------------------------------------------------------------------- exact_total
// The whole list's correctly rounded norm for lists without float64 (every square and |x| exact in double, no
// float64 underflow or overflow), decided from a float64 sum with a proven error bound when that suffices,
// which is all but a vanishing fraction of calls: the true sum S lies in [S'(1 - d), S'(1 + d)] and when both
// ends round to the same value of the target dtype, that value is the correctly rounded norm (rounding is
// monotonic). Otherwise (an end on each side of a midpoint, or a NaN/inf element) the exact digits decide.
//
// The bound: each of 16 lanes adds 16 terms of a 256-element block (relative error <= 15u), the lanes are added
// pairwise (4u), blocks and items with Neumaier's compensated sum (<= 2u each, plus n u^2 terms); all terms are
// non-negative, so the relative error of the list's sum stays below 25u = 25 * 2^-53 < 2^-48.3. d = 2^-44 leaves
// a factor of twenty, and the square root halves it.
constexpr double kFilter = 0x1.0p-44;

template <typename Load>
inline double block_sum(int64_t len, const Load& load, bool sq) {
  CompensatedSum total;
  for (int64_t b = 0; b < len; b += 256) {
    const int64_t end = std::min(len, b + 256);
    // 16 lanes: four AVX2 registers of independent additions (the add latency, not the loads, bounds fewer)
    double lane[16] = {};
    int64_t i = b;
    if (sq) {
      for (; i + 16 <= end; i += 16)
        for (int j = 0; j < 16; ++j) {
          const double v = static_cast<double>(load(i + j));
          lane[j] += v * v;
        }
    } else {
      for (; i + 16 <= end; i += 16)
        for (int j = 0; j < 16; ++j) lane[j] += std::fabs(static_cast<double>(load(i + j)));
    }
    for (int j = 0; i < end; ++i, ++j) {
      const double v = static_cast<double>(load(i));
      lane[j] += sq ? v * v : std::fabs(v);
    }
    for (int w = 8; w >= 1; w /= 2)
      for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
    total.add(lane[0]);
  }
  return total.value();
}

FASTGRAD_SIMD_CLONES double filter_range(c10::ScalarType st, const void* ptr, int64_t n, bool sq) {
  switch (st) {
    case c10::ScalarType::Float: {
      const float* p = static_cast<const float*>(ptr);
      return block_sum(n, [p](int64_t i) { return p[i]; }, sq);
    }
    case c10::ScalarType::BFloat16: {
      const uint16_t* p = static_cast<const uint16_t*>(ptr);
      return block_sum(n, [p](int64_t i) { return bf16_to_f32(p[i]); }, sq);
    }
    case c10::ScalarType::Half: {
      const uint16_t* p = static_cast<const uint16_t*>(ptr);
      return block_sum(n, [p](int64_t i) { return fp16_to_f32(p[i]); }, sq);
    }
    default:
      TORCH_CHECK(false, "fastgrad::exact_total: unsupported dtype ", st);
  }
}

// d rounded to nearest even in st, as a 0-dim tensor (bf16/fp16 through float rounded to odd: one rounding).
Tensor rounded(double d, c10::ScalarType st, uint64_t* bits) {
  Tensor out = at::empty({}, at::TensorOptions().dtype(st));
  switch (st) {
    case c10::ScalarType::Float: {
      const float f = static_cast<float>(d);
      *out.data_ptr<float>() = f;
      *bits = f32_bits(f);
      break;
    }
    case c10::ScalarType::BFloat16: {
      const uint16_t h = f32_to_bf16(f64_to_f32_odd(d));
      std::memcpy(out.data_ptr(), &h, 2);
      *bits = h;
      break;
    }
    case c10::ScalarType::Half: {
      const uint16_t h = f32_to_fp16(f64_to_f32_odd(d));
      std::memcpy(out.data_ptr(), &h, 2);
      *bits = h;
      break;
    }
    default:
      TORCH_CHECK(false, "fastgrad::exact_total: unsupported result dtype ", st);
  }
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> exact_total_cpu(at::TensorList tensors, int64_t p, int64_t base,
                                                           int64_t nlimbs, c10::ScalarType a, c10::ScalarType b) {
  TORCH_CHECK(p == 1 || p == 2, "fastgrad::exact_total: p must be 1 or 2, got ", p);
  std::vector<Flat> fl;
  fl.reserve(tensors.size());
  int64_t total = 0;
  bool f64 = false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].device().is_cpu()) wrong_device("exact_total", "tensor", static_cast<int64_t>(i), tensors[i].device(), "cpu");
    fl.push_back(flat(tensors[i], false));
    total += fl.back().n;
    f64 = f64 || fl.back().st == c10::ScalarType::Double;
  }
  auto exact = [&]() {
    auto [dg, flags] = exact_limbs_cpu(tensors, p, base, nlimbs, false);
    return std::make_tuple(at::zeros({}, at::TensorOptions().dtype(a)), at::zeros({}, at::TensorOptions().dtype(b)),
                           dg, flags);
  };
  if (f64 || a == c10::ScalarType::Double || b == c10::ScalarType::Double) return exact();
  const auto items = split(fl);
  const int64_t ni = static_cast<int64_t>(items.size());
  std::vector<double> part(static_cast<size_t>(ni));
  for_items(ni, total, [&](int64_t i) {
    const Item& it = items[i];
    const Flat& f = fl[it.t];
    part[i] = filter_range(f.st, static_cast<const char*>(f.ptr) + it.begin * c10::elementSize(f.st), it.len, p == 2);
  });
  CompensatedSum sum;
  for (double v : part) sum.add(v);
  const double s = sum.value();
  if (!std::isfinite(s)) return exact();
  double lo = s * (1.0 - kFilter), hi = s * (1.0 + kFilter);
  if (p == 2) {
    lo = std::sqrt(lo);
    hi = std::sqrt(hi);
  }
  uint64_t la, ha, lb, hb;
  Tensor ra = rounded(lo, a, &la), rb = rounded(lo, b, &lb);
  rounded(hi, a, &ha);
  rounded(hi, b, &hb);
  if (la != ha || lb != hb) return exact();
  return {ra, rb, at::zeros({0, nlimbs}, at::TensorOptions().dtype(at::kLong)),
          at::zeros({0, 2}, at::TensorOptions().dtype(at::kLong))};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastgrad, CPU, m) {
  m.impl("exact_limbs", &exact_limbs_cpu);
  m.impl("exact_total", &exact_total_cpu);
}

}  // namespace cpu
}  // namespace fastgrad
