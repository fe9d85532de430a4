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
constexpr int kKeys = 64;  // ranks per shared-memory stage (a sub-chunk)
constexpr int kMaskWords = kTreeAttentionMaskWords;
constexpr int kChunk = kTreeAttentionChunkKeys;
static_assert(kChunk % kKeys == 0, "chunks are whole sub-chunks");
constexpr int kSub = kChunk / kKeys;
// Job codes: sub-chunk * kJobStride + query + 1 (query -1: the shared load).
constexpr int kJobStride = kRows + 1;
constexpr int kMaxJobs = kSub * (kRows + 1);
// The split workspace is capped (it grows with queries times chunks); past that, one CTA per
// tile walks all chunks, which gives the same bits.
constexpr int64_t kMaxWorkspaceFloats = int64_t{64} << 20;
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
  // Per local query: mask_begin clamped to kv_end; num_keys = visible keys (ranks); ident_end:
  // ranks below it are their own logical slots. The mask has bits past kv_end cleared.
  int32_t mask_begin[kRows];
  int32_t num_keys[kRows];
  int32_t ident_end[kRows];
  uint32_t mask[kRows][kMaskWords];
  int32_t job[kMaxJobs];
  int32_t num_jobs;
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

// Logical slot of the k-th set bit of a query's mask (the k-th tree ancestor after mask_begin).
__device__ __forceinline__ int RankToSlot(const uint32_t* words, int mask_begin, int k) {
#pragma unroll 1
  for (int w = 0; w < kMaskWords; ++w) {
    uint32_t x = words[w];
    const int pc = __popc(x);
    if (k < pc) {
#pragma unroll 1
      for (int i = 0; i < k; ++i) x &= x - 1u;
      return mask_begin + 32 * w + __ffs(static_cast<int>(x)) - 1;
    }
    k -= pc;
  }
  return -1;
}

// Batch invariance (DESIGN.md, lossless verification): a row's result is a function of its own
// query and its own visible keys only. Keys are numbered by RANK, the position in the query's
// logical key order (the committed prefix and chain, then its tree ancestors), which is the
// order a plain decode of the same token sees them in. Chunk c is ranks [c * kChunk, +kChunk)
// for every query, whatever the batch, tile or split; inside it 64-rank sub-chunks sit at fixed
// offsets, rank R0 + i in column i of the score tile. A sub-chunk is loaded once for all the
// tile's rows whose ranks there are their slots ("regular" rows: decode, chains, and tree nodes
// below their contiguous part), and once per other ("irregular") tree query with its ancestors
// gathered to their ranks; a row takes part in exactly one of those jobs per sub-chunk, so the
// arithmetic it sees is the same in every case. Each chunk starts a fresh online softmax; chunk
// states are merged in chunk order with one fixed formula (MergeChunk), in this kernel when a
// CTA owns all chunks, or in the combine kernel when chunks are split over CTAs: both give the
// same bits. Every float operation that a compiler could contract or reorder is spelled out
// with _rn intrinsics.
__device__ __forceinline__ void MergeChunk(float& big_m, float& big_l, float m, float l,
                                           float* big_o, const float* o, int n) {
  if (!(l > 0.0f)) return;
  if (!(big_l > 0.0f)) {
    big_m = m;
    big_l = l;
    for (int i = 0; i < n; ++i) big_o[i] = o[i];
    return;
  }
  const float mn = fmaxf(big_m, m);
  const float a = exp2f(__fsub_rn(big_m, mn));
  const float b = exp2f(__fsub_rn(m, mn));
  big_l = __fmaf_rn(big_l, a, __fmul_rn(l, b));
  for (int i = 0; i < n; ++i) big_o[i] = __fmaf_rn(big_o[i], a, __fmul_rn(o[i], b));
  big_m = mn;
}

