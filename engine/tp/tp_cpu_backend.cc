#include "engine/tp/tp_cpu_backend.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/io/safetensors.h"
#include "engine/cpu/cpu_model.h"
#include "engine/model_config.h"
#include "engine/thread_pool.h"
#include "engine/tp/tp_plan.h"

namespace specd {
namespace {

// One rank: its CpuModel slice (engine/cpu/cpu_model.h) and its own attention thread pool.
class CpuRankExecutor : public TpRankExecutor {
 public:
  CpuRankExecutor(const ModelConfig& config, const TpPlan& plan, int rank,
                  std::shared_ptr<const TensorStore> store, int threads, bool bf16_weights)
      : c_(config),
        rp_(plan.ranks[rank]),
        store_(std::move(store)),
        threads_(threads),
        model_(config, plan.ranks[rank], bf16_weights) {}

  absl::Status Load() override {
    // The pool's workers belong to this rank, so they are created on its thread.
    pool_ = std::make_unique<ThreadPool>(threads_);
    return model_.Load(*store_);
  }
  void ReserveKvBlocks(int64_t blocks) override { model_.ReserveKvBlocks(blocks); }
  absl::Status Forward(const StepLayout& layout, TpCommunicator* comm, const Output& out) override;
  void CopyKvSlots(absl::Span<const int64_t> src, absl::Span<const int64_t> dst) override {
    model_.CopyKvSlots(src, dst);
  }
  void ShardLogprobs(absl::Span<const LogprobQuery> queries,
                     absl::Span<ShardLogprobStats> out) override {
    const int64_t v = rp_.vocab.size();
    for (size_t q = 0; q < queries.size(); ++q) {
      const LogprobQuery& query = queries[q];
      const absl::Span<const float> row =
          v == 0 ? absl::Span<const float>()
                 : absl::Span<const float>(shard_).subspan(query.row * v, v);
      out[q] =
          ComputeShardLogprobStats(row, rp_.vocab, query.scale, query.emitted_logit, query.top_n);
    }
  }

 private:
  const ModelConfig c_;
  const TpRankPlan rp_;
  std::shared_ptr<const TensorStore> store_;
  const int threads_;
  std::unique_ptr<ThreadPool> pool_;
  CpuModel model_;
  // The last Forward()'s logits of this rank's vocabulary columns, [R, vocab slice] fp32, host:
  // kept for ShardLogprobs().
  std::vector<float> shard_;
};

absl::Status CpuRankExecutor::Forward(const StepLayout& l, TpCommunicator* comm,
                                      const Output& out) {
  std::vector<float> residual, sub;
  model_.Hidden(l, pool_.get(), comm, &residual, &sub, out.tap_layers,
                comm->rank() == 0 ? out.taps : nullptr);

  // Every rank holds the same residual stream, so each normalises the requested rows itself
  // and computes the logits of its vocabulary range only.
  const int64_t R = static_cast<int64_t>(l.logit_tokens.size()), V = rp_.vocab.size();
  if (out.candidates != nullptr) {
    for (int64_t r = 0; r < R; ++r) out.candidates[r * comm->world_size() + comm->rank()] = {};
  }
  shard_.assign(R * V, 0.0f);
  if (V == 0 || R == 0) return absl::OkStatus();
  model_.Logits(l, residual, sub, shard_.data(), pool_.get());
  for (int64_t r = 0; r < R; ++r) {
    const float* row = &shard_[r * V];
    if (out.logits != nullptr) {
      std::memcpy(out.logits + r * c_.vocab_size + rp_.vocab.begin, row, sizeof(float) * V);
    }
    if (out.candidates != nullptr) {
      out.candidates[r * comm->world_size() + comm->rank()] = ShardCandidate(
          absl::Span<const float>(row, V), rp_.vocab, *out.row_sampling[r], out.row_position[r]);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TensorParallelBackend>> CreateTpCpuBackend(
    const std::string& dir, const BackendOptions& options) {
  if (absl::Status s = CheckCpuBackendOptions(options); !s.ok()) return s;
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<TpPlan> plan = MakeTpPlan(*config, options.tensor_parallel);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<std::unique_ptr<TensorStore>> store = TensorStore::OpenFolder(dir);
  if (!store.ok()) return store.status();
  std::shared_ptr<const TensorStore> shared_store(std::move(*store));

  const int n = plan->world_size;
  const int threads = CpuBackendThreads(options);
  const int per_rank = std::max(1, threads / n);

  std::vector<std::unique_ptr<TpRankExecutor>> executors;
  for (int r = 0; r < n; ++r) {
    executors.push_back(std::make_unique<CpuRankExecutor>(*config, *plan, r, shared_store, per_rank,
                                                          options.cpu_bf16_weights));
  }
  absl::StatusOr<std::unique_ptr<TensorParallelBackend>> backend = TensorParallelBackend::Create(
      *config, *plan, std::move(executors), std::make_unique<InProcessCommGroup>(n), kKvBlockTokens,
      options.kv_capacity_tokens);
  return backend;
}

}  // namespace specd
