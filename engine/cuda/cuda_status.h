// Status plumbing of the CUDA backend's files (engine/cuda/cuda_*.cc): early returns of an
// absl::Status and of a CUDA runtime error as INTERNAL naming what failed.
#ifndef SPECD_ENGINE_CUDA_CUDA_STATUS_H_
#define SPECD_ENGINE_CUDA_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#define SPECD_RETURN_IF_ERROR_(expr) \
  do {                               \
    absl::Status _s = (expr);        \
    if (!_s.ok()) return _s;         \
  } while (0)

// Returns INTERNAL "cuda backend: <what>: <error name> (<error string>)" when `expr`, a
// cudaError_t, is not cudaSuccess.
#define SPECD_CUDA_RETURN_(expr, what)                                                            \
  do {                                                                                            \
    const cudaError_t _e = (expr);                                                                \
    if (_e != cudaSuccess) {                                                                      \
      return absl::InternalError(absl::StrCat("cuda backend: ", what, ": ", cudaGetErrorName(_e), \
                                              " (", cudaGetErrorString(_e), ")"));                \
    }                                                                                             \
  } while (0)

#endif  // SPECD_ENGINE_CUDA_CUDA_STATUS_H_
