// Host-side helpers of fastgrad._C for the Python layer (fastgrad/_scan.py).
//
// Every public call looks at each tensor of its list several times (collect .grad, check dtype and
// layout, group by device, build a kernel table key). In CPython each of those reads costs ~0.1 us per
// tensor per pass, which on a 4,000-tensor model is milliseconds: more than the kernels take. These
// functions do the same reads in one C++ loop. They only answer the common case (plain dense real
// floating tensors on one device); anything else returns None and the Python code, which owns the
// exact semantics and error messages, takes over.
#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu/kernels.h"

namespace {

// Bit of each dtype in a dtype mask (fastgrad/_scan.py mirrors these).
int dtype_bit(c10::ScalarType st) {
  switch (st) {
    case c10::ScalarType::Half:
      return 1;
    case c10::ScalarType::BFloat16:
      return 2;
    case c10::ScalarType::Float:
      return 4;
    case c10::ScalarType::Double:
      return 8;
    default:
      return 0;
  }
}

// The items of a list or tuple argument, borrowed for the call (PySequence_Fast gives the object itself,
// with a new reference this releases). ok() is false for any other argument: the caller answers None.
class Items {
 public:
  explicit Items(PyObject* seq)
      : fast_((PyList_Check(seq) || PyTuple_Check(seq)) ? PySequence_Fast(seq, "expected a list or tuple") : nullptr) {}
  ~Items() { Py_XDECREF(fast_); }
  Items(const Items&) = delete;
  Items& operator=(const Items&) = delete;
  bool ok() const { return fast_ != nullptr; }
  Py_ssize_t size() const { return PySequence_Fast_GET_SIZE(fast_); }
  PyObject* operator[](Py_ssize_t i) const { return PySequence_Fast_ITEMS(fast_)[i]; }

