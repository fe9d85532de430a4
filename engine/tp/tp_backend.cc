#include "engine/tp/tp_backend.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/topk.h"

namespace specd {

// ---------------------------------------------------------------------------------------------
// In-process all-reduce.

class InProcessCommGroup::Rank : public TpCommunicator {
 public:
  Rank(InProcessCommGroup* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size_; }

  void AllReduceSum(float* data, int64_t n) override {
    InProcessCommGroup& g = *group_;
    const int world = g.world_size_;
    if (world == 1) return;
    // Phase 1: publish the buffer. Once every rank has arrived, none is still copying the
    // previous call's result, so the last to arrive may grow it.
    g.buffers_[rank_] = data;
    g.Barrier(n);
    // Phase 2: each rank sums its contiguous share over ranks in rank order.
    const int64_t share = (n + world - 1) / world;
    const int64_t begin = std::min(n, share * rank_), end = std::min(n, begin + share);
    float* result = g.result_.data();
    for (int64_t i = begin; i < end; ++i) {
      float acc = g.buffers_[0][i];
      for (int r = 1; r < world; ++r) acc += g.buffers_[r][i];
      result[i] = acc;
    }
    g.Barrier();
    // Phase 3: everyone copies the whole result; the next call's first barrier keeps the
    // result alive until all copies are done.
    if (n > 0) std::memcpy(data, result, sizeof(float) * n);
  }

 private:
  InProcessCommGroup* group_;
  int rank_;
};

InProcessCommGroup::InProcessCommGroup(int world_size)
    : world_size_(world_size), buffers_(world_size, nullptr) {
  for (int r = 0; r < world_size; ++r) ranks_.push_back(std::make_unique<Rank>(this, r));
}

InProcessCommGroup::~InProcessCommGroup() = default;

TpCommunicator* InProcessCommGroup::rank(int r) { return ranks_[r].get(); }

void InProcessCommGroup::Barrier(int64_t result_size) {
  // Sleeps rather than spins: CI cores are shared, and ranks may outnumber them.
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t gen = generation_;
  if (++arrived_ == world_size_) {
    if (static_cast<int64_t>(result_.size()) < result_size) result_.resize(result_size);
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return generation_ != gen; });
}

// ---------------------------------------------------------------------------------------------
// Backend.

absl::StatusOr<std::unique_ptr<TensorParallelBackend>> TensorParallelBackend::Create(
    ModelConfig config, TpPlan plan, std::vector<std::unique_ptr<TpRankExecutor>> executors,
    std::unique_ptr<TpCommGroup> comm, int64_t kv_block_tokens, int64_t kv_capacity_tokens) {
  if (static_cast<int>(executors.size()) != plan.world_size || comm == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("tensor-parallel backend: ", executors.size(),
                                                   " executors for ", plan.world_size,
                                                   " ranks, or no communicator group"));
  }
  if (kv_capacity_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_capacity_tokens must be positive, got ", kv_capacity_tokens));
  }
  std::unique_ptr<TensorParallelBackend> backend(
      new TensorParallelBackend(std::move(config), std::move(plan), std::move(executors),
                                std::move(comm), kv_block_tokens, kv_capacity_tokens));
  absl::Status loaded = backend->RunOnRanks([&](int r) { return backend->executors_[r]->Load(); });
  if (!loaded.ok()) return loaded;
  return backend;
}

TensorParallelBackend::TensorParallelBackend(ModelConfig config, TpPlan plan,
                                             std::vector<std::unique_ptr<TpRankExecutor>> executors,
                                             std::unique_ptr<TpCommGroup> comm,
                                             int64_t kv_block_tokens, int64_t kv_capacity_tokens)
    : config_(std::move(config)),
      plan_(std::move(plan)),
      executors_(std::move(executors)),
      comm_(std::move(comm)),
      table_(kv_block_tokens, kv_capacity_tokens, config_.vocab_size,
             config_.max_position_embeddings),
      workers_(plan_.world_size) {}

TensorParallelBackend::~TensorParallelBackend() = default;

absl::Status TensorParallelBackend::RunOnRanks(const std::function<absl::Status(int)>& fn) {
  return workers_.Run(fn);
}

