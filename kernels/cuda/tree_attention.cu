#include <algorithm>
#include <climits>
#include <cstddef>


#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/mma_utils.cuh"
#include "specd/kernels/cuda/tree_attention.h"

namespace specd {
namespace cuda {
namespace {

using internal::CpAsync16;
using internal::CpAsyncCommit;
using internal::CpAsyncWait;
using internal::FenceProxyAsyncShared;
using internal::GmmaDescSw128;
using internal::kFullMask;
using internal::LdMatrixX4;
using internal::LdMatrixX4Trans;
using internal::Mma16816;
using internal::PackBf16x2;
using internal::SmemAddr;
using internal::Wgmma64x128x16;
using internal::Wgmma64x64x16;
using internal::WgmmaCommit;
using internal::WgmmaFence;
using internal::WgmmaFenceOperands;
using internal::WgmmaWait;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16 * kWarps;  // one m16 MMA row block per warp
static_assert(kRows == kTreeAttentionTileRows, "tile rows");
constexpr int kKeys = 64;  // ranks per shared-memory stage (a sub-chunk)
constexpr int kStages = 2;
// A window job holds up to this many distinct keys (WindowRows, in the stages' memory).
constexpr int kWindowRows = kStages * kKeys;
constexpr uint8_t kZeroRow = 0xff;  // window-table entry of a padding column
static_assert(kWindowRows <= kZeroRow, "window rows fit the table's bytes");
constexpr int kMaskWords = kTreeAttentionMaskWords;
constexpr int kChunk = kTreeAttentionChunkKeys;
static_assert(kChunk % kKeys == 0, "chunks are whole sub-chunks");
constexpr int kSub = kChunk / kKeys;
// The split workspace is capped (it grows with queries times chunks); past that, one CTA per
// tile walks all chunks, which gives the same bits.
constexpr int64_t kMaxWorkspaceFloats = int64_t{64} << 20;
constexpr float kLog2e = 1.4426950408889634f;
// Block-table entries a CTA keeps in shared memory, from its first chunk's block on (2048 slots at
// 16-slot blocks: every split CTA of up to 8 chunks); jobs past them read the table in global
// memory.
constexpr int kTableEntries = 128;

#ifdef SPECD_ATTN_PROFILE
// Profiling builds (cmake -DSPECD_ATTN_PROFILE=ON) only: where each CTA of the last main-kernel
// launch spent its time (TreeAttentionProfile). The slot of a CTA is its linear block index.
__device__ unsigned long long g_attn_prof[kTreeAttentionProfileCtas][kTreeAttentionProfileFields];
__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
#define SPECD_PROF(...) __VA_ARGS__
#else
#define SPECD_PROF(...)
#endif

// K and V are kept key-major; two stages: while one sub-chunk is computed on, cp.async brings
// the next. At head_dim 64 and 128 ("swizzled"), a key's head is split into 64-dim halves of 128
// bytes, half-major ([half][key][64]), and the 16-byte piece p of key r's half sits at piece
// p ^ (r % 8): the 128-byte swizzle that wgmma reads its B operand in (K as K-major, V as
// MN-major), which also keeps the ldmatrix reads of 8 keys at one piece on 32 distinct banks.
// Other head sizes keep each key's row padded by 8 elements (16 bytes) for the same bank
// spread.
template <int HD>
constexpr bool kSwizzled = HD == 64 || HD == 128;
// Plain jobs of swizzled stages run on wgmma where the build has it (sm_90a).
template <int HD>
constexpr bool kWgPlain = kSwizzled<HD> && internal::kHasWgmma;

template <int HD, bool kSwz = kSwizzled<HD>>
struct __align__(16) AttnStage {
  bf16 k[kKeys][HD + 8];
  bf16 v[kKeys][HD + 8];
  __device__ __forceinline__ bf16* K(int key, int d) { return &k[key][d]; }
  __device__ __forceinline__ bf16* V(int key, int d) { return &v[key][d]; }
  __device__ __forceinline__ const bf16* K(int key, int d) const { return &k[key][d]; }
  __device__ __forceinline__ const bf16* V(int key, int d) const { return &v[key][d]; }
};

// wgmma applies the swizzle to shared-memory address bits 4-6 from bits 7-9, so each 8-key group
// of a half starts on a 1024-byte boundary (the stage's alignment, and the dynamic shared
// memory's).
template <int HD>
struct __align__(1024) AttnStage<HD, true> {
  static constexpr int kHalves = HD / 64;
  bf16 k[kHalves][kKeys][64];
  bf16 v[kHalves][kKeys][64];
  // Element d (within a 16-byte piece: d % 8 is kept) of key `key`'s head.
  __device__ __forceinline__ static int Offset(int key, int d) {
    return ((d >> 6) * kKeys + key) * 64 + ((((d >> 3) & 7) ^ (key & 7)) << 3) + (d & 7);
  }
  __device__ __forceinline__ bf16* K(int key, int d) { return &k[0][0][0] + Offset(key, d); }
  __device__ __forceinline__ bf16* V(int key, int d) { return &v[0][0][0] + Offset(key, d); }
  __device__ __forceinline__ const bf16* K(int key, int d) const {
    return &k[0][0][0] + Offset(key, d);
  }
  __device__ __forceinline__ const bf16* V(int key, int d) const {
    return &v[0][0][0] + Offset(key, d);
  }
};

// A window job's rows (see the kernel): each key's row padded by 8 elements, whatever the head
// size. A window pass reads K and V rows through a query's table, so consecutive columns are
// rows from anywhere in the window; padded rows keep its ldmatrix reads on distinct banks with
// plain row addresses, where the swizzle would cost an XOR per row and dim piece (measured: 16-
// and 64-node steps 0.2-0.3 ms slower with the window in the swizzled stages).
template <int HD>
struct __align__(16) WindowRows {
  bf16 k[kWindowRows][HD + 8];
  bf16 v[kWindowRows][HD + 8];
};

template <int HD>
struct __align__(16) AttnSmem {
  // Plain jobs stream through the stages; a window job, with nothing in flight across it, puts
  // its rows in the same memory.
  union {
    AttnStage<HD> stage[kStages];
    WindowRows<HD> win;
  };
  bf16 zero_row[HD + 8];  // K and V of a window pass's padding columns
  // Per local query: the mask with bits past kv_end cleared; mask_begin clamped to kv_end;
  // num_keys = visible keys (ranks); plain_subs: its leading sub-chunks whose ranks are their own
  // slots (served by the shared plain loads); subs: sub-chunks holding any of its ranks.
  uint32_t mask[kRows][kMaskWords];
  int32_t mask_begin[kRows];
  int32_t num_keys[kRows];
  int32_t plain_subs[kRows];
  int32_t subs[kRows];
  // The window job in progress (see the kernel): per query, its mask bits whose ranks fall in
  // the sub-chunk, its group, and its table column -> window row; the group's window.
  uint32_t win_bits[kRows][kMaskWords];
  uint8_t win_table[kRows][kKeys];
  int32_t win_slot[kWindowRows];
  int8_t win_group[kRows];
  uint32_t win_union[kMaskWords];
  int32_t win_mb;
  int32_t win_groups;
  // The tile's summary (see the kernel), and its sequence's kv_stable_end (0 without one).
  int32_t max_keys, plain_end, plain_bound, irr_begin, irr_end, stable_end;
  // Block-table entries table_first + i (see kTableEntries).
  int32_t table[kTableEntries];
};

// The merged state of the chunks done so far when a CTA walks all chunks: thread t's
// accumulators for its two rows, o[j][2hr..2hr+1] at v[j][hr][t] (conflict-free float2 rows).
// Kept in shared memory rather than registers, so that HD = 128 needs no spills.
template <int HD>
struct __align__(16) BigO {
  float2 v[HD / 8][2][kThreads];
};

// CTAs per SM that the register budget aims at: two at HD = 128 (the accumulators and Q
// fragments alone take 96 registers); more below, one fewer with the window machinery (whose
// second AttendColumns instance ptxas would otherwise spill for).
template <int HD, bool kTrees>
constexpr int MinBlocks() {
  return HD >= 128 ? 2 : (HD >= 64 ? 3 : 4) - (kTrees ? 1 : 0);
}

template <int HD, bool kSplit>
constexpr size_t SmemBytes() {
  return sizeof(AttnSmem<HD>) + (kSplit ? 0 : sizeof(BigO<HD>));
}

__device__ __forceinline__ uint32_t Ld32(const bf16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Bit position of the n-th (from 0) set bit of x; n < popc(x).
__device__ __forceinline__ int SelectBit(uint32_t x, int n) {
  int pos = 0;
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) {
    const uint32_t low = x & ((1u << w) - 1u);
    const int c = __popc(low);
    if (n >= c) {
      n -= c;
      x >>= w;
      pos += w;
    } else {
      x = low;
    }
  }
  return pos;
}

// 2^x with MUFU.EX2 alone (flushing subnormal results to zero: a probability below 2^-126 of
// the row's largest). exp2f would add the range fix-ups around it on every score.
__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The lowest n set bits of x (all of them when n >= popc(x), none when n <= 0).
__device__ __forceinline__ uint32_t LowestSetBits(uint32_t x, int n) {
  if (n <= 0) return 0u;
  if (n >= __popc(x)) return x;
  return x & ((1u << SelectBit(x, n)) - 1u);
}

// The set bits of a query's mask whose index among the set bits is in [k_lo, k_hi): the tree
// ancestors of ranks [mask_begin + k_lo, mask_begin + k_hi).
__device__ __forceinline__ void SetBitsOfRanks(const uint32_t* words, int k_lo, int k_hi,
                                               uint32_t (&out)[kMaskWords]) {
  int before = 0;  // set bits in the words before w
#pragma unroll
  for (int w = 0; w < kMaskWords; ++w) {
    const uint32_t x = words[w];
    out[w] = LowestSetBits(x, k_hi - before) & ~LowestSetBits(x, k_lo - before);
    before += __popc(x);
  }
}

// Batch invariance (docs/architecture.md, lossless verification): a row's result is a function of
// its own query and its own visible keys only. Keys are numbered by RANK, the position in the
// query's logical key order (the committed prefix and chain, then its tree ancestors), which is the
// order a plain decode of the same token sees them in. Chunk c is ranks [c * kChunk, +kChunk) for
// every query, whatever the batch, tile or split; inside it 64-rank sub-chunks sit at fixed
// offsets, rank R0 + i in column i of the score tile. Each chunk starts a fresh online softmax
// whose per-row arithmetic is fixed: sub-chunks in order, each one AttendColumns pass; chunk states
// are merged in chunk order with one fixed formula (MergeWeights), in this kernel when a CTA owns
// all chunks, or in the combine kernel when chunks are split over CTAs: both give the same bits.
// Every float operation that a compiler could contract or reorder is spelled out with _rn
// intrinsics.
//
// Merging a chunk state (m, l) into the running one (big_m, big_l): returns 0 (nothing to merge:
// the chunk saw no key), 1 (the running state was empty: take the chunk's o as is) or 2 (o_new =
// o_big * a + o * b, elementwise); big_m and big_l are updated.
__device__ __forceinline__ int MergeWeights(float& big_m, float& big_l, float m, float l, float& a,
                                            float& b) {
  if (!(l > 0.0f)) return 0;
  if (!(big_l > 0.0f)) {
    big_m = m;
    big_l = l;
    return 1;
  }
  const float mn = fmaxf(big_m, m);
  a = exp2f(__fsub_rn(big_m, mn));
  b = exp2f(__fsub_rn(m, mn));
  big_l = __fmaf_rn(big_l, a, __fmul_rn(l, b));
  big_m = mn;
  return 2;
}

__device__ __forceinline__ float MergeValue(int mode, float big, float o, float a, float b) {
  return mode == 1 ? o : __fmaf_rn(big, a, __fmul_rn(o, b));
}

// One warp's pass over the 64 rank columns [R0, R0 + 64) of a sub-chunk: scores, online-softmax
// update and P V for its rows with lim > R0 (their ranks [R0, lim) are visible). key_at(c, d)
// and val_at(c, d) give the shared-memory address of dim d (a multiple of 8, plus up to 7) of
// column c's K and V: the stage's key c in a plain job, the window row a query's table picks in
// a window pass. A row's arithmetic is the same whichever rows share the warp and whatever other
// columns hold: MMA rows are independent, a column past the row's limit gets score -inf and
// probability exactly 0 (its V finite: a key or zeros), and the MMAs skipped -- key tiles and
// k-steps past every active row's limit -- would only add exact-zero products.
//
// kFewColumns (window passes, a handful of columns each as a rule) compiles only the scores loop
// that skips key tiles past cnt, the one that serves any cnt with the same bits: a smaller body,
// which the instruction cache holds better (ncu: "no instruction" stalls in window passes).
//
// kWg (plain jobs of swizzled stages): the warpgroup's four warps compute S and P V together with
// wgmma, B read straight from the stage (K at k_smem, V at v_smem: shared-memory addresses), and
// every warp must call, rows or not. A wgmma adds each 16-wide k-step's products into the fp32
// accumulator as m16n8k16 does (bench/history/: cuBLASLt's Hopper kernels and an mma.sync
// chain give the same bits; tree_attention_cuda_test checks plain wgmma jobs against window
// mma.sync passes bit for bit), so the arithmetic of a row does not depend on the path.
template <int HD, bool kWg = false, bool kFewColumns = false, typename KeyAt, typename ValAt>
__device__ __forceinline__ void AttendColumns(const uint32_t (&qf)[HD / 16][4],
                                              float (&o)[HD / 8][4], float (&m)[2], float (&l)[2],
                                              int R0, const int (&lim)[2], float scale_log2,
                                              int lane, KeyAt key_at, ValAt val_at,
                                              uint32_t k_smem = 0, uint32_t v_smem = 0) {
  const int g = lane >> 2, t4 = lane & 3;
  const bool act[2] = {lim[0] > R0, lim[1] > R0};
  int mine = 0;
  if (act[0]) mine = min(kKeys, lim[0] - R0);
  if (act[1]) mine = max(mine, min(kKeys, lim[1] - R0));
  const int cnt = __reduce_max_sync(kFullMask, mine);  // columns with a visible key for any row
  if constexpr (!kWg) {
    if (cnt == 0) return;
  }
  // Scores S = Q K^T for the warp's 16 rows and the 64 columns. Each key tile's accumulator
  // takes its k-steps in order (the bits); which tile's MMA issues next is free. With every
  // column in use, the k-step loop is outermost, so that consecutive MMAs are independent
  // instead of each waiting for the previous one; key tiles past `cnt` (no visible key in any
  // row) are skipped. At HD >= 32, ldmatrix brings the K fragments of two k-steps at once:
  // lane L addresses row L % 8 of the tile, dims 8 * (L / 8) of the pair.
  float sc[kKeys / 8][4];
#pragma unroll
  for (int n = 0; n < kKeys / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
  if constexpr (kWg) {
    // K-major B: 64-dim halves 8 KB apart, 32 bytes a k-step inside one, 8-key groups 1 KB
    // apart.
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      Wgmma64x64x16<0>(sc, qf[kk],
                       GmmaDescSw128(k_smem + (kk / 4) * 8192 + (kk % 4) * 32, 16, 1024));
    }
    WgmmaCommit();
    WgmmaWait<0>();
    WgmmaFenceOperands(sc);
  } else {
    if constexpr (HD % 32 == 0) {
      // Key tile n's k-steps 2kp and 2kp + 1.
      const auto score_pair = [&](int n, int kp) {
        uint32_t b0, b1, b2, b3;
        LdMatrixX4(key_at(n * 8 + (lane & 7), (lane >> 3) * 8 + kp * 32), b0, b1, b2, b3);
        Mma16816(sc[n], qf[2 * kp], b0, b1);
        Mma16816(sc[n], qf[2 * kp + 1], b2, b3);
      };
      if (!kFewColumns && cnt == kKeys) {
#pragma unroll
        for (int kp = 0; kp < HD / 32; ++kp) {
#pragma unroll
          for (int n = 0; n < kKeys / 8; ++n) score_pair(n, kp);
        }
      } else {
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
          if (n * 8 < cnt) {
#pragma unroll
            for (int kp = 0; kp < HD / 32; ++kp) score_pair(n, kp);
          }
        }
      }
    } else {
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
        if (n * 8 < cnt) {
#pragma unroll
          for (int kk = 0; kk < HD / 16; ++kk) {
            Mma16816(sc[n], qf[kk], Ld32(key_at(n * 8 + g, kk * 16 + 2 * t4)),
                     Ld32(key_at(n * 8 + g, kk * 16 + 8 + 2 * t4)));
          }
        }
      }
    }
  }
  uint32_t pa[kKeys / 16][4];
  if (kWg && cnt == 0) {  // a warp without rows here joins the warpgroup's P V with zeros
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
  } else {
    // Columns past a row's limit get -inf. Only a sub-chunk where some active row's limit falls
    // inside it needs the test (a warp-uniform branch); in the common full sub-chunk no column is
    // masked. Inactive rows keep whatever scores they have: their results are never stored.
    const bool edge = (act[0] && lim[0] < R0 + kKeys) || (act[1] && lim[1] < R0 + kKeys);
    if (__any_sync(kFullMask, edge)) {
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int rank = R0 + n * 8 + 2 * t4 + (e & 1);
          if (rank >= lim[e >> 1]) sc[n][e] = -INFINITY;
        }
      }
    }
    // Online softmax (base 2); the 4 threads of a quad share a row. The running max m is kept in
    // scaled units. A max is exact in any order, so it is a tree over the raw scores; scaling by
    // scale_log2 > 0 is monotone, so the scaled max is the max of the scaled scores. Each
    // probability is ex2(s * scale_log2 - m) with one rounding (one FFMA), and a row's sum adds
    // its 64 probabilities as a fixed pairwise tree.
    float alpha[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      static_assert(kKeys == 64, "the max tree below");
      float mx4[kKeys / 16];
#pragma unroll
      for (int n = 0; n < kKeys / 16; ++n) {
        mx4[n] = fmaxf(fmaxf(sc[2 * n][2 * hr], sc[2 * n][2 * hr + 1]),
                       fmaxf(sc[2 * n + 1][2 * hr], sc[2 * n + 1][2 * hr + 1]));
      }
      float mx = fmaxf(fmaxf(mx4[0], mx4[1]), fmaxf(mx4[2], mx4[3]));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float m_new = fmaxf(m[hr], __fmul_rn(mx, scale_log2));
      // A row with no visible key keeps zeros; subtracting 0 instead of -inf avoids NaN.
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float neg_m = -m_use;
      alpha[hr] = Ex2(__fsub_rn(m[hr], m_use));
      // Key tiles past cnt hold -inf for every active row, whose probabilities are exact zeros:
      // they are set rather than computed (a window pass's few columns, a sub-chunk's edge).
      float pair[kKeys / 8];
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
        if (n * 8 < cnt) {
          sc[n][2 * hr] = Ex2(__fmaf_rn(sc[n][2 * hr], scale_log2, neg_m));
          sc[n][2 * hr + 1] = Ex2(__fmaf_rn(sc[n][2 * hr + 1], scale_log2, neg_m));
          pair[n] = __fadd_rn(sc[n][2 * hr], sc[n][2 * hr + 1]);
        } else {
          sc[n][2 * hr] = sc[n][2 * hr + 1] = pair[n] = 0.0f;
        }
      }
#pragma unroll
      for (int w = 1; w < kKeys / 8; w *= 2) {
#pragma unroll
        for (int n = 0; n < kKeys / 8; n += 2 * w) pair[n] = __fadd_rn(pair[n], pair[n + w]);
      }
      if (act[hr]) {
        l[hr] = __fmaf_rn(l[hr], alpha[hr], pair[0]);
        m[hr] = m_new;
      }
    }
    // O = O * alpha, then P V accumulated straight into O by the MMAs: every 8-dim tile of O is
    // its own accumulation chain over the k-steps in order, so the 16 chains (HD = 128) are
    // independent of each other. An inactive row keeps its O: it is not scaled, its P row is
    // zeros, and an MMA adds exact zeros (V is finite: a key or the zero row). The score
    // accumulators of key tiles 2kk and 2kk+1 are exactly the A fragment of the k-step kk; the B
    // fragments of two 8-dim tiles come from one transposed ldmatrix of V's 16 key rows (lanes
    // 0-15: dims j*8.., lanes 16-31: dims (j+1)*8..).
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      pa[kk][0] = act[0] ? PackBf16x2(sc[2 * kk][0], sc[2 * kk][1]) : 0u;
      pa[kk][1] = act[1] ? PackBf16x2(sc[2 * kk][2], sc[2 * kk][3]) : 0u;
      pa[kk][2] = act[0] ? PackBf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]) : 0u;
      pa[kk][3] = act[1] ? PackBf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]) : 0u;
    }
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (act[e >> 1]) o[j][e] = __fmul_rn(o[j][e], alpha[e >> 1]);
      }
    }
  }
  if constexpr (kWg) {
    // MN-major B (V's dims contiguous): 64-dim halves 8 KB apart, 16 keys (a k-step) 2 KB.
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint64_t desc = GmmaDescSw128(v_smem + kk * 2048, 8192, 1024);
      if constexpr (HD == 128) {
        Wgmma64x128x16<1>(o, pa[kk], desc);
      } else {
        Wgmma64x64x16<1>(o, pa[kk], desc);
      }
    }
    WgmmaCommit();
    WgmmaWait<0>();
    WgmmaFenceOperands(o);
  } else {
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      if (kk * 16 < cnt) {
#pragma unroll
        for (int j = 0; j < HD / 8; j += 2) {
          uint32_t b0, b1, b2, b3;
          LdMatrixX4Trans(val_at(kk * 16 + (lane & 15), (lane >> 4) * 8 + j * 8), b0, b1, b2,
                          b3);
          Mma16816(o[j], pa[kk], b0, b1);
          Mma16816(o[j + 1], pa[kk], b2, b3);
        }
      }
    }
  }
}

