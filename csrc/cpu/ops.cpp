// CPU implementations of the fastgrad ops (schemas in csrc/ops.cpp).
#include "kernels.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>

namespace fastgrad {
namespace cpu {
namespace {

using at::Tensor;
using at::TensorList;

inline const char* at_elem(const Flat& f, int64_t i) {
  return static_cast<const char*>(f.ptr) + i * static_cast<int64_t>(c10::elementSize(f.st));
}
inline char* at_elem_mut(const Flat& f, int64_t i) {
  return static_cast<char*>(f.ptr) + i * static_cast<int64_t>(c10::elementSize(f.st));
}

// Combines two partials of the same reduction; for Inf the max keeps NaN.
inline double combine(Mode m, double a, double b) {
  if (m != Mode::Inf) return a + b;
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  return a > b ? a : b;
}

// Norm from its partial: sum of |x|^p -> p-th root.
inline double finalize(Mode m, double s, double p) {
  switch (m) {
    case Mode::L2:
      return std::sqrt(s);
    case Mode::P:
      // 1/p is rounded; in long double that rounding stops mattering for double results.
      return static_cast<double>(std::pow(static_cast<long double>(s), 1.0L / static_cast<long double>(p)));
    default:
      return s;  // L1, Inf, Sum
  }
}

void check_cpu(TensorList ts, const char* op, const char* what = "tensor") {
  for (size_t i = 0; i < ts.size(); ++i)
    if (!ts[i].device().is_cpu()) wrong_device(op, what, static_cast<int64_t>(i), ts[i].device(), "cpu");
}

// A one-element CPU tensor argument (inv_scale, factor): the number of elements is in the message.
void check_cpu_scalar(const Tensor& s, const char* op, const char* name) {
  if (!s.device().is_cpu()) wrong_device(op, name, -1, s.device(), "cpu");
  TORCH_CHECK(s.numel() == 1, "fastgrad::", op, ": ", name, " must have exactly one element, got ", s.numel());
}

int64_t total_numel(const std::vector<Flat>& fl) {
  int64_t n = 0;
  for (const auto& f : fl) n += f.n;
  return n;
}

std::vector<Flat> flats(TensorList ts, bool writeback) {
  std::vector<Flat> fl;
  fl.reserve(ts.size());
  for (const auto& t : ts) fl.push_back(flat(t, writeback));
  return fl;
}

Tensor make_1d(const std::vector<double>& v, bool acc64) {
  Tensor out = at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(acc64 ? at::kDouble : at::kFloat));
  if (acc64) {
    double* o = out.data_ptr<double>();
    for (size_t i = 0; i < v.size(); ++i) o[i] = v[i];
  } else {
    float* o = out.data_ptr<float>();
    for (size_t i = 0; i < v.size(); ++i) o[i] = static_cast<float>(v[i]);
  }
  return out;
}

Tensor make_0d(double v, at::ScalarType st) {
  Tensor out = at::empty({}, at::TensorOptions().dtype(st));
  if (st == at::kDouble)
    *out.data_ptr<double>() = v;
  else
    *out.data_ptr<float>() = static_cast<float>(v);
  return out;
}

// Per-tensor partials of a read pass -> total norm (double, before rounding to the accumulation dtype)
// and, when `per` is given, each tensor's norm.
double total_from(size_t nt, const std::vector<Item>& items, const std::vector<double>& part, Mode mode, double p,
                  std::vector<double>* per) {
  std::vector<double> sums(nt, 0.0);
  double total;
  if (mode == Mode::Inf) {
    for (size_t i = 0; i < items.size(); ++i) sums[items[i].t] = combine(mode, sums[items[i].t], part[i]);
    double tot = 0.0;
    for (size_t t = 0; t < nt; ++t) tot = combine(mode, tot, sums[t]);
    total = tot;
    if (per != nullptr) *per = std::move(sums);
  } else {
    // Items of one tensor are consecutive: sum them, then the tensors, both compensated.
    CompensatedSum tot;
    for (size_t i = 0; i < items.size();) {
      const size_t t = items[i].t;
      if (i + 1 == items.size() || items[i + 1].t != t) {
        // A one-item tensor (most of a long list of small ones): a CompensatedSum of one value is 0.0 + x
        // exactly (-0 becomes +0; inf/NaN pass), without its branchy add.
        sums[t] = 0.0 + part[i++];
      } else {
        CompensatedSum s;
        for (; i < items.size() && items[i].t == t; ++i) s.add(part[i]);
        sums[t] = s.value();
      }
      tot.add(sums[t]);
    }
    if (per != nullptr) {
      per->resize(nt);
      for (size_t t = 0; t < nt; ++t) (*per)[t] = finalize(mode, sums[t], p);
    }
    total = finalize(mode, tot.value(), p);
  }
  return total;
}

std::tuple<Tensor, Tensor> norms_from(const std::vector<Flat>& fl, const std::vector<Item>& items,
                                      const std::vector<double>& part, Mode mode, double p, bool acc64) {
  std::vector<double> per;
  const double total = total_from(fl.size(), items, part, mode, p, &per);
  return {make_0d(total, acc64 ? at::kDouble : at::kFloat), make_1d(per, acc64)};
}

// ------------------------------------------------------------------------------------------- norm
// The read pass of a norm: one partial per work item.
std::vector<double> norm_partials(const std::vector<Flat>& fl, const std::vector<Item>& items, Mode mode, double p,
                                  bool acc64) {
  std::vector<double> part(items.size());
  for_items(static_cast<int64_t>(items.size()), total_numel(fl), [&](int64_t i) {
    const Item& it = items[i];
    const Flat& f = fl[it.t];
    part[i] = reduce_range(mode, f.st, acc64, at_elem(f, it.begin), it.len, p);
  });
  return part;
}

std::tuple<Tensor, Tensor> norm_cpu(TensorList tensors, double p) {
  check_cpu(tensors, "norm");
  const auto fl = flats(tensors, false);
  const bool acc64 = any_double(fl);
  const Mode mode = mode_for(p);
  const auto items = split(fl);
  return norms_from(fl, items, norm_partials(fl, items, mode, p, acc64), mode, p, acc64);
}

// The AMP read pass over flat views: one partial per work item of the norm of T(x * inv), and whether any
// stored element is NaN/inf. Shared by amp_norm and amp_clip_, so both give the same total.
std::vector<double> amp_partials(const std::vector<Flat>& fl, const std::vector<Item>& items, Mode mode, double p,
                                 bool acc64, double inv, bool* found_out) {
  std::vector<double> part(items.size());
  std::vector<char> bad(items.size(), 0);
  for_items(static_cast<int64_t>(items.size()), total_numel(fl), [&](int64_t i) {
    const Item& it = items[i];
    const Flat& f = fl[it.t];
    bool nf = false;
    part[i] = amp_range(mode, f.st, acc64, at_elem(f, it.begin), it.len, p, inv, &nf);
    bad[i] = nf ? 1 : 0;
  });
  bool found = false;
  for (char b : bad) found = found || b;
  *found_out = found;
  return part;
}

double amp_inv(const Tensor& inv_scale, const char* op) {
  check_cpu_scalar(inv_scale, op, "inv_scale");
  return inv_scale.item<double>();  // CPU memory: no device sync involved
}

std::tuple<Tensor, Tensor> amp_norm_cpu(TensorList tensors, const Tensor& inv_scale, double p) {
  check_cpu(tensors, "amp_norm");
  const double inv = amp_inv(inv_scale, "amp_norm");
  const auto fl = flats(tensors, false);
  const bool acc64 = any_double(fl);
  const Mode mode = mode_for(p);
  const auto items = split(fl);
  bool found = false;
  const auto part = amp_partials(fl, items, mode, p, acc64, inv, &found);
  Tensor total = std::get<0>(norms_from(fl, items, part, mode, p, acc64));
  return {total, make_0d(found ? 1.0 : 0.0, at::kFloat)};
}

// ------------------------------------------------------------------------------------ elementwise
void scale_cpu(TensorList tensors, const Tensor& factor) {
  check_cpu(tensors, "scale_");
  check_cpu_scalar(factor, "scale_", "factor");
  const double f = factor.item<double>();
  // Multiplying by exactly 1 changes nothing: skip the memory entirely (the "not clipping" case).
  if (f == 1.0) return;
  const bool f32_is_one = static_cast<float>(f) == 1.0f;
  std::vector<Flat> fl;
  fl.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (f32_is_one && t.scalar_type() != at::kDouble) continue;  // see scale_flats
    fl.push_back(flat(t, true));
  }
  scale_flats(fl, f);
  for (auto& x : fl) finish(x);
}

void clip_value_cpu(TensorList tensors, double clip_value) {
  check_cpu(tensors, "clip_value_");
  auto fl = flats(tensors, true);
  const auto items = split(fl);
  for_items(static_cast<int64_t>(items.size()), total_numel(fl), [&](int64_t i) {
    const Item& it = items[i];
    const Flat& fv = fl[it.t];
    clamp_range(fv.st, at_elem_mut(fv, it.begin), it.len, clip_value);
  });
  for (auto& x : fl) finish(x);
}

// --------------------------------------------------------------------------------- per-row ops
// Units are dim-0 slices ("rows") of length L. Short rows are grouped into one work item up to
// kChunk elements; long rows are cut into kChunk pieces whose partials are combined in order.
struct RowItem {
  int64_t t;      // tensor
  int64_t row0;   // first row (tensor-local)
  int64_t nrows;  // whole rows in this item, or 1 for a piece
  int64_t off;    // element offset inside the row (pieces only)
  int64_t len;    // elements per row (whole rows) or piece length
  bool piece;
};

struct RowPlan {
  std::vector<int64_t> L, rows, base;  // per tensor: row length, row count, index of its first row
  std::vector<RowItem> items;
  int64_t total_rows = 0;
  int64_t total_elems = 0;
};

RowPlan plan_rows(const std::vector<int64_t>& numel, const std::vector<int64_t>& rows) {
  RowPlan pl;
  const size_t nt = numel.size();
  pl.L.resize(nt);
  pl.rows = rows;
  pl.base.resize(nt);
  for (size_t t = 0; t < nt; ++t) {
    const int64_t r = rows[t];
    const int64_t L = r > 0 ? numel[t] / r : 0;
    pl.L[t] = L;
    pl.base[t] = pl.total_rows;
    pl.total_rows += r;
    pl.total_elems += numel[t];
    if (L == 0) continue;
    if (L <= kChunk) {
      const int64_t g = kChunk / L;
      for (int64_t r0 = 0; r0 < r; r0 += g)
        pl.items.push_back({static_cast<int64_t>(t), r0, std::min(g, r - r0), 0, L, false});
    } else {
      for (int64_t r0 = 0; r0 < r; ++r0)
        for (int64_t b = 0; b < L; b += kChunk)
          pl.items.push_back({static_cast<int64_t>(t), r0, 1, b, std::min(kChunk, L - b), true});
    }
  }
  return pl;
}

// Row reductions of `fl` (one flat per tensor, rows are consecutive runs) into one value per row.
std::vector<double> row_reduce(const RowPlan& pl, const std::vector<Flat>& fl, Mode mode, double p,
                               const std::vector<char>& acc64) {
  std::vector<double> out(static_cast<size_t>(pl.total_rows), 0.0);
  std::vector<double> part(pl.items.size(), 0.0);
  for_items(static_cast<int64_t>(pl.items.size()), pl.total_elems, [&](int64_t i) {
    const RowItem& it = pl.items[i];
    const Flat& f = fl[it.t];
    const int64_t L = pl.L[it.t];
    if (it.piece) {
      part[i] = reduce_range(mode, f.st, acc64[it.t], at_elem(f, it.row0 * L + it.off), it.len, p);
    } else {
      for (int64_t r = it.row0; r < it.row0 + it.nrows; ++r)
        out[pl.base[it.t] + r] = reduce_range(mode, f.st, acc64[it.t], at_elem(f, r * L), L, p);
    }
  });
  for (size_t i = 0; i < pl.items.size(); ++i) {
    const RowItem& it = pl.items[i];
    if (!it.piece) continue;
    double& o = out[pl.base[it.t] + it.row0];
    o = it.off == 0 ? part[i] : combine(mode, o, part[i]);
  }
  return out;
}

// Applies fn(flat, row, ptr, n) to every row (or piece of a row) for which want[row] is set.
template <typename F>
void row_apply(const RowPlan& pl, const std::vector<Flat>& fl, const std::vector<char>& want, const F& fn) {
  for_items(static_cast<int64_t>(pl.items.size()), pl.total_elems, [&](int64_t i) {
    const RowItem& it = pl.items[i];
    const Flat& f = fl[it.t];
    const int64_t L = pl.L[it.t];
    for (int64_t r = it.row0; r < it.row0 + it.nrows; ++r) {
      const int64_t g = pl.base[it.t] + r;
      if (!want[g]) continue;
      if (it.piece)
        fn(f, g, at_elem_mut(f, r * L + it.off), it.len);
      else
        fn(f, g, at_elem_mut(f, r * L), L);
    }
  });
}

void agc_cpu(TensorList params, TensorList grads, double clip_factor, double eps, double p) {
  check_cpu(params, "agc_", "parameter");
  check_cpu(grads, "agc_", "gradient");
  TORCH_CHECK(params.size() == grads.size(), "fastgrad::agc_: params and grads differ in length");
  const size_t nt = grads.size();
  std::vector<Flat> fw, fg;
  std::vector<int64_t> numel(nt), rows(nt);
  std::vector<char> acc64(nt);
  for (size_t t = 0; t < nt; ++t) {
    TORCH_CHECK(params[t].sizes() == grads[t].sizes(), "fastgrad::agc_: param and grad shapes differ");
    fw.push_back(flat_rows(params[t], false));
    fg.push_back(flat_rows(grads[t], true));
    numel[t] = grads[t].numel();
    rows[t] = grads[t].dim() <= 1 ? 1 : grads[t].size(0);
    acc64[t] = params[t].scalar_type() == at::kDouble || grads[t].scalar_type() == at::kDouble;
  }
  const Mode mode = mode_for(p);
  const RowPlan pl = plan_rows(numel, rows);
  const auto ws = row_reduce(pl, fw, mode, p, acc64);
  const auto gs = row_reduce(pl, fg, mode, p, acc64);
  std::vector<double> ratio(static_cast<size_t>(pl.total_rows), 1.0);
  std::vector<char> want(static_cast<size_t>(pl.total_rows), 0);
  bool any = false;
  for (size_t t = 0; t < nt; ++t) {
    for (int64_t r = 0; r < pl.rows[t]; ++r) {
      const int64_t g = pl.base[t] + r;
      // Whole formula in double and one rounding at the final multiply: never less accurate than
      // timm's fp32 chain (norms, clamp, ratio and product each rounded), element by element.
      const double wn = finalize(mode, ws[g], p);
      const double gn = finalize(mode, gs[g], p);
      const double max_norm = (std::isnan(wn) ? wn : (wn < eps ? eps : wn)) * clip_factor;
      if (gn < max_norm) continue;  // kept; NaN norms fall through and clip (to NaN), as in timm
      const double den = std::isnan(gn) ? gn : (gn < 1e-6 ? 1e-6 : gn);
      ratio[g] = max_norm / den;
      want[g] = 1;
      any = true;
    }
  }
  if (any) {
    row_apply(pl, fg, want, [&](const Flat& f, int64_t g, char* ptr, int64_t n) {
      scale_range(f.st, ptr, n, ratio[g], true);
    });
  }
  for (auto& x : fg) finish(x);
}

void centralize_cpu(TensorList grads) {
  check_cpu(grads, "centralize_");
  const size_t nt = grads.size();
  std::vector<Flat> fg;
  std::vector<int64_t> numel(nt), rows(nt);
  for (size_t t = 0; t < nt; ++t) {
    fg.push_back(flat_rows(grads[t], true));
    numel[t] = grads[t].numel();
    // 1-D (and 0-D) gradients are not centralised: no rows.
    rows[t] = grads[t].dim() <= 1 ? 0 : grads[t].size(0);
    if (rows[t] == 0) numel[t] = 0;
  }
  const RowPlan pl = plan_rows(numel, rows);
  // Rows that fit in one work item are summed and centralised in the same item, while they are still in
  // cache (two passes over the whole list would read every gradient from memory twice). Row sums use the
  // norm kernels' summation (float lanes over 256-element blocks, blocks added in compensated double;
  // all double for float64), so the mean is more accurate than torch's fp32 mean; it is then rounded to
  // float and subtracted in float, as torch's g.sub_(mean) does (double here made GC compute-bound).
  std::vector<double> part(pl.items.size(), 0.0);
  bool any_piece = false;
  for (const auto& it : pl.items) any_piece = any_piece || it.piece;
  for_items(static_cast<int64_t>(pl.items.size()), pl.total_elems, [&](int64_t i) {
    const RowItem& it = pl.items[i];
    const Flat& f = fg[it.t];
    const int64_t L = pl.L[it.t];
    if (it.piece) {
      part[i] = reduce_range(Mode::Sum, f.st, f.st == at::kDouble, at_elem(f, it.row0 * L + it.off), it.len, 1.0);
      return;
    }
    for (int64_t r = it.row0; r < it.row0 + it.nrows; ++r) {
      char* ptr = at_elem_mut(f, r * L);
      const double m = reduce_range(Mode::Sum, f.st, f.st == at::kDouble, ptr, L, 1.0) / static_cast<double>(L);
      sub_range(f.st, ptr, L, m);
    }
  });
  if (any_piece) {
    // Rows longer than kChunk: their piece sums are added in order, then the pieces are centralised.
    std::vector<double> mean(static_cast<size_t>(pl.total_rows), 0.0);
    for (size_t i = 0; i < pl.items.size(); ++i) {
      const RowItem& it = pl.items[i];
      if (!it.piece) continue;
      double& o = mean[pl.base[it.t] + it.row0];
      o = it.off == 0 ? part[i] : o + part[i];
    }
    for (size_t t = 0; t < nt; ++t)
      for (int64_t r = 0; r < pl.rows[t]; ++r) mean[pl.base[t] + r] /= static_cast<double>(pl.L[t]);
    for_items(static_cast<int64_t>(pl.items.size()), pl.total_elems, [&](int64_t i) {
      const RowItem& it = pl.items[i];
      if (!it.piece) return;
      const Flat& f = fg[it.t];
      sub_range(f.st, at_elem_mut(f, it.row0 * pl.L[it.t] + it.off), it.len, mean[pl.base[it.t] + it.row0]);
    });
  }
  for (auto& x : fg) finish(x);
}

// ------------------------------------------------------------------------------------- grad_stats
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> grad_stats_cpu(TensorList tensors) {
  check_cpu(tensors, "grad_stats");
  const auto fl = flats(tensors, false);
  const bool acc64 = any_double(fl);
  return stats_tensors(tensor_stats(fl, acc64), acc64);
}

}  // namespace

