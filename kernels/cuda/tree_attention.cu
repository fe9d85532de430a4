#include <algorithm>
#include <climits>

#include "kernels/cuda/device_utils.cuh"
#include "specd/kernels/cuda/tree_attention.h"

namespace specd {
namespace cuda {
namespace {

using internal::PackBf16x2;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16 * kWarps;  // one m16 MMA row block per warp
static_assert(kRows == kTreeAttentionTileRows, "tile rows");
constexpr int kKeys = 64;  // keys per shared-memory chunk
constexpr int kMaskWords = kTreeAttentionMaskWords;
// One chunk per split at least: decode at short contexts still spreads over many CTAs.
constexpr int kMinKeysPerSplit = kKeys;
constexpr int kMaxSplits = 64;
constexpr float kLog2e = 1.4426950408889634f;

// K and V are kept key-major, each row padded by 8 elements (16 bytes) so that the 32-bit
// fragment loads of K and the ldmatrix row reads of V by a warp hit 32 distinct banks. Two
// stages: while a chunk is computed on, cp.async brings the next one.
template <int HD>
struct __align__(16) AttnStage {
  bf16 k[kKeys][HD + 8];
  bf16 v[kKeys][HD + 8];
};

template <int HD>
struct __align__(16) AttnSmem {
  AttnStage<HD> stage[2];
  int32_t kv_end[kRows];
  int32_t mask_begin[kRows];
  uint32_t mask[kRows][kMaskWords];
};

// 16 bytes global -> shared without a register round trip; `valid` false writes zeros (the
// source is then not read, but must still be a mapped address).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 bf16 matrices, transposed: lanes 8i..8i+7 give the row addresses of matrix i, and
// register i of lane (g = lane / 4, t = lane % 4) receives its elements [2t][g] and [2t+1][g].
__device__ __forceinline__ void LdMatrixX4Trans(const bf16* smem, uint32_t& r0, uint32_t& r1,
                                                uint32_t& r2, uint32_t& r3) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// D += A * B for one m16n8k16 tile, bf16 inputs, fp32 accumulators. Fragment layouts (PTX ISA,
// "Matrix Fragments for mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   A regs: {A[g][2t..2t+1]}, {A[g+8][2t..]}, {A[g][2t+8..]}, {A[g+8][2t+8..]}
//   B regs: {B[2t..2t+1][g]}, {B[2t+8..2t+9][g]}
//   D:      D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t Ld32(const bf16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <int HD>
__device__ __forceinline__ bool Visible(const AttnSmem<HD>& s, int lq, int key, int key_end) {
  if (key >= key_end) return false;
  const int mb = s.mask_begin[lq];
  if (key < mb) return true;
  if (key >= s.kv_end[lq]) return false;
  const int b = key - mb;
  return b < kTreeAttentionMaskBits && ((s.mask[lq][b >> 5] >> (b & 31)) & 1u);
}

// grid = (tiles, kv heads, splits). Warp w owns tile rows [16w, 16w + 16); row r is query
// tile_begin + r / group, head kv_head * group + r % group.
template <int HD>
__global__ void __launch_bounds__(kThreads) TreeAttentionKernel(TreeAttentionParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  AttnSmem<HD>& s = *reinterpret_cast<AttnSmem<HD>*>(smem_raw);
  const int tile = blockIdx.x;
  const int kvh = blockIdx.y;
  const int split = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int q0 = p.tile_begin[tile];
  const int nq = p.tile_end[tile] - q0;
  const int rows = nq * group;
  const int32_t* table =
      p.block_tables + static_cast<int64_t>(p.query_seq[q0]) * p.max_blocks_per_seq;
  const int64_t kv_dim = p.num_kv_heads * HD;

  if (tid < nq) {
    const int64_t qi = q0 + tid;
    const int end = p.kv_end[qi];
    s.kv_end[tid] = end;
    s.mask_begin[tid] = p.mask_begin != nullptr ? min(p.mask_begin[qi], end) : end;
#pragma unroll
    for (int w = 0; w < kMaskWords; ++w) {
      s.mask[tid][w] = p.mask != nullptr ? p.mask[qi * kMaskWords + w] : 0u;
    }
  }
  __syncthreads();
  // Keys of the tile: [0, range_end); all of [0, full_end) is visible to every row.
  int range_end = 0, full_end = INT_MAX;
  for (int i = 0; i < nq; ++i) {
    range_end = max(range_end, s.kv_end[i]);
    full_end = min(full_end, s.mask_begin[i]);
  }
  const int per_split = ((range_end + p.num_splits - 1) / p.num_splits + kKeys - 1) / kKeys * kKeys;
  const int key_begin = split * per_split;
  const int key_end = min(range_end, key_begin + per_split);

  const int r0 = warp * 16 + g;
  const int r1 = r0 + 8;
  const bool warp_active = warp * 16 < rows;
  // Local query index of each of this thread's two rows, clamped so that padding rows read
  // valid (unused) mask entries.
  const int lq0 = min(r0 / group, nq - 1);
  const int lq1 = min(r1 / group, nq - 1);

  uint32_t qf[HD / 16][4];
  {
    const bf16* q_row0 = r0 < rows ? p.q + (q0 + r0 / group) * p.q_stride +
                                         (kvh * group + r0 % group) * static_cast<int64_t>(HD)
                                   : nullptr;
    const bf16* q_row1 = r1 < rows ? p.q + (q0 + r1 / group) * p.q_stride +
                                         (kvh * group + r1 % group) * static_cast<int64_t>(HD)
                                   : nullptr;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const int c = kk * 16 + 2 * t4;
      qf[kk][0] = q_row0 != nullptr ? Ld32(q_row0 + c) : 0u;
      qf[kk][1] = q_row1 != nullptr ? Ld32(q_row1 + c) : 0u;
      qf[kk][2] = q_row0 != nullptr ? Ld32(q_row0 + c + 8) : 0u;
      qf[kk][3] = q_row1 != nullptr ? Ld32(q_row1 + c + 8) : 0u;
    }
  }