// The MMA A fragments (rows g and g + 8 of a warp's block) of two rows' query vectors, global
// memory; a null row gives zeros.
template <int HD>
__device__ __forceinline__ void LoadQueryFragments(const bf16* q_row0, const bf16* q_row1, int t4,
                                                   uint32_t (&qf)[HD / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    const int c = kk * 16 + 2 * t4;
    qf[kk][0] = q_row0 != nullptr ? Ld32(q_row0 + c) : 0u;
    qf[kk][1] = q_row1 != nullptr ? Ld32(q_row1 + c) : 0u;
    qf[kk][2] = q_row0 != nullptr ? Ld32(q_row0 + c + 8) : 0u;
    qf[kk][3] = q_row1 != nullptr ? Ld32(q_row1 + c + 8) : 0u;
  }
}

// A warp's window passes of one window job: for each member query q of group `grp` among the
// warp's rows (local queries qa..qb), its rows over the window, each column's K and V rows picked
// by q's table (kZeroRow: the zero row); the warp's other rows sit the pass out (their limits are
// R0). One call a job rather than one a query: the query fragments are read once (from global
// memory, L1/L2 hits, rather than kept live across the kernel) and, out of line, the chunk state
// crosses the call once.
template <int HD>
__device__ __forceinline__ void WindowPasses(float (&o)[HD / 8][4], float (&m)[2], float (&l)[2],
                                             int R0, int qa, int qb, int grp, int lq0, int lq1,
                                             float scale_log2, int lane, const AttnSmem<HD>& s,
                                             const bf16* q_row0, const bf16* q_row1) {
  uint32_t qf[HD / 16][4];
  LoadQueryFragments<HD>(q_row0, q_row1, lane & 3, qf);
  for (int q = qa; q <= qb; ++q) {
    if (s.win_group[q] != grp) continue;
    const int nk = s.num_keys[q];
    const int lim[2] = {q_row0 != nullptr && lq0 == q ? nk : R0,
                        q_row1 != nullptr && lq1 == q ? nk : R0};
    const uint8_t* tab = s.win_table[q];
    AttendColumns<HD, false, true>(
        qf, o, m, l, R0, lim, scale_log2, lane,
        [&](int c, int d) -> const bf16* {
          const int row = tab[c];
          return row == kZeroRow ? s.zero_row + d : &s.win.k[row][d];
        },
        [&](int c, int d) -> const bf16* {
          const int row = tab[c];
          return row == kZeroRow ? s.zero_row + d : &s.win.v[row][d];
        });
  }
}

