#include "specd/kernels/cuda/gemm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <utility>

namespace specd {
namespace cuda {
namespace {

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
// The base's choice (gemm.h): potential bases timed, and the row counts timed
// with their weights in the cost.
constexpr size_t kMaxBases = 6;
constexpr int64_t kCostRows[] = {1, 64, 256};
constexpr double kCostWeights[] = {1.0, 0.5, 0.25};
// A later candidate (in cuBLASLt's order; the base last) displaces an earlier
// one only when faster than this fraction of its time: timing noise should not
// flip the choice from run to run.
constexpr double kDisplace = 0.97;
constexpr int kThreads = 256;

// cuBLASLt's tile ids by shape, for re-tiled class candidates (DecideClass): tile
// (64 * (i + 1)) x (8 * (j + 1)) is kRetileTiles[i][j], where the first extent counts rows of
// the weight (cuBLAS's M: y^T = w x^T) and the second token rows.
constexpr cublasLtMatmulTile_t kRetileTiles[4][32] = {
    {CUBLASLT_MATMUL_TILE_64x8, CUBLASLT_MATMUL_TILE_64x16, CUBLASLT_MATMUL_TILE_64x24, CUBLASLT_MATMUL_TILE_64x32, CUBLASLT_MATMUL_TILE_64x40, CUBLASLT_MATMUL_TILE_64x48, CUBLASLT_MATMUL_TILE_64x56, CUBLASLT_MATMUL_TILE_64x64, CUBLASLT_MATMUL_TILE_64x72, CUBLASLT_MATMUL_TILE_64x80, CUBLASLT_MATMUL_TILE_64x88, CUBLASLT_MATMUL_TILE_64x96, CUBLASLT_MATMUL_TILE_64x104, CUBLASLT_MATMUL_TILE_64x112, CUBLASLT_MATMUL_TILE_64x120, CUBLASLT_MATMUL_TILE_64x128, CUBLASLT_MATMUL_TILE_64x136, CUBLASLT_MATMUL_TILE_64x144, CUBLASLT_MATMUL_TILE_64x152, CUBLASLT_MATMUL_TILE_64x160, CUBLASLT_MATMUL_TILE_64x168, CUBLASLT_MATMUL_TILE_64x176, CUBLASLT_MATMUL_TILE_64x184, CUBLASLT_MATMUL_TILE_64x192, CUBLASLT_MATMUL_TILE_64x200, CUBLASLT_MATMUL_TILE_64x208, CUBLASLT_MATMUL_TILE_64x216, CUBLASLT_MATMUL_TILE_64x224, CUBLASLT_MATMUL_TILE_64x232, CUBLASLT_MATMUL_TILE_64x240, CUBLASLT_MATMUL_TILE_64x248, CUBLASLT_MATMUL_TILE_64x256},
    {CUBLASLT_MATMUL_TILE_128x8, CUBLASLT_MATMUL_TILE_128x16, CUBLASLT_MATMUL_TILE_128x24, CUBLASLT_MATMUL_TILE_128x32, CUBLASLT_MATMUL_TILE_128x40, CUBLASLT_MATMUL_TILE_128x48, CUBLASLT_MATMUL_TILE_128x56, CUBLASLT_MATMUL_TILE_128x64, CUBLASLT_MATMUL_TILE_128x72, CUBLASLT_MATMUL_TILE_128x80, CUBLASLT_MATMUL_TILE_128x88, CUBLASLT_MATMUL_TILE_128x96, CUBLASLT_MATMUL_TILE_128x104, CUBLASLT_MATMUL_TILE_128x112, CUBLASLT_MATMUL_TILE_128x120, CUBLASLT_MATMUL_TILE_128x128, CUBLASLT_MATMUL_TILE_128x136, CUBLASLT_MATMUL_TILE_128x144, CUBLASLT_MATMUL_TILE_128x152, CUBLASLT_MATMUL_TILE_128x160, CUBLASLT_MATMUL_TILE_128x168, CUBLASLT_MATMUL_TILE_128x176, CUBLASLT_MATMUL_TILE_128x184, CUBLASLT_MATMUL_TILE_128x192, CUBLASLT_MATMUL_TILE_128x200, CUBLASLT_MATMUL_TILE_128x208, CUBLASLT_MATMUL_TILE_128x216, CUBLASLT_MATMUL_TILE_128x224, CUBLASLT_MATMUL_TILE_128x232, CUBLASLT_MATMUL_TILE_128x240, CUBLASLT_MATMUL_TILE_128x248, CUBLASLT_MATMUL_TILE_128x256},
    {CUBLASLT_MATMUL_TILE_192x8, CUBLASLT_MATMUL_TILE_192x16, CUBLASLT_MATMUL_TILE_192x24, CUBLASLT_MATMUL_TILE_192x32, CUBLASLT_MATMUL_TILE_192x40, CUBLASLT_MATMUL_TILE_192x48, CUBLASLT_MATMUL_TILE_192x56, CUBLASLT_MATMUL_TILE_192x64, CUBLASLT_MATMUL_TILE_192x72, CUBLASLT_MATMUL_TILE_192x80, CUBLASLT_MATMUL_TILE_192x88, CUBLASLT_MATMUL_TILE_192x96, CUBLASLT_MATMUL_TILE_192x104, CUBLASLT_MATMUL_TILE_192x112, CUBLASLT_MATMUL_TILE_192x120, CUBLASLT_MATMUL_TILE_192x128, CUBLASLT_MATMUL_TILE_192x136, CUBLASLT_MATMUL_TILE_192x144, CUBLASLT_MATMUL_TILE_192x152, CUBLASLT_MATMUL_TILE_192x160, CUBLASLT_MATMUL_TILE_192x168, CUBLASLT_MATMUL_TILE_192x176, CUBLASLT_MATMUL_TILE_192x184, CUBLASLT_MATMUL_TILE_192x192, CUBLASLT_MATMUL_TILE_192x200, CUBLASLT_MATMUL_TILE_192x208, CUBLASLT_MATMUL_TILE_192x216, CUBLASLT_MATMUL_TILE_192x224, CUBLASLT_MATMUL_TILE_192x232, CUBLASLT_MATMUL_TILE_192x240, CUBLASLT_MATMUL_TILE_192x248, CUBLASLT_MATMUL_TILE_192x256},
    {CUBLASLT_MATMUL_TILE_256x8, CUBLASLT_MATMUL_TILE_256x16, CUBLASLT_MATMUL_TILE_256x24, CUBLASLT_MATMUL_TILE_256x32, CUBLASLT_MATMUL_TILE_256x40, CUBLASLT_MATMUL_TILE_256x48, CUBLASLT_MATMUL_TILE_256x56, CUBLASLT_MATMUL_TILE_256x64, CUBLASLT_MATMUL_TILE_256x72, CUBLASLT_MATMUL_TILE_256x80, CUBLASLT_MATMUL_TILE_256x88, CUBLASLT_MATMUL_TILE_256x96, CUBLASLT_MATMUL_TILE_256x104, CUBLASLT_MATMUL_TILE_256x112, CUBLASLT_MATMUL_TILE_256x120, CUBLASLT_MATMUL_TILE_256x128, CUBLASLT_MATMUL_TILE_256x136, CUBLASLT_MATMUL_TILE_256x144, CUBLASLT_MATMUL_TILE_256x152, CUBLASLT_MATMUL_TILE_256x160, CUBLASLT_MATMUL_TILE_256x168, CUBLASLT_MATMUL_TILE_256x176, CUBLASLT_MATMUL_TILE_256x184, CUBLASLT_MATMUL_TILE_256x192, CUBLASLT_MATMUL_TILE_256x200, CUBLASLT_MATMUL_TILE_256x208, CUBLASLT_MATMUL_TILE_256x216, CUBLASLT_MATMUL_TILE_256x224, CUBLASLT_MATMUL_TILE_256x232, CUBLASLT_MATMUL_TILE_256x240, CUBLASLT_MATMUL_TILE_256x248, CUBLASLT_MATMUL_TILE_256x256}};
// Classes up to this many rows get re-tiled candidates (the tables' widest token extent).
constexpr int64_t kRetileMaxRows = 256;
// The cluster shapes a re-tiled candidate is tried at besides its own (the LM head's best at one
// row is 192 x 8 at 1x2x1, gate_up's at 65 rows 128 x 72 at 4x1x1: bench/history/).
constexpr uint16_t kRetileClusters[] = {CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                                        CUBLASLT_CLUSTER_SHAPE_4x1x1, CUBLASLT_CLUSTER_SHAPE_1x2x1};

int Alignment(const void *p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % align != 0)
    align /= 2;
  return align;
}

// A heuristic query preference: at most `workspace` bytes, and the alignments
// (bytes) of X (operand B), W (operand A) and Y (C and D) this call has.
cublasStatus_t CreatePreference(uint64_t workspace, uint32_t align_x,
                                uint32_t align_w, uint32_t align_y,
                                cublasLtMatmulPreference_t *out) {
  cublasStatus_t st = cublasLtMatmulPreferenceCreate(out);
  if (st != CUBLAS_STATUS_SUCCESS)
    return st;
  cublasLtMatmulPreference_t pref = *out;
  const uint64_t ws = workspace;
  const uint32_t ax = align_x, aw = align_w, ay = align_y;
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw, sizeof(aw));
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax, sizeof(ax));
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ay, sizeof(ay));
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ay, sizeof(ay));
  return CUBLAS_STATUS_SUCCESS;
}