// grid = (tiles, kv heads, splits). The KV head serves local query heads [h_lo, h_lo + nh): its
// whole group of `group` heads, or under tensor parallelism the part of it this rank owns. Warp w
// owns tile rows [16w, 16w + 16); row r is query tile_begin + r / nh, head h_lo + r % nh. With
// one split a CTA walks all chunks of its tile; with more, CTA z computes chunk z and leaves its
// state in the workspace.
template <int HD>
__global__ void __launch_bounds__(kThreads) TreeAttentionKernel(TreeAttentionParams p) {
  static_assert(HD % 16 == 0 && HD >= 16, "whole MMA k-steps and pairs of 8-dim V tiles");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  AttnSmem<HD>& s = *reinterpret_cast<AttnSmem<HD>*>(smem_raw);
  const int tile = blockIdx.x;
  const int kvh = blockIdx.y;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t group = p.kv_group > 0 ? p.kv_group : p.num_heads / p.num_kv_heads;
  // The group's first head, local; TreeAttentionCuda checked that 1 <= nh <= group.
  const int64_t first = (p.kv_head_offset + kvh) * group - p.q_head_offset;
  const int h_lo = static_cast<int>(max(first, int64_t{0}));
  const int nh = static_cast<int>(min(first + group, p.num_heads)) - h_lo;
  const int q0 = p.tile_begin[tile];
  const int nq = p.tile_end[tile] - q0;
  const int rows = nq * nh;
  const int32_t* table =
      p.block_tables + static_cast<int64_t>(p.query_seq[q0]) * p.max_blocks_per_seq;
  const int64_t kv_dim = p.num_kv_heads * HD;

  if (tid < nq) {
    const int64_t qi = q0 + tid;
    const int end = p.kv_end[qi];
    const int mb = p.mask_begin != nullptr ? min(p.mask_begin[qi], end) : end;
    const int bits = end - mb;  // mask bits in use; later ones are cleared
    int count = 0, ident = 0;
    bool run = true;
#pragma unroll
    for (int w = 0; w < kMaskWords; ++w) {
      uint32_t word = p.mask != nullptr ? p.mask[qi * kMaskWords + w] : 0u;
      const int lo = 32 * w;
      if (bits <= lo) {
        word = 0u;
      } else if (bits < lo + 32) {
        word &= (1u << (bits - lo)) - 1u;
      }
      s.mask[tid][w] = word;
      count += __popc(word);
      if (run) {
        if (word == 0xffffffffu) {
          ident += 32;
        } else {
          ident += __ffs(static_cast<int>(~word)) - 1;
          run = false;
        }
      }
    }
    s.mask_begin[tid] = mb;
    s.num_keys[tid] = mb + count;
    s.ident_end[tid] = mb + ident;
  }
  __syncthreads();
  // Keys in use by the tile; ranks of regular rows are slots below it, all mapped.
  int max_keys = 0;
  for (int i = 0; i < nq; ++i) max_keys = max(max_keys, s.num_keys[i]);
  const bool split = p.num_splits > 1;
  const int chunk_first = split ? static_cast<int>(blockIdx.z) : 0;
  const int chunk_last = split ? chunk_first + 1 : (max_keys + kChunk - 1) / kChunk;

  const int r0 = warp * 16 + g;
  const int r1 = r0 + 8;
  const bool ok0 = r0 < rows, ok1 = r1 < rows;
  // Local query index of each of this thread's two rows, clamped so that padding rows read
  // valid (unused) entries.
  const int lq0 = min(r0 / nh, nq - 1);
  const int lq1 = min(r1 / nh, nq - 1);

  uint32_t qf[HD / 16][4];
  {
    const bf16* q_row0 =
        ok0 ? p.q + (q0 + r0 / nh) * p.q_stride + (h_lo + r0 % nh) * static_cast<int64_t>(HD)
            : nullptr;
    const bf16* q_row1 =
        ok1 ? p.q + (q0 + r1 / nh) * p.q_stride + (h_lo + r1 % nh) * static_cast<int64_t>(HD)
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

  // Merged state over the chunks done so far (unsplit case only).
  float big_o[HD / 8][4];
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) big_o[j][0] = big_o[j][1] = big_o[j][2] = big_o[j][3] = 0.0f;
  float big_m[2] = {-INFINITY, -INFINITY};
  float big_l[2] = {0.0f, 0.0f};
  const float scale_log2 = p.scale * kLog2e;

  // Each thread copies the same (key, 16-byte piece) pairs of K and V; columns past the job's
  // keys are zero-filled, never garbage that a zero probability would not cancel (NaN * 0).
  constexpr int kPieces = HD / 8;  // 16-byte pieces of a key's head
  constexpr int kCopies = kKeys * kPieces / kThreads;
  static_assert(kKeys * kPieces % kThreads == 0, "copy split");
  const bf16* k_head = p.k_cache + kvh * HD;
  const bf16* v_head = p.v_cache + kvh * HD;
  const int block_size = static_cast<int>(p.block_size);

  for (int chunk = chunk_first; chunk < chunk_last; ++chunk) {
    const int cb = chunk * kChunk;
    __syncthreads();  // the previous chunk's job list is read no more
    // Jobs of this chunk: per sub-chunk, one shared load for the regular rows (if any has
    // keys there), then one per irregular query. Job code: sub * kJobStride + query + 1.
    if (warp == 0) {
      int n = 0;
#pragma unroll 1
      for (int sub = 0; sub < kSub; ++sub) {
        const int R0 = cb + sub * kKeys;
        bool any_regular = false;
        uint32_t irregular[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int q = lane + 32 * h;
          const bool act = q < nq && s.num_keys[q] > R0;
          const bool reg = act && min(R0 + kKeys, s.num_keys[q]) <= s.ident_end[q];
          any_regular = __any_sync(internal::kFullMask, reg) || any_regular;
          irregular[h] = __ballot_sync(internal::kFullMask, act && !reg);
        }
        if (lane == 0) {
          if (any_regular) s.job[n++] = sub * kJobStride;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            for (uint32_t b = irregular[h]; b != 0u; b &= b - 1u) {
              s.job[n++] = sub * kJobStride + 1 + 32 * h + __ffs(static_cast<int>(b)) - 1;
            }
          }
        }
      }
      if (lane == 0) s.num_jobs = n;
    }
    __syncthreads();
    const int num_jobs = s.num_jobs;

    auto issue = [&](int jn) {
      const int code = s.job[jn];
      const int jq = code % kJobStride - 1;
      const int R0 = cb + (code / kJobStride) * kKeys;
      AttnStage<HD>& st = s.stage[jn & 1];
      int bound = max_keys, mb = 0, ident = INT_MAX;
      const uint32_t* words = nullptr;
      if (jq >= 0) {
        bound = s.num_keys[jq];
        mb = s.mask_begin[jq];
        ident = s.ident_end[jq];
        words = s.mask[jq];
      }
#pragma unroll
      for (int it = 0; it < kCopies; ++it) {
        const int i = tid + it * kThreads;
        const int key = i / kPieces, c = i % kPieces;
        const int rank = R0 + key;
        bool valid = rank < bound;
        int64_t off = 0;
        if (valid) {
          const int slot = rank < ident ? rank : RankToSlot(words, mb, rank - mb);
          valid = slot >= 0;
          if (valid) {
            const int64_t phys =
                static_cast<int64_t>(table[slot / block_size]) * block_size + slot % block_size;
            off = phys * kv_dim + c * 8;
          }
        }
        CpAsync16(&st.k[key][c * 8], k_head + off, valid);
        CpAsync16(&st.v[key][c * 8], v_head + off, valid);
      }
    };

    // This chunk's online softmax, from scratch.
    float o[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.0f, 0.0f};

    if (num_jobs > 0) issue(0);
    CpAsyncCommit();
    for (int jn = 0; jn < num_jobs; ++jn) {
      // Prefetch the next job into the other stage (freed by the barrier that ended the
      // previous iteration), then wait for this one.
      if (jn + 1 < num_jobs) issue(jn + 1);
      CpAsyncCommit();
      CpAsyncWait<1>();
      __syncthreads();
      const AttnStage<HD>& st = s.stage[jn & 1];
      const int code = s.job[jn];
      const int jq = code % kJobStride - 1;
      const int R0 = cb + (code / kJobStride) * kKeys;
      // Ranks [R0, lim) of a row are visible in this job; lim == R0: the row sits it out.
      auto limit = [&](int lq, bool ok) {
        if (!ok) return R0;
        const int n = s.num_keys[lq];
        if (jq < 0) return min(R0 + kKeys, n) <= s.ident_end[lq] ? n : R0;
        return lq == jq ? n : R0;
      };
      const int lim[2] = {limit(lq0, ok0), limit(lq1, ok1)};
      const bool act[2] = {lim[0] > R0, lim[1] > R0};
      if (__any_sync(internal::kFullMask, act[0] || act[1])) {
        // Scores S = Q K^T for the warp's 16 rows and the job's 64 columns.
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
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int rank = R0 + n * 8 + 2 * t4 + (e & 1);
            sc[n][e] = rank < lim[e >> 1] ? __fmul_rn(sc[n][e], scale_log2) : -INFINITY;
          }
        }
        // Online softmax (base 2); the 4 threads of a quad share a row.
        float alpha[2];
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
          // A row with no visible key keeps zeros; subtracting 0 instead of -inf avoids NaN.
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;
          alpha[hr] = exp2f(__fsub_rn(m[hr], m_use));
          float row_sum = 0.0f;
#pragma unroll
          for (int n = 0; n < kKeys / 8; ++n) {
            sc[n][2 * hr] = exp2f(__fsub_rn(sc[n][2 * hr], m_use));
            sc[n][2 * hr + 1] = exp2f(__fsub_rn(sc[n][2 * hr + 1], m_use));
            row_sum = __fadd_rn(row_sum, __fadd_rn(sc[n][2 * hr], sc[n][2 * hr + 1]));
          }
          if (act[hr]) {
            l[hr] = __fmaf_rn(l[hr], alpha[hr], row_sum);
            m[hr] = m_new;
          }
        }
        // P V into fresh accumulators, then O = O * alpha + P V for the rows in this job.
        // The score accumulators of key tiles 2kk and 2kk+1 are exactly the A fragment of the
        // k-step kk; the B fragments of two 8-dim tiles come from one transposed ldmatrix of
        // V's 16 key rows (lanes 0-15: dims j*8.., lanes 16-31: dims (j+1)*8..).
        uint32_t pa[kKeys / 16][4];
