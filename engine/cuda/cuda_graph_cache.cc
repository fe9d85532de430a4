#include "engine/cuda/cuda_graph_cache.h"

#include <cstdio>

#include "engine/cuda/cuda_status.h"

namespace specd {

void CudaGraphCache::Clear() {
  for (auto& [key, entry] : graphs_) {
    if (entry.exec != nullptr) cudaGraphExecDestroy(entry.exec);
  }
  graphs_.clear();
}

absl::Status CudaGraphCache::Run(const CudaStep& step, cudaStream_t stream,
                                 uint64_t buffer_generation,
                                 absl::FunctionRef<absl::Status()> enqueue) {
  if (!step.padded) {
    ++eager_steps_;
    return enqueue();
  }
  if (buffer_generation != generation_) {
    // A buffer a graph points into was reallocated (after a stream synchronisation).
    Clear();
    generation_ = buffer_generation;
  }
  Entry& entry = graphs_[CudaGraphKey(step)];
  if (entry.exec == nullptr) {
    if (entry.failed || ++entry.uses < 2) {
      ++eager_steps_;
      return enqueue();
    }
    cudaGraph_t graph = nullptr;
    SPECD_CUDA_RETURN_(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                       "beginning graph capture");
    const absl::Status enqueued = enqueue();
    // Always end the capture, so the stream leaves capture mode whatever happened.
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
    cudaError_t instantiated = cudaErrorUnknown;
    if (enqueued.ok() && ended == cudaSuccess && graph != nullptr) {
      instantiated = cudaGraphInstantiate(&entry.exec, graph, 0);
    }
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!enqueued.ok() || ended != cudaSuccess || instantiated != cudaSuccess) {
      entry.exec = nullptr;
      entry.failed = true;
      cudaGetLastError();  // a failed capture leaves a sticky-free error behind; clear it
      std::fprintf(stderr,
                   "specd cuda backend: graph capture failed (batch %lld, %lld tokens a "
                   "sequence): %s / %s / %s; this bucket runs eagerly\n",
                   static_cast<long long>(step.batch), static_cast<long long>(step.per_seq),
                   enqueued.ToString().c_str(), cudaGetErrorName(ended),
                   cudaGetErrorName(instantiated));
      ++eager_steps_;
      return enqueue();
    }
    ++captured_;
  }
  SPECD_CUDA_RETURN_(cudaGraphLaunch(entry.exec, stream), "launching a CUDA graph");
  ++launches_;
  return absl::OkStatus();
}

}  // namespace specd