// Appends cuBLASLt's candidates for one problem (in its order of preference)
// to `out`, skipping those already there.
void AppendCandidates(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                      cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                      cublasLtMatrixLayout_t d, uint64_t workspace,
                      uint32_t align_x, uint32_t align_w, uint32_t align_y,
                      std::vector<cublasLtMatmulAlgo_t> *out) {
  cublasLtMatmulPreference_t pref = nullptr;
  if (CreatePreference(workspace, align_x, align_w, align_y, &pref) !=
      CUBLAS_STATUS_SUCCESS)
    return;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int returned = 0;
  if (cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, pref,
                                     kCandidates, results,
                                     &returned) == CUBLAS_STATUS_SUCCESS) {
    for (int i = 0; i < returned; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS)
        continue;
      const cublasLtMatmulAlgo_t &algo = results[i].algo;
      const bool seen =
          std::any_of(out->begin(), out->end(), [&](const auto &o) {
            return std::memcmp(&o, &algo, sizeof(algo)) == 0;
          });
      if (!seen)
        out->push_back(algo);
    }
  }
  cublasLtMatmulPreferenceDestroy(pref);
}

// The configuration attributes of an algorithm that name it in logs and decide
// how it splits K.
struct AlgoConfig {
  int32_t id = -1;
  uint32_t tile = 0, stages = 0, reduction = 0, swizzle = 0, custom = 0;
  int32_t splitk = 1;
  uint16_t inner = 0, cluster = 0;
};

template <typename T>
void ReadAttribute(const cublasLtMatmulAlgo_t &algo,
                   cublasLtMatmulAlgoConfigAttributes_t attr, T *value) {
  T v = {};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v),
                                           &written) == CUBLAS_STATUS_SUCCESS &&
      written == sizeof(v)) {
    *value = v;
  }
}

AlgoConfig ReadConfig(const cublasLtMatmulAlgo_t &algo) {
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
bool SameKSplit(const AlgoConfig &a, const AlgoConfig &b) {
  const int32_t sa = std::max<int32_t>(1, a.splitk),
                sb = std::max<int32_t>(1, b.splitk);
  const uint32_t ra = sa > 1 ? a.reduction : 0, rb = sb > 1 ? b.reduction : 0;
  return sa == sb && ra == rb;
}

// Whether an algorithm's output is a fixed function of its inputs: without a
// K split, or with one whose partial sums are added in a fixed order. INPLACE
// adds them in the output through counters that "guarantee the sequentiality"
// (cublasLt.h); COMPUTE_TYPE and OUTPUT_TYPE add them in a separate pass over
// the workspace. A split without a scheme (NONE), or a value this code does
// not know, is refused.
bool DeterministicReduction(const AlgoConfig &c) {
  if (c.splitk <= 1)
    return true;
  return c.reduction == CUBLASLT_REDUCTION_SCHEME_INPLACE ||
         c.reduction == CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE ||
         c.reduction == CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
}

// `algo` with the K split of `base` (split count and reduction scheme) set in
// its configuration, so that it may add up K as the base does; false when the
// algorithm does not support that split or scheme. cuBLASLt still has to
// accept the result (AlgoFits), and the self-check decides.
bool WithKSplit(const cublasLtMatmulAlgo_t &algo, const AlgoConfig &base,
                cublasLtMatmulAlgo_t *out) {
  const int32_t splitk = std::max<int32_t>(1, base.splitk);
  const uint32_t reduction =
      splitk > 1 ? base.reduction
                 : static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE);
  if (splitk > 1) {
    int32_t split_support = 0;
    uint32_t scheme_mask = 0;
    size_t written = 0;
    if (cublasLtMatmulAlgoCapGetAttribute(
            &algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &split_support,
            sizeof(split_support), &written) != CUBLAS_STATUS_SUCCESS ||
        split_support == 0 ||
        cublasLtMatmulAlgoCapGetAttribute(
            &algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &scheme_mask,
            sizeof(scheme_mask), &written) != CUBLAS_STATUS_SUCCESS ||
        (scheme_mask & reduction) != reduction) {
      return false;
    }
  }
  cublasLtMatmulAlgo_t a = algo;
  if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                           &splitk, sizeof(splitk)) !=
          CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulAlgoConfigSetAttribute(
          &a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
          sizeof(reduction)) != CUBLAS_STATUS_SUCCESS) {
    return false;
  }
  *out = a;
  return true;
}

bool SameAlgo(const cublasLtMatmulAlgo_t &a, const cublasLtMatmulAlgo_t &b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0;
}

std::string ConfigString(const cublasLtMatmulAlgo_t &algo) {
  const AlgoConfig c = ReadConfig(algo);
  char buf[160];
  std::snprintf(buf, sizeof(buf),
                "algo %d tile %u stages %u splitK %d reduction %u swizzle %u "
                "custom %u inner %u cluster %u",
                c.id, c.tile, c.stages, c.splitk, c.reduction, c.swizzle,
                c.custom, c.inner, c.cluster);
  return buf;
}

// Self-check rows. In an m-row check input, a row is a probe row (a copy of
// probe row `row % probe`, whose output is known from the base algorithm) when
// it lies in an even group of `probe` rows or among the last `probe` rows (the
// last, partial tile); the other rows are filler of their own. So probe copies
// sit at many positions inside the candidate's tiles.
__host__ __device__ inline bool IsProbeRow(int64_t row, int64_t m,
                                           int64_t probe) {
  return (row / probe) % 2 == 0 || row >= m - probe;
}

__device__ inline uint64_t SplitMix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// x[m, k]: uniform values in (-1, 1) scaled by 2^e, e in [-6, 6] drawn per row
// (activations of various magnitudes), with one element in 32 a further 32x
// outlier. Probe rows get the content of their probe index, so every copy of
// probe row r is the same bf16 row.
__global__ void FillCheckRowsKernel(bf16 *x, int64_t m, int64_t k,
                                    int64_t probe) {
  const int64_t total = m * k;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < total; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / k, col = i % k;
    const uint64_t id = IsProbeRow(row, m, probe) ? row % probe : probe + row;
    const uint64_t h = SplitMix64(SplitMix64(id) ^ static_cast<uint64_t>(col));
    const int e = static_cast<int>(SplitMix64(id ^ 0x5EEDull) % 13) - 6;
    float v = static_cast<float>(h >> 40) * (2.0f / 16777216.0f) - 1.0f;
    v = ldexpf(v, e);
    if ((h & 31) == 0)
      v *= 32.0f;
    x[i] = __float2bfloat16(v);
  }
}

