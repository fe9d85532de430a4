// Gemm's dealings with cuBLASLt's candidates, and the timing of launches (gemm_internal.h).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>

#include "kernels/cuda/gemm_internal.h"

namespace specd {
namespace cuda {
namespace internal {

// cuBLASLt's tile ids by shape, for re-tiled class candidates (DecideClass): tile
// (64 * (i + 1)) x (8 * (j + 1)) is kRetileTiles[i][j], where the first extent counts rows of
// the weight (cuBLAS's M: y^T = w x^T) and the second token rows.
const cublasLtMatmulTile_t kRetileTiles[4][32] = {
    {CUBLASLT_MATMUL_TILE_64x8,   CUBLASLT_MATMUL_TILE_64x16,  CUBLASLT_MATMUL_TILE_64x24,
     CUBLASLT_MATMUL_TILE_64x32,  CUBLASLT_MATMUL_TILE_64x40,  CUBLASLT_MATMUL_TILE_64x48,
     CUBLASLT_MATMUL_TILE_64x56,  CUBLASLT_MATMUL_TILE_64x64,  CUBLASLT_MATMUL_TILE_64x72,
     CUBLASLT_MATMUL_TILE_64x80,  CUBLASLT_MATMUL_TILE_64x88,  CUBLASLT_MATMUL_TILE_64x96,
     CUBLASLT_MATMUL_TILE_64x104, CUBLASLT_MATMUL_TILE_64x112, CUBLASLT_MATMUL_TILE_64x120,
     CUBLASLT_MATMUL_TILE_64x128, CUBLASLT_MATMUL_TILE_64x136, CUBLASLT_MATMUL_TILE_64x144,
     CUBLASLT_MATMUL_TILE_64x152, CUBLASLT_MATMUL_TILE_64x160, CUBLASLT_MATMUL_TILE_64x168,
     CUBLASLT_MATMUL_TILE_64x176, CUBLASLT_MATMUL_TILE_64x184, CUBLASLT_MATMUL_TILE_64x192,
     CUBLASLT_MATMUL_TILE_64x200, CUBLASLT_MATMUL_TILE_64x208, CUBLASLT_MATMUL_TILE_64x216,
     CUBLASLT_MATMUL_TILE_64x224, CUBLASLT_MATMUL_TILE_64x232, CUBLASLT_MATMUL_TILE_64x240,
     CUBLASLT_MATMUL_TILE_64x248, CUBLASLT_MATMUL_TILE_64x256},
    {CUBLASLT_MATMUL_TILE_128x8,   CUBLASLT_MATMUL_TILE_128x16,  CUBLASLT_MATMUL_TILE_128x24,
     CUBLASLT_MATMUL_TILE_128x32,  CUBLASLT_MATMUL_TILE_128x40,  CUBLASLT_MATMUL_TILE_128x48,
     CUBLASLT_MATMUL_TILE_128x56,  CUBLASLT_MATMUL_TILE_128x64,  CUBLASLT_MATMUL_TILE_128x72,
     CUBLASLT_MATMUL_TILE_128x80,  CUBLASLT_MATMUL_TILE_128x88,  CUBLASLT_MATMUL_TILE_128x96,
     CUBLASLT_MATMUL_TILE_128x104, CUBLASLT_MATMUL_TILE_128x112, CUBLASLT_MATMUL_TILE_128x120,
     CUBLASLT_MATMUL_TILE_128x128, CUBLASLT_MATMUL_TILE_128x136, CUBLASLT_MATMUL_TILE_128x144,
     CUBLASLT_MATMUL_TILE_128x152, CUBLASLT_MATMUL_TILE_128x160, CUBLASLT_MATMUL_TILE_128x168,
     CUBLASLT_MATMUL_TILE_128x176, CUBLASLT_MATMUL_TILE_128x184, CUBLASLT_MATMUL_TILE_128x192,
     CUBLASLT_MATMUL_TILE_128x200, CUBLASLT_MATMUL_TILE_128x208, CUBLASLT_MATMUL_TILE_128x216,
     CUBLASLT_MATMUL_TILE_128x224, CUBLASLT_MATMUL_TILE_128x232, CUBLASLT_MATMUL_TILE_128x240,
     CUBLASLT_MATMUL_TILE_128x248, CUBLASLT_MATMUL_TILE_128x256},
    {CUBLASLT_MATMUL_TILE_192x8,   CUBLASLT_MATMUL_TILE_192x16,  CUBLASLT_MATMUL_TILE_192x24,
     CUBLASLT_MATMUL_TILE_192x32,  CUBLASLT_MATMUL_TILE_192x40,  CUBLASLT_MATMUL_TILE_192x48,
     CUBLASLT_MATMUL_TILE_192x56,  CUBLASLT_MATMUL_TILE_192x64,  CUBLASLT_MATMUL_TILE_192x72,
     CUBLASLT_MATMUL_TILE_192x80,  CUBLASLT_MATMUL_TILE_192x88,  CUBLASLT_MATMUL_TILE_192x96,
     CUBLASLT_MATMUL_TILE_192x104, CUBLASLT_MATMUL_TILE_192x112, CUBLASLT_MATMUL_TILE_192x120,
     CUBLASLT_MATMUL_TILE_192x128, CUBLASLT_MATMUL_TILE_192x136, CUBLASLT_MATMUL_TILE_192x144,
     CUBLASLT_MATMUL_TILE_192x152, CUBLASLT_MATMUL_TILE_192x160, CUBLASLT_MATMUL_TILE_192x168,
     CUBLASLT_MATMUL_TILE_192x176, CUBLASLT_MATMUL_TILE_192x184, CUBLASLT_MATMUL_TILE_192x192,
     CUBLASLT_MATMUL_TILE_192x200, CUBLASLT_MATMUL_TILE_192x208, CUBLASLT_MATMUL_TILE_192x216,
     CUBLASLT_MATMUL_TILE_192x224, CUBLASLT_MATMUL_TILE_192x232, CUBLASLT_MATMUL_TILE_192x240,
     CUBLASLT_MATMUL_TILE_192x248, CUBLASLT_MATMUL_TILE_192x256},
    {CUBLASLT_MATMUL_TILE_256x8,   CUBLASLT_MATMUL_TILE_256x16,  CUBLASLT_MATMUL_TILE_256x24,
     CUBLASLT_MATMUL_TILE_256x32,  CUBLASLT_MATMUL_TILE_256x40,  CUBLASLT_MATMUL_TILE_256x48,
     CUBLASLT_MATMUL_TILE_256x56,  CUBLASLT_MATMUL_TILE_256x64,  CUBLASLT_MATMUL_TILE_256x72,
     CUBLASLT_MATMUL_TILE_256x80,  CUBLASLT_MATMUL_TILE_256x88,  CUBLASLT_MATMUL_TILE_256x96,
     CUBLASLT_MATMUL_TILE_256x104, CUBLASLT_MATMUL_TILE_256x112, CUBLASLT_MATMUL_TILE_256x120,
     CUBLASLT_MATMUL_TILE_256x128, CUBLASLT_MATMUL_TILE_256x136, CUBLASLT_MATMUL_TILE_256x144,
     CUBLASLT_MATMUL_TILE_256x152, CUBLASLT_MATMUL_TILE_256x160, CUBLASLT_MATMUL_TILE_256x168,
     CUBLASLT_MATMUL_TILE_256x176, CUBLASLT_MATMUL_TILE_256x184, CUBLASLT_MATMUL_TILE_256x192,
     CUBLASLT_MATMUL_TILE_256x200, CUBLASLT_MATMUL_TILE_256x208, CUBLASLT_MATMUL_TILE_256x216,
     CUBLASLT_MATMUL_TILE_256x224, CUBLASLT_MATMUL_TILE_256x232, CUBLASLT_MATMUL_TILE_256x240,
     CUBLASLT_MATMUL_TILE_256x248, CUBLASLT_MATMUL_TILE_256x256}};

int Alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// A heuristic query preference: at most `workspace` bytes, and the alignments
// (bytes) of X (operand B), W (operand A) and Y (C and D) this call has.
cublasStatus_t CreatePreference(uint64_t workspace, uint32_t align_x, uint32_t align_w,
                                uint32_t align_y, cublasLtMatmulPreference_t* out) {
  cublasStatus_t st = cublasLtMatmulPreferenceCreate(out);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  cublasLtMatmulPreference_t pref = *out;
  const uint64_t ws = workspace;
  const uint32_t ax = align_x, aw = align_w, ay = align_y;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                       sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw,
                                       sizeof(aw));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax,
                                       sizeof(ax));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ay,
                                       sizeof(ay));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ay,
                                       sizeof(ay));
  return CUBLAS_STATUS_SUCCESS;
}

