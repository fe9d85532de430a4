#include "engine/cpu/cpu_backend.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/io/load_progress.h"
#include "common/io/safetensors.h"

namespace specd {

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(const std::string& dir,
                                                               const BackendOptions& options) {
  if (absl::Status s = CheckCpuBackendOptions(options); !s.ok()) return s;
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  std::unique_ptr<CpuBackend> backend(new CpuBackend(*std::move(config), options));
  absl::StatusOr<std::unique_ptr<TensorStore>> store =
      TensorStore::OpenFolder(backend->config_.dir);
  if (!store.ok()) return store.status();
  LoadProgress progress("cpu");
  if (absl::Status s = backend->model_.Load(**store); !s.ok()) return s;
  // What the model holds: fp32, and bf16 for the matrices it kept so.
  progress.Add(backend->model_.WeightBytes(), static_cast<int64_t>((*store)->Names().size()));
  progress.Finish();
  return backend;
}

CpuBackend::CpuBackend(ModelConfig config, const BackendOptions& options)
    : config_(std::move(config)),
      table_(kKvBlockTokens, options.kv_capacity_tokens, config_.vocab_size,
             config_.max_position_embeddings),
      model_(config_, FullModelSlice(config_), options.cpu_bf16_weights) {
  pool_ = std::make_unique<ThreadPool>(CpuBackendThreads(options));
}

CpuBackend::~CpuBackend() = default;

absl::Status CpuBackend::AddSequence(SeqId seq) { return table_.AddSequence(seq); }

absl::Status CpuBackend::RemoveSequence(SeqId seq) { return table_.RemoveSequence(seq); }

bool CpuBackend::HasSequence(SeqId seq) const { return table_.HasSequence(seq); }

absl::StatusOr<int64_t> CpuBackend::CommittedLength(SeqId seq) const {
  return table_.CommittedLength(seq);
}

absl::StatusOr<int64_t> CpuBackend::ScratchLength(SeqId seq) const {
  return table_.ScratchLength(seq);
}

KvUsage CpuBackend::Usage() const { return table_.Usage(); }

absl::Status CpuBackend::Commit(SeqId seq, absl::Span<const int32_t> path) {
  std::vector<int64_t> src, dst;
  if (absl::Status s = table_.PrepareCommit(seq, path, &src, &dst); !s.ok()) return s;
  model_.CopyKvSlots(src, dst);
  return absl::OkStatus();
}

absl::Status CpuBackend::Forward(absl::Span<const ForwardItem> items, std::vector<float>* logits) {
  return ForwardWithTaps(items, {}, logits, nullptr);
}

absl::Status CpuBackend::ForwardWithTaps(absl::Span<const ForwardItem> items,
                                         absl::Span<const int> tap_layers,
                                         std::vector<float>* logits, std::vector<float>* taps) {
  if (logits == nullptr) return absl::InvalidArgumentError("logits is null");
  if (!tap_layers.empty() && taps == nullptr) return absl::InvalidArgumentError("taps is null");
  for (int layer : tap_layers) {
    if (layer < 0 || layer > FinalNormTap(config_.num_layers)) {
      return absl::InvalidArgumentError(absl::StrCat("tap_layers: ", layer, " is not in [0, ",
                                                     FinalNormTap(config_.num_layers), "]"));
    }
  }
  if (taps != nullptr) taps->clear();
  logits->clear();
  // PrepareForward validates the whole batch before changing anything, so a bad item leaves
  // all sequences as they were.
  StepLayout layout;
  if (absl::Status s = table_.PrepareForward(items, &layout); !s.ok()) return s;
  if (items.empty()) return absl::OkStatus();
  model_.ReserveKvBlocks(table_.allocated_blocks());
  std::vector<float> residual, sub;
  model_.Hidden(layout, pool_.get(), /*comm=*/nullptr, &residual, &sub, tap_layers,
                tap_layers.empty() ? nullptr : taps);
  logits->resize(layout.logit_tokens.size() * config_.vocab_size);
  model_.Logits(layout, residual, sub, logits->data(), pool_.get());
  return absl::OkStatus();
}

}  // namespace specd

namespace specd {

absl::Status CpuBackend::ForwardTopK(absl::Span<const ForwardItem> items, int k, TopKRows* out) {
  if (absl::Status s = CheckForwardTopK(k, out); !s.ok()) return s;
  // The logits buffer is reused across calls: drafting asks for a level's rows every step.
  if (absl::Status s = Forward(items, &topk_logits_); !s.ok()) return s;
  const int64_t vocab = config_.vocab_size;
  const int64_t rows = static_cast<int64_t>(topk_logits_.size()) / vocab;
  out->k = static_cast<int>(std::min<int64_t>(k, vocab));
  out->ids.resize(static_cast<size_t>(rows * out->k));
  out->logprobs.resize(out->ids.size());
  const absl::Span<const float> logits(topk_logits_);
  pool_->ParallelFor(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      RowTopKLogprobs(logits.subspan(static_cast<size_t>(r * vocab), static_cast<size_t>(vocab)),
                      out->k, &out->ids[r * out->k], &out->logprobs[r * out->k]);
    }
  });
  return absl::OkStatus();
}

}  // namespace specd
