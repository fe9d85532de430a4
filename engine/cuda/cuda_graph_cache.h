// The CUDA backend's graph cache: runs a planned step (engine/cuda/cuda_step_plan.h) eagerly,
// or, when it is padded to a bucket, as a CUDA graph captured for its key (CudaGraphKey). A
// bucket's graph is captured on its second use, so the first use runs (and warms up) the same
// launches eagerly: cuBLASLt's plans and lazily loaded kernels are in place before capture, and
// a bucket used once costs no capture. A failed capture leaves its bucket eager for good.
#ifndef SPECD_ENGINE_CUDA_CUDA_GRAPH_CACHE_H_
#define SPECD_ENGINE_CUDA_CUDA_GRAPH_CACHE_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "engine/cuda/cuda_step_plan.h"

namespace specd {

class CudaGraphCache {
 public:
  CudaGraphCache() = default;
  CudaGraphCache(const CudaGraphCache&) = delete;
  CudaGraphCache& operator=(const CudaGraphCache&) = delete;
  // Destroys the graphs (the caller has their device current).
  ~CudaGraphCache() { Clear(); }

  // Runs `step` on `stream`: `enqueue` launches its kernels (allocating nothing, synchronising
  // nothing, reading nothing back, so that it can be captured). Graphs point into buffers whose
  // reallocations `buffer_generation` counts: graphs captured under an older one are dropped.
  absl::Status Run(const CudaStep& step, cudaStream_t stream, uint64_t buffer_generation,
                   absl::FunctionRef<absl::Status()> enqueue);
  void Clear();

  // Graphs captured and graph launches so far, and steps launched kernel by kernel.
  int64_t captured() const { return captured_; }
  int64_t launches() const { return launches_; }
  int64_t eager_steps() const { return eager_steps_; }

 private:
  struct Entry {
    cudaGraphExec_t exec = nullptr;
    int uses = 0;
    bool failed = false;
  };

  uint64_t generation_ = 0;
  absl::flat_hash_map<std::vector<int64_t>, Entry> graphs_;
  int64_t captured_ = 0;
  int64_t launches_ = 0;
  int64_t eager_steps_ = 0;
};

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_CUDA_GRAPH_CACHE_H_