#pragma unroll
        for (int kk = 0; kk < kKeys / 16; ++kk) {
          pa[kk][0] = PackBf16x2(sc[2 * kk][0], sc[2 * kk][1]);
          pa[kk][1] = PackBf16x2(sc[2 * kk][2], sc[2 * kk][3]);
          pa[kk][2] = PackBf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
          pa[kk][3] = PackBf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
        }
        const int v_row = lane & 15, v_col = (lane >> 4) * 8;
#pragma unroll
        for (int j = 0; j < HD / 8; j += 2) {
          float pv0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, pv1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int kk = 0; kk < kKeys / 16; ++kk) {
            uint32_t b0, b1, b2, b3;
            LdMatrixX4Trans(&st.v[kk * 16 + v_row][j * 8 + v_col], b0, b1, b2, b3);
            Mma16816(pv0, pa[kk], b0, b1);
            Mma16816(pv1, pa[kk], b2, b3);
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (act[e >> 1]) {
              o[j][e] = __fmaf_rn(o[j][e], alpha[e >> 1], pv0[e]);
              o[j + 1][e] = __fmaf_rn(o[j + 1][e], alpha[e >> 1], pv1[e]);
            }
          }
        }
      }
      __syncthreads();  // this stage is read no more; the next iteration may refill it
    }

    // The chunk's state per row: l summed over the quad (same value in all four threads).
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      l[hr] = __fadd_rn(l[hr], __shfl_xor_sync(internal::kFullMask, l[hr], 1));
      l[hr] = __fadd_rn(l[hr], __shfl_xor_sync(internal::kFullMask, l[hr], 2));
    }
    if (split) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = hr == 0 ? r0 : r1;
        if (r >= rows) continue;
        const int64_t qi = q0 + r / nh;
        const int64_t head = h_lo + r % nh;
        const int64_t items = p.num_queries * p.num_heads;
        const int64_t item = chunk * items + qi * p.num_heads + head;
        float* dst = p.workspace + item * HD + 2 * t4;
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
          *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[j][2 * hr], o[j][2 * hr + 1]);
        }
        if (t4 == 0) {
          float* ml = p.workspace + static_cast<int64_t>(p.num_splits) * items * HD;
          ml[2 * item] = l[hr] > 0.0f ? m[hr] : -INFINITY;
          ml[2 * item + 1] = l[hr];
        }
      }
    } else {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float mine[HD / 4], merged[HD / 4];
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
          mine[2 * j] = o[j][2 * hr];
          mine[2 * j + 1] = o[j][2 * hr + 1];
          merged[2 * j] = big_o[j][2 * hr];
          merged[2 * j + 1] = big_o[j][2 * hr + 1];
        }
        MergeChunk(big_m[hr], big_l[hr], m[hr], l[hr], merged, mine, HD / 4);
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
          big_o[j][2 * hr] = merged[2 * j];
          big_o[j][2 * hr + 1] = merged[2 * j + 1];
        }
      }
    }
  }

  if (split) return;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = hr == 0 ? r0 : r1;
    if (r >= rows) continue;
    const int64_t qi = q0 + r / nh;
    const int64_t head = h_lo + r % nh;
    const float inv = big_l[hr] > 0.0f ? __fdiv_rn(1.0f, big_l[hr]) : 0.0f;
    bf16* dst = p.out + qi * p.out_stride + head * HD + 2 * t4;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
      *reinterpret_cast<uint32_t*>(dst + j * 8) =
          PackBf16x2(__fmul_rn(big_o[j][2 * hr], inv), __fmul_rn(big_o[j][2 * hr + 1], inv));
    }
  }
}

