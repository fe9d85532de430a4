// The gated activation of Llama-family MLPs on the GPU: out = silu(gate) * up (the CPU
// reference is specd/kernels/swiglu.h SwiGluCpu). Gate and up come from one fused GEMM whose
// weight stacks gate_proj over up_proj, so each row holds the gate then the up projection.
#ifndef SPECD_KERNELS_CUDA_SWIGLU_H_
#define SPECD_KERNELS_CUDA_SWIGLU_H_

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

struct SwiGluParams {
  // [rows, 2 * dim] bf16, device: row r's gate in columns [0, dim), its up in [dim, 2 * dim).
  const bf16* gate_up = nullptr;
  bf16* out = nullptr;  // [rows, dim] bf16, device
  int64_t rows = 0;
  int64_t dim = 0;  // intermediate size
  // Drop gate_up's lines from L2 once read (it is dead after this kernel; DeadRows in common.h
  // says why). Lines are dropped by the warp that read them, where dim % 8 == 0.
  bool discard_gate_up = false;
  // A buffer whose rows [0, rows) are dropped too (the gate_up GEMM's input, say).
  DeadRows dead;
};

cudaError_t SwiGluCuda(const SwiGluParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_SWIGLU_H_
