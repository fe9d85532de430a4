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

// A buffer that no kernel reads again once the kernel given it runs: [rows, row_bytes] bytes,
// device, or null. That kernel drops its lines from L2 without writing them back (PTX
// `discard.global.L2`; only 128-byte lines wholly inside a row). Why: a verify step's
// intermediates (tens of MB a layer at 65 rows) sit dirty in L2 until the next GEMM's weight
// stream evicts them, and their write-back then takes HBM bandwidth from that GEMM. The caller
// promises that nothing reads the rows before they are written again: their contents become
// indeterminate.
struct DeadRows {
  const void* ptr = nullptr;
  int64_t row_bytes = 0;
};

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_COMMON_H_
