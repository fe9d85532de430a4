#include "engine/cuda/cuda_tp_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "engine/cuda/custom_allreduce.h"
#include "engine/cuda/nccl_group.h"
#include "engine/model_config.h"

namespace specd {

CudaTensorParallelBackend::CudaTensorParallelBackend(TpPlan plan, int world)
    : plan_(std::move(plan)), rank_info_(world), ranks_(world), workers_(world) {}

CudaTensorParallelBackend::~CudaTensorParallelBackend() = default;

absl::StatusOr<std::unique_ptr<CudaTensorParallelBackend>> CudaTensorParallelBackend::Create(
    const std::string& dir, const BackendOptions& options, const CudaTpOptions& tp) {
  const int world = static_cast<int>(tp.devices.size());
  if (world < 1) return absl::InvalidArgumentError("devices: at least one CUDA device needed");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  absl::flat_hash_set<int> seen;
  for (int d : tp.devices) {
    if (d < 0 || d >= count) {
      return absl::FailedPreconditionError(absl::StrCat(
          "devices: cuda:", d, " is not available: this machine has ", count, " CUDA device(s)"));
    }
    if (!seen.insert(d).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("devices: cuda:", d, " is listed twice (one rank a GPU)"));
    }
  }
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  // FFN and vocabulary shards in whole 64-column units keep the GEMM shapes friendly.
  TpPlanOptions plan_options;
  plan_options.ffn_align = 64;
  plan_options.vocab_align = 64;
  absl::StatusOr<TpPlan> plan = MakeTpPlan(*config, world, plan_options);
  if (!plan.ok()) return plan.status();

