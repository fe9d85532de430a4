// RMSNorm with a fused residual add on the GPU (the CPU reference is specd/kernels/rmsnorm.h
// RmsNormCpu): out = h / sqrt(mean(h^2) + eps) * weight, where h = x, or, with a residual
// stream, h = residual = x + residual. The residual stream stays fp32 across layers so that
// summing dozens of sublayer outputs does not round to bf16 at every step; only the normalised
// output, the next GEMM's input, is bf16. The weight is fp32, as the checkpoint gives it (as
// llama.cpp keeps norm vectors F32 in every format): a vector of `dim` floats costs nothing, and
// rounding an fp32 checkpoint's norm weights to bf16 was a visible part of the bf16 backend's
// error against fp32 (tools/oracle/bf16_emulate.py).
#ifndef SPECD_KERNELS_CUDA_RMSNORM_H_
#define SPECD_KERNELS_CUDA_RMSNORM_H_

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

struct RmsNormParams {
  const bf16* x = nullptr;  // [rows, dim] bf16, device (a sublayer's output, or the embedding)
  // Instead of x (which is then null): [num_partials, rows, dim] fp32, device, the slabs of a
  // K-split GEMM (GemmParams::k_splits); the input row is their sum, added in slab order in
  // fp32. So the sublayer's output reaches the fp32 residual stream without a rounding to bf16
  // and without a reduction launch of its own.
  const float* partials = nullptr;
  int num_partials = 0;
  // [rows, dim] fp32, device, or null (plain norm of x). When set it is updated in place to
  // x + residual, or set to x when residual_init (the first layer), and the norm is taken of it.
  float* residual = nullptr;
  bool residual_init = false;
  const float* weight = nullptr;  // [dim] fp32, device
  bf16* out = nullptr;            // [rows, dim] bf16, device; may alias x
  int64_t rows = 0;
  int64_t dim = 0;
  float eps = 1e-5f;
  // With a residual: drop the partials' lines of the row from L2 once it is read (they are dead
  // after this kernel; DeadRows in common.h says why).
  bool discard_partials = false;
  // Up to two buffers whose row r block r drops from L2 (the previous GEMMs' inputs, say).
  DeadRows dead[2];
};

cudaError_t RmsNormCuda(const RmsNormParams& p, cudaStream_t stream);

// The residual update of RmsNormCuda without the norm, for models whose next GEMM reads the
// stream itself (an EAGLE-1/2 head: its first layer reads fc's output, bias added, with no input
// norm, and its LM head reads the last layer's output unnormalised): residual = x + residual (x
// alone when residual_init), plus bias per column when given, in fp32; and out = the updated
// stream rounded to bf16.
struct ResidualAddParams {
  const bf16* x = nullptr;      // [rows, dim] bf16, device, or null (nothing to add)
  float* residual = nullptr;    // [rows, dim] fp32, device, updated in place
  bool residual_init = false;   // with x: the stream becomes x (without x: unused)
  const float* bias = nullptr;  // [dim] fp32, device, or null
  bf16* out = nullptr;          // [rows, dim] bf16, device, or null (only the stream is wanted)
  int64_t rows = 0;
  int64_t dim = 0;
};

cudaError_t ResidualAddCuda(const ResidualAddParams& p, cudaStream_t stream);

// A norm's bf16 output widened to fp32 into a strided buffer: the final norm's output exported as
// an EAGLE tap (FinalNormTap, an EAGLE-1/2 head's feature) is the bf16 row the LM head reads,
// each value exactly, in the fp32 columns of the step's tap buffer.
struct Bf16ToF32Params {
  const bf16* src = nullptr;  // [rows, src_stride] bf16, device; the first `dim` of each row
  int64_t src_stride = 0;     // elements
  float* dst = nullptr;       // [rows, dst_stride] fp32, device; the first `dim` of each row
  int64_t dst_stride = 0;     // elements
  int64_t rows = 0;
  int64_t dim = 0;
};

cudaError_t Bf16ToF32Cuda(const Bf16ToF32Params& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_RMSNORM_H_