  float o[HD / 8][4];
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  const float scale_log2 = p.scale * kLog2e;

  // Chunk c covers keys [key_begin + c * kKeys, +kKeys). Each thread copies the same
  // (key, 16-byte piece) pairs of K and V; keys at or past key_end are zero-filled, never
  // garbage that a zero probability would not cancel (NaN * 0).
  constexpr int kPieces = HD / 8;  // 16-byte pieces of a key's head
  constexpr int kCopies = kKeys * kPieces / kThreads;
  static_assert(kKeys * kPieces % kThreads == 0, "copy split");
  const int num_chunks = key_end > key_begin ? (key_end - key_begin + kKeys - 1) / kKeys : 0;
  const bf16* k_head = p.k_cache + kvh * HD;
  const bf16* v_head = p.v_cache + kvh * HD;
  const int block_size = static_cast<int>(p.block_size);
  auto issue = [&](int chunk) {
    AttnStage<HD>& st = s.stage[chunk & 1];
    const int kb = key_begin + chunk * kKeys;
#pragma unroll
    for (int it = 0; it < kCopies; ++it) {
      const int i = tid + it * kThreads;
      const int key = i / kPieces, c = i % kPieces;
      const int abs_key = kb + key;
      const bool valid = abs_key < key_end;
      int64_t off = 0;
      if (valid) {
        const int64_t slot =
            static_cast<int64_t>(table[abs_key / block_size]) * block_size + abs_key % block_size;
        off = slot * kv_dim + c * 8;
      }
      CpAsync16(&st.k[key][c * 8], k_head + off, valid);
      CpAsync16(&st.v[key][c * 8], v_head + off, valid);
    }
  };
  if (num_chunks > 0) issue(0);
  CpAsyncCommit();

