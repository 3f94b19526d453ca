// double -> float rounded to odd, shared by the C++ CPU kernels (csrc/cpu) and the CUDA kernels (csrc/cuda):
// both round a double result (AGC's row ratio times a gradient, GC's split-row apply, the float64 factor of a
// mixed list) to fp16/bf16 exactly once with these same operations, so the CPU kernels, which the tests run on
// every machine, check the arithmetic the GPU runs (tests/test_ext.py, tests/cuda/round_check.cu).
//
// The nearest float when d is one, else whichever float neighbour of d has an odd last bit. Rounding that
// float to fp16 or bf16 (to nearest) then gives exactly the correctly rounded 16-bit value of d, since float
// keeps more than 2 bits beyond either; a plain double -> float -> 16-bit chain rounds twice and can land 1 ulp
// off (a double just past a 16-bit tie becomes the tie in float). A direct double -> 16-bit conversion
// instruction is not used either: what a compiler lowers it to is not visible here (and not testable without
// the GPU). Done on the double's bits: cut the 29 mantissa bits float does not keep and put "was anything cut"
// into float's last bit; the result is a float exactly, so the conversion to float does not round. Plain
// integer work and a select, so it vectorises on the CPU (a float-rounding-plus-correction form made bf16 AGC
// 4x slower, a variable-shift form 3.5x). NaN stays NaN, inf stays inf. Below float's normal range
// (|d| < 2^-126) float's last bit sits higher, so there the plain conversion is used: fp16 rounds all of those
// to 0 anyway; bf16 subnormals can be 1 subnormal ulp off the correctly rounded value at an exact tie (still
// within the contract's 1-ulp rule).
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FASTGRAD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FASTGRAD_HOST_DEVICE inline
#endif

namespace fastgrad {

FASTGRAD_HOST_DEVICE float f64_to_f32_odd(double d) {
  constexpr uint64_t kCut = (uint64_t(1) << 29) - 1;
  uint64_t b;
  memcpy(&b, &d, sizeof b);
  const uint64_t odd = (b & ~kCut) | (uint64_t((b & kCut) != 0) << 29);
  double t;
  memcpy(&t, &odd, sizeof t);
  const bool normal = fabs(d) >= 1.1754943508222875e-38;  // false for NaN: the plain conversion keeps it
  return static_cast<float>(normal ? t : d);
}

}  // namespace fastgrad