// One warp per (query, head): the chunk states merged in chunk order by MergeChunk, exactly as
// the main kernel merges them when one CTA owns all chunks.
template <int HD>
__global__ void __launch_bounds__(kThreads) TreeAttentionCombineKernel(TreeAttentionParams p) {
  const int64_t item = blockIdx.x * static_cast<int64_t>(kWarps) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int64_t items = p.num_queries * p.num_heads;
  if (item >= items) return;
  // Below 32 dims a lane owns one dim and the lanes past head_dim have none (the kernel uses
  // no warp collectives, so they may leave). MergeChunk is elementwise, so how dims are dealt
  // to lanes does not change a dim's bits.
  constexpr int kPerLane = HD >= 32 ? HD / 32 : 1;
  if constexpr (HD < 32) {
    if (lane >= HD) return;
  }
  const float* ml = p.workspace + static_cast<int64_t>(p.num_splits) * items * HD;
  float acc[kPerLane];
#pragma unroll
  for (int d = 0; d < kPerLane; ++d) acc[d] = 0.0f;
  float big_m = -INFINITY, big_l = 0.0f;
  for (int sp = 0; sp < p.num_splits; ++sp) {
    const int64_t at = sp * items + item;
    float part[kPerLane];
    const float* o = p.workspace + at * HD;
#pragma unroll
    for (int d = 0; d < kPerLane; ++d) part[d] = o[lane + 32 * d];
    MergeChunk(big_m, big_l, ml[2 * at], ml[2 * at + 1], acc, part, kPerLane);
  }
  const float inv = big_l > 0.0f ? __fdiv_rn(1.0f, big_l) : 0.0f;
  const int64_t qi = item / p.num_heads, head = item % p.num_heads;
  bf16* dst = p.out + qi * p.out_stride + head * HD;
#pragma unroll
  for (int d = 0; d < kPerLane; ++d) dst[lane + 32 * d] = __float2bfloat16_rn(__fmul_rn(acc[d], inv));
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

// Whether the tensor-parallel head mapping is well formed: the local KV heads are exactly those
// the local query heads read, so each serves between 1 and `group` of them (rows <= kRows).
bool HeadRangesValid(const TreeAttentionParams& p) {
  if (p.q_head_offset < 0 || p.kv_head_offset < 0 || p.kv_group < 0) return false;
  if (p.kv_group == 0 && p.num_heads % p.num_kv_heads != 0) return false;
  const int64_t group = p.kv_group > 0 ? p.kv_group : p.num_heads / p.num_kv_heads;
  return group <= kRows && p.q_head_offset / group == p.kv_head_offset &&
         (p.q_head_offset + p.num_heads - 1) / group == p.kv_head_offset + p.num_kv_heads - 1;
}

}  // namespace

