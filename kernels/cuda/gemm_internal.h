// Gemm's private pieces (specd/kernels/cuda/gemm.h), shared by its files:
//   gemm.cc         the Gemm class: plans, the per-shape pick, Run, Summary
//   gemm_choose.cc  the row-invariant picks: a family's base, a row class's algorithm
//   gemm_algo.cc    cuBLASLt's candidates and their configurations; timing
//   gemm_check.cu   the self-check's device code (check rows, mismatch counts, fingerprints)
//   gemm_plan.cc    the row classes, plain C++ (specd/kernels/cuda/gemm_plan.h)
#ifndef SPECD_KERNELS_CUDA_GEMM_INTERNAL_H_
#define SPECD_KERNELS_CUDA_GEMM_INTERNAL_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "specd/kernels/cuda/gemm.h"

namespace specd {
namespace cuda {

// cuBLAS is column-major; a row-major [r, c] matrix is a column-major [c, r]
// one. So y^T[n, m] = (w[n, k] row-major = col-major [k, n], transposed) * (x^T
// = col-major [k, m]).
struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo = {};
  // The base algorithm stands in for a row class whose self-check was deferred
  // (the stream was capturing); the next Run outside a capture chooses again.
  bool provisional = false;

  ~Plan() {
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

namespace internal {

// Input rows whose outputs the self-check compares (fewer when invariant_rows
// is smaller).
constexpr int64_t kProbeRows = 8;
// Heuristic candidates asked for, per query.
constexpr int kCandidates = 16;
// Candidates that passed the self-check timed against each other and the base.
constexpr size_t kMaxTimed = 4;
// Candidates a row class runs through the self-check at most (each check is
// three GEMMs at up to the class's largest m).
constexpr int kMaxChecked = 16;
constexpr int kTimingReps = 3;
// The base's choice (gemm.h): potential bases timed (the row counts timed and their weights are
// GemmBaseCostRows', the displacement rule kGemmDisplace: gemm_plan.h).
constexpr size_t kMaxBases = 6;

// cuBLASLt's tile ids by shape, for re-tiled class candidates (DecideClass): tile
// (64 * (i + 1)) x (8 * (j + 1)) is kRetileTiles[i][j], where the first extent counts rows of
// the weight (cuBLAS's M: y^T = w x^T) and the second token rows.
extern const cublasLtMatmulTile_t kRetileTiles[4][32];
// Classes up to this many rows get re-tiled candidates (the tables' widest token extent).
constexpr int64_t kRetileMaxRows = 256;
// The cluster shapes a re-tiled candidate is tried at besides its own (the LM head's best at one
// row is 192 x 8 at 1x2x1, gate_up's at 65 rows 128 x 72 at 4x1x1: bench/history/).
constexpr uint16_t kRetileClusters[] = {CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                                        CUBLASLT_CLUSTER_SHAPE_4x1x1, CUBLASLT_CLUSTER_SHAPE_1x2x1};

// gemm_algo.cc: cuBLASLt's candidates and their configurations (each defined with its comment).
int Alignment(const void* p);
cublasStatus_t CreatePreference(uint64_t workspace, uint32_t align_x, uint32_t align_w,
                                uint32_t align_y, cublasLtMatmulPreference_t* out);
void AppendCandidates(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                      cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t d, uint64_t workspace,
                      uint32_t align_x, uint32_t align_w, uint32_t align_y,
                      std::vector<cublasLtMatmulAlgo_t>* out);
// The configuration attributes of an algorithm that name it in logs and decide
// how it splits K.
struct AlgoConfig {
  int32_t id = -1;
  uint32_t tile = 0, stages = 0, reduction = 0, swizzle = 0, custom = 0;
  int32_t splitk = 1;
  uint16_t inner = 0, cluster = 0;
};
AlgoConfig ReadConfig(const cublasLtMatmulAlgo_t& algo);
bool SameKSplit(const AlgoConfig& a, const AlgoConfig& b);
bool DeterministicReduction(const AlgoConfig& c);
bool WithKSplit(const cublasLtMatmulAlgo_t& algo, const AlgoConfig& base,
                cublasLtMatmulAlgo_t* out);
bool SameAlgo(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b);
std::string ConfigString(const cublasLtMatmulAlgo_t& algo);

// gemm_check.cu: the self-check's device work, enqueued on `stream` (each defined with its
// comment).
cudaError_t FillCheckRows(bf16* x, int64_t m, int64_t k, int64_t probe, cudaStream_t stream);
cudaError_t CountMismatches(const void* y, const void* ref, bool fp32, int64_t m, int64_t n,
                            int64_t probe, unsigned long long* count, cudaStream_t stream);
cudaError_t Fingerprint(const void* y, bool fp32, int64_t total, unsigned long long* sum,
                        cudaStream_t stream);
cudaError_t ReadFlush(const uint4* words, int64_t count, unsigned* sink, cudaStream_t stream);

// gemm_algo.cc: what the measurements need (each defined with its comment).
size_t FlushBytes(int64_t n, int64_t k);
bool TimeLaunches(size_t slots, const std::function<bool(size_t)>& launch,
                  const class CheckScratch& scratch, cudaStream_t stream, std::vector<float>* us);

// Device memory of one self-check or base choice, freed when it goes out of
// scope: the input rows, the candidate's output, the base's output on the
// probe rows, 64-bit counters (mismatches, fingerprints), a word the flush
// kernel never writes, and a buffer whose reading evicts the weights from L2
// before a timed launch, each 256-byte aligned.
class CheckScratch {
 public:
  explicit CheckScratch(cudaStream_t stream) : stream_(stream) {}
  ~CheckScratch() {
    if (block_ != nullptr) {
      // Work of the check may still be queued (a check that gave up half way).
      cudaStreamSynchronize(stream_);
      cudaFree(block_);
    }
  }
  bool Allocate(size_t x_bytes, size_t y_bytes, size_t ref_bytes, size_t counters,
                size_t flush_bytes) {
    const auto round = [](size_t b) { return (b + 255) / 256 * 256; };
    const size_t counter_bytes = round(std::max<size_t>(1, counters) * sizeof(unsigned long long));
    const size_t total = round(x_bytes) + round(y_bytes) + round(ref_bytes) + counter_bytes + 256 +
                         round(flush_bytes);
    if (cudaMalloc(&block_, total) != cudaSuccess) {
      block_ = nullptr;
      cudaGetLastError();  // an allocation failure is not sticky; clear it
      return false;
    }
    char* p = static_cast<char*>(block_);
    x = reinterpret_cast<bf16*>(p);
    p += round(x_bytes);
    y = p;
    p += round(y_bytes);
    ref = p;
    p += round(ref_bytes);
    count = reinterpret_cast<unsigned long long*>(p);
    p += counter_bytes;
    sink_ = reinterpret_cast<unsigned*>(p);
    p += 256;
    flush_ = flush_bytes > 0 ? p : nullptr;
    flush_bytes_ = flush_bytes / sizeof(uint4) * sizeof(uint4);
    return true;
  }
  // Enqueues the eviction of L2 (nothing without a flush buffer).
  cudaError_t EvictL2() const {
    if (flush_ == nullptr || flush_bytes_ == 0) return cudaSuccess;
    const int64_t words = static_cast<int64_t>(flush_bytes_ / sizeof(uint4));
    return ReadFlush(static_cast<const uint4*>(flush_), words, sink_, stream_);
  }

  bf16* x = nullptr;
  void* y = nullptr;
  void* ref = nullptr;
  unsigned long long* count = nullptr;  // `counters` of them

 private:
  cudaStream_t stream_;
  void* block_ = nullptr;
  unsigned* sink_ = nullptr;
  void* flush_ = nullptr;
  size_t flush_bytes_ = 0;
};

// CUDA events, destroyed with the object.
class Events {
 public:
  ~Events() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  // Appends an event recorded on `stream` now; null on failure.
  cudaEvent_t Record(cudaStream_t stream) {
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) return nullptr;
    events_.push_back(e);
    return cudaEventRecord(e, stream) == cudaSuccess ? e : nullptr;
  }

 private:
  std::vector<cudaEvent_t> events_;
};

}  // namespace internal
}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_GEMM_INTERNAL_H_
