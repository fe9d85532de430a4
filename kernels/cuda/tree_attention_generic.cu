// Tree attention's generic kernel: the head sizes the MMA kernel is not built for.
#include "kernels/cuda/tree_attention_common.cuh"

namespace specd {
namespace cuda {
namespace tree_attn {
namespace {

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
      p.kv.block_tables + static_cast<int64_t>(p.query_seq[qi]) * p.kv.max_blocks_per_seq;
  const int64_t block_size = p.kv.block_size;
  const int64_t head_off = kvh * p.head_dim;
  // Element offset of a rank's K (and V) head in the caches.
  auto key_offset = [&](int rank) -> int64_t {
    const int slot = rank < mb ? rank : tree_slot[rank - mb];
    const int64_t phys =
        static_cast<int64_t>(__ldg(table + slot / block_size)) * block_size + slot % block_size;
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
          const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(p.kv.k_cache + off[h]);
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
        const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(p.kv.v_cache + oc);
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
cudaError_t LaunchGenericPairs(const TreeAttentionParams& p, cudaStream_t stream) {
  const int64_t items = p.num_queries * p.num_heads;
  const dim3 grid(static_cast<unsigned>((items + kWarps - 1) / kWarps));
  return LaunchPdl("attention", TreeAttentionGenericKernel<kPairs>, grid, dim3(kThreads), 0, stream,
                   p);
}

}  // namespace

cudaError_t LaunchGeneric(const TreeAttentionParams& p, cudaStream_t stream) {
  static_assert(kTreeAttentionMaxHeadDim <= 4 * 64, "at most four dim pairs a lane");
  if (p.head_dim <= 64) return LaunchGenericPairs<1>(p, stream);
  if (p.head_dim <= 128) return LaunchGenericPairs<2>(p, stream);
  if (p.head_dim <= 192) return LaunchGenericPairs<3>(p, stream);
  return LaunchGenericPairs<4>(p, stream);
}

}  // namespace tree_attn
}  // namespace cuda
}  // namespace specd
