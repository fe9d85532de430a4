// Linear layer y = x W^T (+ bias) with W in Hugging Face [out_features, in_features] layout,
// through OpenBLAS cblas_sgemm.
//
// Batch invariance. Speculative decoding is lossless only if a token's logits do not depend on
// how many other rows share its GEMM (a tree node verified in a batch vs. the same token
// decoded alone). OpenBLAS 0.3.21 does not give that: measured on a Sapphire Rapids host, row
// results differ in the last bits between M = 1, odd M and multiples of 8, because the
// M-tail micro-kernels and the thread split depend on M. With M fixed, the result of a row
// does not depend on its position inside the call nor on the other rows (each output element
// is one fixed sequence of FMAs along K). So LinearCpu always calls sgemm with exactly
// kLinearRowBlock rows, padding the last block with zeros: every row of every batch goes
// through the same (M, N, K) path. tests/unit/cpu_kernels_test.cc checks this bit for bit.
// The price is up to kLinearRowBlock - 1 wasted rows per call (decode of one token computes 8
// rows, about 2x the cost of a single-row GEMV on 2 cores).
#ifndef SPECD_KERNELS_LINEAR_H_
#define SPECD_KERNELS_LINEAR_H_

#include <stdint.h>

namespace specd {

inline constexpr int64_t kLinearRowBlock = 8;

struct LinearParams {
  const float* x = nullptr;     // [rows, in_features] fp32, host
  const float* w = nullptr;     // [out_features, in_features] fp32, host
  const float* bias = nullptr;  // [out_features] fp32, host, or null
  float* y = nullptr;           // [rows, out_features] fp32, host; must not alias x
  int64_t rows = 0;
  int64_t in_features = 0;
  int64_t out_features = 0;
};

// Batch-invariant: row r of y depends only on row r of x (bit for bit), whatever `rows` is.
void LinearCpu(const LinearParams& p);

// The same product with plain loops (double accumulation); the tests' oracle for LinearCpu.
void LinearNaiveCpu(const LinearParams& p);

}  // namespace specd

#endif  // SPECD_KERNELS_LINEAR_H_