// The same out of line, for HD = 128: inlined, its AttendColumns instance (besides the plain
// jobs') makes ptxas spill across the whole kernel; out of line, a copy of the chunk state (o, m,
// l) goes through a small local-memory frame, only in window jobs, which are a few per tile at
// most.
template <int HD>
__device__ __noinline__ void WindowPassesOutOfLine(float (&o)[HD / 8][4], float (&m)[2],
                                                   float (&l)[2], int R0, int qa, int qb, int grp,
                                                   int lq0, int lq1, float scale_log2, int lane,
                                                   const AttnSmem<HD>& s, const bf16* q_row0,
                                                   const bf16* q_row1) {
  // The state in registers for the passes: through the references themselves, ptxas read and
  // wrote the caller's frame at every access (ncu: local loads and stores in the passes).
  float ro[HD / 8][4], rm[2] = {m[0], m[1]}, rl[2] = {l[0], l[1]};
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) ro[j][e] = o[j][e];
  }
  WindowPasses<HD>(ro, rm, rl, R0, qa, qb, grp, lq0, lq1, scale_log2, lane, s, q_row0, q_row1);
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = ro[j][e];
  }
  m[0] = rm[0], m[1] = rm[1], l[0] = rl[0], l[1] = rl[1];
}

// grid = (tiles, kv heads, splits). The KV head serves local query heads [h_lo, h_lo + nh): its
// whole group of `group` heads, or under tensor parallelism the part of it this rank owns. Warp w
// owns tile rows [16w, 16w + 16); row r is query tile_begin + r / nh, head h_lo + r % nh. With
// kSplit false a CTA walks all chunks of its tile; with kSplit, CTA z computes chunk z and leaves
// its state in the workspace.
//
// Jobs. A query's ranks below its "identity end" (the committed prefix and chain, plus any
// leading run of the mask's bits) are their own slots, so its leading sub-chunks that lie below
// it are "plain" for the query; the tile's plain sub-chunks are the union of those prefixes, a
// contiguous range. A plain job loads a sub-chunk's 64 slots once into a stage and serves every
// row that is plain there (all rows of the tile for the committed prefix); the plain jobs stream
// through the two stages with cp.async across chunk boundaries. A query's remaining sub-chunks
// (a tree node's tail: the end of the prefix and its ancestors) are "window" sub-chunks: the
// tile's queries that need one are grouped so that the distinct keys of a group -- the prefix
// slots from the sub-chunk's start and the union of their ancestors with ranks there -- fit the
// window of 128 rows (WindowRows, over the stages' memory); the window is loaded once per group,
// and each warp then makes one pass per query of the group among its rows, reading K and V rows
// through the query's table (column -> window row, or a zero row past its keys), so that each
// key still sits in the column of its rank. In a chunk, plain jobs come before window jobs; a query's plain
// sub-chunks all precede its window ones, so each row still sees its sub-chunks in rank order,
// one AttendColumns pass each, with the same arithmetic as in any other batch. kTrees false
// (null masks: every sub-chunk is plain) compiles the window machinery out.
template <int HD, bool kSplit, bool kTrees>
__global__ void __launch_bounds__(kThreads, MinBlocks<HD, kTrees>())
    TreeAttentionKernel(TreeAttentionParams p) {
  static_assert(HD % 16 == 0 && HD >= 16, "whole MMA k-steps and pairs of 8-dim V tiles");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  AttnSmem<HD>& s = *reinterpret_cast<AttnSmem<HD>*>(smem_raw);
  SPECD_PROF(const unsigned long long prof_t0 = GlobalTimer();
             const long long prof_c0 = clock64(); long long prof_wait = 0, prof_plain = 0,
             prof_win = 0, prof_mark = 0, prof_win_mark = 0, prof_grp = 0, prof_tab = 0,
             prof_load = 0, prof_pass = 0; int prof_subs = 0;)
  // Unsplit only: the merged chunk states (see BigO).
  float2(*big_o)[2][kThreads] =
      reinterpret_cast<float2(*)[2][kThreads]>(smem_raw + sizeof(AttnSmem<HD>));
  // Launched as a programmatic dependent of RoPE (LaunchPdl). Until PdlWait below, the kernel
  // reads only the step's metadata (tiles, block tables, kv_end, masks), which the host uploaded
  // before the step's first kernel, and cache slots below kv_stable_end, so that its setup and
  // first load overlap RoPE; q and the step's own slots are RoPE's outputs and wait.
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
  // A row's offset within its block: below block_size * kv_dim, which TreeAttentionCuda keeps
  // under 2^31.
  const int kv_dim32 = static_cast<int>(kv_dim);

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
    const int num_keys = mb + count;
    const int ident_end = mb + ident;  // ranks below it are their own slots
    const int subs = (num_keys + kKeys - 1) / kKeys;
    s.mask_begin[tid] = mb;
    s.num_keys[tid] = num_keys;
    s.subs[tid] = subs;
    // Sub-chunk u is plain for the query when all its ranks there are below ident_end.
    s.plain_subs[tid] = ident_end >= num_keys ? subs : ident_end / kKeys;
  }
  for (int i = tid; i < (HD + 8) / 2; i += kThreads) {
    reinterpret_cast<uint32_t*>(s.zero_row)[i] = 0u;
  }
  // Read here, beside the other metadata, so that its latency overlaps theirs.
  if (tid == kThreads - 1) {
    s.stable_end = p.kv_stable_end != nullptr ? p.kv_stable_end[p.query_seq[q0]] : 0;
  }
  // The block-table entries of the CTA's keys, from its first chunk on: a plain job then reads
  // each entry from shared memory instead of every thread reading its 8 from global memory
  // through a 64-bit address (~10 instructions and an L1/L2 latency each, ncu). Entries past the
  // row are never used (they would hold slots at or past kv_end).
  const int chunk_first = kSplit ? static_cast<int>(blockIdx.z) * p.chunks_per_cta : 0;
  const int table_first = chunk_first * kChunk / static_cast<int>(p.block_size);
  {
    const int n = static_cast<int>(
        min(static_cast<int64_t>(kTableEntries), p.max_blocks_per_seq - table_first));
    for (int i = tid; i < n; i += kThreads) s.table[i] = __ldg(table + table_first + i);
  }

  const int r0 = warp * 16 + g;
  const int r1 = r0 + 8;
  const bool ok0 = r0 < rows, ok1 = r1 < rows;
  // Local query index of each of this thread's two rows, clamped so that padding rows read
  // valid (unused) entries.
  const int lq0 = min(r0 / nh, nq - 1);
  const int lq1 = min(r1 / nh, nq - 1);

  // Merged state over the chunks done so far (unsplit only; o in big_o, zero until a chunk
  // with keys is merged).
  float big_m[2] = {-INFINITY, -INFINITY};
  float big_l[2] = {0.0f, 0.0f};
  if constexpr (!kSplit) {
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
      big_o[j][0][tid] = make_float2(0.0f, 0.0f);
      big_o[j][1][tid] = make_float2(0.0f, 0.0f);
    }
  }
  __syncthreads();

  // The tile's summary: keys in use; plain sub-chunks [0, plain_end), whose loads stop at
  // plain_bound (no plain row sees a rank at or past it); window sub-chunks within
  // [irr_begin, irr_end).
  if (warp == 0) {
    int mk = 0, pe = 0, pb = 0, ib = INT_MAX, ie = 0;
    for (int q = lane; q < nq; q += 32) {
      const int nk = s.num_keys[q], x = s.plain_subs[q], e = s.subs[q];
      mk = max(mk, nk);
      pe = max(pe, x);
      pb = max(pb, x == e ? nk : x * kKeys);
      if (x < e) {
        ib = min(ib, x);
        ie = max(ie, e);
      }
    }
    mk = __reduce_max_sync(kFullMask, mk);
    pe = __reduce_max_sync(kFullMask, pe);
    pb = __reduce_max_sync(kFullMask, pb);
    ib = __reduce_min_sync(kFullMask, ib);
    ie = __reduce_max_sync(kFullMask, ie);
    if (lane == 0) {
      s.max_keys = mk;
      s.plain_end = pe;
      s.plain_bound = pb;
      s.irr_begin = ib;
      s.irr_end = ie;
    }
  }
  __syncthreads();
  const int max_keys = s.max_keys;
  const int plain_end = s.plain_end;
  const int plain_bound = s.plain_bound;
  const int irr_begin = s.irr_begin;
  const int irr_end = s.irr_end;
  const int chunk_last = kSplit ? min(chunk_first + p.chunks_per_cta, p.num_splits)
                                : (max_keys + kChunk - 1) / kChunk;
  const int sub_limit = chunk_last * kSub;  // the CTA's sub-chunks end here
  const float scale_log2 = p.scale * kLog2e;
  const bf16* k_head = p.k_cache + kvh * HD;
  const bf16* v_head = p.v_cache + kvh * HD;
  const int block_size = static_cast<int>(p.block_size);
  const int bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
  auto phys = [&](int slot) -> int64_t {
    int blk, in;
    if (bs_shift >= 0) {
      blk = slot >> bs_shift;
      in = slot & (block_size - 1);
    } else {
      blk = slot / block_size;
      in = slot - blk * block_size;
    }
    return static_cast<int64_t>(__ldg(table + blk)) * block_size + in;
  };

  // A plain job's load: slots [R0, R0 + 64) of sub-chunk `sub` into stage sub % 2, slots at or
  // past plain_bound zero-filled (never garbage that a zero probability would not cancel).
  //
  // Thread t copies piece t % kPieces of keys t / kPieces + kKeyStep * it. The loop issues every
  // block-table read before any copy, so that their latencies overlap instead of each copy
  // waiting for its own, and a key's element offset is its block's base (entry * blk_elems, one
  // unsigned 32 x 32 -> 64-bit multiply) plus its row in the block. ncu's SASS counters
  // (bench/history/14-gpu-run-08.md) put the loads before that multiply at ~38 instructions a K/V
  // copy pair, where the generic phys() took ~50.
  constexpr int kPieces = HD / 8;  // 16-byte pieces of a key's head
  constexpr int kCopies = kKeys * kPieces / kThreads;
  constexpr int kKeyStep = kThreads / kPieces;
  static_assert(kKeys * kPieces % kThreads == 0 && kThreads % kPieces == 0, "copy split");
  const int key0 = tid / kPieces, piece = tid % kPieces;
  // Below 2^31 (TreeAttentionCuda), so that a block's base is one 32 x 32 -> 64-bit multiply of
  // its (non-negative) entry.
  const uint32_t blk_elems = static_cast<uint32_t>(block_size) * static_cast<uint32_t>(kv_dim32);
  const bf16* k_piece = k_head + piece * 8;
  const bf16* v_piece = v_head + piece * 8;
  auto issue_plain = [&](int sub) {
    AttnStage<HD>& st = s.stage[sub & 1];
    const int first = sub * kKeys + key0;  // this thread's first slot
    int32_t entry[kCopies];
    int row[kCopies];  // the slot's row within its block
    int blk[kCopies];
    if (bs_shift >= 0) {  // uniform: one loop or the other, no branch a copy
#pragma unroll
      for (int it = 0; it < kCopies; ++it) {
        const int slot = first + it * kKeyStep;
        row[it] = slot & (block_size - 1);
        blk[it] = slot >> bs_shift;
      }
    } else {
#pragma unroll
      for (int it = 0; it < kCopies; ++it) {
        const int slot = first + it * kKeyStep;
        blk[it] = slot / block_size;
        row[it] = slot - blk[it] * block_size;
      }
    }
    // Uniform for the CTA: whether the job's last block is among the shared entries.
    const int last_slot = sub * kKeys + kKeys - 1;
    const int last_blk = bs_shift >= 0 ? last_slot >> bs_shift : last_slot / block_size;
    if (last_blk - table_first < kTableEntries) {
#pragma unroll
      for (int it = 0; it < kCopies; ++it) {
        entry[it] = first + it * kKeyStep < plain_bound ? s.table[blk[it] - table_first] : 0;
      }
    } else {
#pragma unroll
      for (int it = 0; it < kCopies; ++it) {
        entry[it] = first + it * kKeyStep < plain_bound ? __ldg(table + blk[it]) : 0;
      }
    }
#pragma unroll
    for (int it = 0; it < kCopies; ++it) {
      const bool valid = first + it * kKeyStep < plain_bound;
      // An invalid copy has entry 0 and reads nothing; its row is cleared too, so that no select
      // is needed: the offset stays in bounds.
      const uint64_t off = static_cast<uint64_t>(static_cast<uint32_t>(entry[it])) * blk_elems +
                           static_cast<uint32_t>((valid ? row[it] : 0) * kv_dim32);
      const int key = key0 + it * kKeyStep;
      CpAsync16(st.K(key, piece * 8), k_piece + off, valid);
      CpAsync16(st.V(key, piece * 8), v_piece + off, valid);
    }
  };
  int issued = -1;  // the last plain job whose load was issued
  // The CTA's first job may load before the wait when it is plain and every slot it reads was
  // written before the step began (below kv_stable_end): RoPE, which this kernel waits for, writes
  // only the step's own slots, and the rest of the cache was complete before the step's first
  // GEMM. The load then overlaps RoPE instead of stalling the first job.
  if (const int sub0 = chunk_first * kSub;
      sub0 < min(plain_end, sub_limit) &&
      min(sub0 * kKeys + kKeys, plain_bound) <= s.stable_end) {
    issue_plain(sub0);
    CpAsyncCommit();
    issued = sub0;
  }
  internal::PdlWait();
  SPECD_PROF(prof_wait = clock64() - prof_c0;)
  // Split: the combine kernel (a programmatic dependent) is scheduled over this one's tail.
  if constexpr (kSplit) internal::PdlTrigger();
  // The A fragments of the rows' query vectors (zeros for padding rows); a window pass re-reads
  // them (LoadQueryFragments) rather than taking these.
  const bf16* q_row0 =
      ok0 ? p.q + (q0 + r0 / nh) * p.q_stride + (h_lo + r0 % nh) * static_cast<int64_t>(HD)
          : nullptr;
  const bf16* q_row1 =
      ok1 ? p.q + (q0 + r1 / nh) * p.q_stride + (h_lo + r1 % nh) * static_cast<int64_t>(HD)
          : nullptr;
  uint32_t qf[HD / 16][4];
  LoadQueryFragments<HD>(q_row0, q_row1, t4, qf);

  for (int chunk = chunk_first; chunk < chunk_last; ++chunk) {
    // This chunk's online softmax, from scratch.
    float o[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.0f, 0.0f};
    const int sub_first = chunk * kSub;
    const int plain_last = min(sub_first + kSub, plain_end);
    // Window sub-chunks (none without tree masks).
    const int win_first = max(sub_first, irr_begin);
    const int win_last = kTrees ? min(sub_first + kSub, irr_end) : win_first;

    SPECD_PROF(prof_mark = clock64();)
    for (int sub = sub_first; sub < plain_last; ++sub) {
      if (issued < sub) {
        issue_plain(sub);
        CpAsyncCommit();
      }
      // Prefetch the next job when it is plain too, into the other stage (freed by the
      // barrier that ended the previous job). Window jobs take both stages, so nothing is in
      // flight across them.
      const int next = sub + 1;
      if (next < min(plain_end, sub_limit) && (next < plain_last || win_first >= win_last)) {
        issue_plain(next);
        issued = next;
      }
      CpAsyncCommit();
      CpAsyncWait<1>();
      // The wgmma reads the stage through the async proxy: order this thread's copies before
      // them, then the block barrier orders everyone's.
      if constexpr (kWgPlain<HD>) FenceProxyAsyncShared();
      __syncthreads();
      const AttnStage<HD>& st = s.stage[sub & 1];
      const int R0 = sub * kKeys;
      // Rows plain here see ranks [R0, num_keys); the others sit this job out.
      const int lim[2] = {ok0 && sub < s.plain_subs[lq0] ? s.num_keys[lq0] : R0,
                          ok1 && sub < s.plain_subs[lq1] ? s.num_keys[lq1] : R0};
      AttendColumns<HD, kWgPlain<HD>>(
          qf, o, m, l, R0, lim, scale_log2, lane, [&](int c, int d) { return st.K(c, d); },
          [&](int c, int d) { return st.V(c, d); }, SmemAddr(st.K(0, 0)), SmemAddr(st.V(0, 0)));
      __syncthreads();  // this stage is read no more; a later job may refill it
    }

    SPECD_PROF(prof_plain += clock64() - prof_mark; prof_mark = clock64();)
    if constexpr (kTrees) {
      for (int sub = win_first; sub < win_last; ++sub) {
        SPECD_PROF(prof_win_mark = clock64();)
        const int R0 = sub * kKeys;
        // Which queries need a window here, their mask bits with ranks in the sub-chunk, and
        // their groups: all in one when they share mask_begin and their keys fit, else greedily
        // in query order (one query's keys here are at most 64).
        if (warp == 0) {
          uint32_t uni[kMaskWords];
#pragma unroll
          for (int w = 0; w < kMaskWords; ++w) uni[w] = 0u;
          int mb_lo = INT_MAX, mb_hi = INT_MIN;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int q = lane + 32 * h;
            const bool irr = q < nq && s.plain_subs[q] <= sub && sub < s.subs[q];
            if (irr) {
              const int mb = s.mask_begin[q];
              uint32_t bits[kMaskWords];
              SetBitsOfRanks(s.mask[q], max(0, R0 - mb), R0 + kKeys - mb, bits);
#pragma unroll
              for (int w = 0; w < kMaskWords; ++w) {
                s.win_bits[q][w] = bits[w];
                uni[w] |= bits[w];
              }
              mb_lo = min(mb_lo, mb);
              mb_hi = max(mb_hi, mb);
            }
            s.win_group[q] = irr ? 0 : -1;
          }
          int need = 0;
#pragma unroll
          for (int w = 0; w < kMaskWords; ++w) {
            uni[w] = __reduce_or_sync(kFullMask, uni[w]);
            need += __popc(uni[w]);
          }
          mb_lo = __reduce_min_sync(kFullMask, mb_lo);
          mb_hi = __reduce_max_sync(kFullMask, mb_hi);
          int groups = 0;
          if (mb_lo <= mb_hi) {
            if (mb_lo == mb_hi && max(0, mb_lo - R0) + need <= kWindowRows) {
              groups = 1;
              if (lane == 0) {
#pragma unroll
                for (int w = 0; w < kMaskWords; ++w) s.win_union[w] = uni[w];
                s.win_mb = mb_lo;
              }
            } else {
              __syncwarp();  // every lane's win_bits and win_group are visible to lane 0
              if (lane == 0) {
                uint32_t u[kMaskWords];
#pragma unroll
                for (int w = 0; w < kMaskWords; ++w) u[w] = 0u;
                int gm = 0, grp = -1;
                for (int q = 0; q < nq; ++q) {
                  if (s.win_group[q] < 0) continue;
                  const int mb = s.mask_begin[q];
                  const bool same = grp >= 0 && mb == gm;
                  uint32_t t[kMaskWords];
                  int rows_needed = max(0, mb - R0);
#pragma unroll
                  for (int w = 0; w < kMaskWords; ++w) {
                    t[w] = (same ? u[w] : 0u) | s.win_bits[q][w];
                    rows_needed += __popc(t[w]);
                  }
                  if (!same || rows_needed > kWindowRows) {
                    if (grp == 0) {  // group 0 is complete: publish it
#pragma unroll
                      for (int w = 0; w < kMaskWords; ++w) s.win_union[w] = u[w];
                      s.win_mb = gm;
                    }
                    ++grp;
#pragma unroll
                    for (int w = 0; w < kMaskWords; ++w) t[w] = s.win_bits[q][w];
                  }
#pragma unroll
                  for (int w = 0; w < kMaskWords; ++w) u[w] = t[w];
                  gm = mb;
                  s.win_group[q] = static_cast<int8_t>(grp);
                }
                if (grp == 0) {
#pragma unroll
                  for (int w = 0; w < kMaskWords; ++w) s.win_union[w] = u[w];
                  s.win_mb = gm;
                }
                groups = grp + 1;
              }
              groups = __shfl_sync(kFullMask, groups, 0);
            }
          }
          if (lane == 0) s.win_groups = groups;
        }
        __syncthreads();
        const int groups = s.win_groups;
        SPECD_PROF(++prof_subs; prof_grp += clock64() - prof_win_mark; prof_win_mark = clock64();)
        for (int grp = 0; grp < groups; ++grp) {
          if (grp > 0) {  // the group's window: the union of its members' bits
            if (warp == 0) {
              uint32_t u[kMaskWords];
              int mbv = INT_MAX;
#pragma unroll
              for (int w = 0; w < kMaskWords; ++w) u[w] = 0u;
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int q = lane + 32 * h;
                if (q < nq && s.win_group[q] == grp) {
#pragma unroll
                  for (int w = 0; w < kMaskWords; ++w) u[w] |= s.win_bits[q][w];
                  mbv = min(mbv, s.mask_begin[q]);
                }
              }
#pragma unroll
              for (int w = 0; w < kMaskWords; ++w) u[w] = __reduce_or_sync(kFullMask, u[w]);
              mbv = __reduce_min_sync(kFullMask, mbv);
              if (lane == 0) {
#pragma unroll
                for (int w = 0; w < kMaskWords; ++w) s.win_union[w] = u[w];
                s.win_mb = mbv;
              }
            }
            __syncthreads();
          }
          SPECD_PROF(prof_grp += clock64() - prof_win_mark; prof_win_mark = clock64();)
          // Window rows: [0, pre) the prefix slots R0.., then the union's slots in slot order.
          // Tables: column c < pre -> row c; a tree key's column (its rank - R0) -> its row;
          // columns past the query's keys -> the zero row.
          const int mb = s.win_mb;
          const int pre = max(0, mb - R0);
          for (int i = tid; i < pre; i += kThreads) s.win_slot[i] = R0 + i;
          if (tid < kMaskWords) {
            int row = pre;
            for (int w = 0; w < tid; ++w) row += __popc(s.win_union[w]);
            for (uint32_t x = s.win_union[tid]; x != 0u; x &= x - 1u) {
              s.win_slot[row++] = mb + 32 * tid + __ffs(static_cast<int>(x)) - 1;
            }
          }
          for (int i = tid; i < nq * kKeys; i += kThreads) {
            const int q = i / kKeys, c = i % kKeys;
            if (s.win_group[q] != grp) continue;
            if (c < pre) {
              s.win_table[q][c] = static_cast<uint8_t>(c);
            } else if (c >= s.num_keys[q] - R0) {
              s.win_table[q][c] = kZeroRow;
            }
          }
          for (int i = tid; i < nq * kMaskWords; i += kThreads) {
            const int q = i / kMaskWords, w = i % kMaskWords;
            if (s.win_group[q] != grp) continue;
            uint32_t x = s.win_bits[q][w];
            if (x == 0u) continue;
            int col = mb - R0;  // column of the query's first tree key, plus its bits before w
            int row = pre;
            for (int v = 0; v < w; ++v) {
              col += __popc(s.mask[q][v]);
              row += __popc(s.win_union[v]);
            }
            const uint32_t mw = s.mask[q][w], uw = s.win_union[w];
            for (; x != 0u; x &= x - 1u) {
              const uint32_t below = (x & (0u - x)) - 1u;  // bits below x's lowest set bit
              s.win_table[q][col + __popc(mw & below)] =
                  static_cast<uint8_t>(row + __popc(uw & below));
            }
          }
          __syncthreads();
          SPECD_PROF(prof_tab += clock64() - prof_win_mark; prof_win_mark = clock64();)
          // Load the window (at most kWindowRows rows by the grouping).
          int win_rows = pre;
#pragma unroll
          for (int w = 0; w < kMaskWords; ++w) win_rows += __popc(s.win_union[w]);
          for (int i = tid; i < win_rows * kPieces; i += kThreads) {
            const int row = i / kPieces, c = i % kPieces;
            const int64_t off = phys(s.win_slot[row]) * kv_dim + c * 8;
            CpAsync16(&s.win.k[row][c * 8], k_head + off, true);
            CpAsync16(&s.win.v[row][c * 8], v_head + off, true);
          }
          CpAsyncCommit();
          CpAsyncWait<0>();
          __syncthreads();
          SPECD_PROF(prof_load += clock64() - prof_win_mark; prof_win_mark = clock64();)
          // One pass per member query among the warp's rows.
          if (warp * 16 < rows) {
            const int qa = warp * 16 / nh, qb = min((warp * 16 + 15) / nh, nq - 1);
            if constexpr (HD >= 128) {
              // The call takes a copy of the chunk state: were o's own address passed, ptxas
              // would keep o in the local frame for the whole chunk (ncu of 7dba992: it
              // zeroed, stored and reloaded it every chunk, plain-only chunks included).
              float fo[HD / 8][4], fm[2], fl[2];
#pragma unroll
              for (int j = 0; j < HD / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) fo[j][e] = o[j][e];
              }
              fm[0] = m[0], fm[1] = m[1], fl[0] = l[0], fl[1] = l[1];
              WindowPassesOutOfLine<HD>(fo, fm, fl, R0, qa, qb, grp, lq0, lq1, scale_log2, lane,
                                        s, q_row0, q_row1);
#pragma unroll
              for (int j = 0; j < HD / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) o[j][e] = fo[j][e];
              }
              m[0] = fm[0], m[1] = fm[1], l[0] = fl[0], l[1] = fl[1];
            } else {
              WindowPasses<HD>(o, m, l, R0, qa, qb, grp, lq0, lq1, scale_log2, lane, s, q_row0,
                               q_row1);
            }
          }
          __syncthreads();  // the window and tables are read no more
          SPECD_PROF(prof_pass += clock64() - prof_win_mark; prof_win_mark = clock64();)
        }
      }
    }

    SPECD_PROF(prof_win += clock64() - prof_mark;)
    // The chunk's state per row: l summed over the quad (same value in all four threads).
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      l[hr] = __fadd_rn(l[hr], __shfl_xor_sync(kFullMask, l[hr], 1));
      l[hr] = __fadd_rn(l[hr], __shfl_xor_sync(kFullMask, l[hr], 2));
    }
    if constexpr (kSplit) {
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
        float a = 0.0f, b = 0.0f;
        const int mode = MergeWeights(big_m[hr], big_l[hr], m[hr], l[hr], a, b);
        if (mode != 0) {
#pragma unroll
          for (int j = 0; j < HD / 8; ++j) {
            float2& bo = big_o[j][hr][tid];
            bo = make_float2(MergeValue(mode, bo.x, o[j][2 * hr], a, b),
                             MergeValue(mode, bo.y, o[j][2 * hr + 1], a, b));
          }
        }
      }
    }
  }

  if constexpr (!kSplit) {
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
        const float2 bo = big_o[j][hr][tid];
        *reinterpret_cast<uint32_t*>(dst + j * 8) =
            PackBf16x2(__fmul_rn(bo.x, inv), __fmul_rn(bo.y, inv));
      }
    }
  }
