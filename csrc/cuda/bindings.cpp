// torch side of the CUDA kernels: turns tensor lists into the Seg table of fastgrad_cuda.h, finds (or
// uploads once) its device copy, allocates outputs and workspace through torch's caching allocator, and
// launches on the current stream. Compiled only in CUDA builds.
#include "fastgrad_cuda.h"
#include "../cpu/kernels.h"  // Flat views (device-agnostic)

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cstring>
#include <list>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace fastgrad {
namespace cuda_bind {
namespace {

using at::Tensor;
using at::TensorList;
using cpu::Flat;

int32_t dtype_code(c10::ScalarType st) {
  switch (st) {
    case at::kFloat: return fgcuda::kF32;
    case at::kHalf: return fgcuda::kF16;
    case at::kBFloat16: return fgcuda::kBF16;
    case at::kDouble: return fgcuda::kF64;
    default: TORCH_CHECK(false, "fastgrad (CUDA): unsupported dtype ", st);
  }
}

int mode_code(double p) {
  switch (cpu::mode_for(p)) {
    case cpu::Mode::L1: return fgcuda::kL1;
    case cpu::Mode::L2: return fgcuda::kL2;
    case cpu::Mode::Inf: return fgcuda::kInf;
    default: return fgcuda::kP;
  }
}

// "cudaErrorNoKernelImageForDevice: no kernel image is available ...": the name lets the Python side
// (fastgrad/backends/ext_backend.py) tell a build without code for this GPU from other failures.
std::string error_text(int err) {
  const auto e = static_cast<cudaError_t>(err);
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

void check(int err, const char* op) {
  TORCH_CHECK(err == 0, "fastgrad::", op, " CUDA launch failed: ", error_text(err));
}

// Every tensor on one CUDA device. (An op whose only CUDA argument is a scalar tensor, e.g. scale_ with a
// CUDA factor, can be dispatched here with CPU or no tensors in its list; those are refused or handled
// by the callers before anything reads tensors[0].)
void check_device(TensorList ts, const char* op, const char* what = "tensor") {
  TORCH_CHECK(!ts.empty(), "fastgrad::", op, " (CUDA kernel): empty tensor list");
  const auto dev = ts[0].device();
  if (!dev.is_cuda()) wrong_device(op, what, 0, dev, "cuda");
  for (size_t i = 1; i < ts.size(); ++i)
    if (ts[i].device() != dev) wrong_device(op, what, static_cast<int64_t>(i), ts[i].device(), dev.str());
}

// A one-element argument the kernels read on the device (inv_scale, factor): on `dev`, the tensors' device (a
// CPU scalar would be an illegal address there).
void check_scalar(const Tensor& s, const char* op, const char* name) {
  TORCH_CHECK(s.numel() == 1, "fastgrad::", op, ": ", name, " must have exactly one element, got ", s.numel());
}

void check_scalar_on(const Tensor& s, const at::Device& dev, const char* op, const char* name) {
  if (s.device() != dev) wrong_device(op, name, -1, s.device(), dev.str());
}

// The Seg table, planned on the host, in device memory.
struct Table {
  Tensor dev;
  int64_t nseg = 0, nchunks = 0, nrows = 0;
  fgcuda::RowPlan rp;  // row-planned tables (AGC, GC) only; then nchunks/nrows are its blocks and split rows
  const fgcuda::Seg* ptr() const { return reinterpret_cast<const fgcuda::Seg*>(dev.data_ptr()); }
};

// Device tables cached by their exact contents (every Seg's pointers, rows, length and dtypes) and device.
// A training loop hands the same gradient buffers every step (the caching allocator returns the same
// addresses), so the table is uploaded once and each later call costs one hash of the list instead of a
// pinned staging buffer and a host-to-device copy. It is also what makes the kernels capturable in a CUDA
// graph: a captured call finds its table here and enqueues no copy.
//
// Policy (as the Triton backend's plan cache, fastgrad/triton_kernels/multi_tensor.py): an LRU of kCapacity
// tables; a table used while the stream is being captured moves to a list nothing evicts, because the
// graph holds its device address for every replay (release_captured() drops those); a miss during capture
// is an error asking for one warm-up call, since building a table copies it from host memory.
class TableCache {
 public:
  static constexpr size_t kCapacity = 256;

  Table get(const std::vector<fgcuda::Seg>& segs, const at::Device& device, const c10::cuda::CUDAStream& cs_) {
    const cudaStream_t stream = cs_.stream();
    const uint64_t h = hash(segs, device.index());
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    const bool capturing = cudaStreamIsCapturing(stream, &cs) == cudaSuccess && cs != cudaStreamCaptureStatusNone;
    std::lock_guard<std::mutex> lock(mu_);
    auto range = index_.equal_range(h);
    for (auto it = range.first; it != range.second; ++it) {
      auto e = it->second;
      if (e->device != device.index() || e->segs.size() != segs.size() ||
          std::memcmp(e->segs.data(), segs.data(), segs.size() * sizeof(fgcuda::Seg)) != 0)
        continue;
      if (capturing && !e->captured) {
        e->captured = true;
        captured_.splice(captured_.begin(), lru_, e);  // splice keeps the iterator (and index_) valid
      } else if (!e->captured) {
        lru_.splice(lru_.begin(), lru_, e);
      }
      if (stream != e->stream) {
        // Used on another stream than the one it was allocated on: tell the allocator, so that freeing it on
        // eviction waits for this stream's use.
        e->tab.dev.record_stream(cs_);
      }
      ++hits_;
      return e->tab;
    }
    TORCH_CHECK(!capturing,
                "fastgrad (cuda backend): no cached kernel table for this tensor list during CUDA graph capture. "
                "Call the same fastgrad function once on the same tensors before capturing (a warm-up): building "
                "a table copies it from host memory, which a captured graph would re-read at every replay. "
                "Non-contiguous gradients are copied on every call and can never be captured: make them "
                "contiguous.");
    Entry e;
    e.device = device.index();
    e.hash = h;
    e.segs = segs;
    e.stream = stream;
    e.tab = upload(segs, device);
    ++builds_;
    lru_.push_front(std::move(e));
    index_.emplace(h, lru_.begin());
    while (lru_.size() > kCapacity) drop(std::prev(lru_.end()), lru_);
    return lru_.front().tab;
  }

  // clear(): the evictable tables; release_captured(): also those captured graphs may replay.
  void clear(bool release_captured) {
    std::lock_guard<std::mutex> lock(mu_);
    while (!lru_.empty()) drop(lru_.begin(), lru_);
    if (release_captured)
      while (!captured_.empty()) drop(captured_.begin(), captured_);
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {hits_, builds_, static_cast<int64_t>(lru_.size()), static_cast<int64_t>(captured_.size())};
  }

 private:
  struct Entry {
    int device = 0;
    uint64_t hash = 0;
    bool captured = false;
    cudaStream_t stream = nullptr;
    std::vector<fgcuda::Seg> segs;  // as the ops build them: plan() fields zero
    Table tab;
  };
  using Iter = std::list<Entry>::iterator;

  // Multiply-xorshift over the fields that define a table: a few ns per tensor, so thousands of tensors
  // cost microseconds. Collisions only cost a memcmp: equality is checked on the full contents.
  static uint64_t hash(const std::vector<fgcuda::Seg>& segs, int device) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(device) << 32) ^ segs.size();
    auto mix = [&h](uint64_t w) {
      h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
      h ^= h >> 31;
    };
    for (const auto& s : segs) {
      mix(reinterpret_cast<uintptr_t>(s.ptr));
      mix(reinterpret_cast<uintptr_t>(s.ptr2));
      mix(static_cast<uint64_t>(s.rows));
      mix(static_cast<uint64_t>(s.len) ^ (static_cast<uint64_t>(static_cast<uint32_t>(s.dtype)) << 48) ^
          (static_cast<uint64_t>(static_cast<uint32_t>(s.dtype2)) << 56));
    }
    return h;
  }

