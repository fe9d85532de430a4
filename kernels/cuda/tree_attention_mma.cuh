// Tree attention's MMA kernel (head sizes 16, 32, 64 and 128) and its launcher, included by one
// instance file per head size (tree_attention_instances/), so that the sizes compile in parallel.
// Its building blocks are tree_attention_mma_core.cuh (stages, AttendColumns) and
// tree_attention_mma_jobs.cuh (the plain and window jobs); the split launch's second kernel is
// tree_attention_combine.cuh.
#ifndef SPECD_KERNELS_CUDA_TREE_ATTENTION_MMA_CUH_
#define SPECD_KERNELS_CUDA_TREE_ATTENTION_MMA_CUH_

#include "kernels/cuda/tree_attention_combine.cuh"
#include "kernels/cuda/tree_attention_mma_jobs.cuh"

namespace specd {
namespace cuda {
namespace tree_attn {

#ifdef SPECD_ATTN_PROFILE
// Profiling builds only: where each CTA of the last launch of this instance file's kernels spent
// its time (TreeAttentionProfile). The slot of a CTA is its linear block index. Static: each
// instance file keeps its own records, which ReadMmaProfile<HD> copies.
static __device__ unsigned long long g_attn_prof[kTreeAttentionProfileCtas]
                                                [kTreeAttentionProfileFields];
__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
#endif

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
// key still sits in the column of its rank. In a chunk, plain jobs come before window jobs; a
// query's plain sub-chunks all precede its window ones, so each row still sees its sub-chunks in
// rank order, one AttendColumns pass each, with the same arithmetic as in any other batch. kTrees
// false (null masks: every sub-chunk is plain) compiles the window machinery out.
template <int HD, bool kSplit, bool kTrees>
__global__ void __launch_bounds__(kThreads, MinBlocks<HD, kTrees>())
    TreeAttentionKernel(TreeAttentionParams p) {
  static_assert(HD % 16 == 0 && HD >= 16, "whole MMA k-steps and pairs of 8-dim V tiles");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  AttnSmem<HD>& s = *reinterpret_cast<AttnSmem<HD>*>(smem_raw);
  SPECD_PROF(AttnProf prof; prof.t0 = GlobalTimer(); prof.c0 = clock64();)
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
      p.kv.block_tables + static_cast<int64_t>(p.query_seq[q0]) * p.kv.max_blocks_per_seq;
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
  const int table_first = chunk_first * kChunk / static_cast<int>(p.kv.block_size);
  {
    const int n = static_cast<int>(
        min(static_cast<int64_t>(kTableEntries), p.kv.max_blocks_per_seq - table_first));
    for (int i = tid; i < n; i += kThreads) s.table[i] = __ldg(table + table_first + i);
  }

  const int r0 = warp * 16 + g;
  const int r1 = r0 + 8;
  const bool ok0 = r0 < rows, ok1 = r1 < rows;
  // Local query index of each of this thread's two rows, clamped so that padding rows read
  // valid (unused) entries.
  const int lq0 = min(r0 / nh, nq - 1);
  const int lq1 = min(r1 / nh, nq - 1);
  const TileRows tr{nq, nh, rows, ok0, ok1, lq0, lq1};

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
  const int chunk_last =
      kSplit ? min(chunk_first + p.chunks_per_cta, p.num_splits) : (max_keys + kChunk - 1) / kChunk;
  const int sub_limit = chunk_last * kSub;  // the CTA's sub-chunks end here
  const float scale_log2 = p.scale * kLog2e;
  const bf16* k_head = p.kv.k_cache + kvh * HD;
  const bf16* v_head = p.kv.v_cache + kvh * HD;
  const int block_size = static_cast<int>(p.kv.block_size);
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
      sub0 < min(plain_end, sub_limit) && min(sub0 * kKeys + kKeys, plain_bound) <= s.stable_end) {
    issue_plain(sub0);
    CpAsyncCommit();
    issued = sub0;
  }
  internal::PdlWait();
  SPECD_PROF(prof.wait = clock64() - prof.c0;)
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