#ifdef SPECD_ATTN_PROFILE
  if (tid == 0) {
    const int64_t cta =
        blockIdx.x + gridDim.x * (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
    if (cta < kTreeAttentionProfileCtas) {
      unsigned long long* r = g_attn_prof[cta];
      r[0] = prof_t0;
      r[1] = GlobalTimer();
      r[2] = static_cast<unsigned long long>(clock64() - prof_c0);
      r[3] = static_cast<unsigned long long>(prof_wait);
      r[4] = static_cast<unsigned long long>(prof_plain);
      r[5] = static_cast<unsigned long long>(prof_win);
      r[6] = static_cast<unsigned long long>(prof_grp);
      r[7] = static_cast<unsigned long long>(prof_tab);
      r[8] = static_cast<unsigned long long>(prof_load);
      r[9] = static_cast<unsigned long long>(prof_pass);
      r[10] = blockIdx.z;
      r[11] = static_cast<unsigned long long>(prof_subs);
    }
  }
#endif
}

// One warp per (query, head): the chunk states merged in chunk order with MergeWeights, exactly
// as the main kernel merges them when one CTA owns all chunks.
template <int HD>
__global__ void __launch_bounds__(kThreads) TreeAttentionCombineKernel(TreeAttentionParams p) {
  // Launched as a programmatic dependent of the main kernel: nothing it wrote may be read
  // before this.
  internal::PdlWait();
  const int64_t item = blockIdx.x * static_cast<int64_t>(kWarps) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int64_t items = p.num_queries * p.num_heads;
  if (item >= items) return;
  // Below 32 dims a lane owns one dim and the lanes past head_dim have none (the kernel uses
  // no warp collectives, so they may leave). The merge is elementwise, so how dims are dealt
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
  // The states are read kBatch chunks ahead of their merges (which stay in chunk order), so that
  // a long split (33 chunks at 8K keys) costs a few memory latencies, not one per chunk; 16 makes
  // the common splits (9-10 chunks at 2K keys) one round trip instead of two.
  constexpr int kBatch = 16;
  for (int sp0 = 0; sp0 < p.num_splits; sp0 += kBatch) {
    float cm[kBatch], cl[kBatch], part[kBatch][kPerLane];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      cm[i] = -INFINITY;
      cl[i] = 0.0f;  // past the last chunk: nothing to merge
#pragma unroll
      for (int d = 0; d < kPerLane; ++d) part[i][d] = 0.0f;
      if (sp0 + i < p.num_splits) {
        const int64_t at = (sp0 + i) * items + item;
        cm[i] = ml[2 * at];
        cl[i] = ml[2 * at + 1];
        const float* o = p.workspace + at * HD;
#pragma unroll
        for (int d = 0; d < kPerLane; ++d) part[i][d] = o[lane + 32 * d];
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      float a = 0.0f, b = 0.0f;
      const int mode = MergeWeights(big_m, big_l, cm[i], cl[i], a, b);
      if (mode != 0) {
#pragma unroll
        for (int d = 0; d < kPerLane; ++d) acc[d] = MergeValue(mode, acc[d], part[i][d], a, b);
      }
    }
  }
  if constexpr (HD % 32 == 0) {
    if (p.discard_workspace && (reinterpret_cast<uintptr_t>(p.workspace) & 127) == 0) {
      // The merges above consumed every lane's loads; the warp's barrier orders them all before
      // the drops. An item's partial output is HD floats of its own, kLines whole lines; the
      // warp's lanes take one line each (a drop costs its thread about an L2 round trip).
      constexpr int kLines = HD * static_cast<int>(sizeof(float)) / 128;
      __syncwarp();
      for (int idx = lane; idx < p.num_splits * kLines; idx += 32) {
        internal::DiscardL2Line(p.workspace + ((idx / kLines) * items + item) * HD +
                                (idx % kLines) * 32);
      }
    }
  }
  const float inv = big_l > 0.0f ? __fdiv_rn(1.0f, big_l) : 0.0f;
  const int64_t qi = item / p.num_heads, head = item % p.num_heads;
  bf16* dst = p.out + qi * p.out_stride + head * HD;
#pragma unroll
  for (int d = 0; d < kPerLane; ++d)
    dst[lane + 32 * d] = __float2bfloat16_rn(__fmul_rn(acc[d], inv));
}

