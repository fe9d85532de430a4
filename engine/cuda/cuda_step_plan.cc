#include "engine/cuda/cuda_step_plan.h"

#include <algorithm>
#include <optional>

#include "common/token_tree.h"
#include "engine/cuda/tree_mask.h"
#include "specd/kernels/cuda/tree_attention_plan.h"

namespace specd {

int64_t NextPow2(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

int64_t TokenBucket(int64_t n) { return n <= 1 ? 1 : 1 + NextPow2(n - 1); }

bool ChooseBuckets(const std::vector<int64_t>& item_tokens, CudaStep* step) {
  if (item_tokens.empty()) return false;
  const int64_t b = static_cast<int64_t>(item_tokens.size());
  if (b > kGraphMaxBatch) return false;
  int64_t most = 0;
  for (int64_t n : item_tokens) most = std::max(most, n);
  if (most > kGraphMaxTreeTokens + 1) return false;
  const int64_t batch = NextPow2(b), per_seq = TokenBucket(most);
  // Longer steps run eagerly: their activations and logits would take too much memory for the
  // little a graph saves on a step that long.
  if (batch * per_seq > kGraphMaxTokens) return false;
  step->padded = true;
  step->batch = batch;
  step->per_seq = per_seq;
  return true;
}

ReservedStep ReservedStepShape(int64_t invariant_rows, int64_t head_dim, bool tensor_parallel) {
  ReservedStep reserved;
  CudaStep& step = reserved.step;
  // At least a padded step of the widest batch bucket with 8-node trees, so that the policy's
  // usual trees at full batch replay graphs instead of growing the buffers (which drops them).
  const int64_t rows = std::max<int64_t>(
      invariant_rows > 0 ? invariant_rows : kDefaultGemmInvariantRows, kGraphMaxBatch * 9);
  step.verify = true;
  step.batch = 1;
  step.T = rows;
  step.R = rows;
  step.gather_logits = tensor_parallel;
  step.ws_floats =
      cuda::TreeAttentionUsesMmaKernel(head_dim) ? cuda::kTreeAttentionMaxWorkspaceFloats : 0;
  reserved.meta_bytes = static_cast<size_t>(rows) * 256 + (size_t{1} << 20) +
                        static_cast<size_t>(kGraphMaxBatch) * 4096 * sizeof(int32_t);
  return reserved;
}

void PlanItemsFromLayout(const StepLayout& layout, PlanItems* out) {
  const int64_t num_seqs = layout.num_seqs;
  out->depth.assign(num_seqs, {});
  out->spine.assign(num_seqs, {});
  out->items.assign(num_seqs, {});
  for (int64_t t = 0; t < layout.num_tokens; ++t) {
    const int32_t b = layout.query_seq[t];
    const int64_t committed = layout.committed[b];
    out->depth[b].push_back(static_cast<int32_t>(layout.positions[t] - committed));
    // prefix_len is committed + a + 1 for the token's own spine end a.
    out->spine[b].push_back(static_cast<int32_t>(layout.prefix_len[t] - committed - 1));
  }
  for (int64_t b = 0; b < num_seqs; ++b) {
    PlanItem& item = out->items[b];
    item.committed = layout.committed[b];
    item.scratch_parents = layout.scratch_parents[b];
    item.depth = out->depth[b];
    item.spine = out->spine[b];
    item.blocks = absl::MakeConstSpan(layout.block_tables)
                      .subspan(b * layout.max_blocks_per_seq, layout.max_blocks_per_seq);
  }
}

void LayoutForward(absl::Span<const ForwardItem> items, absl::Span<const PlanItem> plan_items,
                   const StepPlanOptions& options, CudaStep* step, StepPacker* pack) {
  constexpr int kWords = cuda::kTreeAttentionMaskWords;
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (!step->padded) {
    step->batch = num_items;
    step->T = 0;
    step->R = 0;
    for (const ForwardItem& it : items) {
      step->T += static_cast<int64_t>(it.tokens.size());
      step->R += static_cast<int64_t>(it.logit_rows.size());
    }
  } else {
    step->T = step->batch * step->per_seq;
    step->R = step->batch * step->per_seq;
  }
  // The same choice on every rank: it depends on the step's shape only.
  step->custom_allreduce =
      options.custom_allreduce_max_bytes >= 0 &&
      step->T * options.hidden * 2 /* bf16 */ <= options.custom_allreduce_max_bytes;
  const int64_t T = step->T;
  // Token and logit-row base of each launched sequence.
  std::vector<int64_t> token_base(step->batch), row_base(step->batch);
  for (int64_t b = 0, t = 0, r = 0; b < step->batch; ++b) {
    token_base[b] = step->padded ? b * step->per_seq : t;
    row_base[b] = step->padded ? b * step->per_seq : r;
    if (b < num_items) {
      t += static_cast<int64_t>(items[b].tokens.size());
      r += static_cast<int64_t>(items[b].logit_rows.size());
    }
  }
  step->item_row_begin.assign(row_base.begin(), row_base.begin() + num_items);
  step->item_token_begin.assign(token_base.begin(), token_base.begin() + num_items);

  std::vector<int32_t> tokens(T, 0), positions(T, 0), query_seq(T, 0), kv_end(T, 1),
      mask_begin(T, 1), rows(step->R, 0);
  std::vector<uint32_t> mask(static_cast<size_t>(T) * kWords, 0u);
  // A negative slot makes the KV write skip the row: padding never touches the cache.
  std::vector<int64_t> slots(T, -1);
  // The real queries alone, packed, for the split decision (see below).
  std::vector<int32_t> real_query_seq, real_kv_end;
  int64_t max_blocks = 1;
  const int64_t bt = options.block_tokens;
  for (int64_t b = 0; b < num_items; ++b) {
    const ForwardItem& it = items[b];
    const PlanItem& s = plan_items[b];
    const int64_t n = static_cast<int64_t>(it.tokens.size());
    const int32_t first_index = static_cast<int32_t>(s.scratch_parents.size() - n);
    max_blocks = std::max<int64_t>(max_blocks, s.blocks.size());
    for (size_t j = 0; j < it.logit_rows.size(); ++j) {
      rows[row_base[b] + j] = static_cast<int32_t>(token_base[b] + it.logit_rows[j]);
    }
    // One spine end for the sequence's masked tokens (engine/cuda/tree_mask.h: the same keys, one
    // attention window group a tile instead of one per run). SPECD_SHARED_SPINE=0 keeps each
    // token's own spine end (A/B runs).
    const std::optional<int32_t> shared_a =
        options.shared_spine ? SharedSpineEnd(s.spine, first_index) : std::nullopt;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = token_base[b] + j;
      const int32_t index = first_index + static_cast<int32_t>(j);
      tokens[t] = it.tokens[j];
      positions[t] = static_cast<int32_t>(s.committed + s.depth[j]);
      query_seq[t] = static_cast<int32_t>(b);
      const int64_t logical = s.committed + index;
      slots[t] = int64_t{s.blocks[logical / bt]} * bt + logical % bt;
      // Visible: [0, committed + a + 1) in full, then the node's ancestors after a (itself
      // included) through the mask (engine/cuda/tree_mask.h).
      const int32_t a = MaskSpineEnd(index, s.spine[j], shared_a, cuda::kTreeAttentionMaskBits);
      kv_end[t] = static_cast<int32_t>(s.committed + index + 1);
      mask_begin[t] = static_cast<int32_t>(s.committed + a + 1);
      SetTreeMaskBits(s.scratch_parents, index, a,
                      absl::MakeSpan(&mask[static_cast<size_t>(t) * kWords], kWords));
      real_query_seq.push_back(static_cast<int32_t>(b));
      real_kv_end.push_back(kv_end[t]);
    }
    if (step->padded) {
      // Padding slots of a real sequence repeat its last query (same keys, same mask, no KV
      // write), so the attention tile they join keeps the key range and fully visible prefix it
      // has without them, and every real query's result keeps its bits.
      const int64_t last = token_base[b] + n - 1;
      for (int64_t j = n; j < step->per_seq; ++j) {
        const int64_t t = token_base[b] + j;
        tokens[t] = tokens[last];
        positions[t] = positions[last];
        query_seq[t] = query_seq[last];
        kv_end[t] = kv_end[last];
        mask_begin[t] = mask_begin[last];
        std::copy_n(&mask[static_cast<size_t>(last) * kWords], kWords,
                    &mask[static_cast<size_t>(t) * kWords]);
      }
      for (int64_t j = static_cast<int64_t>(it.logit_rows.size()); j < step->per_seq; ++j) {
        rows[row_base[b] + j] = static_cast<int32_t>(token_base[b]);
      }
    }
  }
  // Padding sequences: their own block-table row of zeros (block 0: reads only), one key each.
  for (int64_t b = num_items; b < step->batch; ++b) {
    for (int64_t j = 0; j < step->per_seq; ++j) {
      query_seq[token_base[b] + j] = static_cast<int32_t>(b);
      rows[row_base[b] + j] = static_cast<int32_t>(token_base[b]);
    }
  }
  step->tree_masks = false;
  for (int64_t t = 0; t < T; ++t) step->tree_masks = step->tree_masks || mask_begin[t] != kv_end[t];
  // A fixed block-table stride per power of two, so that contexts growing within a bucket
  // replay the same graph.
  step->max_blocks = step->padded ? std::max<int64_t>(8, NextPow2(max_blocks)) : max_blocks;
  std::vector<int32_t> block_tables(step->batch * step->max_blocks, 0);
  // Per block-table row, the slots written before this step (attention may load them while
  // RoPE writes the step's own slots); padding rows none.
  std::vector<int32_t> kv_stable(step->batch, 0);
  for (int64_t b = 0; b < num_items; ++b) {
    std::copy(plan_items[b].blocks.begin(), plan_items[b].blocks.end(),
              block_tables.begin() + b * step->max_blocks);
    kv_stable[b] = static_cast<int32_t>(plan_items[b].committed);
  }
  const int64_t heads = options.heads, kv_heads = options.kv_heads;
  cuda::TreeAttentionPlan plan = cuda::PlanTreeAttention(
      query_seq.data(), kv_end.data(), T, heads, kv_heads, options.kv_group, options.num_sms);
  if (step->padded) {
    // The key-range split changes how a query's partial softmaxes are combined, so it must not
    // depend on the padding: take the split the real queries alone would get.
    plan.num_splits = cuda::PlanTreeAttention(real_query_seq.data(), real_kv_end.data(),
                                              static_cast<int64_t>(real_query_seq.size()), heads,
                                              kv_heads, options.kv_group, options.num_sms)
                          .num_splits;
    // How many chunks a CTA takes changes no bits: size it for the padded tiles.
    plan.chunks_per_cta = cuda::TreeAttentionChunksPerCta(
        static_cast<int64_t>(plan.tile_begin.size()), kv_heads, plan.num_splits, options.num_sms);
  }
  if (!cuda::TreeAttentionUsesMmaKernel(options.head_dim)) {
    // The generic attention kernel never splits the key range: plan no split, so that no
    // workspace is allocated and graph keys do not vary with it.
    plan.num_splits = 1;
    plan.chunks_per_cta = 1;
  }
  // SPECD_ATTN_CHUNKS_PER_CTA=N, an A/B switch: N key chunks a CTA instead of the planner's
  // choice (its WaveCost model), to time the model against the step. It changes the CTA count,
  // never the bits.
  const int chunks_override = options.attn_chunks_per_cta;
  if (chunks_override > 0 && plan.num_splits > 1) {
    plan.chunks_per_cta = std::min(chunks_override, plan.num_splits);
  }
  step->num_tiles = static_cast<int64_t>(plan.tile_begin.size());
  step->num_splits = plan.num_splits;
  step->chunks_per_cta = plan.chunks_per_cta;
  // Split, the chunk count (and so the workspace) grows with the context; a power of two keeps
  // reallocations, which drop every captured graph, rare.
  step->ws_floats = NextPow2(std::max<int64_t>(
      1, cuda::TreeAttentionWorkspaceFloats(plan.num_splits, T, heads, options.head_dim)));

  step->o_tokens = pack->Add(tokens);
  step->o_positions = pack->Add(positions);
  step->o_query_seq = pack->Add(query_seq);
  step->o_kv_end = pack->Add(kv_end);
  step->o_mask_begin = pack->Add(mask_begin);
  step->o_mask = pack->Add(mask);
  step->o_slots = pack->Add(slots);
  step->o_tables = pack->Add(block_tables);
  step->o_rows = pack->Add(rows);
  step->o_tile_begin = pack->Add(plan.tile_begin);
  step->o_tile_end = pack->Add(plan.tile_end);
  step->o_kv_stable = pack->Add(kv_stable);
}

std::vector<VerifyRow> VerifyRows(absl::Span<const VerifyItem> items,
                                  absl::Span<const int64_t> committed, const CudaStep& step) {
  std::vector<VerifyRow> rows(step.R);
  for (size_t b = 0; b < items.size(); ++b) {
    const VerifyItem& it = items[b];
    const int64_t first_position = committed[b] + static_cast<int64_t>(it.pending.size());
    const std::vector<int> depth = TreeDepths(it.tree);
    for (int node = -1; node < it.tree.size(); ++node) {
      VerifyRow& r = rows[step.item_row_begin[b] + node + 1];
      r.item = static_cast<int>(b);
      r.position = first_position + (node < 0 ? 0 : depth[node] + 1);
    }
  }
  return rows;
}

void LayoutVerify(absl::Span<const VerifyItem> items, absl::Span<const int64_t> committed,
                  CudaStep* step, StepPacker* pack) {
  const int64_t num_seqs = static_cast<int64_t>(items.size());
  int64_t max_nodes = 0;
  for (const VerifyItem& it : items) max_nodes = std::max<int64_t>(max_nodes, it.tree.size());
  step->out_stride = step->padded ? step->per_seq : max_nodes + 1;
  std::vector<int32_t> sample_offset(step->batch, 0), node_offset(step->batch, 0),
      num_nodes(step->batch, 0), seq_rows(step->batch, 0), base_slot(step->batch, 0);
  std::vector<int32_t> tree_tokens, tree_parents;
  for (int64_t b = 0; b < step->batch; ++b) {
    seq_rows[b] = static_cast<int32_t>(b);
    sample_offset[b] = static_cast<int32_t>(b < num_seqs ? step->item_row_begin[b] : 0);
    // Padded: fixed tree sections of per_seq nodes, so the layout depends on the bucket only.
    node_offset[b] = static_cast<int32_t>(step->padded ? b * step->per_seq : tree_tokens.size());
    if (b >= num_seqs) continue;
    const VerifyItem& it = items[b];
    num_nodes[b] = it.tree.size();
    base_slot[b] = static_cast<int32_t>(committed[b] + static_cast<int64_t>(it.pending.size()));
    tree_tokens.resize(node_offset[b]);
    tree_parents.resize(node_offset[b]);
    tree_tokens.insert(tree_tokens.end(), it.tree.tokens.begin(), it.tree.tokens.end());
    tree_parents.insert(tree_parents.end(), it.tree.parents.begin(), it.tree.parents.end());
  }
  if (step->padded) {
    tree_tokens.resize(step->batch * step->per_seq, 0);
    tree_parents.resize(step->batch * step->per_seq, -1);
  }
  step->o_sample_offset = pack->Add(sample_offset);
  step->o_node_offset = pack->Add(node_offset);
  step->o_num_nodes = pack->Add(num_nodes);
  step->o_tree_tokens = pack->Add(tree_tokens);
  step->o_tree_parents = pack->Add(tree_parents);
  step->o_seq_rows = pack->Add(seq_rows);
  step->o_base_slot = pack->Add(base_slot);
  // Outputs follow the inputs in the same buffer (uploaded as zeros): sampled tokens, then
  // (copied back in one piece) accepted counts, accepted tokens and accepted nodes.
  step->o_sampled = pack->Add(std::vector<int32_t>(step->R));
  step->o_out = pack->Add(std::vector<int32_t>(VerifyOutCount(*step)));
}

size_t VerifyOutCount(const CudaStep& step) {
  return static_cast<size_t>(step.batch) * (1 + 2 * step.out_stride);
}

std::vector<int64_t> CudaGraphKey(const CudaStep& step) {
  std::vector<int64_t> key = {step.verify,
                              step.custom_allreduce,
                              step.tree_masks,
                              step.gather_logits,
                              step.batch,
                              step.per_seq,
                              step.T,
                              step.R,
                              step.max_blocks,
                              step.num_tiles,
                              step.num_splits,
                              step.chunks_per_cta,
                              step.ws_floats,
                              step.out_stride,
                              static_cast<int64_t>(step.o_tokens),
                              static_cast<int64_t>(step.o_positions),
                              static_cast<int64_t>(step.o_query_seq),
                              static_cast<int64_t>(step.o_kv_end),
                              static_cast<int64_t>(step.o_mask_begin),
                              static_cast<int64_t>(step.o_mask),
                              static_cast<int64_t>(step.o_slots),
                              static_cast<int64_t>(step.o_tables),
                              static_cast<int64_t>(step.o_rows),
                              static_cast<int64_t>(step.o_tile_begin),
                              static_cast<int64_t>(step.o_tile_end),
                              static_cast<int64_t>(step.o_kv_stable),
                              static_cast<int64_t>(step.o_row_params),
                              static_cast<int64_t>(step.o_sample_offset),
                              static_cast<int64_t>(step.o_node_offset),
                              static_cast<int64_t>(step.o_num_nodes),
                              static_cast<int64_t>(step.o_tree_tokens),
                              static_cast<int64_t>(step.o_tree_parents),
                              static_cast<int64_t>(step.o_seq_rows),
                              static_cast<int64_t>(step.o_base_slot),
                              static_cast<int64_t>(step.o_sampled),
                              static_cast<int64_t>(step.o_out),
                              step.topk_k,
                              step.topk_rows,
                              static_cast<int64_t>(step.o_topk_rows),
                              step.processors,
                              step.kept_lower,
                              static_cast<int64_t>(step.o_kept_lower),
                              static_cast<int64_t>(step.o_proc_rows),
                              static_cast<int64_t>(step.o_proc_seqs),
                              static_cast<int64_t>(step.o_proc_data)};
  // The taps' copies are graph nodes too: their count and layers select the graph.
  key.push_back(static_cast<int64_t>(step.tap_layers.size()));
  key.insert(key.end(), step.tap_layers.begin(), step.tap_layers.end());
  return key;
}

}  // namespace specd