  static Table upload(const std::vector<fgcuda::Seg>& segs, const at::Device& device) {
    std::vector<fgcuda::Seg> planned(segs);
    Table t;
    t.nseg = static_cast<int64_t>(planned.size());
    if (!planned.empty() && planned[0].team == fgcuda::kPlanRows) {  // the per-row ops' tables (row_seg)
      t.nchunks = fgcuda::plan_rows(planned.data(), t.nseg, &t.rp);
      t.nrows = t.rp.nsplit_rows;
    } else {
      t.nchunks = fgcuda::plan(planned.data(), t.nseg, &t.nrows);
    }
    const int64_t bytes = t.nseg * static_cast<int64_t>(sizeof(fgcuda::Seg));
    // Pinned staging + async copy: no host sync; the caching host allocator keeps the buffer until the
    // copy has run.
    Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(host.data_ptr(), planned.data(), static_cast<size_t>(bytes));
    t.dev = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
    t.dev.copy_(host, /*non_blocking=*/true);
    return t;
  }

  void drop(Iter e, std::list<Entry>& from) {
    auto range = index_.equal_range(e->hash);
    for (auto it = range.first; it != range.second; ++it)
      if (it->second == e) {
        index_.erase(it);
        break;
      }
    from.erase(e);
  }

  std::mutex mu_;
  std::list<Entry> lru_;       // most recently used first
  std::list<Entry> captured_;  // used during a capture: kept until release_captured
  std::unordered_multimap<uint64_t, Iter> index_;
  int64_t hits_ = 0, builds_ = 0;
};

TableCache& tables() {
  static TableCache* cache = new TableCache();  // never destroyed: no CUDA frees at process exit
  return *cache;
}

Table upload(std::vector<fgcuda::Seg>& segs, const at::Device& device) {
  return tables().get(segs, device, c10::cuda::getCurrentCUDAStream(device.index()));
}

Tensor workspace(const Table& t, const at::Device& device) {
  return at::empty({static_cast<int64_t>(fgcuda::workspace_bytes(t.nchunks, t.nrows))},
                   at::TensorOptions().dtype(at::kByte).device(device));
}

fgcuda::Seg whole(const Flat& f) {
  return {f.ptr, nullptr, 1, f.n, 0, 0, 0, dtype_code(f.st), 0};
}

// The flat views of `ts` into *fl (with `write`, non-contiguous tensors go through a copy that cpu::finish
// writes back) and one whole-tensor Seg per tensor: the table of every op that treats tensors as a whole.
std::vector<fgcuda::Seg> whole_segs(TensorList ts, bool write, std::vector<Flat>* fl) {
  std::vector<fgcuda::Seg> segs;
  fl->reserve(ts.size());
  segs.reserve(ts.size());
  for (const auto& t : ts) {
    fl->push_back(cpu::flat(t, write));
    segs.push_back(whole(fl->back()));
  }
  return segs;
}

// A Seg of `rows` dim-0 rows for AGC (`w` the parameter) or GC (w null); kPlanRows asks for a row plan.
fgcuda::Seg row_seg(const Flat& g, const Flat* w, int64_t rows, int64_t len) {
  return {g.ptr, w ? w->ptr : nullptr, rows, len, 0, 0, 0, dtype_code(g.st), w ? dtype_code(w->st) : 0,
          fgcuda::kPlanRows, 0};
}

bool any_double(TensorList ts) {
  for (const auto& t : ts)
    if (t.scalar_type() == at::kDouble) return true;
  return false;
}

fgcuda::Stream stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// --------------------------------------------------------------------------------------------- ops
std::tuple<Tensor, Tensor> norm_impl(TensorList tensors, const Tensor* inv, double p, Tensor* found) {
  const at::Device dev = tensors[0].device();
  c10::cuda::CUDAGuard guard(dev);
  std::vector<Flat> fl;
  std::vector<fgcuda::Seg> segs = whole_segs(tensors, false, &fl);
  const bool acc64 = any_double(tensors);
  Table tab = upload(segs, dev);
  Tensor ws = workspace(tab, dev);
  const auto opts = at::TensorOptions().dtype(acc64 ? at::kDouble : at::kFloat).device(dev);
  Tensor total = at::empty({}, opts), per = at::empty({tab.nrows}, opts);
  Tensor inv_f;
  if (inv != nullptr) {
    inv_f = inv->to(dev, at::kFloat).contiguous();
    *found = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(dev));
  }
  check(fgcuda::norm(tab.ptr(), tab.nseg, tab.nchunks, tab.nrows, mode_code(p), p, acc64,
                     inv ? inv_f.data_ptr<float>() : nullptr, total.data_ptr(), per.data_ptr(),
                     inv ? found->data_ptr<float>() : nullptr, ws.data_ptr(), stream()),
        inv ? "amp_norm" : "norm");
  return {total, per};
}