// Adds to *count the elements of the probe rows of y[m, n] whose bits differ
// from those of their probe row in ref[probe, n]. T is a same-size unsigned
// integer type, so the comparison is of bits.
template <typename T>
__global__ void CountMismatchesKernel(const T *y, const T *ref, int64_t m,
                                      int64_t n, int64_t probe,
                                      unsigned long long *count) {
  const int64_t total = m * n;
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < total; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / n;
    if (!IsProbeRow(row, m, probe))
      continue;
    local += y[i] != ref[(row % probe) * n + i % n];
  }
  if (local != 0)
    atomicAdd(count, local);
}

// Adds to *sum a hash of every element of y[total] with its index: equal
// outputs give equal sums, and a sum of 64-bit words does not depend on the
// order of the additions. T as in CountMismatchesKernel.
template <typename T>
__global__ void FingerprintKernel(const T *y, int64_t total,
                                  unsigned long long *sum) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < total; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    local += SplitMix64((static_cast<uint64_t>(i) << 32) ^ y[i]);
  }
  // One atomic a warp: a single counter takes them one at a time.
  for (int offset = 16; offset > 0; offset /= 2)
    local += __shfl_down_sync(0xffffffffu, local, offset);
  if (threadIdx.x % 32 == 0)
    atomicAdd(sum, local);
}

// Reads words[count]: evicts the weights from L2 before a timed launch. A
// memset would do it too but leave L2 full of dirty lines, whose write-back
// would then slow down, and blur, the timed GEMM. The store never happens in
// practice (blocks have 256 threads) but keeps the loads alive.
__global__ void ReadFlushKernel(const uint4 *words, int64_t count,
                                unsigned *sink) {
  unsigned acc = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < count; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = words[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (threadIdx.x == 1023 && acc == 0x9E3779B9u)
    *sink = acc;
}

unsigned Blocks(int64_t total) {
  return static_cast<unsigned>(std::max<int64_t>(
      1, std::min<int64_t>((total + kThreads - 1) / kThreads, 2048)));
}

cudaError_t FillCheckRows(bf16 *x, int64_t m, int64_t k, int64_t probe,
                          cudaStream_t stream) {
  FillCheckRowsKernel<<<Blocks(m * k), kThreads, 0, stream>>>(x, m, k, probe);
  return cudaGetLastError();
}

cudaError_t CountMismatches(const void *y, const void *ref, bool fp32,
                            int64_t m, int64_t n, int64_t probe,
                            unsigned long long *count, cudaStream_t stream) {
  if (fp32) {
    CountMismatchesKernel<<<Blocks(m * n), kThreads, 0, stream>>>(
        static_cast<const uint32_t *>(y), static_cast<const uint32_t *>(ref), m,
        n, probe, count);
  } else {
    CountMismatchesKernel<<<Blocks(m * n), kThreads, 0, stream>>>(
        static_cast<const uint16_t *>(y), static_cast<const uint16_t *>(ref), m,
        n, probe, count);
  }
  return cudaGetLastError();
}

cudaError_t Fingerprint(const void *y, bool fp32, int64_t total,
                        unsigned long long *sum, cudaStream_t stream) {
  if (fp32) {
    FingerprintKernel<<<Blocks(total), kThreads, 0, stream>>>(
        static_cast<const uint32_t *>(y), total, sum);
  } else {
    FingerprintKernel<<<Blocks(total), kThreads, 0, stream>>>(
        static_cast<const uint16_t *>(y), total, sum);
  }
  return cudaGetLastError();
}

// Bytes of a buffer whose reading evicts weights of n x k bf16 from L2: twice
// the L2 size, or 0 when the weights are too big to sit there between two
// launches anyway (a model's layers stream theirs from HBM).
size_t FlushBytes(int64_t n, int64_t k) {
  int device = 0, l2_bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const size_t weight_bytes = static_cast<size_t>(n * k) * sizeof(bf16);
  return weight_bytes < size_t{4} * l2_bytes ? size_t{2} * l2_bytes : 0;
}

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
  bool Allocate(size_t x_bytes, size_t y_bytes, size_t ref_bytes,
                size_t counters, size_t flush_bytes) {
    const auto round = [](size_t b) { return (b + 255) / 256 * 256; };
    const size_t counter_bytes =
        round(std::max<size_t>(1, counters) * sizeof(unsigned long long));
    const size_t total = round(x_bytes) + round(y_bytes) + round(ref_bytes) +
                         counter_bytes + 256 + round(flush_bytes);
    if (cudaMalloc(&block_, total) != cudaSuccess) {
      block_ = nullptr;
      cudaGetLastError(); // an allocation failure is not sticky; clear it
      return false;
    }
    char *p = static_cast<char *>(block_);
    x = reinterpret_cast<bf16 *>(p);
    p += round(x_bytes);
    y = p;
    p += round(y_bytes);
    ref = p;
    p += round(ref_bytes);
    count = reinterpret_cast<unsigned long long *>(p);
    p += counter_bytes;
    sink_ = reinterpret_cast<unsigned *>(p);
    p += 256;
    flush_ = flush_bytes > 0 ? p : nullptr;
    flush_bytes_ = flush_bytes / sizeof(uint4) * sizeof(uint4);
    return true;
  }
  // Enqueues the eviction of L2 (nothing without a flush buffer).
  cudaError_t EvictL2() const {
    if (flush_ == nullptr || flush_bytes_ == 0)
      return cudaSuccess;
    const int64_t words = static_cast<int64_t>(flush_bytes_ / sizeof(uint4));
    ReadFlushKernel<<<Blocks(words), kThreads, 0, stream_>>>(
        static_cast<const uint4 *>(flush_), words, sink_);
    return cudaGetLastError();
  }

  bf16 *x = nullptr;
  void *y = nullptr;
  void *ref = nullptr;
  unsigned long long *count = nullptr; // `counters` of them

private:
  cudaStream_t stream_;
  void *block_ = nullptr;
  unsigned *sink_ = nullptr;
  void *flush_ = nullptr;
  size_t flush_bytes_ = 0;
};

// CUDA events, destroyed with the object.
class Events {
public:
  ~Events() {
    for (cudaEvent_t e : events_)
      cudaEventDestroy(e);
  }
  // Appends an event recorded on `stream` now; null on failure.
  cudaEvent_t Record(cudaStream_t stream) {
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess)
      return nullptr;
    events_.push_back(e);
    return cudaEventRecord(e, stream) == cudaSuccess ? e : nullptr;
  }

private:
  std::vector<cudaEvent_t> events_;
};

// Times `slots` launches, each the least GPU time (microseconds) of
// kTimingReps rounds in which every slot runs once, L2 evicted before each:
// (*us)[i] for launch(i). False when a CUDA call or a launch failed.
bool TimeLaunches(size_t slots, const std::function<bool(size_t)> &launch,
                  const CheckScratch &scratch, cudaStream_t stream,
                  std::vector<float> *us) {
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
    if (cudaEventElapsedTime(&ms, marks[j].first, marks[j].second) !=
        cudaSuccess) {
      ok = false;
      break;
    }
    float &best = (*us)[j % slots];
    if (best < 0.0f || ms * 1e3f < best)
      best = ms * 1e3f;
  }
  if (!ok)
    cudaGetLastError();
  return ok;
}

} // namespace

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
    if (d != nullptr)
      cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr)
      cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr)
      cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr)
      cublasLtMatmulDescDestroy(desc);
  }
};