absl::Status TensorParallelBackend::RunStep(const StepLayout& layout,
                                            const TpRankExecutor::Output& out) {
  const int64_t blocks = table_.allocated_blocks();
  const bool grow = blocks > reserved_blocks_;
  reserved_blocks_ = std::max(reserved_blocks_, blocks);
  return RunOnRanks([&](int r) {
    if (grow) executors_[r]->ReserveKvBlocks(blocks);
    return executors_[r]->Forward(layout, comm_->rank(r), out);
  });
}

absl::Status TensorParallelBackend::Forward(absl::Span<const ForwardItem> items,
                                            std::vector<float>* logits) {
  if (logits == nullptr) return absl::InvalidArgumentError("logits is null");
  logits->clear();
  StepLayout layout;
  if (absl::Status s = table_.PrepareForward(items, &layout); !s.ok()) return s;
  if (items.empty()) return absl::OkStatus();
  logits->assign(layout.logit_tokens.size() * static_cast<size_t>(config_.vocab_size), 0.0f);
  TpRankExecutor::Output out;
  out.logits = logits->data();
  return RunStep(layout, out);
}

absl::Status TensorParallelBackend::ForwardTopK(absl::Span<const ForwardItem> items, int k,
                                                TopKRows* out) {
  if (absl::Status s = CheckForwardTopK(k, out); !s.ok()) return s;
  const int64_t vocab = config_.vocab_size;
  out->k = static_cast<int>(std::min<int64_t>(k, vocab));
  out->ids.clear();
  out->logprobs.clear();
  StepLayout layout;
  if (absl::Status s = table_.PrepareForward(items, &layout); !s.ok()) return s;
  if (items.empty()) return absl::OkStatus();
  const int64_t rows = static_cast<int64_t>(layout.logit_tokens.size());
  topk_logits_.assign(static_cast<size_t>(rows) * vocab, 0.0f);
  TpRankExecutor::Output step;
  step.logits = topk_logits_.data();
  if (absl::Status s = RunStep(layout, step); !s.ok()) return s;
  out->ids.resize(static_cast<size_t>(rows) * out->k);
  out->logprobs.resize(out->ids.size());
  const int world = plan_.world_size;
  return RunOnRanks([&](int r) {
    for (int64_t row = r; row < rows; row += world) {
      RowTopKLogprobs(absl::Span<const float>(topk_logits_).subspan(row * vocab, vocab), out->k,
                      out->ids.data() + row * out->k, out->logprobs.data() + row * out->k);
    }
    return absl::OkStatus();
  });
}

absl::Status TensorParallelBackend::ForwardWithTaps(absl::Span<const ForwardItem> items,
                                                    absl::Span<const int> tap_layers,
                                                    std::vector<float>* logits,
                                                    std::vector<float>* taps) {
  if (logits == nullptr || taps == nullptr) {
    return absl::InvalidArgumentError("logits or taps is null");
  }
  for (int layer : tap_layers) {
    if (layer < 0 || layer > FinalNormTap(config_.num_layers)) {
      return absl::InvalidArgumentError(absl::StrCat("tap_layers: ", layer, " is not in [0, ",
                                                     FinalNormTap(config_.num_layers), "]"));
    }
  }
  logits->clear();
  taps->clear();
  StepLayout layout;
  if (absl::Status s = table_.PrepareForward(items, &layout); !s.ok()) return s;
  if (items.empty()) return absl::OkStatus();
  logits->assign(layout.logit_tokens.size() * static_cast<size_t>(config_.vocab_size), 0.0f);
  TpRankExecutor::Output out;
  out.logits = logits->data();
  out.tap_layers = tap_layers;
  out.taps = taps;
  return RunStep(layout, out);
}