 private:
  PyObject* fast_;
};

// A plain tensor (torch.Tensor or nn.Parameter, not a subclass with its own semantics) the kernels can
// address as memory: strided, real floating, no lazy negation/conjugation bit, not nested.
const at::Tensor* plain(PyObject* o, int* bit) {
  if (!THPVariable_CheckExact(o)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(o);
  if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() || t.is_neg() || t.is_conj()) return nullptr;
  *bit = dtype_bit(t.scalar_type());
  return *bit ? &t : nullptr;
}

// grads_of(params) -> [p.grad for p in params if p.grad is not None], or None when some element is not
// a plain tensor (then Python's getattr path runs, with its warnings and subclass hooks).
PyObject* grads_of(PyObject*, PyObject* seq) {
  const Items items(seq);
  if (!items.ok()) Py_RETURN_NONE;
  for (Py_ssize_t i = 0; i < items.size(); ++i)
    if (!THPVariable_CheckExact(items[i])) Py_RETURN_NONE;
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < items.size(); ++i) {
    // The impl's grad: Tensor::grad() first asks is_leaf() (through the autograd hooks) for a warning
    // that only applies to an undefined grad, a tenth of this call's work on 4,000 tiny tensors. An
    // undefined grad still goes through Tensor::grad(), for that warning.
    const at::Tensor& t = THPVariable_Unpack(items[i]);
    const at::Tensor& own = t.unsafeGetTensorImpl()->grad();
    const at::Tensor& g = own.defined() ? own : t.grad();
    if (!g.defined()) continue;
    PyObject* w = THPVariable_Wrap(g);  // the grad's existing Python object, new reference
    if (w == nullptr || PyList_Append(out, w) < 0) {
      Py_XDECREF(w);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(w);
  }
  return out;
}

// pairs_of(params) -> ([p for p with a grad], [p.grad ...]) when every p is a plain tensor whose grad (if
// any) is a plain tensor of its shape on its device, else None (Python then names the mismatch).
PyObject* pairs_of(PyObject*, PyObject* seq) {
  const Items items(seq);
  if (!items.ok()) Py_RETURN_NONE;
  std::vector<PyObject*> ws;
  ws.reserve(static_cast<size_t>(items.size()));
  for (Py_ssize_t i = 0; i < items.size(); ++i) {
    if (!THPVariable_CheckExact(items[i])) Py_RETURN_NONE;
    const at::Tensor& w = THPVariable_Unpack(items[i]);
    const at::Tensor& g = w.grad();
    if (!g.defined()) continue;
    if (g.sizes() != w.sizes() || g.device() != w.device()) Py_RETURN_NONE;
    ws.push_back(items[i]);
  }
  PyObject* wl = PyList_New(static_cast<Py_ssize_t>(ws.size()));
  PyObject* gl = PyList_New(static_cast<Py_ssize_t>(ws.size()));
  if (wl == nullptr || gl == nullptr) {
    Py_XDECREF(wl);
    Py_XDECREF(gl);
    return nullptr;
  }
  for (size_t i = 0; i < ws.size(); ++i) {
    Py_INCREF(ws[i]);
    PyList_SET_ITEM(wl, static_cast<Py_ssize_t>(i), ws[i]);
    PyObject* g = THPVariable_Wrap(THPVariable_Unpack(ws[i]).grad());
    if (g == nullptr) {
      Py_DECREF(wl);  // the unset slots of gl are NULL, which list dealloc skips
      Py_DECREF(gl);
      return nullptr;
    }
    PyList_SET_ITEM(gl, static_cast<Py_ssize_t>(i), g);
  }
  return Py_BuildValue("(NN)", wl, gl);
}

// scan(tensors) -> (device, dtype_mask, all_contiguous) for a non-empty list or tuple of plain tensors on
// one device, else None.
PyObject* scan(PyObject*, PyObject* seq) {
  const Items items(seq);
  if (!items.ok() || items.size() == 0) Py_RETURN_NONE;
  int mask = 0;
  bool contiguous = true;
  c10::Device device(c10::kCPU);
  for (Py_ssize_t i = 0; i < items.size(); ++i) {
    int bit = 0;
    const at::Tensor* t = plain(items[i], &bit);
    if (t == nullptr || (i > 0 && t->device() != device)) Py_RETURN_NONE;
    if (i == 0) device = t->device();
    mask |= bit;
    contiguous = contiguous && t->is_contiguous();
  }
  PyObject* dev = THPDevice_New(device);
  if (dev == nullptr) return nullptr;
  return Py_BuildValue("(NiO)", dev, mask, contiguous ? Py_True : Py_False);
}

// plan_key(tensors) -> bytes of (data_ptr, numel, dtype) per tensor: the identity of a kernel table
// (fastgrad/triton_kernels/multi_tensor.py). None unless every element is a plain tensor.
PyObject* plan_key(PyObject*, PyObject* seq) {
  const Items items(seq);
  if (!items.ok()) Py_RETURN_NONE;
  std::vector<int64_t> key(static_cast<size_t>(items.size()) * 3);
  for (Py_ssize_t i = 0; i < items.size(); ++i) {
    int bit = 0;
    const at::Tensor* t = plain(items[i], &bit);
    if (t == nullptr) Py_RETURN_NONE;
    key[3 * i] = reinterpret_cast<int64_t>(t->data_ptr());
    key[3 * i + 1] = t->numel();
    key[3 * i + 2] = bit;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(key.data()),
                                   static_cast<Py_ssize_t>(key.size() * sizeof(int64_t)));
}

// The dispatch keys of an ordinary CPU tensor outside inference mode, in this torch build. A tensor with
// exactly these keys is dense CPU memory with no wrapper, subclass, lazy conj/neg bit or inference flag.
c10::DispatchKeySet plain_cpu_keys() {
  static const c10::DispatchKeySet keys = [] {
    c10::InferenceMode normal(false);
    return at::empty({0}).key_set();
  }();
  return keys;
}

// No mode, transform or tracer that would want to see the ops of a call: then running the kernels
// directly is the same as dispatching them.
bool plain_context() {
  return c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !at::impl::torch_function_mode_enabled() &&
         c10::impl::tls_local_dispatch_key_set().included_ == c10::default_included_set;
}

class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  ~GilRelease() { PyEval_RestoreThread(state_); }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

// Lines [p, p + bytes) towards the cache, for a read a few statements later (a hint: no fault, no effect on
// results).
inline void prefetch(const void* p, int bytes = 64) {
  for (int o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o);
}

// A dense CPU tensor of the four floating dtypes with nothing but the plain CPU dispatch keys, as a flat view
// whose ptr is still the tensor itself (its data pointer is read once the call is sure to go on: data_ptr()
// may materialize a copy-on-write storage), its dtype's bit added to *mask. False (nothing set) otherwise.
inline bool plain_flat(const at::Tensor& t, c10::DispatchKeySet keys, fastgrad::cpu::Flat* f, int* mask) {
  const int bit = dtype_bit(t.scalar_type());
  if (bit == 0 || t.key_set() != keys || !t.is_non_overlapping_and_dense()) return false;
  *mask |= bit;
  f->ptr = const_cast<at::Tensor*>(&t);
  f->n = t.numel();
  f->st = t.scalar_type();
  return true;
}

// The grads of the params `items` as flat views of their memory, with their dtype mask. No tensor handles:
// the grads are alive for the call and processed in place. False (the caller answers None, nothing done)
// unless every item is a plain tensor whose grad is a dense CPU tensor of the four floating dtypes; a param
// without grad is skipped, or with `all` also answers false.
//
// Each grad is reached through a chain of objects (param TensorImpl -> AutogradMeta -> grad TensorImpl ->
// StorageImpl -> data) that backward() allocated anew since the last call (set_to_none): each link a cache
// miss, and one tensor's misses can only come one after another. Walked tensor by tensor, 4,000 one-element
// grads spent most of the call waiting on those misses. So the walk goes one link at a time over the whole
// list, prefetching the next link of every tensor: the misses of different tensors overlap. Checks and
// their order (the first failing tensor decides, Tensor::grad()'s warning for a missing grad comes in list
// order) are as in a tensor-by-tensor loop.
//
// Kept over a software-pipelined and a blocked walk, which were slower at the list sizes models have
// (benchmarks/results/host-cpu/README.md).
bool cpu_grads(const Items& items, bool all, std::vector<fastgrad::cpu::Flat>* fl, int* mask) {
  const c10::DispatchKeySet keys = plain_cpu_keys();
  const Py_ssize_t n = items.size();
  std::vector<c10::TensorImpl*> impl(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_CheckExact(items[i])) return false;
    impl[i] = THPVariable_Unpack(items[i]).unsafeGetTensorImpl();
    prefetch(impl[i], 256);
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    const auto* meta = impl[i]->autograd_meta();
    if (meta != nullptr) prefetch(meta, 128);
  }
  // The impl's grad: Tensor::grad() first asks is_leaf() (through the autograd hooks) for a warning that
  // only applies to an undefined grad, a tenth of this call's work on 4,000 tiny tensors. An undefined grad
  // still goes through Tensor::grad() (below, in list order), for that warning.
  std::vector<const at::Tensor*> grad(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor& own = impl[i]->grad();
    grad[i] = own.defined() ? &own : nullptr;
    if (grad[i] != nullptr) prefetch(own.unsafeGetTensorImpl(), 256);
  }
  fl->reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor* g = grad[i];
    if (g == nullptr) {
      const at::Tensor& t = THPVariable_Unpack(items[i]).grad();
      if (!t.defined()) {
        if (all) return false;
        continue;
      }
      g = &t;
    }
    fastgrad::cpu::Flat f;
    if (!plain_flat(*g, keys, &f, mask)) return false;
    prefetch(g->unsafeGetTensorImpl()->storage().unsafeGetStorageImpl());
    fl->push_back(f);  // f.ptr: the grad itself until the next loop reads its data pointer
  }
  // The data pointers (StorageImpl, now in cache), and the first line of each grad's data for the kernels.
  for (auto& f : *fl) {
    f.ptr = static_cast<at::Tensor*>(f.ptr)->data_ptr();
    __builtin_prefetch(f.ptr);
  }
  return true;
}