template <int HD, bool kSplit, bool kTrees>
cudaError_t LaunchMain(const TreeAttentionParams& p, cudaStream_t stream) {
  const int ctas_z = kSplit ? (p.num_splits + p.chunks_per_cta - 1) / p.chunks_per_cta : 1;
  const dim3 grid(static_cast<unsigned>(p.num_tiles), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(ctas_z));
  // The stages (and, unsplit, the merged state) exceed the 48 KiB of static shared memory. The
  // attribute is per device and cheap to set, so it is set on every launch (multi-GPU processes
  // included).
  constexpr size_t kSmem = SmemBytes<HD, kSplit>();
  if (cudaError_t e = cudaFuncSetAttribute(TreeAttentionKernel<HD, kSplit, kTrees>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kSmem));
      e != cudaSuccess) {
    return e;
  }
  return LaunchPdl("attention", TreeAttentionKernel<HD, kSplit, kTrees>, grid,
                   dim3(kThreads), kSmem, stream, p);
}

// Without masks every query's keys are its own slots, so the kernel is built without the window
// machinery (decode and prefill chains; fewer registers).
template <int HD, bool kSplit>
cudaError_t LaunchMain(const TreeAttentionParams& p, cudaStream_t stream) {
  return p.mask_begin != nullptr ? LaunchMain<HD, kSplit, true>(p, stream)
                                 : LaunchMain<HD, kSplit, false>(p, stream);
}