absl::StatusOr<std::vector<VerifyOutcome>> TensorParallelBackend::Verify(
    absl::Span<const VerifyItem> items) {
  for (const VerifyItem& it : items) {
    if (!VocabParallelSamplingSupported(it.sampling) || !it.tap_layers.empty()) {
      ++gathered_verify_calls_;
      return Backend::Verify(items);
    }
  }
  // The same feed as Backend::Verify: pending tokens as a chain, the tree below the last one,
  // logits of the last pending token and of every tree node. Each row's token is a pure
  // function of its logits, sampling and position (engine/sampling.h), so all rows are chosen
  // up front and the walk below only looks them up.
  std::vector<ForwardItem> forward(items.size());
  std::vector<int64_t> first_position(items.size());
  std::vector<const SamplingParams*> row_sampling;
  std::vector<int64_t> row_position;
  for (size_t b = 0; b < items.size(); ++b) {
    const VerifyItem& it = items[b];
    absl::StatusOr<int64_t> first = MakeVerifyForward(*this, it, b, &forward[b]);
    if (!first.ok()) return first.status();
    first_position[b] = *first;
    // Row 0 (the last pending token) samples at first_position, a node at depth d (0 for a
    // child of the root) one further down: first_position + d + 1.
    const std::vector<int> depth = TreeDepths(it.tree);
    row_sampling.push_back(&it.sampling);
    row_position.push_back(first_position[b]);
    for (int i = 0; i < it.tree.size(); ++i) {
      row_sampling.push_back(&it.sampling);
      row_position.push_back(first_position[b] + depth[i] + 1);
    }
  }
  StepLayout layout;
  if (absl::Status s = table_.PrepareForward(forward, &layout); !s.ok()) return s;
  std::vector<VerifyOutcome> outcomes(items.size());
  if (items.empty()) return outcomes;
  const int world = plan_.world_size;
  const size_t rows = layout.logit_tokens.size();
  std::vector<VocabCandidate> candidates(rows * world);
  TpRankExecutor::Output out;
  out.row_sampling = row_sampling.data();
  out.row_position = row_position.data();
  out.candidates = candidates.data();
  if (absl::Status s = RunStep(layout, out); !s.ok()) return s;

  // The walk records each emitted row that asks for log-probabilities; their statistics come
  // from the ranks' shards in one more pass, before the commits touch the KV caches.
  std::vector<TpRankExecutor::LogprobQuery> queries;
  std::vector<size_t> query_item;
  size_t row = 0;
  for (size_t b = 0; b < items.size(); ++b) {
    const VerifyItem& it = items[b];
    const double scale = it.logprobs >= 0 ? LogprobScale(it.sampling, it.logprobs_mode) : 1.0;
    outcomes[b] = WalkTree(it.tree, first_position[b], [&](int node_row, int64_t) {
      const size_t r = row + static_cast<size_t>(node_row);
      const VocabCandidate best =
          ReduceCandidates(absl::Span<const VocabCandidate>(candidates).subspan(r * world, world));
      if (it.logprobs >= 0) {
        queries.push_back({static_cast<int64_t>(r), scale, best.logit, it.logprobs});
        query_item.push_back(b);
      }
      return best.token;
    });
    row += forward[b].logit_rows.size();
  }
  if (!queries.empty()) {
    std::vector<ShardLogprobStats> stats(queries.size() * world);  // [rank, query]
    absl::Status s = RunOnRanks([&](int r) {
      executors_[r]->ShardLogprobs(queries, absl::Span<ShardLogprobStats>(stats).subspan(
                                                r * queries.size(), queries.size()));
      return absl::OkStatus();
    });
    if (!s.ok()) return s;
    std::vector<ShardLogprobStats> shards(world);
    for (size_t q = 0; q < queries.size(); ++q) {
      for (int r = 0; r < world; ++r) shards[r] = std::move(stats[r * queries.size() + q]);
      outcomes[query_item[q]].logprobs.push_back(MergeShardLogprobStats(
          shards, queries[q].scale, queries[q].emitted_logit, queries[q].top_n));
    }
  }
  for (size_t b = 0; b < items.size(); ++b) {
    const std::vector<int32_t> path =
        AcceptedScratchPath(static_cast<int>(items[b].pending.size()), outcomes[b]);
    if (absl::Status s = Commit(items[b].seq, path); !s.ok()) return s;
  }
  return outcomes;
}

absl::Status TensorParallelBackend::Commit(SeqId seq, absl::Span<const int32_t> path) {
  std::vector<int64_t> src, dst;
  if (absl::Status s = table_.PrepareCommit(seq, path, &src, &dst); !s.ok()) return s;
  if (src.empty()) return absl::OkStatus();
  return RunOnRanks([&](int r) {
    executors_[r]->CopyKvSlots(src, dst);
    return absl::OkStatus();
  });
}

}  // namespace specd