// clip_grad_norm_ from the total norm `raw` (before rounding to the accumulation dtype): the coefficient and the
// scale pass (skipped at a coefficient of 1; nothing written when `check` and the total is not finite, and then
// *nonfinite is set). Returns the total as a 0-dim tensor of the accumulation dtype. Runs without the GIL.
at::Tensor clip_by_total(const std::vector<fastgrad::cpu::Flat>& fl, double raw, double max_norm, bool check,
                         bool acc64, bool* nonfinite) {
  const double total = acc64 ? raw : static_cast<double>(static_cast<float>(raw));
  const bool bad = !std::isfinite(total);
  if (!(check && bad)) fastgrad::cpu::scale_flats(fl, fastgrad::cpu::clip_coef(total, max_norm, acc64));
  *nonfinite = bad && check;
  at::Tensor out = at::empty({}, at::TensorOptions().dtype(acc64 ? at::kDouble : at::kFloat));
  if (acc64)
    *out.data_ptr<double>() = total;
  else
    *out.data_ptr<float>() = static_cast<float>(total);
  return out;
}

// clip_norm_cpu(params, max_norm, norm_type, error_if_nonfinite) -> (total, nonfinite) or None.
//
// The whole of clip_grad_norm_ on the cpu backend in one call for the common case: plain params whose
// grads are dense CPU tensors of the four floating dtypes. It runs the cpu backend's norm, the clip
// coefficient and the scale pass (skipped when the coefficient is 1) through the same functions as the
// fastgrad::norm and fastgrad::scale_ ops (csrc/cpu/ops.cpp), so the bits are the same as the op-by-op
// path; what it saves is two dispatcher calls (each converts the whole list to IValues and back), the
// .grad list, the scan and the coefficient's three tensor ops. `total` is the norm in the grads'
// promoted dtype, as clip_grad_norm_ returns it. With error_if_nonfinite and a non-finite norm nothing
// is written and `nonfinite` is True (Python raises). None (nothing done) for anything else: no grads,
// another layout, device or dtype, a non-dense grad, a subclass or a dispatch/function mode.
PyObject* clip_norm_cpu(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* seq = nullptr;
  double max_norm = 0.0, p = 2.0;
  int check = 0;
  if (!PyArg_ParseTuple(args, "Oddp", &seq, &max_norm, &p, &check)) return nullptr;
  if (!plain_context()) Py_RETURN_NONE;
  const Items items(seq);
  std::vector<fastgrad::cpu::Flat> fl;
  int mask = 0;
  if (!items.ok() || !cpu_grads(items, false, &fl, &mask) || fl.empty()) Py_RETURN_NONE;
  const bool acc64 = (mask & dtype_bit(c10::ScalarType::Double)) != 0;
  bool nonfinite = false;
  at::Tensor out;
  {
    GilRelease nogil;
    out = clip_by_total(fl, fastgrad::cpu::total_norm(fl, p, acc64), max_norm, check, acc64, &nonfinite);
    // The promoted dtype, as Tensor.to rounds the accumulation dtype's value.
    if (mask == dtype_bit(c10::ScalarType::Half)) out = out.to(at::kHalf);  // all fp16
    if (mask == dtype_bit(c10::ScalarType::BFloat16)) out = out.to(at::kBFloat16);  // all bf16
  }
  return Py_BuildValue("(NO)", THPVariable_Wrap(std::move(out)), nonfinite ? Py_True : Py_False);
  END_HANDLE_TH_ERRORS
}