std::tuple<Tensor, Tensor> norm_cuda(TensorList tensors, double p) {
  check_device(tensors, "norm");
  return norm_impl(tensors, nullptr, p, nullptr);
}

std::tuple<Tensor, Tensor> amp_norm_cuda(TensorList tensors, const Tensor& inv_scale, double p) {
  check_scalar(inv_scale, "amp_norm", "inv_scale");
  if (tensors.empty()) {  // nothing to read: norm 0, no overflow (on the scale's device)
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(inv_scale.device());
    return {at::zeros({}, opts), at::zeros({}, opts)};
  }
  check_device(tensors, "amp_norm");
  check_scalar_on(inv_scale, tensors[0].device(), "amp_norm", "inv_scale");
  Tensor found;
  Tensor total = std::get<0>(norm_impl(tensors, &inv_scale, p, &found));
  return {total, found};
}

void scale_cuda(TensorList tensors, const Tensor& factor) {
  check_scalar(factor, "scale_", "factor");
  if (tensors.empty()) return;
  check_device(tensors, "scale_");
  const at::Device dev = tensors[0].device();
  check_scalar_on(factor, dev, "scale_", "factor");
  c10::cuda::CUDAGuard guard(dev);
  Tensor f = factor.to(dev, factor.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).contiguous();
  std::vector<Flat> fl;
  std::vector<fgcuda::Seg> segs = whole_segs(tensors, true, &fl);
  Table tab = upload(segs, dev);
  check(fgcuda::scale(tab.ptr(), tab.nseg, tab.nchunks, f.data_ptr(),
                      f.scalar_type() == at::kDouble ? fgcuda::kF64 : fgcuda::kF32, stream()),
        "scale_");
  for (auto& x : fl) cpu::finish(x);
}

