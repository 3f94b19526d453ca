// CUDA kernels: the AMP read pass (norm of T(x * inv) and per-chunk overflow flags), helpers in common.cuh.
#include "common.cuh"

namespace fgcuda {

int row_reduce_amp(const Seg* segs, int64_t nseg, int64_t nchunks, int64_t nrows, int mode, double p, int acc64,
                   const float* inv, double* part, int* flags, double* out, cudaStream_t st) {
  Ws w{};
  w.part = part;
  w.flags = flags;
  return row_reduce<true>(segs, nseg, nchunks, nrows, mode, p, acc64, inv, 0, w, out, st);
}

int probe_amp() {
  cudaFuncAttributes a;
  return static_cast<int>(cudaFuncGetAttributes(&a, k_reduce<kL2, float, true>));
}

}  // namespace fgcuda