  for (int chunk = 0; chunk < num_chunks; ++chunk) {
    const int kb = key_begin + chunk * kKeys;
    // Prefetch the next chunk into the other stage (freed by the barrier that ended the
    // previous iteration), then wait for this one.
    if (chunk + 1 < num_chunks) issue(chunk + 1);
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();
    const AttnStage<HD>& st = s.stage[chunk & 1];
    if (warp_active) {
      // Scores S = Q K^T for the warp's 16 rows and the chunk's 64 keys.
      float sc[kKeys / 8][4];
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
        sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          const bf16* krow = &st.k[n * 8 + g][kk * 16 + 2 * t4];
          Mma16816(sc[n], qf[kk], Ld32(krow), Ld32(krow + 8));
        }
      }
      const bool need_mask = kb + kKeys > full_end || kb + kKeys > key_end;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = sc[n][e] * scale_log2;
          if (need_mask) {
            const int key = kb + n * 8 + 2 * t4 + (e & 1);
            if (!Visible(s, e < 2 ? lq0 : lq1, key, key_end)) x = -INFINITY;
          }
          sc[n][e] = x;
        }
      }
      // Online softmax (base 2); the 4 threads of a quad share a row.
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
          mx = fmaxf(mx, fmaxf(sc[n][2 * hr], sc[n][2 * hr + 1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(internal::kFullMask, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(internal::kFullMask, mx, 2));
        const float m_new = fmaxf(m[hr], mx);
        // A row with no visible key yet keeps zeros; subtracting 0 instead of -inf avoids NaN.
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = exp2f(m[hr] - m_use);
        float row_sum = 0.0f;
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
          sc[n][2 * hr] = exp2f(sc[n][2 * hr] - m_use);
          sc[n][2 * hr + 1] = exp2f(sc[n][2 * hr + 1] - m_use);
          row_sum += sc[n][2 * hr] + sc[n][2 * hr + 1];
        }
        l[hr] = l[hr] * alpha + row_sum;
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
          o[j][2 * hr] *= alpha;
          o[j][2 * hr + 1] *= alpha;
        }
        m[hr] = m_new;
      }
      // O += P V: the score accumulators of key tiles 2kk and 2kk+1 are exactly the A
      // fragment of the k-step kk; the B fragments of two 8-dim tiles come from one transposed
      // ldmatrix of V's 16 key rows (lanes 0-15: dims j*8.., lanes 16-31: dims (j+1)*8..).
      const int v_row = lane & 15, v_col = (lane >> 4) * 8;
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        const uint32_t a[4] = {PackBf16x2(sc[2 * kk][0], sc[2 * kk][1]),
                               PackBf16x2(sc[2 * kk][2], sc[2 * kk][3]),
                               PackBf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                               PackBf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
        for (int j = 0; j < HD / 8; j += 2) {
          uint32_t b0, b1, b2, b3;
          LdMatrixX4Trans(&st.v[kk * 16 + v_row][j * 8 + v_col], b0, b1, b2, b3);
          Mma16816(o[j], a, b0, b1);
          Mma16816(o[j + 1], a, b2, b3);
        }
      }
    }
    __syncthreads();  // this stage is read no more; the next iteration may refill it
  }

#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    l[hr] += __shfl_xor_sync(internal::kFullMask, l[hr], 1);
    l[hr] += __shfl_xor_sync(internal::kFullMask, l[hr], 2);
  }
  if (!warp_active) return;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = hr == 0 ? r0 : r1;
    if (r >= rows) continue;
    const int64_t qi = q0 + r / group;
    const int64_t head = kvh * group + r % group;
    const float inv = l[hr] > 0.0f ? 1.0f / l[hr] : 0.0f;
    if (p.num_splits == 1) {
      bf16* dst = p.out + qi * p.out_stride + head * HD + 2 * t4;
#pragma unroll
      for (int j = 0; j < HD / 8; ++j) {
        *reinterpret_cast<uint32_t*>(dst + j * 8) =
            PackBf16x2(o[j][2 * hr] * inv, o[j][2 * hr + 1] * inv);
      }
    } else {
      const int64_t item = (split * p.num_queries + qi) * p.num_heads + head;
      float* dst = p.workspace + item * HD + 2 * t4;
#pragma unroll
      for (int j = 0; j < HD / 8; ++j) {
        *reinterpret_cast<float2*>(dst + j * 8) =
            make_float2(o[j][2 * hr] * inv, o[j][2 * hr + 1] * inv);
      }
      if (t4 == 0) {
        float* lse =
            p.workspace + static_cast<int64_t>(p.num_splits) * p.num_queries * p.num_heads * HD;
        lse[item] = l[hr] > 0.0f ? m[hr] + log2f(l[hr]) : -INFINITY;
      }
    }
  }
}

// One warp per (query, head): out = sum_s 2^(lse_s - max) O_s / sum_s 2^(lse_s - max).
template <int HD>
__global__ void __launch_bounds__(kThreads) TreeAttentionCombineKernel(TreeAttentionParams p) {
  const int64_t item = blockIdx.x * static_cast<int64_t>(kWarps) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int64_t items = p.num_queries * p.num_heads;
  if (item >= items) return;
  const float* lse = p.workspace + static_cast<int64_t>(p.num_splits) * items * HD;
  float mx = -INFINITY;
  for (int sp = 0; sp < p.num_splits; ++sp) mx = fmaxf(mx, lse[sp * items + item]);
  float acc[HD / 32];
#pragma unroll
  for (int d = 0; d < HD / 32; ++d) acc[d] = 0.0f;
  float wsum = 0.0f;
  if (mx != -INFINITY) {
    for (int sp = 0; sp < p.num_splits; ++sp) {
      const float w = exp2f(lse[sp * items + item] - mx);
      wsum += w;
      const float* o = p.workspace + (sp * items + item) * HD;
#pragma unroll
      for (int d = 0; d < HD / 32; ++d) acc[d] += w * o[lane + 32 * d];
    }
  }
  const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
  const int64_t qi = item / p.num_heads, head = item % p.num_heads;
  bf16* dst = p.out + qi * p.out_stride + head * HD;
#pragma unroll
  for (int d = 0; d < HD / 32; ++d) dst[lane + 32 * d] = __float2bfloat16(acc[d] * inv);
}