// monitor_clip_cpu(params, max_norm, error_if_nonfinite) -> (total, nonfinite, dtype_mask, norm, max_abs, nan,
// inf, zero) or None. `total` is in the accumulation dtype (the monitor records it; Python converts the
// returned norm to the grads' promoted dtype, which the mask gives).
//
// GradientMonitor.clip_grad_norm_ (L2) on the cpu backend in one call and one read: clip_norm_cpu's work with
// the grad_stats pass (fastgrad::grad_stats' kernels) in place of the norm pass. Its per-tensor sums are the
// norm kernel's bit for bit and are added the same way, so `total` and the clipped gradients are exactly
// clip_norm_cpu's. The statistics columns are grad_stats' (before clipping). Every param must have a plain
// dense CPU grad, else None (nothing done: the monitor's general path runs).
PyObject* monitor_clip_cpu(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* seq = nullptr;
  double max_norm = 0.0;
  int check = 0;
  if (!PyArg_ParseTuple(args, "Odp", &seq, &max_norm, &check)) return nullptr;
  if (!plain_context()) Py_RETURN_NONE;
  const Items items(seq);
  std::vector<fastgrad::cpu::Flat> fl;
  int mask = 0;
  if (!items.ok() || !cpu_grads(items, true, &fl, &mask) || fl.empty()) Py_RETURN_NONE;
  const bool acc64 = (mask & dtype_bit(c10::ScalarType::Double)) != 0;
  bool nonfinite = false;
  at::Tensor out, norm, mx, nan, inf, zero;
  {
    GilRelease nogil;
    const auto st = fastgrad::cpu::tensor_stats(fl, acc64);
    out = clip_by_total(fl, fastgrad::cpu::stats_total(st), max_norm, check, acc64, &nonfinite);
    std::tie(norm, mx, nan, inf, zero) = fastgrad::cpu::stats_tensors(st, acc64);
  }
  return Py_BuildValue("(NOiNNNNN)", THPVariable_Wrap(std::move(out)), nonfinite ? Py_True : Py_False, mask,
                       THPVariable_Wrap(std::move(norm)), THPVariable_Wrap(std::move(mx)),
                       THPVariable_Wrap(std::move(nan)), THPVariable_Wrap(std::move(inf)),
                       THPVariable_Wrap(std::move(zero)));
  END_HANDLE_TH_ERRORS
}