// clip_grad_norm_ in one op: read pass, finish (total and coefficient, both on the device) and the scale
// pass, enqueued back to back with no torch op between them; the total in the accumulation dtype.
Tensor clip_norm_cuda(TensorList grads, double max_norm, double p) {
  check_device(grads, "clip_norm_");
  const at::Device dev = grads[0].device();
  c10::cuda::CUDAGuard guard(dev);
  std::vector<Flat> fl;
  std::vector<fgcuda::Seg> segs = whole_segs(grads, true, &fl);
  const bool acc64 = any_double(grads);
  Table tab = upload(segs, dev);
  Tensor ws = workspace(tab, dev);
  Tensor total = at::empty({}, at::TensorOptions().dtype(acc64 ? at::kDouble : at::kFloat).device(dev));
  check(fgcuda::clip_norm(tab.ptr(), tab.nseg, tab.nchunks, mode_code(p), p, acc64, max_norm, total.data_ptr(),
                          ws.data_ptr(), stream()),
        "clip_norm_");
  for (auto& x : fl) cpu::finish(x);  // non-contiguous grads were processed through a copy
  return total;
}

// scaler_unscale_and_clip on one device in one op: the AMP read pass, a finish that computes the total, found_inf
// and the factor inv_scale * coef on the device, and (if `write`) the scale pass, back to back with no torch op.
std::tuple<Tensor, Tensor, Tensor> amp_clip_cuda(TensorList grads, const Tensor& inv_scale, double max_norm, double p,
                                                 bool write) {
  check_scalar(inv_scale, "amp_clip_", "inv_scale");
  check_device(grads, "amp_clip_");
  const at::Device dev = grads[0].device();
  check_scalar_on(inv_scale, dev, "amp_clip_", "inv_scale");
  c10::cuda::CUDAGuard guard(dev);
  std::vector<Flat> fl;
  std::vector<fgcuda::Seg> segs = whole_segs(grads, write, &fl);
  const bool acc64 = any_double(grads);
  Table tab = upload(segs, dev);
  Tensor ws = workspace(tab, dev);
  Tensor inv = inv_scale.to(dev, at::kFloat).contiguous();
  const auto opts = at::TensorOptions().dtype(acc64 ? at::kDouble : at::kFloat).device(dev);
  Tensor total = at::empty({}, opts), factor = at::empty({}, opts);
  Tensor found = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(dev));
  check(fgcuda::amp_clip(tab.ptr(), tab.nseg, tab.nchunks, mode_code(p), p, acc64, inv.data_ptr<float>(), max_norm,
                         write ? 1 : 0, total.data_ptr(), found.data_ptr<float>(), factor.data_ptr(), ws.data_ptr(),
                         stream()),
        "amp_clip_");
  for (auto& x : fl) cpu::finish(x);  // non-contiguous grads were processed through a copy (when writing)
  return {total, found, factor};
}

