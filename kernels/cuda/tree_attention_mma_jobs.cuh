// Tree attention's MMA kernel, its jobs (the kernel is tree_attention_mma.cuh, which says what a
// plain and a window job are): a plain job streams one sub-chunk's slots through a stage for
// every row that is plain there; a window job groups the tile's tree nodes that need a sub-chunk
// of their own keys, loads each group's distinct keys once and makes one pass per node.
#ifndef SPECD_KERNELS_CUDA_TREE_ATTENTION_MMA_JOBS_CUH_
#define SPECD_KERNELS_CUDA_TREE_ATTENTION_MMA_JOBS_CUH_

#include "kernels/cuda/tree_attention_mma_core.cuh"

namespace specd {
namespace cuda {
namespace tree_attn {

#ifdef SPECD_ATTN_PROFILE
// Profiling builds (cmake -DSPECD_ATTN_PROFILE=ON) only: a CTA's clock marks and the SM cycles
// it spent in each part (TreeAttentionProfile's fields).
struct AttnProf {
  unsigned long long t0 = 0;
  long long c0 = 0, wait = 0, plain = 0, win = 0, mark = 0, win_mark = 0, grp = 0, tab = 0,
            load = 0, pass = 0;
  int subs = 0;
};
#endif

// What a thread knows of its CTA's tile (TreeAttentionKernel): its nq queries times the nh local
// query heads of the KV head make rows = nq * nh rows, row r being query r / nh; the thread's two
// rows r0 = 16 warp + lane / 4 and r1 = r0 + 8 exist when ok0 and ok1 (padding rows do not), and
// lq0 and lq1 are their local queries, clamped so that padding rows read valid (unused) entries.
struct TileRows {
  int nq, nh, rows;
  bool ok0, ok1;
  int lq0, lq1;
};

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

// A plain job is sub-chunk `sub`'s 64 slots, loaded once into stage sub % 2, and one
// AttendColumns pass over them for every row of the tile that is plain there. The kernel runs
// LoadPlainJob, then the rows' limits (TreeAttentionKernel), then PlainJobPasses.
//
// LoadPlainJob: the job's load (unless already in flight: `issued` is the last job whose load was
// issued), the next job's load into the other stage when that job is plain too (below the CTA's
// plain sub-chunks, plain_end and sub_limit, and in this chunk or with no window job in between:
// no_windows), then the wait for this job's copies and the barrier that publishes them.
// issue_plain(sub) issues a job's cp.async copies.
template <int HD, typename IssuePlain>
__device__ __forceinline__ void LoadPlainJob(int sub, int plain_last, int plain_end, int sub_limit,
                                             bool no_windows, int& issued,
                                             IssuePlain& issue_plain) {
  if (issued < sub) {
    issue_plain(sub);
    CpAsyncCommit();
  }
  // Prefetch the next job when it is plain too, into the other stage (freed by the
  // barrier that ended the previous job). Window jobs take both stages, so nothing is in
  // flight across them.
  const int next = sub + 1;
  if (next < min(plain_end, sub_limit) && (next < plain_last || no_windows)) {
    issue_plain(next);
    issued = next;
  }
  CpAsyncCommit();
  CpAsyncWait<1>();
  // The wgmma reads the stage through the async proxy: order this thread's copies before
  // them, then the block barrier orders everyone's.
  if constexpr (kWgPlain<HD>) FenceProxyAsyncShared();
  __syncthreads();
}

// PlainJobPasses: the warp's rows over stage st (the job's, at ranks R0), each up to its limit
// (R0 for the rows that are not plain here), then the barrier after which the stage may be
// refilled.
template <int HD>
__device__ __forceinline__ void PlainJobPasses(const AttnStage<HD>& st, int R0, const int (&lim)[2],
                                               const uint32_t (&qf)[HD / 16][4],
                                               float (&o)[HD / 8][4], float (&m)[2], float (&l)[2],
                                               float scale_log2, int lane) {
  AttendColumns<HD, kWgPlain<HD>>(
      qf, o, m, l, R0, lim, scale_log2, lane, [&](int c, int d) { return st.K(c, d); },
      [&](int c, int d) { return st.V(c, d); }, SmemAddr(st.K(0, 0)), SmemAddr(st.V(0, 0)));
  __syncthreads();  // this stage is read no more; a later job may refill it
}

// Warp 0, window sub-chunk at ranks R0: which queries need a window here, their mask bits with
// ranks in the sub-chunk, and their groups: all in one when they share mask_begin and their keys
// fit, else greedily in query order (one query's keys here are at most 64). Publishes group 0's
// window (win_union, win_mb) and the group count (win_groups).
template <int HD>
__device__ __forceinline__ void GroupWindowQueries(AttnSmem<HD>& s, int sub, int R0, int nq,
                                                   int lane) {
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

// Warp 0: publishes group grp's window (grp > 0): the union of its members' bits and their
// smallest mask_begin.
template <int HD>
__device__ __forceinline__ void PublishGroupWindow(AttnSmem<HD>& s, int grp, int nq, int lane) {
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

// The whole CTA: group grp's window rows and its members' tables, for the window's mask_begin mb
// and its pre = max(0, mb - R0) prefix rows. Window rows: [0, pre) the prefix slots R0.., then
// the union's slots in slot order. Tables: column c < pre -> row c; a tree key's column (its rank
// - R0) -> its row; columns past the query's keys -> the zero row.
template <int HD>
__device__ __forceinline__ void BuildWindowTables(AttnSmem<HD>& s, int grp, int R0, int mb, int pre,
                                                  int nq, int tid) {
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
      s.win_table[q][col + __popc(mw & below)] = static_cast<uint8_t>(row + __popc(uw & below));
    }
  }
}

// One window job, the window sub-chunk `sub`: its queries grouped, then per group its window
// loaded (at most kWindowRows rows by the grouping; phys(slot) maps a logical slot of the tile's
// sequence to its physical slot) and one pass per member query among each warp's rows. The
// stages' memory holds the window, so no plain load may be in flight.
template <int HD, typename Phys>
__device__ __forceinline__ void WindowJob(AttnSmem<HD>& s, int sub, const TileRows& tr, int tid,
                                          int warp, int lane, float scale_log2, const bf16* q_row0,
                                          const bf16* q_row1, const bf16* k_head,
                                          const bf16* v_head, int64_t kv_dim, Phys& phys,
                                          float (&o)[HD / 8][4], float (&m)[2],
                                          float (&l)[2] SPECD_PROF(, AttnProf& prof)) {
  constexpr int kPieces = HD / 8;  // 16-byte pieces of a key's head
  const int nq = tr.nq, nh = tr.nh, rows = tr.rows;
  SPECD_PROF(prof.win_mark = clock64();)
  const int R0 = sub * kKeys;
  if (warp == 0) GroupWindowQueries<HD>(s, sub, R0, nq, lane);
  __syncthreads();
  const int groups = s.win_groups;
  SPECD_PROF(++prof.subs; prof.grp += clock64() - prof.win_mark; prof.win_mark = clock64();)
  for (int grp = 0; grp < groups; ++grp) {
    if (grp > 0) {  // the group's window: the union of its members' bits
      if (warp == 0) PublishGroupWindow<HD>(s, grp, nq, lane);
      __syncthreads();
    }
    SPECD_PROF(prof.grp += clock64() - prof.win_mark; prof.win_mark = clock64();)
    const int mb = s.win_mb;
    const int pre = max(0, mb - R0);
    BuildWindowTables<HD>(s, grp, R0, mb, pre, nq, tid);
    __syncthreads();
    SPECD_PROF(prof.tab += clock64() - prof.win_mark; prof.win_mark = clock64();)
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
    SPECD_PROF(prof.load += clock64() - prof.win_mark; prof.win_mark = clock64();)
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
        WindowPassesOutOfLine<HD>(fo, fm, fl, R0, qa, qb, grp, tr.lq0, tr.lq1, scale_log2, lane, s,
                                  q_row0, q_row1);
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) o[j][e] = fo[j][e];
        }
        m[0] = fm[0], m[1] = fm[1], l[0] = fl[0], l[1] = fl[1];
      } else {
        WindowPasses<HD>(o, m, l, R0, qa, qb, grp, tr.lq0, tr.lq1, scale_log2, lane, s, q_row0,
                         q_row1);
      }
    }
    __syncthreads();  // the window and tables are read no more
    SPECD_PROF(prof.pass += clock64() - prof.win_mark; prof.win_mark = clock64();)
  }
}

}  // namespace tree_attn
}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_TREE_ATTENTION_MMA_JOBS_CUH_
