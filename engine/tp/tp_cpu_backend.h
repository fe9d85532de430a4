// The fp32 CPU model split over N simulated tensor-parallel ranks: a TensorParallelBackend
// (engine/tp/tp_backend.h) whose rank executors run the CPU kernels on their weight shards and
// exchange partial sums through the in-process all-reduce. It exists so that CI proves the
// sharding (any N, uneven head/FFN/vocab splits, replicated KV heads) on the same structure the
// CUDA tensor-parallel backend has, and its logits match CpuBackend's to fp32 rounding (the
// row-parallel sums are split differently, so not bit for bit).
//
// Like CpuBackend, every per-token result is independent of batching (batch-invariant GEMMs,
// element-wise all-reduce in rank order), so a tree node's logits equal, bit for bit, those of
// the same token decoded after its path at the same N.
//
// Threads. Each rank has its own pool of BackendOptions::num_threads / N threads (at least one:
// the rank thread) for its GEMMs (output columns split over the pool, which does not change
// their bits) and its attention.
#ifndef SPECD_ENGINE_TP_TP_CPU_BACKEND_H_
#define SPECD_ENGINE_TP_TP_CPU_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/tp/tp_backend.h"

namespace specd {

// Loads dir/config.json and, per rank, only that rank's slices of the safetensors weights;
// options.tensor_parallel ranks (>= 1). Errors name the file and the tensor.
absl::StatusOr<std::unique_ptr<TensorParallelBackend>> CreateTpCpuBackend(
    const std::string& dir, const BackendOptions& options);

}  // namespace specd

#endif  // SPECD_ENGINE_TP_TP_CPU_BACKEND_H_