template <int HD>
cudaError_t Launch(const TreeAttentionParams& p, cudaStream_t stream) {
  if (p.num_splits == 1) return LaunchMain<HD, false>(p, stream);
  if (cudaError_t e = LaunchMain<HD, true>(p, stream); e != cudaSuccess) return e;
  const int64_t items = p.num_queries * p.num_heads;
  return LaunchPdl("combine", TreeAttentionCombineKernel<HD>,
                   dim3(static_cast<unsigned>((items + kWarps - 1) / kWarps)),
                   dim3(kThreads), 0, stream, p);
}

// The generic kernel: head sizes the MMA kernel is not built for (any even head_dim up to
// kTreeAttentionMaxHeadDim), for small or unusual models, where simplicity beats speed. One warp
// per (query, head), nothing shared between warps, so batch invariance holds by construction: a
// warp reads only its query's vector, kv_end, mask and block-table row. It follows the MMA
// kernel's structure where that is cheap: keys by rank in the query's own key order, in the same
// 64-rank sub-chunks and kTreeAttentionChunkKeys-rank chunks; per sub-chunk an online-softmax
// update (base 2, scores scaled by scale * log2(e), p = exp2(s - m) summed in fp32 into l,
// probabilities rounded to bf16 before P V, whose products are summed in fp32 into fresh
// accumulators and then folded in as o = o * alpha + pv); each chunk a fresh softmax, merged in
// chunk order with MergeWeights; out = o * (1 / l) rounded to bf16. Scores are fp32 FMAs over
// the dims in order instead of MMAs, and the softmax's roundings are its own, so the bits are
// not the MMA kernel's (a model runs one kernel or the other, never both). It
// never splits the key range: the tiles, num_splits, chunks_per_cta and the workspace are not
// read.
//
// Lanes: for scores, lane i takes the sub-chunk's columns i and i + 32 (its key's whole head
// dot product); for P V, lane i owns dim pairs i, i + 32, ... (kPairs of them; lanes past
// head_dim / 2 idle) and walks the sub-chunk's columns in order, each column's probability and
// V row offset broadcast from the lane that scored it.
template <int kPairs>
__global__ void __launch_bounds__(kThreads) TreeAttentionGenericKernel(TreeAttentionParams p) {
  constexpr int kDims = 64 * kPairs;  // head dims this build serves at most
  __shared__ float q_s[kWarps][kDims];
  // Logical slots of the query's tree keys (mask bits in use), in rank order.
  __shared__ int32_t tree_slot_s[kWarps][kTreeAttentionMaskBits];
  // Launched as a programmatic dependent of RoPE (LaunchPdl): q and the cache are its outputs.
  internal::PdlWait();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= p.num_queries * p.num_heads) return;  // no block-wide barriers below
  const int64_t qi = item / p.num_heads;
  const int64_t head = item % p.num_heads;
  const int hd = static_cast<int>(p.head_dim);
  const int64_t group = p.kv_group > 0 ? p.kv_group : p.num_heads / p.num_kv_heads;
  const int64_t kvh = (p.q_head_offset + head) / group - p.kv_head_offset;
  const int64_t kv_dim = p.num_kv_heads * p.head_dim;
  float* q_w = q_s[warp];
  int32_t* tree_slot = tree_slot_s[warp];

  const bf16* q_row = p.q + qi * p.q_stride + head * p.head_dim;
  for (int i = lane; 2 * i < hd; i += 32) {
    const float2 x = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(q_row)[i]);
    q_w[2 * i] = x.x;
    q_w[2 * i + 1] = x.y;
  }
  // Visible keys, as in the MMA kernel: ranks [0, mb) are slots [0, mb); then the mask's bits
  // below kv_end - mb, each the slot mb + bit.
  const int end = p.kv_end[qi];
  const int mb = p.mask_begin != nullptr ? min(p.mask_begin[qi], end) : end;
  const int bits = end - mb;
  int tree_keys = 0;
  if (bits > 0) {  // the warp agrees (mb and end are the query's)
    uint32_t word = 0u;
    if (lane < kMaskWords) {
      word = p.mask[qi * kMaskWords + lane];
      const int lo = 32 * lane;
      if (bits <= lo) {
        word = 0u;
      } else if (bits < lo + 32) {
        word &= (1u << (bits - lo)) - 1u;
      }
    }
    const int count = __popc(word);
    int row = 0;  // this lane's first rank among the tree keys
#pragma unroll
    for (int w = 0; w < kMaskWords; ++w) {
      const int c = __shfl_sync(kFullMask, count, w);
      if (w < lane) row += c;
      tree_keys += c;
    }
    for (uint32_t x = word; x != 0u; x &= x - 1u) {
      tree_slot[row++] = mb + 32 * lane + __ffs(static_cast<int>(x)) - 1;
    }
  }
  __syncwarp();  // q_w and tree_slot are visible to the whole warp
  const int num_keys = mb + tree_keys;

  const int32_t* table =
      p.block_tables + static_cast<int64_t>(p.query_seq[qi]) * p.max_blocks_per_seq;
  const int64_t block_size = p.block_size;
  const int64_t head_off = kvh * p.head_dim;
  // Element offset of a rank's K (and V) head in the caches.
  auto key_offset = [&](int rank) -> int64_t {
    const int slot = rank < mb ? rank : tree_slot[rank - mb];
    const int64_t phys = static_cast<int64_t>(__ldg(table + slot / block_size)) * block_size +
                         slot % block_size;
    return phys * kv_dim + head_off;
  };
  const float scale_log2 = p.scale * kLog2e;

  // Merged state over the chunks done so far.
  float big_o[kPairs][2];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) big_o[j][0] = big_o[j][1] = 0.0f;
  float big_m = -INFINITY, big_l = 0.0f;
  const int num_chunks = (num_keys + kChunk - 1) / kChunk;
  for (int chunk = 0; chunk < num_chunks; ++chunk) {
    // This chunk's online softmax, from scratch; l is this lane's share of the sum.
    float o[kPairs][2];
#pragma unroll
    for (int j = 0; j < kPairs; ++j) o[j][0] = o[j][1] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int sub = chunk * kSub; sub < (chunk + 1) * kSub && sub * kKeys < num_keys; ++sub) {
      const int R0 = sub * kKeys;
      const int cnt = min(kKeys, num_keys - R0);  // columns with a visible key
      float s[2];
      int64_t off[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = lane + 32 * h;
        s[h] = -INFINITY;
        off[h] = 0;
        if (c < cnt) {
          off[h] = key_offset(R0 + c);
          const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(p.k_cache + off[h]);
          float acc = 0.0f;
          for (int i = 0; 2 * i < hd; ++i) {
            const float2 k = __bfloat1622float2(k2[i]);
            acc = __fmaf_rn(q_w[2 * i], k.x, acc);
            acc = __fmaf_rn(q_w[2 * i + 1], k.y, acc);
          }
          s[h] = __fmul_rn(acc, scale_log2);
        }
      }
      float mx = fmaxf(s[0], s[1]);
#pragma unroll
      for (int x = 16; x > 0; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, x));
      const float m_new = fmaxf(m, mx);
      // cnt > 0 keys are visible, so m_new is finite for finite data; the guard keeps a
      // non-finite one from turning into NaN here as in the MMA kernel.
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2f(__fsub_rn(m, m_use));
      const float p0 = exp2f(__fsub_rn(s[0], m_use));
      const float p1 = exp2f(__fsub_rn(s[1], m_use));
      l = __fmaf_rn(l, alpha, __fadd_rn(p0, p1));
      m = m_new;
      // P V with P rounded to bf16, as the MMA kernel's A fragment of P is.
      const float pb0 = __bfloat162float(__float2bfloat16_rn(p0));
      const float pb1 = __bfloat162float(__float2bfloat16_rn(p1));
      float pv[kPairs][2];
