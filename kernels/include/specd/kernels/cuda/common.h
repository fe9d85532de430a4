// Definitions shared by the CUDA kernels' launchers (kernels/cuda/*.cu).
//
// Conventions. Each op has one launcher, `<Op>Cuda(const <Op>Params&, cudaStream_t)`, that
// enqueues its kernels on the stream and returns at once. It returns cudaErrorInvalidValue when
// the params break a documented precondition (a programmer error: the backend validates user
// input before it reaches a kernel), else the launch's own status. Pointers in params are device
// pointers unless a comment says otherwise. bf16 tensors are `__nv_bfloat16`; the math inside the
// kernels is fp32 (fp64 where the CPU reference needs bit-exact decisions, as in sampling).
#ifndef SPECD_KERNELS_CUDA_COMMON_H_
#define SPECD_KERNELS_CUDA_COMMON_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace specd {
namespace cuda {

using bf16 = __nv_bfloat16;

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_COMMON_H_