void clip_value_cuda(TensorList tensors, double c) {
  check_device(tensors, "clip_value_");
  const at::Device dev = tensors[0].device();
  c10::cuda::CUDAGuard guard(dev);
  std::vector<Flat> fl;
  std::vector<fgcuda::Seg> segs = whole_segs(tensors, true, &fl);
  Table tab = upload(segs, dev);
  check(fgcuda::clamp(tab.ptr(), tab.nseg, tab.nchunks, c, stream()), "clip_value_");
  for (auto& x : fl) cpu::finish(x);
}

void agc_cuda(TensorList params, TensorList grads, double clip_factor, double eps, double p) {
  check_device(grads, "agc_", "gradient");
  check_device(params, "agc_", "parameter");
  TORCH_CHECK(params.size() == grads.size(), "fastgrad::agc_: params and grads differ in length");
  const at::Device dev = grads[0].device();
  c10::cuda::CUDAGuard guard(dev);
  std::vector<Flat> fw, fg;
  std::vector<fgcuda::Seg> segs;
  for (size_t i = 0; i < grads.size(); ++i) {
    TORCH_CHECK(params[i].sizes() == grads[i].sizes(), "fastgrad::agc_: param and grad shapes differ");
    // The kernel dereferences both pointers: a parameter on the CPU or on another GPU would be an illegal
    // address (or a silent host read where unified memory allows it).
    if (params[i].device() != dev) wrong_device("agc_", "parameter", static_cast<int64_t>(i), params[i].device(), dev.str());
    fw.push_back(cpu::flat_rows(params[i], false));
    fg.push_back(cpu::flat_rows(grads[i], true));
    const int64_t rows = grads[i].dim() <= 1 ? 1 : grads[i].size(0);
    const int64_t len = rows > 0 ? grads[i].numel() / rows : 0;
    segs.push_back(row_seg(fg.back(), &fw.back(), rows, len));
  }
  const bool acc64 = any_double(grads) || any_double(params);
  Table tab = upload(segs, dev);
  Tensor ws = workspace(tab, dev);
  check(fgcuda::agc(tab.ptr(), tab.nseg, tab.rp, mode_code(p), p, acc64, clip_factor, eps, ws.data_ptr(), stream()),
        "agc_");
  for (auto& x : fg) cpu::finish(x);
}

