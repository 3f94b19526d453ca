// Launcher API of fastgrad's CUDA kernels. Plain C++: no torch and no CUDA headers, so the torch binding
// (bindings.cpp) and the kernels (reduce.cu, amp.cu, apply.cu) only meet through these raw pointers.
//
// Work description. Every tensor is one Seg, processed as a flat run of `rows * len` elements: a whole
// tensor is one row; per-row ops (AGC, gradient centralisation) use dim-0 slices as rows. Each row is cut
// into `cpr` chunks of at most kChunk elements; one CUDA block handles one chunk, and finds its Seg by a
// binary search over `first_chunk`. The Seg table lives in device memory, so one launch per pass covers
// any number of tensors. Reductions write one partial per chunk and combine them in a fixed order (no
// floating-point atomics): results are bitwise reproducible.
#pragma once

#include <cstddef>
#include <cstdint>

struct CUstream_st;

namespace fgcuda {

using Stream = CUstream_st*;

enum DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3 };
enum Mode : int32_t { kSum = 0, kL1 = 1, kL2 = 2, kInf = 3, kP = 4 };

constexpr int64_t kChunk = int64_t(1) << 15;

struct Seg {
  void* ptr;          // data (dense run of rows * len elements)
  const void* ptr2;   // second tensor of the same shape (AGC: the parameter), else null
  int64_t rows;       // number of rows (1 for whole-tensor ops)
  int64_t len;        // elements per row
  int64_t cpr;        // chunks per row, filled by plan()
  int64_t first_chunk;  // filled by plan()
  int64_t first_row;    // filled by plan()
  int32_t dtype;
  int32_t dtype2;
  // Row plans only (plan_rows; zero elsewhere). Before planning, kPlanRows in `team` asks the table
  // builder for a row plan (and keeps row-plan tables apart from whole-tensor ones in its cache).
  int32_t team;  // lanes per row: 1..32 (sub-warp teams) or 256 (the block) for packed rows; 0: split rows
  int32_t rpb;   // rows per block of a packed Seg
};

constexpr int32_t kPlanRows = -1;

// A row plan (AGC, GC): blocks [0, npacked) take whole rows (several per block when short: `team` lanes
// per row, `rpb` rows per block), each read once into registers, reduced, and written from the registers;
// blocks [npacked, nblocks) are kChunk-element pieces of rows too long for one block ("split rows"). plan_rows
// reorders the Segs so those of split rows come last (from `split_seg0` on); for them `cpr` and `first_chunk`
// are as in plan() and `first_row` counts split rows only (nsplit_rows in all), the index of their
// per-row workspace.
struct RowPlan {
  int64_t nblocks = 0, npacked = 0, nsplit_rows = 0, split_seg0 = 0;
};

// Host side: fills cpr/first_chunk/first_row; returns the number of chunks, *total_rows the rows.
int64_t plan(Seg* segs, int64_t nseg, int64_t* total_rows);

// Host side: the row plan described at RowPlan (reorders segs); returns rp->nblocks.
int64_t plan_rows(Seg* segs, int64_t nseg, RowPlan* rp);

// Bytes of device workspace the launchers below need.
size_t workspace_bytes(int64_t nchunks, int64_t nrows);

// All launchers return a cudaError_t value (0 on success), enqueue on `stream` and never synchronise. A
// launcher of several kernels returns at the first launch that fails, and every launcher's first launch
// only reads (agc/centralize: see there): a GPU without a kernel image for this build leaves the gradients
// untouched.
// `acc64`: accumulate in double (some tensor is float64) instead of float.

// (total, per-row) p-norms. total/per are of the accumulation dtype (float or double). When d_inv is
// not null this is the AMP pass: values are T(x * *d_inv) and *d_found (float) becomes 1.0 if any
// stored element is NaN/inf, else 0.0.
int norm(const Seg* d_segs, int64_t nseg, int64_t nchunks, int64_t nrows, int mode, double p, int acc64,
         const float* d_inv, void* d_total, void* d_per, float* d_found, void* d_ws, Stream stream);

// clip_grad_norm_ over a whole-tensor table (one row per Seg, as norm() builds it), in three launches: the
// read pass, a finish that writes *d_total (accumulation dtype, the bits norm() gives) and the coefficient
// min(max_norm / (total + 1e-6), 1) in that dtype (as torch computes the expression on a 0-dim tensor), and
// scale() by that coefficient, which writes nothing when it is 1. The coefficient stays on the device. Lists
// of more than 8,192 chunks (2^28 elements) get norm()'s per-row pass before the finish: four launches.
int clip_norm(const Seg* d_segs, int64_t nseg, int64_t nchunks, int mode, double p, int acc64, double max_norm,
              void* d_total, void* d_ws, Stream stream);

// scaler_unscale_and_clip over a whole-tensor table: norm()'s AMP read pass (values T(x * *d_inv), overflow
// flags of the stored values), clip_norm()'s finish, which also writes *d_found (float 1.0/0.0) and, instead of
// the coefficient, the factor *d_inv * coef rounded to the accumulation dtype into *d_factor, then, if `write`,
// scale() by the factor (nothing written when it is 1). *d_total has the bits norm() gives with d_inv.
int amp_clip(const Seg* d_segs, int64_t nseg, int64_t nchunks, int mode, double p, int acc64, const float* d_inv,
             double max_norm, int write, void* d_total, float* d_found, void* d_factor, void* d_ws, Stream stream);

// grad_stats: per-row L2 norm and max |x| (accumulation dtype), NaN/inf/zero counts (int64).
int stats(const Seg* d_segs, int64_t nseg, int64_t nchunks, int64_t nrows, int acc64, void* d_norm,
          void* d_max, int64_t* d_nan, int64_t* d_inf, int64_t* d_zero, void* d_ws, Stream stream);

// x = T(x * f), f read on the device (float32 or float64 per factor_dtype); nothing is written when
// f == 1. The product is in float (double for float64 tensors).
int scale(const Seg* d_segs, int64_t nseg, int64_t nchunks, const void* d_factor, int factor_dtype,
          Stream stream);

// x = min(max(x, -c), c), NaN kept.
int clamp(const Seg* d_segs, int64_t nseg, int64_t nchunks, double c, Stream stream);

// AGC over a row-planned table (segs[i].ptr the gradient, segs[i].ptr2 the parameter); workspace of
// workspace_bytes(rp.nblocks, rp.nsplit_rows). One launch when no row is split, else three: the row pass
// (packed rows done, split rows' partials), their coefficients, and their scaling. All three kernels live in
// one module (apply.cu): when the first launches, the others have code for this GPU too.
int agc(const Seg* d_segs, int64_t nseg, const RowPlan& rp, int mode, double p, int acc64, double clip_factor,
        double eps, void* d_ws, Stream stream);

// 0 when this build carries code the current device can run (SASS for its arch, or PTX the driver can
// JIT), else the cudaError_t a launch would fail with. Loads the kernels' modules; enqueues nothing.
int probe();

// Gradient centralisation over a row-planned table: x = T(float(x) - float(mean)) (in double for float64
// tensors), the mean accumulated in double; launches as agc().
int centralize(const Seg* d_segs, int64_t nseg, const RowPlan& rp, void* d_ws, Stream stream);

}  // namespace fgcuda