cublasStatus_t Gemm::Create(size_t workspace_bytes, std::unique_ptr<Gemm> *out,
                            int64_t invariant_rows, int64_t plan_rows,
                            bool bucket_classes, bool timed_picks,
                            bool retile) {
  std::unique_ptr<Gemm> g(new Gemm());
  g->timed_picks_ = timed_picks;
  g->retile_ = retile;
  g->invariant_rows_ = invariant_rows > 0 ? invariant_rows : 0;
  g->plan_rows_ = std::max<int64_t>(
      1, std::min(plan_rows, std::max<int64_t>(1, invariant_rows)));
  if (g->invariant_rows_ > 0) {
    // [1, 1] (decode of one sequence), [2, plan_rows], then doubling ranges;
    // with bucket_classes each bound one row later (gemm.h).
    const int64_t shift = bucket_classes ? 1 : 0;
    g->class_hi_.push_back(1);
    for (int64_t hi = std::max<int64_t>(g->plan_rows_, 2);
         g->class_hi_.back() < g->invariant_rows_; hi *= 2) {
      g->class_hi_.push_back(std::min(hi + shift, g->invariant_rows_));
    }
  }
  if (cublasStatus_t st = cublasLtCreate(&g->handle_);
      st != CUBLAS_STATUS_SUCCESS)
    return st;
  if (workspace_bytes > 0) {
    if (cudaMalloc(&g->workspace_, workspace_bytes) != cudaSuccess) {
      return CUBLAS_STATUS_ALLOC_FAILED;
    }
    g->workspace_bytes_ = workspace_bytes;
  }
  *out = std::move(g);
  return CUBLAS_STATUS_SUCCESS;
}

Gemm::~Gemm() {
  plans_.clear();
  if (workspace_ != nullptr)
    cudaFree(workspace_);
  if (handle_ != nullptr)
    cublasLtDestroy(handle_);
}

cublasStatus_t Gemm::MakeLayouts(const Key &key, Plan *plan) {
  const auto [m, n, k, y_fp32, has_bias, align_x, align_w, align_y, splits] =
      key;
  (void)align_x;
  (void)align_w;
  (void)align_y;
  cublasStatus_t st =
      cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (st != CUBLAS_STATUS_SUCCESS)
    return st;
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                 &trans_a, sizeof(trans_a));
  cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                 &trans_b, sizeof(trans_b));
  if (has_bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                   &epilogue, sizeof(epilogue));
    cublasLtMatmulDescSetAttribute(plan->desc,
                                   CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                   &bias_type, sizeof(bias_type));
  }
  const cudaDataType_t y_type = y_fp32 ? CUDA_R_32F : CUDA_R_16BF;
  // A K split is a strided batch: batch s reads the K range [s k/S, (s+1) k/S)
  // of w and x in place (leading dimension k, batch offset k/S elements) and
  // writes its own [m, n] slab of y.
  const int64_t part = k / splits;
  if ((st = cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, part, n, k)) !=
          CUBLAS_STATUS_SUCCESS ||
      (st = cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, part, m, k)) !=
          CUBLAS_STATUS_SUCCESS ||
      (st = cublasLtMatrixLayoutCreate(&plan->d, y_type, n, m, n)) !=
          CUBLAS_STATUS_SUCCESS) {
    return st;
  }
  if (splits > 1) {
    const int32_t count = splits;
    const int64_t slab = m * n;
    for (const auto &[layout, offset] :
         {std::pair{plan->a, part}, std::pair{plan->b, part},
          std::pair{plan->d, slab}}) {
      if ((st = cublasLtMatrixLayoutSetAttribute(
               layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
               sizeof(count))) != CUBLAS_STATUS_SUCCESS ||
          (st = cublasLtMatrixLayoutSetAttribute(
               layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset,
               sizeof(offset))) != CUBLAS_STATUS_SUCCESS) {
        return st;
      }
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

bool Gemm::AlgoFits(const cublasLtMatmulAlgo_t &algo, const Plan &plan) {
  cublasLtMatmulHeuristicResult_t check = {};
  return cublasLtMatmulAlgoCheck(handle_, plan.desc, plan.a, plan.b, plan.d,
                                 plan.d, &algo,
                                 &check) == CUBLAS_STATUS_SUCCESS &&
         check.workspaceSize <= workspace_bytes_;
}

size_t Gemm::ClassOf(int64_t m) const {
  return static_cast<size_t>(
      std::lower_bound(class_hi_.begin(), class_hi_.end(), m) -
      class_hi_.begin());
}

cublasStatus_t Gemm::ChooseAlgo(const Key &key, const GemmParams &p,
                                cudaStream_t stream, Plan *plan) {
  const auto [m, n, k, y_fp32, has_bias, align_x, align_w, align_y, splits] =
      key;
  plan->provisional = false;
  if (invariant_rows_ > 0 && m <= invariant_rows_) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
      cudaGetLastError();
      capture = cudaStreamCaptureStatusActive; // unknown: do not sync
    }
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    Family &family = FamilyFor(key, p, stream, capturing);
    if (family.found) {
      const size_t c = ClassOf(m);
      RowClass &rc = family.classes[c];
      if (!rc.decided && !capturing) {
        const auto start = std::chrono::steady_clock::now();
        DecideClass(
            FamilyKey{n, k, y_fp32, has_bias, align_x, align_w, align_y, splits},
            &family, c, p, stream);
        rc.decide_ms = std::chrono::duration<float, std::milli>(
                           std::chrono::steady_clock::now() - start)
                           .count();
      }
      if (rc.decided && rc.own && AlgoFits(rc.algo, *plan)) {
        plan->algo = rc.algo;
        return CUBLAS_STATUS_SUCCESS;
      }
      if (AlgoFits(family.base, *plan)) {
        plan->algo = family.base;
        plan->provisional = !rc.decided;
        return CUBLAS_STATUS_SUCCESS;
      }
    }
  }
  cublasLtMatmulPreference_t pref = nullptr;
  cublasStatus_t st =
      CreatePreference(workspace_bytes_, align_x, align_w, align_y, &pref);
  if (st != CUBLAS_STATUS_SUCCESS)
    return st;
  cublasLtMatmulHeuristicResult_t result = {};
  int returned = 0;
  st = cublasLtMatmulAlgoGetHeuristic(handle_, plan->desc, plan->a, plan->b,
                                      plan->d, plan->d, pref, 1, &result,
                                      &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS)
    return st;
  if (returned == 0)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  plan->algo = result.algo;
  return CUBLAS_STATUS_SUCCESS;
}

Gemm::Family &Gemm::FamilyFor(const Key &key, const GemmParams &p,
                              cudaStream_t stream, bool capturing) {
  const auto [m, n, k, y_fp32, has_bias, align_x, align_w, align_y, splits] =
      key;
  (void)m;
  const FamilyKey fk{n, k, y_fp32, has_bias, align_x, align_w, align_y,
                     splits};
  auto found = families_.find(fk);
  if (found != families_.end())
    return found->second;
  Family &family = families_[fk];
  family.classes.resize(class_hi_.size());
  const auto start = std::chrono::steady_clock::now();
  ChooseBase(fk, p, stream, capturing, &family);
  family.choose_ms = std::chrono::duration<float, std::milli>(
                         std::chrono::steady_clock::now() - start)
                         .count();
  if (!family.found)
    ++non_invariant_shapes_;
  else if (!family.timed)
    ++untimed_bases_;
  return family;
}

