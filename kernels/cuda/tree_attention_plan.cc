// Tree attention's planner (specd/kernels/cuda/tree_attention_plan.h): plain C++, unit-tested
// without a GPU (tests/unit/tree_attention_plan_test.cc).
#include "specd/kernels/cuda/tree_attention_plan.h"

#include <algorithm>

namespace specd {
namespace cuda {
namespace {

// The split workspace is capped (it grows with queries times chunks); past that, one CTA per
// tile walks all chunks, which gives the same bits.
constexpr int64_t kMaxWorkspaceFloats = kTreeAttentionMaxWorkspaceFloats;

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
  const int64_t per_tile = std::max<int64_t>(1, kTreeAttentionTileRows / group);
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
  if (chunks > 1 && TreeAttentionWorkspaceFloats(static_cast<int>(chunks), num_queries, num_heads,
                                                 128) <= kMaxWorkspaceFloats) {
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
  return max_kv_end <= 0 ? 0 : (max_kv_end + kTreeAttentionChunkKeys - 1) / kTreeAttentionChunkKeys;
}

int64_t TreeAttentionWorkspaceFloats(int num_splits, int64_t num_queries, int64_t num_heads,
                                     int64_t head_dim) {
  if (num_splits <= 1 || !TreeAttentionUsesMmaKernel(head_dim)) return 0;
  return static_cast<int64_t>(num_splits) * num_queries * num_heads * (head_dim + 2);
}

bool TreeAttentionUsesMmaKernel(int64_t head_dim) {
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
}

bool TreeAttentionHeadDimSupported(int64_t head_dim) {
  return head_dim >= 2 && head_dim <= kTreeAttentionMaxHeadDim && head_dim % 2 == 0;
}

}  // namespace cuda
}  // namespace specd