// ------------------------------------------------------------------------------ sharded gradients (DTensor)
// The local shards of a sharded clip (fastgrad/distributed/layout.py local_cpu_norm), kept between the norm and the
// scale: their flat views, valid as long as `keep` (a tuple of the local tensors' Python objects, owned here)
// holds the tensors, whatever Python does in between. Python references, not at::Tensor copies: a tensor with
// a Python object counts its C++ references through the interpreter (a virtual call each way), which on
// thousands of shards cost more than the whole pass.
struct LocalFlats {
  std::vector<fastgrad::cpu::Flat> fl;
  PyObject* keep = nullptr;
  ~LocalFlats() { Py_XDECREF(keep); }  // (capsule destructors run with the GIL)
};

constexpr const char* kLocalFlats = "fastgrad.local_flats";

void free_local_flats(PyObject* capsule) {
  delete static_cast<LocalFlats*>(PyCapsule_GetPointer(capsule, kLocalFlats));
}

// obj's slot through its member descriptor (DTensor's __slots__), a new reference; nullptr (no error set)
// when the slot is empty.
PyObject* slot(PyObject* desc, PyObject* obj, PyObject* cls) {
  PyObject* v = Py_TYPE(desc)->tp_descr_get(desc, obj, cls);
  if (v == nullptr) PyErr_Clear();
  return v;
}