// Appends cuBLASLt's candidates for one problem (in its order of preference)
// to `out`, skipping those already there.
void AppendCandidates(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                      cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t d, uint64_t workspace,
                      uint32_t align_x, uint32_t align_w, uint32_t align_y,
                      std::vector<cublasLtMatmulAlgo_t>* out) {
  cublasLtMatmulPreference_t pref = nullptr;
  if (CreatePreference(workspace, align_x, align_w, align_y, &pref) != CUBLAS_STATUS_SUCCESS)
    return;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int returned = 0;
  if (cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, pref, kCandidates, results,
                                     &returned) == CUBLAS_STATUS_SUCCESS) {
    for (int i = 0; i < returned; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      const cublasLtMatmulAlgo_t& algo = results[i].algo;
      const bool seen = std::any_of(out->begin(), out->end(), [&](const auto& o) {
        return std::memcmp(&o, &algo, sizeof(algo)) == 0;
      });
      if (!seen) out->push_back(algo);
    }
  }
  cublasLtMatmulPreferenceDestroy(pref);
}

template <typename T>
void ReadAttribute(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr,
                   T* value) {
  T v = {};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) ==
          CUBLAS_STATUS_SUCCESS &&
      written == sizeof(v)) {
    *value = v;
  }
}

AlgoConfig ReadConfig(const cublasLtMatmulAlgo_t& algo) {
  AlgoConfig c;
  ReadAttribute(algo, CUBLASLT_ALGO_CONFIG_ID, &c.id);
  ReadAttribute(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &c.tile);
  ReadAttribute(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &c.stages);
  ReadAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &c.splitk);
  ReadAttribute(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &c.reduction);
  ReadAttribute(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &c.swizzle);
  ReadAttribute(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &c.custom);
  ReadAttribute(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &c.inner);
  ReadAttribute(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &c.cluster);
  return c;
}