template <int HD>
cudaError_t Launch(const TreeAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_tiles), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(p.num_splits));
  // Two K/V stages exceed the 48 KiB of static shared memory at head_dim 128. The attribute is
  // per device and cheap to set, so it is set on every launch (multi-GPU processes included).
  constexpr size_t kSmem = sizeof(AttnSmem<HD>);
  if (cudaError_t e =
          cudaFuncSetAttribute(TreeAttentionKernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(kSmem));
      e != cudaSuccess) {
    return e;
  }
  TreeAttentionKernel<HD><<<grid, kThreads, kSmem, stream>>>(p);
  if (p.num_splits > 1) {
    const int64_t items = p.num_queries * p.num_heads;
    TreeAttentionCombineKernel<HD>
        <<<static_cast<unsigned>((items + kWarps - 1) / kWarps), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

TreeAttentionPlan PlanTreeAttention(const int32_t* query_seq, const int32_t* kv_end,
                                    int64_t num_queries, int64_t num_heads, int64_t num_kv_heads,
                                    int num_sms) {
  TreeAttentionPlan plan;
  if (num_queries <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return plan;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t per_tile = std::max<int64_t>(1, kRows / group);
  int32_t max_kv = 0;
  for (int64_t i = 0; i < num_queries; ++i) {
    max_kv = std::max(max_kv, kv_end[i]);
    const bool fresh =
        i == 0 || query_seq[i] != query_seq[i - 1] || i - plan.tile_begin.back() == per_tile;
    if (fresh) {
      if (i > 0) plan.tile_end.push_back(static_cast<int32_t>(i));
      plan.tile_begin.push_back(static_cast<int32_t>(i));
    }
  }
  plan.tile_end.push_back(static_cast<int32_t>(num_queries));
  const int64_t ctas = static_cast<int64_t>(plan.tile_begin.size()) * num_kv_heads;
  if (ctas < num_sms && max_kv > kMinKeysPerSplit) {
    const int64_t want = (2 * static_cast<int64_t>(num_sms) + ctas - 1) / ctas;
    const int64_t most = (max_kv + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
    plan.num_splits = static_cast<int>(std::min<int64_t>({want, most, kMaxSplits}));
  }
  return plan;
}

int64_t TreeAttentionWorkspaceFloats(int num_splits, int64_t num_queries, int64_t num_heads,
                                     int64_t head_dim) {
  if (num_splits <= 1) return 0;
  return static_cast<int64_t>(num_splits) * num_queries * num_heads * (head_dim + 1);
}

cudaError_t TreeAttentionCuda(const TreeAttentionParams& p, cudaStream_t stream) {
  if (p.num_queries < 0 || p.num_tiles < 0 || p.num_heads <= 0 || p.num_kv_heads <= 0 ||
      p.num_kv_heads > 65535 || p.num_heads % p.num_kv_heads != 0 ||
      p.num_heads / p.num_kv_heads > kRows || (p.head_dim != 64 && p.head_dim != 128) ||
      p.num_splits < 1 || p.num_splits > 65535 || p.block_size <= 0 || p.max_blocks_per_seq <= 0 ||
      p.q_stride < p.num_heads * p.head_dim || p.q_stride % 2 != 0 ||
      p.out_stride < p.num_heads * p.head_dim || p.out_stride % 2 != 0 ||
      (p.mask == nullptr) != (p.mask_begin == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_queries == 0 || p.num_tiles == 0) return cudaSuccess;
  if (p.q == nullptr || p.out == nullptr || p.k_cache == nullptr || p.v_cache == nullptr ||
      p.block_tables == nullptr || p.query_seq == nullptr || p.kv_end == nullptr ||
      p.tile_begin == nullptr || p.tile_end == nullptr ||
      (p.num_splits > 1 && p.workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (!IsAligned(p.q, 4) || !IsAligned(p.out, 4) || !IsAligned(p.k_cache, 16) ||
      !IsAligned(p.v_cache, 16) || !IsAligned(p.workspace, 8)) {
    return cudaErrorInvalidValue;
  }
  return p.head_dim == 64 ? Launch<64>(p, stream) : Launch<128>(p, stream);
}

}  // namespace cuda
}  // namespace specd