#pragma unroll
      for (int j = 0; j < kPairs; ++j) pv[j][0] = pv[j][1] = 0.0f;
      for (int c = 0; c < cnt; ++c) {
        const float pc = __shfl_sync(kFullMask, c < 32 ? pb0 : pb1, c & 31);
        const int64_t oc = __shfl_sync(kFullMask, c < 32 ? off[0] : off[1], c & 31);
        const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(p.v_cache + oc);
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          const int i = lane + 32 * j;
          if (2 * i < hd) {
            const float2 v = __bfloat1622float2(v2[i]);
            pv[j][0] = __fmaf_rn(pc, v.x, pv[j][0]);
            pv[j][1] = __fmaf_rn(pc, v.y, pv[j][1]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        o[j][0] = __fmaf_rn(o[j][0], alpha, pv[j][0]);
        o[j][1] = __fmaf_rn(o[j][1], alpha, pv[j][1]);
      }
    }
    // The chunk's l summed over the warp: a butterfly, so every lane holds the same bits.
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) l = __fadd_rn(l, __shfl_xor_sync(kFullMask, l, x));
    float a = 0.0f, b = 0.0f;
    const int mode = MergeWeights(big_m, big_l, m, l, a, b);
    if (mode != 0) {
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        big_o[j][0] = MergeValue(mode, big_o[j][0], o[j][0], a, b);
        big_o[j][1] = MergeValue(mode, big_o[j][1], o[j][1], a, b);
      }
    }
  }

  const float inv = big_l > 0.0f ? __fdiv_rn(1.0f, big_l) : 0.0f;
  uint32_t* dst = reinterpret_cast<uint32_t*>(p.out + qi * p.out_stride + head * p.head_dim);
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int i = lane + 32 * j;
    if (2 * i < hd) dst[i] = PackBf16x2(__fmul_rn(big_o[j][0], inv), __fmul_rn(big_o[j][1], inv));
  }
}