// Whether two algorithms cut K into the same parts and add them up the same
// way. Bit-identical outputs need that (partial sums added in another grouping
// round differently), so a candidate that differs here is not worth a
// self-check. A split count and scheme fixed in the configuration do not
// depend on m.
bool SameKSplit(const AlgoConfig& a, const AlgoConfig& b) {
  const int32_t sa = std::max<int32_t>(1, a.splitk), sb = std::max<int32_t>(1, b.splitk);
  const uint32_t ra = sa > 1 ? a.reduction : 0, rb = sb > 1 ? b.reduction : 0;
  return sa == sb && ra == rb;
}

// Whether an algorithm's output is a fixed function of its inputs: without a
// K split, or with one whose partial sums are added in a fixed order. INPLACE
// adds them in the output through counters that "guarantee the sequentiality"
// (cublasLt.h); COMPUTE_TYPE and OUTPUT_TYPE add them in a separate pass over
// the workspace. A split without a scheme (NONE), or a value this code does
// not know, is refused.
bool DeterministicReduction(const AlgoConfig& c) {
  if (c.splitk <= 1) return true;
  return c.reduction == CUBLASLT_REDUCTION_SCHEME_INPLACE ||
         c.reduction == CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE ||
         c.reduction == CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
}

// `algo` with the K split of `base` (split count and reduction scheme) set in
// its configuration, so that it may add up K as the base does; false when the
// algorithm does not support that split or scheme. cuBLASLt still has to
// accept the result (AlgoFits), and the self-check decides.
bool WithKSplit(const cublasLtMatmulAlgo_t& algo, const AlgoConfig& base,
                cublasLtMatmulAlgo_t* out) {
  const int32_t splitk = std::max<int32_t>(1, base.splitk);
  const uint32_t reduction =
      splitk > 1 ? base.reduction : static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE);
  if (splitk > 1) {
    int32_t split_support = 0;
    uint32_t scheme_mask = 0;
    size_t written = 0;
    if (cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &split_support,
                                          sizeof(split_support),
                                          &written) != CUBLAS_STATUS_SUCCESS ||
        split_support == 0 ||
        cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK,
                                          &scheme_mask, sizeof(scheme_mask),
                                          &written) != CUBLAS_STATUS_SUCCESS ||
        (scheme_mask & reduction) != reduction) {
      return false;
    }
  }
  cublasLtMatmulAlgo_t a = algo;
  if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk,
                                           sizeof(splitk)) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                           sizeof(reduction)) != CUBLAS_STATUS_SUCCESS) {
    return false;
  }
  *out = a;
  return true;
}