    SPECD_PROF(prof.mark = clock64();)
    for (int sub = sub_first; sub < plain_last; ++sub) {
      LoadPlainJob<HD>(sub, plain_last, plain_end, sub_limit, win_first >= win_last, issued,
                       issue_plain);
      const AttnStage<HD>& st = s.stage[sub & 1];
      const int R0 = sub * kKeys;
      // Rows plain here see ranks [R0, num_keys); the others sit this job out.
      const int lim[2] = {ok0 && sub < s.plain_subs[lq0] ? s.num_keys[lq0] : R0,
                          ok1 && sub < s.plain_subs[lq1] ? s.num_keys[lq1] : R0};
      PlainJobPasses<HD>(st, R0, lim, qf, o, m, l, scale_log2, lane);
    }

    SPECD_PROF(prof.plain += clock64() - prof.mark; prof.mark = clock64();)
    if constexpr (kTrees) {
      for (int sub = win_first; sub < win_last; ++sub) {
        WindowJob<HD>(s, sub, tr, tid, warp, lane, scale_log2, q_row0, q_row1, k_head, v_head,
                      kv_dim, phys, o, m, l SPECD_PROF(, prof));
      }
    }

    SPECD_PROF(prof.win += clock64() - prof.mark;)
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
      r[0] = prof.t0;
      r[1] = GlobalTimer();
      r[2] = static_cast<unsigned long long>(clock64() - prof.c0);
      r[3] = static_cast<unsigned long long>(prof.wait);
      r[4] = static_cast<unsigned long long>(prof.plain);
      r[5] = static_cast<unsigned long long>(prof.win);
      r[6] = static_cast<unsigned long long>(prof.grp);
      r[7] = static_cast<unsigned long long>(prof.tab);
      r[8] = static_cast<unsigned long long>(prof.load);
      r[9] = static_cast<unsigned long long>(prof.pass);
      r[10] = blockIdx.z;
      r[11] = static_cast<unsigned long long>(prof.subs);
    }
  }
#endif
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
  return LaunchPdl("attention", TreeAttentionKernel<HD, kSplit, kTrees>, grid, dim3(kThreads),
                   kSmem, stream, p);
}

// Without masks every query's keys are its own slots, so the kernel is built without the window
// machinery (decode and prefill chains; fewer registers).
template <int HD, bool kSplit>
cudaError_t LaunchMain(const TreeAttentionParams& p, cudaStream_t stream) {
  return p.mask_begin != nullptr ? LaunchMain<HD, kSplit, true>(p, stream)
                                 : LaunchMain<HD, kSplit, false>(p, stream);
}

template <int HD>
cudaError_t LaunchMma(const TreeAttentionParams& p, cudaStream_t stream) {
  if (p.num_splits == 1) return LaunchMain<HD, false>(p, stream);
  if (cudaError_t e = LaunchMain<HD, true>(p, stream); e != cudaSuccess) return e;
  const int64_t items = p.num_queries * p.num_heads;
  return LaunchPdl("combine", TreeAttentionCombineKernel<HD>,
                   dim3(static_cast<unsigned>((items + kWarps - 1) / kWarps)), dim3(kThreads), 0,
                   stream, p);
}

#ifdef SPECD_ATTN_PROFILE
template <int HD>
cudaError_t ReadMmaProfile(unsigned long long* records, int64_t ctas) {
  const int64_t n = std::min<int64_t>(ctas, kTreeAttentionProfileCtas);
  return cudaMemcpyFromSymbol(
      records, g_attn_prof,
      static_cast<size_t>(n) * kTreeAttentionProfileFields * sizeof(unsigned long long));
}
#endif

}  // namespace tree_attn
}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_TREE_ATTENTION_MMA_CUH_