template <int kPairs>
cudaError_t LaunchGeneric(const TreeAttentionParams& p, cudaStream_t stream) {
  const int64_t items = p.num_queries * p.num_heads;
  const dim3 grid(static_cast<unsigned>((items + kWarps - 1) / kWarps));
  return LaunchPdl("attention", TreeAttentionGenericKernel<kPairs>, grid,
                   dim3(kThreads), 0, stream, p);
}

cudaError_t LaunchGeneric(const TreeAttentionParams& p, cudaStream_t stream) {
  static_assert(kTreeAttentionMaxHeadDim <= 4 * 64, "at most four dim pairs a lane");
  if (p.head_dim <= 64) return LaunchGeneric<1>(p, stream);
  if (p.head_dim <= 128) return LaunchGeneric<2>(p, stream);
  if (p.head_dim <= 192) return LaunchGeneric<3>(p, stream);
  return LaunchGeneric<4>(p, stream);
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

// The planner's model of a launch's time: waves of `ctas` over the resident slots (two CTAs per
// multiprocessor) times each CTA's work, its chunks plus about half a chunk of setup.
double WaveCost(int64_t ctas, int num_sms, int64_t chunks_per_cta) {
  const int64_t slots = 2 * static_cast<int64_t>(std::max(num_sms, 1));
  return static_cast<double>((ctas + slots - 1) / slots) *
         (static_cast<double>(chunks_per_cta) + 0.5);
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
  // Splitting changes no bits (see the kernel), only the CTA count. Split whenever the tiles
  // alone leave SMs idle, or when the split's waves of CTAs (WaveCost, plus about a chunk's worth
  // for the combine kernel) take less than the unsplit launch, whose CTAs each walk every chunk:
  // a 256-node tree's 136 tiles fill the SMs but only half the resident slots, and would run 19
  // chunks in a row.
  const int64_t tiles = static_cast<int64_t>(plan.tile_begin.size());
  const int64_t ctas = tiles * num_kv_heads;
  const int64_t chunks = TreeAttentionChunks(max_kv);
  if (chunks > 1 &&
      TreeAttentionWorkspaceFloats(static_cast<int>(chunks), num_queries, num_heads, 128) <=
          kMaxWorkspaceFloats) {
    const int c = TreeAttentionChunksPerCta(tiles, num_kv_heads, static_cast<int>(chunks), num_sms);
    const double split_cost = WaveCost(ctas * ((chunks + c - 1) / c), num_sms, c) + 1.0;
    if (ctas < num_sms || split_cost < WaveCost(ctas, num_sms, chunks)) {
      plan.num_splits = static_cast<int>(chunks);
      plan.chunks_per_cta = c;
    }
  }
  return plan;
}

int TreeAttentionChunksPerCta(int64_t num_tiles, int64_t num_kv_heads, int num_splits,
                              int num_sms) {
  if (num_splits <= 1 || num_tiles <= 0 || num_kv_heads <= 0 || num_sms <= 0) return 1;
  int best = 1;
  double best_cost = 0.0;
  for (int c = 1; c <= num_splits; ++c) {
    const double cost = WaveCost(num_tiles * num_kv_heads * ((num_splits + c - 1) / c), num_sms, c);
    if (c == 1 || cost < best_cost) {
      best = c;
      best_cost = cost;
    }
  }
  return best;
}

int TreeAttentionChunks(int32_t max_kv_end) {
  return max_kv_end <= 0 ? 0 : (max_kv_end + kChunk - 1) / kChunk;
}

int64_t TreeAttentionWorkspaceFloats(int num_splits, int64_t num_queries, int64_t num_heads,
                                     int64_t head_dim) {
  if (num_splits <= 1 || !TreeAttentionUsesMmaKernel(head_dim)) return 0;
  return static_cast<int64_t>(num_splits) * num_queries * num_heads * (head_dim + 2);
}

cudaError_t TreeAttentionCuda(const TreeAttentionParams& p, cudaStream_t stream) {
  if (p.num_queries < 0 || p.num_tiles < 0 || p.num_heads <= 0 || p.num_kv_heads <= 0 ||
      p.num_kv_heads > 65535 || !HeadRangesValid(p) || !TreeAttentionHeadDimSupported(p.head_dim) ||
      p.num_splits < 1 || p.num_splits > 65535 || p.chunks_per_cta < 1 || p.block_size <= 0 ||
      p.max_blocks_per_seq <= 0 ||
      p.q_stride < p.num_heads * p.head_dim || p.q_stride % 2 != 0 ||
      p.out_stride < p.num_heads * p.head_dim || p.out_stride % 2 != 0 ||
      (p.mask == nullptr) != (p.mask_begin == nullptr) ||
      !(p.scale > 0.0f && p.scale < INFINITY) ||
      p.block_size > INT_MAX / (p.num_kv_heads * p.head_dim)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_queries == 0) return cudaSuccess;
  const bool mma = TreeAttentionUsesMmaKernel(p.head_dim);
  // The generic kernel reads no tiles (it needs none: a warp per (query, head)).
  if (mma && p.num_tiles == 0) return cudaSuccess;
  if (p.q == nullptr || p.out == nullptr || p.k_cache == nullptr || p.v_cache == nullptr ||
      p.block_tables == nullptr || p.query_seq == nullptr || p.kv_end == nullptr ||
      (mma && (p.tile_begin == nullptr || p.tile_end == nullptr ||
               (p.num_splits > 1 && p.workspace == nullptr)))) {
    return cudaErrorInvalidValue;
  }
  // Pairs of bf16 everywhere; the MMA kernel copies 16-byte pieces of K and V (head_dim a
  // multiple of 8 keeps every head's row 16-byte aligned in an aligned cache).
  const uintptr_t kv_align = mma ? 16 : 4;
  if (!IsAligned(p.q, 4) || !IsAligned(p.out, 4) || !IsAligned(p.k_cache, kv_align) ||
      !IsAligned(p.v_cache, kv_align) || (mma && !IsAligned(p.workspace, 8))) {
    return cudaErrorInvalidValue;
  }
  switch (p.head_dim) {
    case 16:
      return Launch<16>(p, stream);
    case 32:
      return Launch<32>(p, stream);
    case 64:
      return Launch<64>(p, stream);
    case 128:
      return Launch<128>(p, stream);
    default:
      return LaunchGeneric(p, stream);
  }
}

#ifdef SPECD_ATTN_PROFILE
cudaError_t TreeAttentionProfile(unsigned long long* records, int64_t ctas) {
  const int64_t n = std::min<int64_t>(ctas, kTreeAttentionProfileCtas);
  return cudaMemcpyFromSymbol(records, g_attn_prof,
                              static_cast<size_t>(n) * kTreeAttentionProfileFields *
                                  sizeof(unsigned long long));
}
#endif

bool TreeAttentionUsesMmaKernel(int64_t head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
}

bool TreeAttentionHeadDimSupported(int64_t head_dim) {
  return head_dim >= 2 && head_dim <= kTreeAttentionMaxHeadDim && head_dim % 2 == 0;
}

}  // namespace cuda
}  // namespace specd