// dtensor_local_norm(params, cls, spec_desc, local_desc, specs, counted, norm_type)
//   -> (locals, dtype_mask, contiguous, local_total, handle) or None.
//
// The per-tensor host work of a sharded clip_grad_norm_ on DTensor gradients whose local shards are plain dense
// CPU tensors, in one C++ pass with no dispatcher call: each parameter's .grad (read from its TensorImpl, as
// Python's getter does for a DTensor, whose __torch_function__ is disabled), the grad's spec (checked against
// the cached layout: the same objects, in order, as many as the layout has), its local tensor, and the norm of
// the local tensors this rank counts (counted[k]: the layout's per-DTensor decision; an empty shard adds
// nothing) by the same function as the norm op (csrc/cpu/ops.cpp), so the same bits. `params` must all be
// exactly `cls` (DTensor); a parameter without grad is skipped. `local_total`: a 0-dim tensor in the
// accumulation dtype of all the local tensors (float64 if any is float64, else float32), None when this rank
// counts none. `handle`: for dtensor_local_scale. None (nothing done, nothing read but the list) for anything
// else: another type, a grad with another spec object, a different number of grads, a local tensor that is
// not a plain dense CPU tensor of the four floating dtypes, a dispatch or function mode.
PyObject* dtensor_local_norm(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *seq = nullptr, *cls = nullptr, *spec_desc = nullptr, *local_desc = nullptr, *spec_seq = nullptr,
           *counted_seq = nullptr;
  double p = 2.0;
  if (!PyArg_ParseTuple(args, "OOOOOOd", &seq, &cls, &spec_desc, &local_desc, &spec_seq, &counted_seq, &p))
    return nullptr;
  if (!PyType_Check(cls) || Py_TYPE(spec_desc)->tp_descr_get == nullptr ||
      Py_TYPE(local_desc)->tp_descr_get == nullptr)
    Py_RETURN_NONE;
  if (!plain_context()) Py_RETURN_NONE;
  const Items items(seq), specs(spec_seq), counted(counted_seq);
  if (!items.ok() || !specs.ok() || !counted.ok() || counted.size() != specs.size()) Py_RETURN_NONE;
  const c10::DispatchKeySet keys = plain_cpu_keys();
  const Py_ssize_t ns = specs.size();
  auto hold = std::make_unique<LocalFlats>();
  hold->fl.reserve(static_cast<size_t>(ns));
  std::vector<char> counts(static_cast<size_t>(ns));
  PyObject* locals = PyList_New(ns);
  if (locals == nullptr) return nullptr;
  auto decline = [&]() {
    Py_DECREF(locals);  // unset slots are NULL, which list dealloc skips
    Py_RETURN_NONE;
  };
  int mask = 0;
  bool contiguous = true;
  Py_ssize_t k = 0;
  for (Py_ssize_t i = 0; i < items.size(); ++i) {
    PyObject* o = items[i];
    if (reinterpret_cast<PyObject*>(Py_TYPE(o)) != cls) return decline();
    const at::Tensor& param = THPVariable_Unpack(o);
    // The impl's grad, as in cpu_grads; an undefined one goes through Tensor::grad() for its warning.
    const at::Tensor& own = param.unsafeGetTensorImpl()->grad();
    const at::Tensor& g = own.defined() ? own : param.grad();
    if (!g.defined()) continue;
    if (k == ns) return decline();
    // The grad's own Python object (a DTensor always has one), borrowed: alive as long as the grad, which
    // the param holds. Not THPVariable_Wrap: a new reference to a tensor subclass's object, dropped again,
    // goes through its dealloc/preservation path, several times this whole pass. (PyObjectSlot::load_pyobj:
    // in torch 2.11's and 2.13's headers alike.)
    PyObject* go = g.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
    if (go == nullptr || reinterpret_cast<PyObject*>(Py_TYPE(go)) != cls) return decline();
    PyObject* spec = slot(spec_desc, go, cls);
    const bool same = spec != nullptr && spec == specs[k];
    Py_XDECREF(spec);
    PyObject* loc = same ? slot(local_desc, go, cls) : nullptr;
    if (loc == nullptr) return decline();
    PyList_SET_ITEM(locals, k, loc);  // the list owns it now
    if (!THPVariable_CheckExact(loc)) return decline();
    const at::Tensor& t = THPVariable_Unpack(loc);
    fastgrad::cpu::Flat f;  // f.ptr: the tensor until its data pointer is read (below)
    if (!plain_flat(t, keys, &f, &mask)) return decline();
    contiguous = contiguous && t.is_contiguous();
    const int c = PyObject_IsTrue(counted[k]);
    if (c < 0) {
      Py_DECREF(locals);
      return nullptr;
    }
    counts[k] = c == 1 && f.n > 0;
    hold->fl.push_back(std::move(f));
    ++k;
  }
  if (k != ns || ns == 0) return decline();
  // Data pointers only now that the call goes on (data_ptr() may materialize a copy-on-write storage).
  std::vector<fastgrad::cpu::Flat> mine;  // what this rank counts: pointers only
  for (size_t j = 0; j < hold->fl.size(); ++j) {
    auto& f = hold->fl[j];
    f.ptr = static_cast<at::Tensor*>(f.ptr)->data_ptr();
    if (counts[j]) {
      fastgrad::cpu::Flat m;
      m.ptr = f.ptr;
      m.n = f.n;
      m.st = f.st;
      mine.push_back(m);
    }
  }
  const bool acc64 = (mask & dtype_bit(c10::ScalarType::Double)) != 0;
  PyObject* total = nullptr;
  if (mine.empty()) {
    Py_INCREF(Py_None);
    total = Py_None;
  } else {
    at::Tensor out = at::empty({}, at::TensorOptions().dtype(acc64 ? at::kDouble : at::kFloat));
    {
      GilRelease nogil;
      const double raw = fastgrad::cpu::total_norm(mine, p, acc64);
      if (acc64)
        *out.data_ptr<double>() = raw;
      else
        *out.data_ptr<float>() = static_cast<float>(raw);  // the norm op's 0-dim result (make_0d)
    }
    total = THPVariable_Wrap(std::move(out));
    if (total == nullptr) {
      Py_DECREF(locals);
      return nullptr;
    }
  }
  hold->keep = PyList_AsTuple(locals);
  PyObject* handle = hold->keep == nullptr ? nullptr : PyCapsule_New(hold.get(), kLocalFlats, free_local_flats);
  if (handle == nullptr) {
    Py_DECREF(locals);
    Py_DECREF(total);
    return nullptr;
  }
  hold.release();
  return Py_BuildValue("(NiONN)", locals, mask, contiguous ? Py_True : Py_False, total, handle);
  END_HANDLE_TH_ERRORS
}