// ------------------------------------------------------------------ shared with the host fast path
std::vector<Stats> tensor_stats(const std::vector<Flat>& fl, bool acc64) {
  const auto items = split(fl);
  std::vector<Stats> part(items.size());
  for_items(static_cast<int64_t>(items.size()), total_numel(fl), [&](int64_t i) {
    const Item& it = items[i];
    const Flat& f = fl[it.t];
    part[i] = stats_range(f.st, acc64, at_elem(f, it.begin), it.len);
  });
  std::vector<Stats> s(fl.size());
  // Items of one tensor are consecutive; their sums of squares are added compensated, as total_from adds
  // a norm's partials, so each tensor's sum (and norm) has the norm op's bits.
  for (size_t i = 0; i < items.size();) {
    const size_t t = static_cast<size_t>(items[i].t);
    Stats& o = s[t];
    CompensatedSum sq;
    for (; i < items.size() && static_cast<size_t>(items[i].t) == t; ++i) {
      const Stats& q = part[i];
      sq.add(q.sumsq);
      o.maxabs = combine(Mode::Inf, o.maxabs, q.maxabs);
      o.nan += q.nan;
      o.inf += q.inf;
      o.zero += q.zero;
    }
    o.sumsq = sq.value();
  }
  return s;
}

double stats_total(const std::vector<Stats>& s) {
  CompensatedSum tot;  // as total_from adds the tensors' sums
  for (const auto& x : s) tot.add(x.sumsq);
  return std::sqrt(tot.value());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> stats_tensors(const std::vector<Stats>& s,
                                                                                     bool acc64) {
  const size_t nt = s.size();
  std::vector<double> norm(nt), mx(nt);
  Tensor nan = at::empty({static_cast<int64_t>(nt)}, at::TensorOptions().dtype(at::kLong));
  Tensor inf = at::empty_like(nan), zero = at::empty_like(nan);
  // data_ptr<T>() checks the dtype on every call (~20 ns): once per tensor, not per element (4,000 tensors).
  int64_t* const pnan = nan.data_ptr<int64_t>();
  int64_t* const pinf = inf.data_ptr<int64_t>();
  int64_t* const pzero = zero.data_ptr<int64_t>();
  for (size_t t = 0; t < nt; ++t) {
    norm[t] = std::sqrt(s[t].sumsq);
    mx[t] = s[t].maxabs;
    pnan[t] = s[t].nan;
    pinf[t] = s[t].inf;
    pzero[t] = s[t].zero;
  }
  return {make_1d(norm, acc64), make_1d(mx, acc64), nan, inf, zero};
}

double total_norm(const std::vector<Flat>& fl, double p, bool acc64) {
  const Mode mode = mode_for(p);
  const auto items = split(fl);
  return total_from(fl.size(), items, norm_partials(fl, items, mode, p, acc64), mode, p, nullptr);
}

void scale_flats(const std::vector<Flat>& fl, double f) {
  // Multiplying by exactly 1 changes nothing: skip the memory entirely (the "not clipping" case).
  if (f == 1.0) return;
  // float/half/bf16 tensors multiply in float, like torch's mul_ by a 0-dim tensor: a factor that rounds
  // to 1.0f leaves them unchanged.
  const bool f32_is_one = static_cast<float>(f) == 1.0f;
  std::vector<Item> items;
  int64_t total = 0;
  for (int64_t t = 0; t < static_cast<int64_t>(fl.size()); ++t) {
    if (f32_is_one && fl[t].st != at::kDouble) continue;
    for (int64_t b = 0; b < fl[t].n; b += kChunk) items.push_back({t, b, std::min(kChunk, fl[t].n - b)});
    total += fl[t].n;
  }
  const int64_t ni = static_cast<int64_t>(items.size());
  // Last item first: scale_ usually follows a norm pass over the same list, whose last-read data is
  // what is still in cache. Element-wise, so the order changes no result.
  for_items(ni, total, [&](int64_t i) {
    const Item& it = items[ni - 1 - i];
    const Flat& fv = fl[it.t];
    scale_range(fv.st, at_elem_mut(fv, it.begin), it.len, f, false);
  });
}

double clip_coef(double total, double max_norm, bool acc64) {
  // torch.clamp(max_norm / (total + 1e-6), max=1.0) on a 0-dim tensor of the accumulation dtype, op by
  // op: add, then reciprocal times max_norm (Tensor.__rtruediv__), each rounded to that dtype; the
  // Python scalars are rounded to it first. NaN passes through the clamp.
  if (acc64) {
    const double c = (1.0 / (total + 1e-6)) * max_norm;
    return std::isnan(c) || c < 1.0 ? c : 1.0;
  }
  const float d = static_cast<float>(total) + static_cast<float>(1e-6);
  const float c = (1.0f / d) * static_cast<float>(max_norm);
  return std::isnan(c) || c < 1.0f ? c : 1.0f;
}

namespace {

// fastgrad::clip_norm_ on the CPU: the same steps as the host fast path (csrc/host.cpp clip_norm_cpu) and
// as the norm, coefficient and scale_ sequence, hence the same bits.
Tensor clip_norm_op(TensorList grads, double max_norm, double p) {
  check_cpu(grads, "clip_norm_");
  auto fl = flats(grads, true);
  const bool acc64 = any_double(fl);
  const double raw = total_norm(fl, p, acc64);
  const double total = acc64 ? raw : static_cast<double>(static_cast<float>(raw));
  const double coef = clip_coef(total, max_norm, acc64);
  if (coef != 1.0) {  // not clipping: nothing written, copies of non-contiguous grads not copied back
    scale_flats(fl, coef);
    for (auto& x : fl) finish(x);
  }
  return make_0d(total, acc64 ? at::kDouble : at::kFloat);
}

// fastgrad::amp_clip_ on the CPU: amp_norm's read pass and total, clip_coef, the factor inv * coef rounded to
// the accumulation dtype (as torch multiplies two 0-dim tensors of it), then scale_'s write: the bits of
// amp_norm, the coefficient, the multiply and scale_ run one after the other.
std::tuple<Tensor, Tensor, Tensor> amp_clip_op(TensorList grads, const Tensor& inv_scale, double max_norm, double p,
                                               bool write) {
  check_cpu(grads, "amp_clip_");
  const double inv = amp_inv(inv_scale, "amp_clip_");
  auto fl = flats(grads, write);
  const bool acc64 = any_double(fl);
  const Mode mode = mode_for(p);
  const auto items = split(fl);
  bool found = false;
  const auto part = amp_partials(fl, items, mode, p, acc64, inv, &found);
  const double raw = total_from(fl.size(), items, part, mode, p, nullptr);
  const double total = acc64 ? raw : static_cast<double>(static_cast<float>(raw));
  const double coef = clip_coef(total, max_norm, acc64);
  const double factor = acc64 ? inv * coef : static_cast<double>(static_cast<float>(inv) * static_cast<float>(coef));
  if (write && factor != 1.0) {  // a factor of 1: nothing written, copies of non-contiguous grads not copied back
    scale_flats(fl, factor);
    for (auto& x : fl) finish(x);
  }
  const at::ScalarType acc = acc64 ? at::kDouble : at::kFloat;
  return {make_0d(total, acc), make_0d(found ? 1.0 : 0.0, at::kFloat), make_0d(factor, acc)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastgrad, CPU, m) {
  m.impl("norm", &norm_cpu);
  m.impl("amp_norm", &amp_norm_cpu);
  m.impl("scale_", &scale_cpu);
  m.impl("clip_norm_", &clip_norm_op);
  m.impl("amp_clip_", &amp_clip_op);
  m.impl("clip_value_", &clip_value_cpu);
  m.impl("agc_", &agc_cpu);
  m.impl("centralize_", &centralize_cpu);
  m.impl("grad_stats", &grad_stats_cpu);
}

}  // namespace cpu
}  // namespace fastgrad
