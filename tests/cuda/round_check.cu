// Host-side check of the CUDA kernels' double -> fp16/bf16 rounding (fgcuda::from_double, csrc/cuda/common.cuh,
// through csrc/round_odd.h), run without a GPU by tests/test_ext.py: reads float64 values from stdin and writes,
// per value, the fp16 and the bf16 bits from_double gives, which the test compares with correctly rounded
// values computed independently in Python. The same source the kernels compile, built for the host here
// (the float -> 16-bit step is one cvt.rn instruction on the GPU and correctly rounded on both).
#include "common.cuh"

#include <cstdio>
#include <cstring>
#include <vector>

// apply.cu's probe() and the AMP launcher live in other files: common.cuh only declares them.
namespace fgcuda {
int probe_reduce() { return 0; }
int probe_amp() { return 0; }
}  // namespace fgcuda

int main() {
  std::vector<double> in;
  double d;
  while (std::fread(&d, sizeof d, 1, stdin) == 1) in.push_back(d);
  std::vector<uint16_t> out(2 * in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const __half h = fgcuda::from_double<__half>(in[i]);
    const __nv_bfloat16 b = fgcuda::from_double<__nv_bfloat16>(in[i]);
    std::memcpy(&out[2 * i], &h, 2);
    std::memcpy(&out[2 * i + 1], &b, 2);
  }
  std::fwrite(out.data(), 2, out.size(), stdout);
  return 0;
}
