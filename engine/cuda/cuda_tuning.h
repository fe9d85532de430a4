// The CUDA backend's tuning and debugging switches in one typed struct, parsed from the SPECD_*
// environment once when a backend is created and handed down to what uses them: the backend's
// step planner and forward, its GEMM picker, and the kernel library's launches
// (specd/kernels/cuda/launch_tuning.h). Nothing else reads these variables. docs/tuning.md lists
// them with what each is for.
//
// The defaults are what serves best; every switch exists for an A/B run or for debugging, and
// none lets speculative output differ from target-only output. Plain C++ (no CUDA headers), so
// CPU-only builds compile and test the parser too.
#ifndef SPECD_ENGINE_CUDA_CUDA_TUNING_H_
#define SPECD_ENGINE_CUDA_CUDA_TUNING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "specd/kernels/cuda/launch_tuning.h"

namespace specd {

struct CudaTuning {
  // SPECD_CUDA_GRAPHS=0: run every step eagerly instead of replaying CUDA graphs (also
  // BackendOptions::cuda_graphs).
  bool cuda_graphs = true;
  // SPECD_L2_DISCARD=0: keep a layer's dead intermediates in L2 instead of dropping them without
  // write-back.
  bool l2_discard = true;
  // SPECD_L2_DISCARD_MIN_TOKENS=N (>= 1): the fewest tokens of a step whose kernels drop them;
  // 1 drops on every step (what tests use to exercise the drops).
  int64_t l2_discard_min_tokens = 16;
  // SPECD_RESIDUAL_SPLITS=N (1-8): K ranges of o_proj and down_proj on one GPU, whose fp32 slabs
  // the next RMSNorm adds; 1 restores cuBLASLt's own split-K. Tensor parallelism always uses 1.
  int residual_splits = 2;
  // SPECD_GEMM_CLASSES=pow2: plain doubling GEMM row classes instead of classes that end at the
  // verify buckets (2^j + 1 rows).
  bool gemm_bucket_classes = true;
  // SPECD_GEMM_TIMING=0: pick GEMM algorithms without timing them, the same in every process
  // (A/B runs of other changes; possibly slower).
  bool gemm_timed_picks = true;
  // SPECD_GEMM_RETILE=0: row classes choose among cuBLASLt's own candidates only, not also
  // re-tiled and re-clustered ones.
  bool gemm_retile = true;
  // SPECD_GEMM_SUMMARY=1: print the GEMM algorithms picked, per weight shape and row class,
  // when the backend is destroyed.
  bool gemm_summary = false;
  // SPECD_SHARED_SPINE=0: each masked token of a verify step gets its own spine end as
  // mask_begin instead of one per sequence (the same keys; more attention window groups).
  bool shared_spine = true;
  // SPECD_ATTN_CHUNKS_PER_CTA=N (> 0): key chunks a CTA of split attention, instead of the
  // planner's choice; changes the CTA count, never the bits. 0 leaves it to the planner.
  int attn_chunks_per_cta = 0;
  // SPECD_PDL=0, SPECD_PDL_OFF=site,..., SPECD_SMEM_CARVEOUT=P: how kernels are launched.
  cuda::LaunchTuning launch;
};

// Every variable CudaTuning reads, for documentation and checks.
const std::vector<std::string>& CudaTuningVariables();

// CudaTuning from `lookup`, which returns a variable's value or nullptr when it is unset.
// Values are read as the backend always read them: a switch is off only at its exact "off"
// value, numbers as atoi reads them and clamped to their range, unknown PDL sites ignored.
CudaTuning ParseCudaTuning(absl::FunctionRef<const char*(const char*)> lookup);

// ParseCudaTuning of this process's environment.
CudaTuning CudaTuningFromEnvironment();

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_CUDA_TUNING_H_