void centralize_cuda(TensorList grads) {
  check_device(grads, "centralize_");
  const at::Device dev = grads[0].device();
  c10::cuda::CUDAGuard guard(dev);
  std::vector<Flat> fg;
  std::vector<fgcuda::Seg> segs;
  for (const auto& g : grads) {
    if (g.dim() <= 1) continue;  // 1-D gradients are not centralised
    fg.push_back(cpu::flat_rows(g, true));
    const int64_t rows = g.size(0);
    const int64_t len = rows > 0 ? g.numel() / rows : 0;
    segs.push_back(row_seg(fg.back(), nullptr, rows, len));
  }
  if (segs.empty()) return;
  Table tab = upload(segs, dev);
  Tensor ws = workspace(tab, dev);
  check(fgcuda::centralize(tab.ptr(), tab.nseg, tab.rp, ws.data_ptr(), stream()), "centralize_");
  for (auto& x : fg) cpu::finish(x);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> grad_stats_cuda(TensorList tensors) {
  check_device(tensors, "grad_stats");
  const at::Device dev = tensors[0].device();
  c10::cuda::CUDAGuard guard(dev);
  std::vector<Flat> fl;
  std::vector<fgcuda::Seg> segs = whole_segs(tensors, false, &fl);
  const bool acc64 = any_double(tensors);
  Table tab = upload(segs, dev);
  Tensor ws = workspace(tab, dev);
  const auto fopts = at::TensorOptions().dtype(acc64 ? at::kDouble : at::kFloat).device(dev);
  const auto lopts = at::TensorOptions().dtype(at::kLong).device(dev);
  Tensor norm = at::empty({tab.nrows}, fopts), mx = at::empty({tab.nrows}, fopts);
  Tensor nan = at::empty({tab.nrows}, lopts), inf = at::empty({tab.nrows}, lopts), zero = at::empty({tab.nrows}, lopts);
  check(fgcuda::stats(tab.ptr(), tab.nseg, tab.nchunks, tab.nrows, acc64, norm.data_ptr(), mx.data_ptr(),
                      nan.data_ptr<int64_t>(), inf.data_ptr<int64_t>(), zero.data_ptr<int64_t>(), ws.data_ptr(),
                      stream()),
        "grad_stats");
  return {norm, mx, nan, inf, zero};
}

// ------------------------------------------------------------------------------------ runtime info
// "" when this build can run on the device, else the CUDA error its first launch would raise.
std::string cuda_probe(int64_t device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const int err = fgcuda::probe();
  return err == 0 ? std::string() : error_text(err);
}

// action 0: stats (hits, builds, cached, captured); 1: clear the evictable tables; 2: also the captured.
std::vector<int64_t> cuda_table_cache(int64_t action) {
  if (action > 0) tables().clear(action > 1);
  return tables().stats();
}

}  // namespace

// Ops without tensor arguments (catch-all kernels): what the Python side asks the CUDA build directly.
TORCH_LIBRARY_FRAGMENT(fastgrad, m) {
  m.def("cuda_probe(int device) -> str", &cuda_probe);
  m.def("cuda_table_cache(int action) -> int[]", &cuda_table_cache);
}

TORCH_LIBRARY_IMPL(fastgrad, CUDA, m) {
  m.impl("norm", &norm_cuda);
  m.impl("amp_norm", &amp_norm_cuda);
  m.impl("scale_", &scale_cuda);
  m.impl("clip_norm_", &clip_norm_cuda);
  m.impl("amp_clip_", &amp_clip_cuda);
  m.impl("clip_value_", &clip_value_cuda);
  m.impl("agc_", &agc_cuda);
  m.impl("centralize_", &centralize_cuda);
  m.impl("grad_stats", &grad_stats_cuda);
}

}  // namespace cuda_bind
}  // namespace fastgrad
