// Tree attention's MMA kernel, its building blocks (the kernel is tree_attention_mma.cuh): the
// shared-memory layout of the key stages and the window, and one warp's pass over a sub-chunk of
// 64 rank columns (AttendColumns), which every plain and window job runs.
#ifndef SPECD_KERNELS_CUDA_TREE_ATTENTION_MMA_CORE_CUH_
#define SPECD_KERNELS_CUDA_TREE_ATTENTION_MMA_CORE_CUH_

#include "kernels/cuda/tree_attention_common.cuh"

namespace specd {
namespace cuda {
namespace tree_attn {

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
constexpr bool kWgPlain = kSwizzled<HD>&& internal::kHasWgmma;

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
          LdMatrixX4Trans(val_at(kk * 16 + (lane & 15), (lane >> 4) * 8 + j * 8), b0, b1, b2, b3);
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

}  // namespace tree_attn
}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_TREE_ATTENTION_MMA_CORE_CUH_