// dtensor_local_scale(handle, factor) -> None: the scale_ op's work (scale_flats: nothing written when the
// factor is 1) on the local tensors of a dtensor_local_norm call, by the one-element CPU tensor `factor`;
// the handle is spent (a second call raises).
PyObject* dtensor_local_scale(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *handle = nullptr, *factor = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &handle, &factor)) return nullptr;
  auto* hold = static_cast<LocalFlats*>(PyCapsule_GetPointer(handle, kLocalFlats));
  if (hold == nullptr) return nullptr;  // not such a handle: the capsule API set the error
  if (!THPVariable_Check(factor)) {
    PyErr_SetString(PyExc_TypeError, "dtensor_local_scale: factor must be a tensor");
    return nullptr;
  }
  const at::Tensor& f = THPVariable_Unpack(factor);
  if (!f.device().is_cpu()) fastgrad::wrong_device("dtensor_local_scale", "factor", -1, f.device(), "cpu");
  TORCH_CHECK(f.numel() == 1, "fastgrad::dtensor_local_scale: factor must have one element, got ", f.numel());
  const double x = f.item<double>();
  TORCH_CHECK(hold->keep != nullptr, "dtensor_local_scale: this handle was already used");
  {
    GilRelease nogil;
    fastgrad::cpu::scale_flats(hold->fl, x);
  }
  hold->fl.clear();
  Py_CLEAR(hold->keep);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"dtensor_local_norm", dtensor_local_norm, METH_VARARGS,
     "The local pass of a sharded clip on DTensor grads with plain CPU shards: (locals, dtype_mask, contiguous, "
     "local_total, handle), or None."},
    {"dtensor_local_scale", dtensor_local_scale, METH_VARARGS,
     "Scale the local tensors of a dtensor_local_norm call by a one-element CPU tensor (once per handle)."},
    {"grads_of", grads_of, METH_O, "[p.grad for p in params if p.grad is not None], or None (not plain tensors)."},
    {"pairs_of", pairs_of, METH_O, "(params with a grad, their grads) when shapes and devices match, or None."},
    {"scan", scan, METH_O, "(device, dtype_mask, all_contiguous) of a list of plain tensors on one device, or None."},
    {"plan_key", plan_key, METH_O, "bytes of (data_ptr, numel, dtype) per tensor, or None."},
    {"clip_norm_cpu", clip_norm_cpu, METH_VARARGS,
     "clip_grad_norm_ on the cpu backend for plain dense CPU grads: (total, nonfinite), or None."},
    {"monitor_clip_cpu", monitor_clip_cpu, METH_VARARGS,
     "GradientMonitor.clip_grad_norm_ (L2) on the cpu backend, one read: (total, nonfinite, mask, stats), "
     "or None."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

namespace fastgrad {
PyMethodDef* host_methods() { return methods; }
}  // namespace fastgrad
