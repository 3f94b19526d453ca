// Schemas of the fastgrad ops and the Python module fastgrad._C.
//
// Importing fastgrad._C runs the static registrations below (and the CPU/CUDA kernels' own
// TORCH_LIBRARY_IMPL blocks); the module itself only exposes what was compiled in. Fake (meta)
// implementations live in fastgrad/_ext.py.
#include <Python.h>
#include <torch/library.h>

#ifndef FASTGRAD_WITH_CUDA
#define FASTGRAD_WITH_CUDA 0
#endif
// Archs the CUDA kernels were built for, as one token each ("80_86_90", "none"): setup.py passes them,
// fastgrad/_archs.py reads them back from fastgrad._C.cuda_sass / cuda_ptx.
#ifndef FASTGRAD_CUDA_SASS
#define FASTGRAD_CUDA_SASS none
#endif
#ifndef FASTGRAD_CUDA_PTX
#define FASTGRAD_CUDA_PTX none
#endif
#define FASTGRAD_STR2(x) #x
#define FASTGRAD_STR(x) FASTGRAD_STR2(x)

TORCH_LIBRARY(fastgrad, m) {
  // (total, per-tensor) p-norms in the accumulation dtype (float64 if any input is float64, else float32).
  m.def("norm(Tensor[] tensors, float norm_type) -> (Tensor, Tensor)");
  // (norm of T(x * inv_scale), found_inf as 0-dim float32 1.0/0.0 over the stored values).
  m.def("amp_norm(Tensor[] tensors, Tensor inv_scale, float norm_type) -> (Tensor, Tensor)");
  // x = T(x * factor); no memory touched when factor == 1.
  m.def("scale_(Tensor(a!)[] tensors, Tensor factor) -> ()");
  // clip_grad_norm_ on one device: total = norm(grads) (its bits), coef = min(max_norm / (total + 1e-6), 1)
  // computed as torch computes that expression in the accumulation dtype, grads scaled as scale_ does (not
  // touched when coef == 1). Returns the total (accumulation dtype); the coefficient never leaves the device.
  m.def("clip_norm_(Tensor(a!)[] grads, float max_norm, float norm_type) -> Tensor");
  // scaler_unscale_and_clip on one device: (total, found_inf) = amp_norm(grads, inv_scale) (its bits), factor =
  // inv_scale * coef in the accumulation dtype, coef computed as clip_norm_ computes it, then (if write) grads
  // scaled as scale_ does (not touched when factor == 1). Returns (total, found_inf, factor).
  m.def("amp_clip_(Tensor(a!)[] grads, Tensor inv_scale, float max_norm, float norm_type, bool write) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("clip_value_(Tensor(a!)[] tensors, float clip_value) -> ()");
  m.def("agc_(Tensor[] params, Tensor(a!)[] grads, float clip_factor, float eps, float norm_type) -> ()");
  m.def("centralize_(Tensor(a!)[] grads) -> ()");
  // (L2 norm, max |x|, #NaN, #Inf, #zeros) per tensor.
  m.def("grad_stats(Tensor[] tensors) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // exact=True (fastgrad/exact.py): normalised base-2^32 digits (int64, limb k weighs 2^(base + 32 k)) of the exact
  // sum of |x|^p, p = 1 or 2, per tensor (T, nlimbs) or for the list (1, nlimbs), and (NaN, inf) counts alike.
  m.def("exact_limbs(Tensor[] tensors, int p, int base, int nlimbs, bool per_tensor) -> (Tensor, Tensor)");
  // The list's exact norm rounded to dtypes a and b, decided from a float64 sum with an error bound when that
  // suffices (then the digits are (0, nlimbs)); else the values are zeros and exact_limbs' (1, nlimbs) digits
  // and flags come back for the rounding in fastgrad/exact.py.
  m.def("exact_total(Tensor[] tensors, int p, int base, int nlimbs, ScalarType a, ScalarType b) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
}

namespace fastgrad {
PyMethodDef* host_methods();  // csrc/host.cpp: one-pass list scans for the Python layer
}  // namespace fastgrad

namespace {
PyModuleDef fastgrad_module = {PyModuleDef_HEAD_INIT, "fastgrad._C",
                               "Compiled kernels of fastgrad (ops under torch.ops.fastgrad) and host helpers.", -1,
                               fastgrad::host_methods()};
}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&fastgrad_module);
  if (m == nullptr) return nullptr;
  if (PyModule_AddIntConstant(m, "has_cpu", 1) < 0 || PyModule_AddIntConstant(m, "has_cuda", FASTGRAD_WITH_CUDA) < 0 ||
      PyModule_AddStringConstant(m, "cuda_sass", FASTGRAD_STR(FASTGRAD_CUDA_SASS)) < 0 ||
      PyModule_AddStringConstant(m, "cuda_ptx", FASTGRAD_STR(FASTGRAD_CUDA_PTX)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