TreeAttentionPlan PlanTreeAttention(const int32_t* query_seq, const int32_t* kv_end,
                                    int64_t num_queries, int64_t num_heads, int64_t num_kv_heads,
                                    int num_sms) {
  return PlanTreeAttention(query_seq, kv_end, num_queries, num_heads, num_kv_heads, 0, num_sms);
}

TreeAttentionPlan PlanTreeAttention(const int32_t* query_seq, const int32_t* kv_end,
                                    int64_t num_queries, int64_t num_heads, int64_t num_kv_heads,
                                    int64_t kv_group, int num_sms) {
  TreeAttentionPlan plan;
  if (num_queries <= 0 || num_kv_heads <= 0 || kv_group < 0 ||
      (kv_group == 0 && num_heads % num_kv_heads != 0)) {
    return plan;
  }
  // A tile's rows are its queries times the heads of one KV head: at most `group` of them.
  const int64_t group = kv_group > 0 ? kv_group : num_heads / num_kv_heads;
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
  // Splitting changes no bits (see the kernel), only the CTA count: split whenever the tiles
  // alone leave SMs idle and there is more than one chunk.
  const int64_t ctas = static_cast<int64_t>(plan.tile_begin.size()) * num_kv_heads;
  const int64_t chunks = TreeAttentionChunks(max_kv);
  if (ctas < num_sms && chunks > 1 &&
      TreeAttentionWorkspaceFloats(static_cast<int>(chunks), num_queries, num_heads, 128) <=
          kMaxWorkspaceFloats) {
    plan.num_splits = static_cast<int>(chunks);
  }
  return plan;
}

int TreeAttentionChunks(int32_t max_kv_end) {
  return max_kv_end <= 0 ? 0 : (max_kv_end + kChunk - 1) / kChunk;
}

int64_t TreeAttentionWorkspaceFloats(int num_splits, int64_t num_queries, int64_t num_heads,
                                     int64_t head_dim) {
  if (num_splits <= 1) return 0;
  return static_cast<int64_t>(num_splits) * num_queries * num_heads * (head_dim + 2);
}

cudaError_t TreeAttentionCuda(const TreeAttentionParams& p, cudaStream_t stream) {
  if (p.num_queries < 0 || p.num_tiles < 0 || p.num_heads <= 0 || p.num_kv_heads <= 0 ||
      p.num_kv_heads > 65535 || !HeadRangesValid(p) || !TreeAttentionSupportsHeadDim(p.head_dim) ||
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
  switch (p.head_dim) {
    case 16:
      return Launch<16>(p, stream);
    case 32:
      return Launch<32>(p, stream);
    case 64:
      return Launch<64>(p, stream);
    default:
      return Launch<128>(p, stream);
  }
}

bool TreeAttentionSupportsHeadDim(int64_t head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
}

}  // namespace cuda
}  // namespace specd
