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
// rows, about 2x the cost of a single-row GEMM on 2 cores) and one packing of W per block.
//
// That a row's bits do not depend on its position inside a block is a property of the BLAS
// build and CPU (true of every micro-kernel we know, and checked by the tests on the CI
// machine), so backends check it at load time for each weight with LinearRowBlockInvariant()
// and fall back to row_block = 1 (one sgemm per row: identical calls, trivially invariant)
// where it fails.
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
  // Rows per sgemm call: kLinearRowBlock, or 1 for the slow always-invariant fallback.
  int64_t row_block = kLinearRowBlock;
};

// Batch-invariant: row r of y depends only on row r of x (bit for bit), whatever `rows` is.
void LinearCpu(const LinearParams& p);

// Whether LinearCpu with row_block = kLinearRowBlock gives a row the same bits at every
// position of a block whatever the other rows hold, for this weight: a probe row is computed
// alone and then at each position among random rows (kLinearRowBlock + 1 sgemm calls).
bool LinearRowBlockInvariant(const float* w, int64_t out_features, int64_t in_features);

// The same product with plain loops (double accumulation); the tests' oracle for LinearCpu.
void LinearNaiveCpu(const LinearParams& p);

}  // namespace specd

#endif  // SPECD_KERNELS_LINEAR_H_