  std::unique_ptr<CudaTensorParallelBackend> backend(
      new CudaTensorParallelBackend(*std::move(plan), world));
  if (world > 1) {
    // UNIMPLEMENTED in a build without NCCL.
    absl::StatusOr<std::unique_ptr<NcclGroup>> nccl = NcclGroup::Create(tp.devices);
    if (!nccl.ok()) return nccl.status();
    backend->nccl_ = std::move(*nccl);
    int64_t max_bytes = tp.custom_allreduce_max_bytes;
    if (max_bytes < 0) {
      max_bytes = CudaBackend::kGraphMaxTokens * config->hidden_size * 2;  // bf16
    }
    if (max_bytes > 0) {
      absl::StatusOr<std::unique_ptr<CustomAllReduceGroup>> custom =
          CustomAllReduceGroup::Create(tp.devices, CudaBackend::kAllReduceSites, max_bytes);
      if (custom.ok()) {
        backend->custom_ = std::move(*custom);
      } else {
        std::fprintf(stderr, "specd: custom all-reduce unavailable (%s); using NCCL only\n",
                     custom.status().ToString().c_str());
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    CudaTpRank& info = backend->rank_info_[r];
    info.plan = &backend->plan_;
    info.rank = r;
    info.nccl = backend->nccl_.get();
    info.custom = backend->custom_.get();
  }
  CudaTensorParallelBackend* b = backend.get();
  // Parsed once for the group: every rank runs with the same switches.
  const CudaTuning tuning = CudaTuningFromEnvironment();
  absl::Status loaded = b->workers_.Run([&](int r) -> absl::Status {
    absl::StatusOr<std::unique_ptr<CudaBackend>> rank =
        CudaBackend::Create(dir, tp.devices[r], options, &b->rank_info_[r], &tuning);
    if (!rank.ok()) return rank.status();
    b->ranks_[r] = std::move(*rank);
    return absl::OkStatus();
  });
  if (!loaded.ok()) return loaded;
  // One table for all ranks, as large as the smallest rank's pools.
  int64_t blocks = b->ranks_[0]->kv_blocks();
  for (const auto& rank : b->ranks_) blocks = std::min(blocks, rank->kv_blocks());
  b->table_ = CudaBackend::MakeKvTable(b->ranks_[0]->config(), blocks);
  return backend;
}

absl::Status CudaTensorParallelBackend::AddSequence(SeqId seq) { return table_->AddSequence(seq); }

absl::Status CudaTensorParallelBackend::RemoveSequence(SeqId seq) {
  ranks_[0]->DropHeldTaps(seq);
  return table_->RemoveSequence(seq);
}

absl::Status CudaTensorParallelBackend::Forward(absl::Span<const ForwardItem> items,
                                                std::vector<float>* logits) {
  return ForwardWithTaps(items, {}, logits, nullptr);
}

absl::Status CudaTensorParallelBackend::ForwardWithTaps(absl::Span<const ForwardItem> items,
                                                        absl::Span<const int> tap_layers,
                                                        std::vector<float>* logits,
                                                        std::vector<float>* taps) {
  if (absl::Status s =
          CudaBackend::CheckForwardWithTaps(tap_layers, config().num_layers, logits, taps);
      !s.ok()) {
    return s;
  }
  logits->clear();
  if (taps != nullptr) taps->clear();
  // PrepareForward validates the whole batch before changing anything, so a bad item leaves
  // all sequences as they were.
  StepLayout layout;
  if (absl::Status s = table_->PrepareForward(items, &layout); !s.ok()) return s;
  int64_t rows = 0;
  for (const ForwardItem& it : items) rows += static_cast<int64_t>(it.logit_rows.size());
  logits->assign(static_cast<size_t>(rows) * config().vocab_size, 0.0f);
  float* tap_rows = nullptr;
  if (!tap_layers.empty()) {
    int64_t tokens = 0;
    for (const ForwardItem& it : items) tokens += static_cast<int64_t>(it.tokens.size());
    taps->resize(static_cast<size_t>(tokens) * tap_layers.size() * config().hidden_size);
    tap_rows = taps->data();
  }
  absl::Status s = workers_.Run([&](int r) {
    return r == 0 ? ranks_[r]->ForwardColumns(items, layout, logits->data(), tap_layers, tap_rows)
                  : ranks_[r]->ForwardColumns(items, layout, logits->data());
  });
  if (!s.ok()) {
    logits->clear();
    if (taps != nullptr) taps->clear();
  }
  return s;
}

absl::Status CudaTensorParallelBackend::ForwardTopK(absl::Span<const ForwardItem> items, int k,
                                                    TopKRows* out) {
  if (absl::Status s = CheckForwardTopK(k, out); !s.ok()) return s;
  out->k = std::min(k, config().vocab_size);
  out->ids.clear();
  out->logprobs.clear();
  StepLayout layout;
  if (absl::Status s = table_->PrepareForward(items, &layout); !s.ok()) return s;
  if (items.empty()) return absl::OkStatus();
  absl::Status s = workers_.Run([&](int r) {
    return ranks_[r]->ForwardTopKLaidOut(items, layout, out->k, r == 0 ? out : nullptr);
  });
  if (!s.ok()) {
    out->ids.clear();
    out->logprobs.clear();
  }
  return s;
}

absl::Status CudaTensorParallelBackend::Commit(SeqId seq, absl::Span<const int32_t> path) {
  std::vector<int64_t> src, dst;
  if (absl::Status s = table_->PrepareCommit(seq, path, &src, &dst); !s.ok()) return s;
  if (src.empty()) return absl::OkStatus();
  return workers_.Run([&](int r) { return ranks_[r]->CopyKvSlots(src, dst); });
}

absl::StatusOr<std::vector<VerifyOutcome>> CudaTensorParallelBackend::Verify(
    absl::Span<const VerifyItem> items) {
  return VerifyOnRanks(items);
}

absl::StatusOr<std::vector<VerifyOutcome>> CudaTensorParallelBackend::VerifyOnRanks(
    absl::Span<const VerifyItem> items) {
  // Steps with logits processors, filters or logprobs gather whole rows on every rank
  // (CudaBackend::RunVerify), which then process and sample them alike; rank 0's outcomes carry
  // the log-probabilities.
  CudaBackend::VerifyPlan plan;
  if (absl::Status s = CudaBackend::PrepareVerify(*this, table_.get(), items, &plan); !s.ok()) {
    return s;
  }
  if (items.empty()) return std::vector<VerifyOutcome>{};
  std::vector<absl::StatusOr<std::vector<VerifyOutcome>>> outcomes(ranks_.size());
  absl::Status s = workers_.Run([&](int r) {
    // Rank 0 exports the taps: the residual stream is whole on every rank.
    outcomes[r] = ranks_[r]->RunVerify(items, plan, /*export_taps=*/r == 0);
    return outcomes[r].status();
  });
  if (!s.ok()) return s;
  // The ranks decide alike by construction; a disagreement would silently desynchronise their
  // KV caches, so it is checked (a few integers a sequence).
  for (size_t r = 1; r < outcomes.size(); ++r) {
    for (size_t b = 0; b < items.size(); ++b) {
      const VerifyOutcome& x = (*outcomes[0])[b];
      const VerifyOutcome& y = (*outcomes[r])[b];
      if (x.tokens != y.tokens || x.accepted_nodes != y.accepted_nodes) {
        return absl::InternalError(
            absl::StrCat("tensor-parallel ranks 0 and ", r, " disagree on verify item ", b));
      }
    }
  }
  if (absl::Status c = CudaBackend::CommitVerify(table_.get(), items, *outcomes[0]); !c.ok()) {
    return c;
  }
  return std::move(outcomes[0]);
}

}  // namespace specd