void Gemm::ChooseBase(const FamilyKey &fk, const GemmParams &p,
                      cudaStream_t stream, bool capturing, Family *family) {
  const int64_t n = std::get<0>(fk), k = std::get<1>(fk);
  const bool y_fp32 = std::get<2>(fk), has_bias = std::get<3>(fk);
  const int align_x = std::get<4>(fk), align_w = std::get<5>(fk),
            align_y = std::get<6>(fk), splits = std::get<7>(fk);
  const auto key_for = [&](int64_t m) {
    return Key{m, n, k, y_fp32, has_bias, align_x, align_w, align_y, splits};
  };
  // The timed row counts (capped at invariant_rows; a row count capped onto
  // an earlier one is dropped with its weight) and the largest of them.
  std::vector<int64_t> timed_m;
  std::vector<double> weights;
  for (size_t i = 0; i < sizeof(kCostRows) / sizeof(kCostRows[0]); ++i) {
    const int64_t m = std::min(kCostRows[i], invariant_rows_);
    if (timed_m.empty() || m > timed_m.back()) {
      timed_m.push_back(m);
      weights.push_back(kCostWeights[i]);
    }
  }
  const int64_t max_timed = timed_m.back();
  std::vector<std::unique_ptr<Plan>> plans;
  Plan at_most;
  bool ok =
      MakeLayouts(key_for(invariant_rows_), &at_most) == CUBLAS_STATUS_SUCCESS;
  for (int64_t m : timed_m) {
    plans.push_back(std::make_unique<Plan>());
    ok = ok &&
         MakeLayouts(key_for(m), plans.back().get()) == CUBLAS_STATUS_SUCCESS;
  }
  if (!ok)
    return;
  if (has_bias) {
    for (auto &plan : plans) {
      cublasLtMatmulDescSetAttribute(plan->desc,
                                     CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                     sizeof(p.bias));
    }
  }

  // cuBLASLt's candidates for m = 1, plan_rows, the timed row counts and
  // invariant_rows, one list each, in its order.
  std::vector<int64_t> list_rows;
  std::vector<int64_t> wanted = {1, plan_rows_};
  wanted.insert(wanted.end(), timed_m.begin(), timed_m.end());
  wanted.push_back(invariant_rows_);
  for (int64_t rows : wanted) {
    rows = std::min(rows, invariant_rows_);
    if (std::find(list_rows.begin(), list_rows.end(), rows) == list_rows.end())
      list_rows.push_back(rows);
  }
  std::vector<std::vector<cublasLtMatmulAlgo_t>> lists(list_rows.size());
  for (size_t l = 0; l < list_rows.size(); ++l) {
    Plan at_rows;
    if (MakeLayouts(key_for(list_rows[l]), &at_rows) == CUBLAS_STATUS_SUCCESS) {
      AppendCandidates(handle_, at_rows.desc, at_rows.a, at_rows.b, at_rows.d,
                       workspace_bytes_, align_x, align_w, align_y, &lists[l]);
    }
  }
  const auto list_of = [&](int64_t rows) {
    return static_cast<size_t>(
        std::find(list_rows.begin(), list_rows.end(), rows) -
        list_rows.begin());
  };
  // A base must give fixed bits and run at every m of the range: at both ends
  // and at the timed row counts.
  const auto can_be_base = [&](const cublasLtMatmulAlgo_t &algo) {
    if (!DeterministicReduction(ReadConfig(algo)) || !AlgoFits(algo, at_most))
      return false;
    for (const auto &plan : plans) {
      if (!AlgoFits(algo, *plan))
        return false;
    }
    return true;
  };

  // The untimed choice: the first valid candidate for plan_rows, then for the
  // other row counts.
  std::vector<size_t> untimed_order = {
      list_of(std::min(plan_rows_, invariant_rows_))};
  for (size_t l = 0; l < lists.size(); ++l) {
    if (l != untimed_order[0])
      untimed_order.push_back(l);
  }
  const cublasLtMatmulAlgo_t *first = nullptr;
  for (size_t l : untimed_order) {
    for (const cublasLtMatmulAlgo_t &algo : lists[l]) {
      if (can_be_base(algo)) {
        first = &algo;
        break;
      }
    }
    if (first != nullptr)
      break;
  }
  if (first == nullptr)
    return; // not row-invariant
  family->found = true;
  family->base = *first;
  family->timed_rows = timed_m;
  if (capturing) {
    family->why = "untimed (first used while the stream captured a graph)";
    return;
  }
  if (!timed_picks_) {
    family->why = "untimed (timing off)";
    return;
  }

  // The pool: the untimed choice, then potential bases taken in turn from
  // the lists (m = 1 first), then as helpers cuBLASLt's first pick for each
  // timed row count.
  struct Member {
    cublasLtMatmulAlgo_t algo;
    AlgoConfig config;
    bool base; // may be the base
  };
  std::vector<Member> pool;
  const auto in_pool = [&](const cublasLtMatmulAlgo_t &algo) {
    return std::any_of(pool.begin(), pool.end(), [&](const Member &member) {
      return SameAlgo(member.algo, algo);
    });
  };
  pool.push_back({*first, ReadConfig(*first), true});
  for (size_t i = 0;
       i < static_cast<size_t>(kCandidates) && pool.size() < kMaxBases; ++i) {
    for (size_t l = 0; l < lists.size() && pool.size() < kMaxBases; ++l) {
      if (i < lists[l].size() && !in_pool(lists[l][i]) &&
          can_be_base(lists[l][i])) {
        pool.push_back({lists[l][i], ReadConfig(lists[l][i]), true});
      }
    }
  }
  const size_t bases = pool.size();
  std::vector<int> pick(timed_m.size(), -1); // cuBLASLt's pick, per timed m
  for (size_t t = 0; t < timed_m.size(); ++t) {
    for (const cublasLtMatmulAlgo_t &algo : lists[list_of(timed_m[t])]) {
      if (!AlgoFits(algo, *plans[t]))
        continue;
      for (size_t i = 0; i < pool.size(); ++i) {
        if (SameAlgo(pool[i].algo, algo))
          pick[t] = static_cast<int>(i);
      }
      if (pick[t] < 0) {
        pick[t] = static_cast<int>(pool.size());
        pool.push_back({algo, ReadConfig(algo), false});
      }
      break;
    }
  }

  const size_t elem = y_fp32 ? sizeof(float) : sizeof(bf16);
  const size_t slots = pool.size() * timed_m.size();
  CheckScratch scratch(stream);
  if (!scratch.Allocate(static_cast<size_t>(max_timed * k) * sizeof(bf16),
                        static_cast<size_t>(splits * max_timed * n) * elem, 0,
                        slots, FlushBytes(n, k))) {
    family->why = "untimed (no device memory for the measurement)";
    return;
  }
  const float alpha = 1.0f, beta = 0.0f;
  const auto matmul = [&](const cublasLtMatmulAlgo_t &algo, const Plan &plan) {
    return cublasLtMatmul(handle_, plan.desc, &alpha, p.w, plan.a, scratch.x,
                          plan.b, &beta, scratch.y, plan.d, scratch.y, plan.d,
                          &algo, workspace_, workspace_bytes_, stream);
  };
  // Slot t * pool.size() + i: member i at timed_m[t].
  std::vector<char> usable(slots, 0);
  std::vector<unsigned long long> prints(slots, 0);
  ok = cudaMemsetAsync(scratch.count, 0, slots * sizeof(*scratch.count),
                       stream) == cudaSuccess;
  for (size_t t = 0; t < timed_m.size() && ok; ++t) {
    // The input the timing will run on, too.
    ok = FillCheckRows(scratch.x, timed_m[t], k,
                       std::min(kProbeRows, timed_m[t]), stream) == cudaSuccess;
    for (size_t i = 0; i < pool.size() && ok; ++i) {
      const size_t slot = t * pool.size() + i;
      if (!AlgoFits(pool[i].algo, *plans[t]))
        continue;
      if (matmul(pool[i].algo, *plans[t]) != CUBLAS_STATUS_SUCCESS) {
        cudaGetLastError(); // see DecideClass
        continue;
      }
      usable[slot] = 1;
      ok = Fingerprint(scratch.y, y_fp32, splits * timed_m[t] * n,
                       scratch.count + slot, stream) == cudaSuccess;
    }
  }
  ok = ok &&
       cudaMemcpyAsync(prints.data(), scratch.count,
                       slots * sizeof(*scratch.count), cudaMemcpyDeviceToHost,
                       stream) == cudaSuccess &&
       cudaStreamSynchronize(stream) == cudaSuccess;
  if (!ok) {
    cudaGetLastError();
    family->why = "untimed (a CUDA call of the measurement failed)";
    return;
  }
  std::vector<size_t> timed_slots;
  for (size_t slot = 0; slot < slots; ++slot) {
    if (usable[slot])
      timed_slots.push_back(slot);
  }
  std::vector<float> times;
  if (!TimeLaunches(
          timed_slots.size(),
          [&](size_t j) {
            const size_t slot = timed_slots[j];
            return matmul(pool[slot % pool.size()].algo,
                          *plans[slot / pool.size()]) == CUBLAS_STATUS_SUCCESS;
          },
          scratch, stream, &times)) {
    family->why = "untimed (timing failed)";
    return;
  }
  std::vector<float> us(slots, -1.0f);
  for (size_t j = 0; j < timed_slots.size(); ++j)
    us[timed_slots[j]] = times[j];

  // Member c is in b's group at timed_m[t] when both ran there with the same
  // K split and the same output.
  const auto same_at = [&](size_t b, size_t c, size_t t) {
    const size_t sb = t * pool.size() + b, sc = t * pool.size() + c;
    return usable[sb] && usable[sc] && prints[sb] == prints[sc] &&
           SameKSplit(pool[b].config, pool[c].config);
  };
  const auto group_us = [&](size_t b, size_t t) {
    float best = -1.0f;
    for (size_t c = 0; c < pool.size(); ++c) {
      const float u = us[t * pool.size() + c];
      if (same_at(b, c, t) && u >= 0.0f && (best < 0.0f || u < best))
        best = u;
    }
    return best;
  };
  // Negative when b did not run at every timed m.
  const auto cost = [&](size_t b) {
    double sum = 0.0;
    for (size_t t = 0; t < timed_m.size(); ++t) {
      const float g = group_us(b, t);
      if (g < 0.0f)
        return -1.0;
      sum += weights[t] * g;
    }
    return sum;
  };
  int chosen = -1;
  double chosen_cost = 0.0;
  for (size_t b = 0; b < bases; ++b) {
    const double c = cost(b);
    if (c >= 0.0 && (chosen < 0 || c < kDisplace * chosen_cost)) {
      chosen = static_cast<int>(b);
      chosen_cost = c;
    }
  }
  family->bases_timed = static_cast<int>(bases);
  family->helpers_timed = static_cast<int>(pool.size() - bases);
  family->first_cost_us = static_cast<float>(cost(0));
  if (pick[0] >= 0)
    family->m1_pick_us = us[pick[0]];
  if (chosen < 0) {
    family->why = "untimed (no candidate ran at every timed m)";
    return;
  }
  const size_t b = static_cast<size_t>(chosen);
  family->base = pool[b].algo;
  family->timed = true;
  family->why = b == 0 ? "timed; the untimed choice had the least cost"
                       : "timed; least cost";
  family->cost_us = static_cast<float>(chosen_cost);
  for (size_t t = 0; t < timed_m.size(); ++t) {
    family->base_us.push_back(us[t * pool.size() + b]);
    family->group_us.push_back(group_us(b, t));
  }
  family->weights.assign(weights.begin(), weights.end());
  // The base's group, for the row classes' self-checks: members equal to it
  // wherever both ran.
  for (size_t c = 0; c < pool.size(); ++c) {
    bool same = c != b, ran = false;
    for (size_t t = 0; t < timed_m.size() && same; ++t) {
      if (!usable[t * pool.size() + c])
        continue;
      ran = true;
      same = same_at(b, c, t);
    }
    if (same && ran)
      family->group.push_back(pool[c].algo);
  }
}