bool SameAlgo(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0;
}

std::string ConfigString(const cublasLtMatmulAlgo_t& algo) {
  const AlgoConfig c = ReadConfig(algo);
  char buf[160];
  std::snprintf(buf, sizeof(buf),
                "algo %d tile %u stages %u splitK %d reduction %u swizzle %u "
                "custom %u inner %u cluster %u",
                c.id, c.tile, c.stages, c.splitk, c.reduction, c.swizzle, c.custom, c.inner,
                c.cluster);
  return buf;
}

// Bytes of a buffer whose reading evicts weights of n x k bf16 from L2: twice
// the L2 size, or 0 when the weights are too big to sit there between two
// launches anyway (a model's layers stream theirs from HBM).
size_t FlushBytes(int64_t n, int64_t k) {
  int device = 0, l2_bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const size_t weight_bytes = static_cast<size_t>(n * k) * sizeof(bf16);
  return weight_bytes < size_t{4} * l2_bytes ? size_t{2} * l2_bytes : 0;
}

// Times `slots` launches, each the least GPU time (microseconds) of
// kTimingReps rounds in which every slot runs once, L2 evicted before each:
// (*us)[i] for launch(i). False when a CUDA call or a launch failed.
bool TimeLaunches(size_t slots, const std::function<bool(size_t)>& launch,
                  const CheckScratch& scratch, cudaStream_t stream, std::vector<float>* us) {
  us->assign(slots, -1.0f);
  Events events;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> marks;
  bool ok = true;
  for (int rep = 0; rep < kTimingReps && ok; ++rep) {
    for (size_t i = 0; i < slots && ok; ++i) {
      if (scratch.EvictL2() != cudaSuccess) {
        ok = false;
        break;
      }
      const cudaEvent_t start = events.Record(stream);
      const bool ran = launch(i);
      const cudaEvent_t stop = events.Record(stream);
      ok = ran && start != nullptr && stop != nullptr;
      marks.emplace_back(start, stop);
    }
  }
  ok = ok && cudaStreamSynchronize(stream) == cudaSuccess;
  for (size_t j = 0; j < marks.size() && ok; ++j) {
    float ms = 0.0f;
    if (cudaEventElapsedTime(&ms, marks[j].first, marks[j].second) != cudaSuccess) {
      ok = false;
      break;
    }
    float& best = (*us)[j % slots];
    if (best < 0.0f || ms * 1e3f < best) best = ms * 1e3f;
  }
  if (!ok) cudaGetLastError();
  return ok;
}

}  // namespace internal
}  // namespace cuda
}  // namespace specd
