// Linear layer y = x W^T (+ bias) with W in Hugging Face [out_features, in_features] layout, fp32.
//
// Batch invariance by construction. Speculative decoding is lossless only if a token's logits do
// not depend on how many other rows share its GEMM (a tree node verified in a batch vs. the same
// token decoded alone). BLAS sgemm does not promise that (its M-tail micro-kernels and thread
// split depend on M), so LinearCpu is its own kernel in which every output y[r, j] is computed by
// one fixed sequence of operations that depends only on k: one L-lane accumulator over k in
// order (one FMA per L elements, the k tail as one more FMA with zero-filled lanes), one fixed
// horizontal reduction tree, then + bias[j]. Row and column tiles exist only for register reuse;
// every tile size (the remainder tiles too) runs that same per-output arithmetic with explicit
// FMA intrinsics, so neither the batch size, a row's position, the column split over threads nor
// the blocking can change a bit.
//
// Instruction set. The lane count (and so the bits) depends on the ISA: AVX-512 (16 lanes), AVX2
// + FMA (8 lanes), or a portable scalar path that emulates the 8-lane arithmetic exactly (the
// same bits as AVX2). The process picks the widest its CPU supports once (LinearCpuIsa()), so all
// GEMMs of a process agree.
//
// Cost: each column tile of W (a few weight rows, in L1) is read once per chunk of rows (the
// chunk's x held in L2), so a call reads the weights once for up to hundreds of rows, instead of
// once per block of rows as a row-blocked sgemm does.
#ifndef SPECD_KERNELS_LINEAR_H_
#define SPECD_KERNELS_LINEAR_H_

#include <stdint.h>

namespace specd {

struct LinearParams {
  const float* x = nullptr;  // [rows, in_features] fp32, host
  const float* w = nullptr;  // [out_features, in_features] fp32, host
  // The same matrix as bf16 bit patterns ([out_features, in_features] uint16, host), read
  // instead of w when set. Widening bf16 to fp32 is exact, so this gives w's bits for the
  // matrix whose fp32 values these are: half the bytes a call streams, for the same result.
  const uint16_t* w_bf16 = nullptr;
  const float* bias = nullptr;  // [out_features] fp32, host, or null
  float* y = nullptr;           // [rows, out_features] fp32, host; must not alias x
  int64_t rows = 0;
  int64_t in_features = 0;
  int64_t out_features = 0;
};

enum class LinearIsa { kScalar, kAvx2, kAvx512 };

// The ISA every LinearCpu call of this process uses: chosen on first use, then fixed.
LinearIsa LinearCpuIsa();
// Whether this CPU (and OS) can run `isa`.
bool LinearIsaSupported(LinearIsa isa);
const char* LinearIsaName(LinearIsa isa);

// Batch-invariant: row r of y depends only on row r of x (bit for bit), whatever `rows` is.
void LinearCpu(const LinearParams& p);
// Only the output columns [col_begin, col_end) of every row: the same bits as LinearCpu's, so
// threads may split the columns any way (0 <= col_begin <= col_end <= out_features).
void LinearCpuColumns(const LinearParams& p, int64_t col_begin, int64_t col_end);
// LinearCpuColumns with a given ISA, which must be supported (tests compare the paths).
void LinearCpuColumnsIsa(const LinearParams& p, int64_t col_begin, int64_t col_end, LinearIsa isa);

// The same product with plain loops (double accumulation; w_bf16 if set); the tests' oracle for
// LinearCpu.
void LinearNaiveCpu(const LinearParams& p);

}  // namespace specd

#endif  // SPECD_KERNELS_LINEAR_H_