void Gemm::DecideClass(const FamilyKey &fk, Family *family, size_t c,
                       const GemmParams &p, cudaStream_t stream) {
  RowClass &rc = family->classes[c];
  // Plain variables, not a structured binding: the lambdas below capture them.
  const int64_t n = std::get<0>(fk), k = std::get<1>(fk);
  const bool y_fp32 = std::get<2>(fk), has_bias = std::get<3>(fk);
  const int align_x = std::get<4>(fk), align_w = std::get<5>(fk),
            align_y = std::get<6>(fk), splits = std::get<7>(fk);
  const auto decide = [&](bool own, const cublasLtMatmulAlgo_t *algo,
                          const char *why) {
    rc.decided = true;
    rc.own = own;
    if (own)
      rc.algo = *algo;
    rc.why = why;
    ++(own ? own_classes_ : base_classes_);
    if (!own && rc.base_mismatch)
      ++self_check_failures_;
  };
  const auto key_for = [&](int64_t m) {
    return Key{m, n, k, y_fp32, has_bias, align_x, align_w, align_y, splits};
  };
  const int64_t lo = c == 0 ? 1 : class_hi_[c - 1] + 1, hi = class_hi_[c];
  const int64_t probe = std::min(kProbeRows, invariant_rows_);
  // Row counts checked: both ends of the class and its middle, so that the
  // first, a middle and the last tile count of the candidate are covered.
  std::vector<int64_t> rows = {lo};
  if ((lo + hi) / 2 > lo)
    rows.push_back((lo + hi) / 2);
  if (hi > rows.back())
    rows.push_back(hi);

  Plan ref_plan;
  std::vector<std::unique_ptr<Plan>> plans;
  bool ok = MakeLayouts(key_for(probe), &ref_plan) == CUBLAS_STATUS_SUCCESS;
  for (int64_t m : rows) {
    plans.push_back(std::make_unique<Plan>());
    ok = ok &&
         MakeLayouts(key_for(m), plans.back().get()) == CUBLAS_STATUS_SUCCESS;
  }
  if (!ok) {
    decide(false, nullptr, "base (cuBLASLt refused the check's layouts)");
    return;
  }
  if (has_bias) {
    cublasLtMatmulDescSetAttribute(ref_plan.desc,
                                   CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                   sizeof(p.bias));
    for (auto &plan : plans) {
      cublasLtMatmulDescSetAttribute(plan->desc,
                                     CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                     sizeof(p.bias));
    }
  }

  // cuBLASLt's preferences for the class's largest m, then its smallest, of
  // the base's K split; the base's timing group (ChooseBase); then the
  // preferences of another K split, set to the base's.
  const auto is_base = [&](const cublasLtMatmulAlgo_t &algo) {
    return SameAlgo(algo, family->base);
  };
  const AlgoConfig base_config = ReadConfig(family->base);
  std::vector<cublasLtMatmulAlgo_t> preferred, candidates;
  for (const Plan *plan : {plans.back().get(), plans.front().get()}) {
    AppendCandidates(handle_, plan->desc, plan->a, plan->b, plan->d,
                     workspace_bytes_, align_x, align_w, align_y, &preferred);
  }
  const auto add = [&](const cublasLtMatmulAlgo_t &algo) {
    if (!is_base(algo) &&
        std::none_of(candidates.begin(), candidates.end(),
                     [&](const auto &c) { return SameAlgo(c, algo); })) {
      candidates.push_back(algo);
    }
  };
  for (const cublasLtMatmulAlgo_t &algo : preferred) {
    if (SameKSplit(ReadConfig(algo), base_config))
      add(algo);
  }
  for (const cublasLtMatmulAlgo_t &algo : family->group)
    add(algo);
  for (const cublasLtMatmulAlgo_t &algo : preferred) {
    cublasLtMatmulAlgo_t resplit = {};
    if (!SameKSplit(ReadConfig(algo), base_config) &&
        WithKSplit(algo, base_config, &resplit) &&
        SameKSplit(ReadConfig(resplit), base_config)) {
      add(resplit);
    }
  }

  const size_t elem = y_fp32 ? sizeof(float) : sizeof(bf16);
  CheckScratch scratch(stream);
  if (!scratch.Allocate(static_cast<size_t>(hi * k) * sizeof(bf16),
                        static_cast<size_t>(splits * hi * n) * elem,
                        static_cast<size_t>(splits * probe * n) * elem, 1,
                        FlushBytes(n, k))) {
    decide(false, nullptr, "base (no device memory for the self-check)");
    return;
  }
  const float alpha = 1.0f, beta = 0.0f;
  const auto matmul = [&](const cublasLtMatmulAlgo_t &algo, const Plan &plan,
                          void *y) {
    return cublasLtMatmul(handle_, plan.desc, &alpha, p.w, plan.a, scratch.x,
                          plan.b, &beta, y, plan.d, y, plan.d, &algo,
                          workspace_, workspace_bytes_, stream);
  };
  // Re-tiled candidates. For a few rows cuBLASLt's lists lean on wide tiles:
  // at the 8B's gate_up and 65 rows its picks run 256 weight rows a CTA (112
  // CTAs, 62-63 us), while the same kernels re-tiled to 128 rows, with the
  // class's token extent and another cluster shape, run in 59 us with the same
  // bits (bench/history/20-gpu-run-14.md). So in classes of up to
  // kRetileMaxRows rows every candidate is also tried at every tile width and
  // at the kRetileClusters shapes, and then every candidate is timed once at
  // the class's largest m and the list put in that order, so that the
  // self-check and the final timing below see the fastest first.
  if (retile_ && timed_picks_ && hi <= kRetileMaxRows) {
    const size_t sources = candidates.size();
    const int extent = static_cast<int>((hi + 7) / 8) - 1;
    for (size_t i = 0; i < sources; ++i) {
      for (const cublasLtMatmulTile_t tile : {kRetileTiles[0][extent],
                                             kRetileTiles[1][extent],
                                             kRetileTiles[2][extent],
                                             kRetileTiles[3][extent]}) {
        for (int c = -1; c < static_cast<int>(sizeof(kRetileClusters) /
                                              sizeof(kRetileClusters[0]));
             ++c) {
          cublasLtMatmulAlgo_t variant = candidates[i];
          const uint32_t t = tile;
          cublasLtMatmulAlgoConfigSetAttribute(
              &variant, CUBLASLT_ALGO_CONFIG_TILE_ID, &t, sizeof(t));
          if (c >= 0) {
            cublasLtMatmulAlgoConfigSetAttribute(
                &variant, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
                &kRetileClusters[c], sizeof(kRetileClusters[c]));
          }
          bool fits = SameKSplit(ReadConfig(variant), base_config);
          for (const auto &plan : plans)
            fits = fits && AlgoFits(variant, *plan);
          if (fits)
            add(variant);
        }
      }
    }
    std::vector<float> quick;
    if (!candidates.empty() &&
        TimeLaunches(
            candidates.size(),
            [&](size_t i) {
              return matmul(candidates[i], *plans.back(), scratch.y) ==
                     CUBLAS_STATUS_SUCCESS;
            },
            scratch, stream, &quick)) {
      std::vector<size_t> order(candidates.size());
      std::iota(order.begin(), order.end(), size_t{0});
      std::stable_sort(order.begin(), order.end(),
                       [&](size_t a, size_t b) { return quick[a] < quick[b]; });
      std::vector<cublasLtMatmulAlgo_t> sorted;
      for (size_t i : order)
        sorted.push_back(candidates[i]);
      candidates.swap(sorted);
    }
    rc.retiled = true;
  }
  // The reference: the base algorithm on the probe rows alone.
  if (FillCheckRows(scratch.x, probe, k, probe, stream) != cudaSuccess ||
      matmul(family->base, ref_plan, scratch.ref) != CUBLAS_STATUS_SUCCESS) {
    cudaGetLastError();
    decide(false, nullptr, "base (the reference GEMM failed)");
    return;
  }
  enum class Check { kSame, kDiffers, kUnusable, kBroken };
  const auto check = [&](const cublasLtMatmulAlgo_t &algo) {
    for (const auto &plan : plans) {
      if (!AlgoFits(algo, *plan))
        return Check::kUnusable;
    }
    if (cudaMemsetAsync(scratch.count, 0, sizeof(*scratch.count), stream) !=
        cudaSuccess)
      return Check::kBroken;
    for (size_t i = 0; i < rows.size(); ++i) {
      if (FillCheckRows(scratch.x, rows[i], k, probe, stream) != cudaSuccess)
        return Check::kBroken;
      if (matmul(algo, *plans[i], scratch.y) != CUBLAS_STATUS_SUCCESS) {
        // A launch cuBLASLt reports as failed (say, too many resources) leaves
        // its CUDA error behind; the caller's next error check must not see it.
        cudaGetLastError();
        return Check::kUnusable;
      }
      // Each K range's slab against the same slab of the reference.
      for (int s = 0; s < splits; ++s) {
        if (CountMismatches(static_cast<char *>(scratch.y) +
                                static_cast<size_t>(s * rows[i] * n) * elem,
                            static_cast<char *>(scratch.ref) +
                                static_cast<size_t>(s * probe * n) * elem,
                            y_fp32, rows[i], n, probe, scratch.count,
                            stream) != cudaSuccess)
          return Check::kBroken;
      }
    }
    unsigned long long mismatches = 0;
    if (cudaMemcpyAsync(&mismatches, scratch.count, sizeof(mismatches),
                        cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess)
      return Check::kBroken;
    return mismatches == 0 ? Check::kSame : Check::kDiffers;
  };

  // The first few identical candidates, in the order above, then the base.
  std::vector<cublasLtMatmulAlgo_t> passed;
  for (const cublasLtMatmulAlgo_t &candidate : candidates) {
    if (passed.size() == kMaxTimed || rc.checked == kMaxChecked)
      break;
    const Check r = check(candidate);
    if (r == Check::kBroken) {
      decide(false, nullptr, "base (a CUDA call of the self-check failed)");
      return;
    }
    if (r == Check::kUnusable)
      continue;
    ++rc.checked;
    if (r == Check::kDiffers) {
      ++rc.mismatched;
      continue;
    }
    passed.push_back(candidate);
  }
  // The base through the same check: it competes in the timing, and if it
  // differs at these m its own invariance is broken here.
  const Check base_check = check(family->base);
  if (base_check == Check::kBroken) {
    decide(false, nullptr, "base (a CUDA call of the self-check failed)");
    return;
  }
  rc.base_mismatch = base_check == Check::kDiffers;
  if (base_check == Check::kSame)
    passed.push_back(family->base);
  rc.passed = static_cast<int>(passed.size());
  if (passed.empty()) {
    decide(false, nullptr,
           base_check == Check::kDiffers
               ? "base (no candidate passed; the base itself differs here)"
               : "base (no candidate passed)");
    return;
  }

  if (!timed_picks_) {
    decide(!is_base(passed.front()), &passed.front(),
           "first candidate that passed (timing off)");
    return;
  }
  // Time them at the class's smallest and largest m (input rows as the last
  // check left them).
  std::vector<size_t> timed_rows = {0};
  if (plans.size() > 1)
    timed_rows.push_back(plans.size() - 1);
  std::vector<float> times;
  const bool timed = TimeLaunches(
      passed.size() * timed_rows.size(),
      [&](size_t slot) {
        return matmul(passed[slot / timed_rows.size()],
                      *plans[timed_rows[slot % timed_rows.size()]],
                      scratch.y) == CUBLAS_STATUS_SUCCESS;
      },
      scratch, stream, &times);
  if (!timed) {
    decide(!is_base(passed.front()), &passed.front(),
           "first candidate that passed (timing failed)");
    return;
  }
  std::vector<std::vector<float>> best_us(
      passed.size(), std::vector<float>(timed_rows.size(), -1.0f));
  for (size_t slot = 0; slot < times.size(); ++slot)
    best_us[slot / timed_rows.size()][slot % timed_rows.size()] = times[slot];
  const auto total = [&](size_t a) {
    double sum = 0.0;
    for (float us : best_us[a])
      sum += us;
    return sum;
  };
  size_t chosen = 0;
  for (size_t a = 1; a < passed.size(); ++a) {
    if (total(a) < kDisplace * total(chosen))
      chosen = a;
  }
  const bool own = !is_base(passed[chosen]);
  for (size_t t = 0; t < timed_rows.size(); ++t) {
    rc.us[t == 0 ? 0 : 1] = best_us[chosen][t];
    if (!rc.base_mismatch && base_check == Check::kSame)
      rc.base_us[t == 0 ? 0 : 1] = best_us[passed.size() - 1][t];
  }
  if (timed_rows.size() == 1) {
    rc.us[1] = rc.us[0];
    rc.base_us[1] = rc.base_us[0];
  }
  decide(own, &passed[chosen],
         own ? "own (fastest identical candidate)"
             : "base (fastest identical candidate)");
}

std::string Gemm::Summary() const {
  std::string out;
  char buf[256];
  for (const auto &[fk, family] : families_) {
    const auto [n, k, y_fp32, has_bias, align_x, align_w, align_y, splits] =
        fk;
    std::snprintf(buf, sizeof(buf),
                  "n %lld k %lld%s %s%s align x/w/y %d/%d/%d: ",
                  static_cast<long long>(n), static_cast<long long>(k),
                  splits > 1 ? (" in " + std::to_string(splits) + " K ranges")
                                   .c_str()
                             : "",
                  y_fp32 ? "fp32 out" : "bf16 out", has_bias ? " +bias" : "",
                  align_x, align_w, align_y);
    out += buf;
    if (!family.found) {
      out += "no base algorithm (not row-invariant)\n";
      continue;
    }
    out += "base " + ConfigString(family.base) + "\n    " + family.why;
    if (family.timed) {
      // The cost and its terms: the base's group's time at each timed m
      // (the base's own in parentheses), then the untimed choice's cost and
      // cuBLASLt's m = 1 pick (a per-shape decode) for comparison.
      std::snprintf(buf, sizeof(buf), ": cost %.1f us =", family.cost_us);
      out += buf;
      for (size_t t = 0; t < family.timed_rows.size(); ++t) {
        std::snprintf(buf, sizeof(buf), "%s %.2f x %.1f (base %.1f) at m %lld",
                      t == 0 ? "" : " +", family.weights[t], family.group_us[t],
                      family.base_us[t],
                      static_cast<long long>(family.timed_rows[t]));
        out += buf;
      }
      std::snprintf(buf, sizeof(buf),
                    "; untimed choice's cost %.1f us; cuBLASLt's m 1 pick "
                    "%.1f us; %d bases, %d helpers timed, %zu in the group",
                    family.first_cost_us, family.m1_pick_us, family.bases_timed,
                    family.helpers_timed, family.group.size());
      out += buf;
    }
    std::snprintf(buf, sizeof(buf), " (%.1f ms)", family.choose_ms);
    out += buf;
    out += "\n";
    for (size_t c = 0; c < family.classes.size(); ++c) {
      const RowClass &rc = family.classes[c];
      const long long lo = c == 0 ? 1 : class_hi_[c - 1] + 1, hi = class_hi_[c];
      std::snprintf(buf, sizeof(buf), "  rows [%lld, %lld]: ", lo, hi);
      out += buf;
      if (!rc.decided) {
        out += "not used yet\n";
        continue;
      }
      std::snprintf(buf, sizeof(buf),
                    "%s; %d candidates checked%s, %d differed, %d timed "
                    "(base included when it passed)",
                    rc.why, rc.checked,
                    rc.retiled ? " (re-tiled ones too, fastest first)" : "",
                    rc.mismatched, rc.passed);
      out += buf;
      if (rc.us[0] >= 0.0f) {
        std::snprintf(buf, sizeof(buf), "; %.1f / %.1f us at m %lld / %lld",
                      rc.us[0], rc.us[1], lo, hi);
        out += buf;
      }
      if (rc.own && rc.base_us[0] >= 0.0f) {
        std::snprintf(buf, sizeof(buf), " (base %.1f / %.1f us)", rc.base_us[0],
                      rc.base_us[1]);
        out += buf;
      }
      if (rc.own)
        out += ": " + ConfigString(rc.algo);
      std::snprintf(buf, sizeof(buf), " (%.1f ms)", rc.decide_ms);
      out += buf;
      out += "\n";
    }
  }
  return out;
}

cublasStatus_t Gemm::Run(const GemmParams &p, cudaStream_t stream) {
  if (p.m < 0 || p.n <= 0 || p.k <= 0 || (p.bias != nullptr && p.y_fp32) ||
      p.k_splits < 1 ||
      (p.k_splits > 1 && (!p.y_fp32 || !KSplitFits(p.k, p.k_splits)))) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (p.m == 0)
    return CUBLAS_STATUS_SUCCESS;
  if (p.x == nullptr || p.w == nullptr || p.y == nullptr)
    return CUBLAS_STATUS_INVALID_VALUE;
  // With a K split, the alignments cuBLASLt may assume hold for every batch's
  // pointers: a K range starts k/S elements after its predecessor in x and w,
  // a slab m n elements after its predecessor in y (taken as a multiple of n,
  // so that the alignment, and with it the family, does not depend on m).
  const int64_t part_bytes =
      p.k / p.k_splits * static_cast<int64_t>(sizeof(bf16));
  const int64_t slab_bytes = p.n * static_cast<int64_t>(sizeof(float));
  const auto align = [&](const void *ptr, int64_t step) {
    int a = Alignment(ptr);
    while (p.k_splits > 1 && a > 1 && step % a != 0)
      a /= 2;
    return a;
  };
  const Key key{p.m,
                p.n,
                p.k,
                p.y_fp32,
                p.bias != nullptr,
                align(p.x, part_bytes),
                align(p.w, part_bytes),
                align(p.y, slab_bytes),
                p.k_splits};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    auto plan = std::make_unique<Plan>();
    if (cublasStatus_t st = MakeLayouts(key, plan.get());
        st != CUBLAS_STATUS_SUCCESS)
      return st;
    if (cublasStatus_t st = ChooseAlgo(key, p, stream, plan.get());
        st != CUBLAS_STATUS_SUCCESS)
      return st;
    it = plans_.emplace(key, std::move(plan)).first;
  } else if (it->second->provisional) {
    // The class's check was deferred by a capture; try again. On failure the
    // plan keeps the base algorithm it has.
    Plan &plan = *it->second;
    const cublasLtMatmulAlgo_t kept = plan.algo;
    if (ChooseAlgo(key, p, stream, &plan) != CUBLAS_STATUS_SUCCESS) {
      plan.algo = kept;
      plan.provisional = true;
    }
  }
  Plan &plan = *it->second;
  if (p.bias != nullptr) {
    cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                   &p.bias, sizeof(p.bias));
  }
  const float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(handle_, plan.desc, &alpha, p.w, plan.a, p.x, plan.b,
                        &beta, p.y, plan.d, p.y, plan.d, &plan.algo, workspace_,
                        workspace_bytes_, stream);
}

} // namespace cuda
} // namespace specd
