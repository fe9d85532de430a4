#include "engine/cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/token_tree.h"
#include "engine/cuda/cuda_status.h"
#include "engine/kv/paged_kv_table.h"
#include "engine/sampling.h"
#include "specd/kernels/cuda/logits_processors.h"
#include "specd/kernels/cuda/sampling.h"
#include "specd/kernels/cuda/topk.h"
#include "specd/kernels/cuda/tree_attention.h"

namespace specd {
namespace {

template <typename T>
T* At(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

// Packs the logits processors of a verify step's rows (specd/kernels/cuda/logits_processors.h):
// one LogitsProcessorRow a logit row (rows of items without processors, and padding rows, copy
// unchanged), one LogitsProcessorSeq a launched sequence, then the lists, last, since only their
// length varies between steps of one bucket.
void PackProcessors(absl::Span<const VerifyItem> items, CudaStep* step, StepPacker* pack) {
  std::vector<cuda::LogitsProcessorRow> rows(step->R);
  std::vector<cuda::LogitsProcessorSeq> seqs(step->batch);
  std::vector<int32_t> data;
  for (size_t b = 0; b < items.size(); ++b) {
    const VerifyItem& item = items[b];
    const SamplingParams& sp = item.sampling;
    if (!sp.has_processors()) continue;
    cuda::LogitsProcessorSeq& seq = seqs[b];
    seq.repetition_penalty = sp.repetition_penalty;
    seq.presence_penalty = sp.presence_penalty;
    seq.frequency_penalty = sp.frequency_penalty;
    seq.min_tokens = sp.min_tokens;
    seq.output_length = item.history != nullptr ? item.history->output_length() : 0;
    const bool penalties = sp.has_penalties() && item.history != nullptr;
    if (penalties) {
      std::vector<std::pair<int32_t, TokenHistory::Counts>> entries(item.history->tokens().begin(),
                                                                    item.history->tokens().end());
      std::sort(entries.begin(), entries.end(),
                [](const auto& x, const auto& y) { return x.first < y.first; });
      seq.history_begin = static_cast<int32_t>(data.size());
      seq.history_count = static_cast<int32_t>(entries.size());
      for (const auto& [id, counts] : entries) {
        data.insert(data.end(), {id, counts.output, counts.in_prompt ? 1 : 0});
      }
    }
    seq.bias_begin = static_cast<int32_t>(data.size());
    seq.bias_count = static_cast<int32_t>(sp.logit_bias.size());
    for (const auto& [id, bias] : sp.logit_bias) {
      int32_t bits;
      std::memcpy(&bits, &bias, sizeof(bits));
      data.insert(data.end(), {id, bits});
    }
    seq.stop_begin = static_cast<int32_t>(data.size());
    seq.stop_count = static_cast<int32_t>(sp.min_tokens_stop_ids.size());
    data.insert(data.end(), sp.min_tokens_stop_ids.begin(), sp.min_tokens_stop_ids.end());
    // Row 0 continues the history; row i + 1 continues tree node i, after its ancestors.
    const TokenTree& tree = item.tree;
    for (int j = 0; j <= tree.size(); ++j) {
      cuda::LogitsProcessorRow& row = rows[step->item_row_begin[b] + j];
      row.seq = static_cast<int32_t>(b);
      row.path_begin = static_cast<int32_t>(data.size());
      for (int node = j - 1; node >= 0; node = tree.parents[node]) {
        ++row.path_len;
        if (penalties) data.push_back(tree.tokens[node]);
      }
    }
  }
  step->processors = true;
  step->o_proc_rows = pack->Add(rows);
  step->o_proc_seqs = pack->Add(seqs);
  step->o_proc_data = pack->Add(data);
}

// The rows of one kind of log-probabilities (raw or processed) in a verify step: every sampling
// row of the items that ask for that kind (the walk's rows are known only after acceptance),
// read by one launch after the step; only [rows, k + 1] ids and values come back.
struct LogprobGroup {
  std::vector<int32_t> rows;   // logit rows
  std::vector<int64_t> first;  // per item: its first entry in `rows`, -1 if none
  int k = 0;                   // the widest request's top-n
  // In the topk buffer from `offset`: [rows] row index (16-byte padded), then [rows, k] ids,
  // [rows, k] log-probabilities, [rows] token log-probabilities and [rows] ranks (the results,
  // copied back into `host` in one go).
  size_t offset = 0, index_bytes = 0, result_bytes = 0;
  std::vector<char> host;

  int64_t n() const { return static_cast<int64_t>(rows.size()); }
  const int32_t* ids() const { return reinterpret_cast<const int32_t*>(host.data()); }
  const float* logprobs() const { return reinterpret_cast<const float*>(ids() + n() * k); }
  const float* token_logprobs() const { return logprobs() + n() * k; }
  const int32_t* ranks() const { return reinterpret_cast<const int32_t*>(token_logprobs() + n()); }
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(const std::string& dir, int device,
                                                                 const BackendOptions& options,
                                                                 const CudaTpRank* tp,
                                                                 const CudaTuning* tuning) {
  if (options.kv_capacity_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_capacity_tokens must be positive, got ", options.kv_capacity_tokens));
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat("device cuda:", device,
                                                      " is not available: this machine has ", count,
                                                      " CUDA device", count == 1 ? "" : "s"));
  }
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  // 16, 32, 64 and 128 take the tensor-core attention kernel, other even sizes up to
  // kTreeAttentionMaxHeadDim a generic (slower) one.
  if (!cuda::TreeAttentionHeadDimSupported(config->head_dim)) {
    return absl::UnimplementedError(absl::StrCat("cuda backend: head_dim ", config->head_dim,
                                                 " is not supported (even, at most ",
                                                 cuda::kTreeAttentionMaxHeadDim, ")"));
  }
  if (config->num_kv_heads <= 0 || config->num_heads % config->num_kv_heads != 0 ||
      config->num_heads / config->num_kv_heads > cuda::kTreeAttentionTileRows) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda backend: ", config->num_heads, " query heads over ", config->num_kv_heads,
        " KV heads is not supported (at most ", cuda::kTreeAttentionTileRows, " per KV head)"));
  }
  if (tp != nullptr) {
    const TpPlan* plan = tp->plan;
    if (plan == nullptr || tp->rank < 0 || tp->rank >= plan->world_size) {
      return absl::InvalidArgumentError(
          "cuda backend: tensor-parallel rank without a plan, or out of range");
    }
    if (plan->world_size > 1 && tp->nccl == nullptr) {
      return absl::InvalidArgumentError("cuda backend: tensor parallelism needs an NCCL group");
    }
    for (int r = 0; r < plan->world_size; ++r) {
      const TpRankPlan& rp = plan->ranks[r];
      if (rp.q_heads.empty() || rp.ffn.empty() || rp.vocab.empty()) {
        return absl::UnimplementedError(
            absl::StrCat("tensor_parallel: ", plan->world_size, " ranks leave rank ", r,
                         " without query heads, FFN columns or vocabulary rows (",
                         config->num_heads, " heads, ", config->intermediate_size,
                         " FFN columns); the CUDA backend needs every rank to own some"));
      }
    }
  }
  const CudaTuning parsed = tuning != nullptr ? *tuning : CudaTuningFromEnvironment();
  cuda::SetLaunchTuning(parsed.launch);
  std::unique_ptr<CudaBackend> backend(
      new CudaBackend(*std::move(config), device, options, tp, parsed));
  SPECD_RETURN_IF_ERROR_(backend->forward_->Init());
  // A rank of a group keeps no table: the group keeps one for all ranks.
  if (tp == nullptr) {
    backend->table_ = MakeKvTable(backend->config_, backend->forward_->kv_blocks());
  }
  return backend;
}

CudaBackend::CudaBackend(ModelConfig config, int device, const BackendOptions& options,
                         const CudaTpRank* tp, const CudaTuning& tuning)
    : config_(std::move(config)),
      device_(device),
      options_(options),
      forward_(std::make_unique<CudaForward>(config_, device, options, tp, tuning)) {
  world_ = forward_->world();
  graphs_enabled_ = options_.cuda_graphs && tuning.cuda_graphs;
}

CudaBackend::~CudaBackend() {
  if (cudaSetDevice(device_) != cudaSuccess) return;
  if (forward_->stream() != nullptr) cudaStreamSynchronize(forward_->stream());
  graphs_.Clear();
  if (host_out_ != nullptr) cudaFreeHost(host_out_);
  for (cudaEvent_t e : phase_events_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
}

// ---------------------------------------------------------------------------------------------
// Sequences and KV blocks: engine/kv/paged_kv_table.h.

std::unique_ptr<PagedKvTable> CudaBackend::MakeKvTable(const ModelConfig& config, int64_t blocks) {
  auto table = std::make_unique<PagedKvTable>(kKvBlockTokens, blocks * kKvBlockTokens,
                                              config.vocab_size, config.max_position_embeddings);
  // The pools were allocated whole at load.
  table->AllocateUpFront();
  table->SetMaskBits(cuda::kTreeAttentionMaskBits);
  return table;
}

absl::Status CudaBackend::CheckOwnsTable() const {
  if (table_ != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "cuda backend: a tensor-parallel rank keeps no sequences; its group does");
}

absl::Status CudaBackend::AddSequence(SeqId seq) {
  SPECD_RETURN_IF_ERROR_(CheckOwnsTable());
  return table_->AddSequence(seq);
}

absl::Status CudaBackend::RemoveSequence(SeqId seq) {
  SPECD_RETURN_IF_ERROR_(CheckOwnsTable());
  DropHeldTaps(seq);
  return table_->RemoveSequence(seq);
}

absl::StatusOr<HeldTapRows> CudaBackend::TakeHeldTaps(SeqId seq) {
  if (held_taps_ == nullptr) return HeldTapRows();
  return held_taps_->Take(seq, forward_->stream());
}

void CudaBackend::DropHeldTaps(SeqId seq) {
  if (held_taps_ != nullptr) held_taps_->Drop(seq, forward_->stream());
}

bool CudaBackend::HasSequence(SeqId seq) const {
  return table_ != nullptr && table_->HasSequence(seq);
}

absl::StatusOr<int64_t> CudaBackend::CommittedLength(SeqId seq) const {
  SPECD_RETURN_IF_ERROR_(CheckOwnsTable());
  return table_->CommittedLength(seq);
}

KvUsage CudaBackend::Usage() const { return table_ != nullptr ? table_->Usage() : KvUsage(); }

absl::Status CudaBackend::CopyKvSlots(absl::Span<const int64_t> src,
                                      absl::Span<const int64_t> dst) {
  return forward_->CopyKvSlots(src, dst);
}

absl::Status CudaBackend::Commit(SeqId seq, absl::Span<const int32_t> path) {
  SPECD_RETURN_IF_ERROR_(CheckOwnsTable());
  std::vector<int64_t> src, dst;
  SPECD_RETURN_IF_ERROR_(table_->PrepareCommit(seq, path, &src, &dst));
  return forward_->CopyKvSlots(src, dst);
}

// ---------------------------------------------------------------------------------------------
// Forward.

void CudaBackend::PlanForward(absl::Span<const ForwardItem> items, const StepLayout& layout,
                              const std::vector<int64_t>& item_tokens, CudaStep* step,
                              StepPacker* pack) {
  if (graphs_enabled_) ChooseBuckets(item_tokens, step);
  PlanItems plan;
  PlanItemsFromLayout(layout, &plan);
  LayoutForward(items, plan.items, forward_->PlanOptions(), step, pack);
}

absl::Status CudaBackend::Execute(const CudaStep& step) {
  return graphs_.Run(step, forward_->stream(), forward_->buffer_generation(),
                     [&] { return forward_->Enqueue(step); });
}

absl::Status CudaBackend::Forward(absl::Span<const ForwardItem> items, std::vector<float>* logits) {
  if (logits == nullptr) return absl::InvalidArgumentError("logits is null");
  logits->clear();
  int64_t rows = 0;
  for (const ForwardItem& it : items) rows += static_cast<int64_t>(it.logit_rows.size());
  logits->resize(static_cast<size_t>(rows) * config_.vocab_size);
  absl::Status s = ForwardToHost(items, logits->data());
  if (!s.ok()) logits->clear();
  return s;
}

absl::Status CudaBackend::CheckForwardWithTaps(absl::Span<const int> tap_layers, int num_layers,
                                               const std::vector<float>* logits,
                                               const std::vector<float>* taps) {
  if (logits == nullptr) return absl::InvalidArgumentError("logits is null");
  if (!tap_layers.empty() && taps == nullptr) return absl::InvalidArgumentError("taps is null");
  for (size_t i = 0; i < tap_layers.size(); ++i) {
    const int layer = tap_layers[i];
    if (layer < 0 || layer > FinalNormTap(num_layers)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tap_layers[", i, "]: ", layer, " is not in [0, ", FinalNormTap(num_layers), "]"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (tap_layers[j] == layer) {
        return absl::InvalidArgumentError(
            absl::StrCat("tap_layers[", i, "]: ", layer, " is listed twice"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::ForwardWithTaps(absl::Span<const ForwardItem> items,
                                          absl::Span<const int> tap_layers,
                                          std::vector<float>* logits, std::vector<float>* taps) {
  SPECD_RETURN_IF_ERROR_(CheckForwardWithTaps(tap_layers, config_.num_layers, logits, taps));
  SPECD_RETURN_IF_ERROR_(CheckOwnsTable());
  logits->clear();
  if (taps != nullptr) taps->clear();
  // PrepareForward validates the whole batch before changing anything, so a bad item leaves
  // all sequences as they were.
  StepLayout layout;
  SPECD_RETURN_IF_ERROR_(table_->PrepareForward(items, &layout));
  int64_t rows = 0, tokens = 0;
  for (const ForwardItem& it : items) {
    rows += static_cast<int64_t>(it.logit_rows.size());
    tokens += static_cast<int64_t>(it.tokens.size());
  }
  logits->resize(static_cast<size_t>(rows) * config_.vocab_size);
  if (!tap_layers.empty()) {
    taps->resize(static_cast<size_t>(tokens) * tap_layers.size() * config_.hidden_size);
  }
  if (items.empty()) return absl::OkStatus();
  absl::Status s = ForwardLaidOut(items, layout, logits->data(), tap_layers,
                                  tap_layers.empty() ? nullptr : taps->data());
  if (!s.ok()) {
    logits->clear();
    if (taps != nullptr) taps->clear();
  }
  return s;
}

absl::Status CudaBackend::ForwardColumns(absl::Span<const ForwardItem> items,
                                         const StepLayout& layout, float* logits,
                                         absl::Span<const int> tap_layers, float* taps) {
  if (items.empty()) return absl::OkStatus();
  return ForwardLaidOut(items, layout, logits, tap_layers, taps);
}

absl::Status CudaBackend::CopyTapRows(absl::Span<const int64_t> rows, int64_t width, float* host) {
  const cudaStream_t stream = forward_->stream();
  const float* taps = static_cast<const float*>(forward_->buffers().taps.ptr);
  const size_t row_bytes = static_cast<size_t>(width) * sizeof(float);
  for (size_t i = 0; i < rows.size();) {
    size_t e = i + 1;
    while (e < rows.size() && rows[e] == rows[e - 1] + 1) ++e;
    SPECD_CUDA_RETURN_(cudaMemcpyAsync(host + i * width, taps + rows[i] * width,
                                       (e - i) * row_bytes, cudaMemcpyDeviceToHost, stream),
                       "copying taps");
    i = e;
  }
  SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream), "copying taps");
  return absl::OkStatus();
}

absl::Status CudaBackend::PrepareForward(absl::Span<const ForwardItem> items,
                                         const StepLayout& layout, CudaStep* step) {
  SPECD_CUDA_RETURN_(cudaSetDevice(device_), "selecting the device");
  std::vector<int64_t> item_tokens;
  // A padded sequence has per_seq token slots and per_seq logit rows (rows may repeat).
  for (const ForwardItem& it : items) {
    item_tokens.push_back(static_cast<int64_t>(std::max(it.tokens.size(), it.logit_rows.size())));
  }
  StepPacker pack;
  PlanForward(items, layout, item_tokens, step, &pack);
  SPECD_RETURN_IF_ERROR_(forward_->PrepareBuffers(*step, pack.bytes().size()));
  return forward_->UploadMeta(pack);
}

absl::Status CudaBackend::ForwardToHost(absl::Span<const ForwardItem> items, float* logits) {
  SPECD_RETURN_IF_ERROR_(CheckOwnsTable());
  // PrepareForward validates the whole batch before changing anything, so a bad item leaves
  // all sequences as they were.
  StepLayout layout;
  SPECD_RETURN_IF_ERROR_(table_->PrepareForward(items, &layout));
  if (items.empty()) return absl::OkStatus();
  return ForwardLaidOut(items, layout, logits);
}

absl::Status CudaBackend::ForwardLaidOut(absl::Span<const ForwardItem> items,
                                         const StepLayout& layout, float* logits,
                                         absl::Span<const int> tap_layers, float* taps) {
  CudaStep step;
  if (taps != nullptr) step.tap_layers.assign(tap_layers.begin(), tap_layers.end());
  SPECD_RETURN_IF_ERROR_(PrepareForward(items, layout, &step));
  SPECD_RETURN_IF_ERROR_(Execute(step));
  const cudaStream_t stream = forward_->stream();
  const CudaForward::Buffers& buf = forward_->buffers();
  const int64_t vocab = config_.vocab_size, vocab_rows = forward_->vocab_rows();
  // Each item's rows are contiguous on the device; runs of items that follow
  // each other there go back in one copy (a whole decode batch is one run),
  // into this rank's columns of the host rows.
  int64_t dst = 0;
  for (size_t b = 0; b < items.size();) {
    const int64_t src = step.item_row_begin[b];
    int64_t n = static_cast<int64_t>(items[b].logit_rows.size());
    size_t e = b + 1;
    while (e < items.size() && step.item_row_begin[e] == src + n) {
      n += static_cast<int64_t>(items[e].logit_rows.size());
      ++e;
    }
    if (n > 0) {
      const size_t width = static_cast<size_t>(vocab_rows) * sizeof(float);
      SPECD_CUDA_RETURN_(
          cudaMemcpy2DAsync(logits + dst * vocab + forward_->slice().vocab.begin,
                            vocab * sizeof(float),
                            static_cast<const float*>(buf.logits.ptr) + src * vocab_rows, width,
                            width, n, cudaMemcpyDeviceToHost, stream),
          "copying logits");
    }
    dst += n;
    b = e;
  }
  if (step.tap_layers.empty()) {
    SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream), "forward pass");
    return absl::OkStatus();
  }
  // Every token's taps, items in order: each item's token rows are contiguous on the device.
  std::vector<int64_t> tap_rows;
  for (size_t b = 0; b < items.size(); ++b) {
    for (size_t j = 0; j < items[b].tokens.size(); ++j) {
      tap_rows.push_back(step.item_token_begin[b] + static_cast<int64_t>(j));
    }
  }
  return CopyTapRows(tap_rows, static_cast<int64_t>(step.tap_layers.size()) * config_.hidden_size,
                     taps);
}

absl::Status CudaBackend::ForwardTopK(absl::Span<const ForwardItem> items, int k, TopKRows* out) {
  SPECD_RETURN_IF_ERROR_(CheckForwardTopK(k, out));
  SPECD_RETURN_IF_ERROR_(CheckOwnsTable());
  out->k = static_cast<int>(std::min<int64_t>(k, config_.vocab_size));
  out->ids.clear();
  out->logprobs.clear();
  // PrepareForward validates the whole batch before changing anything.
  StepLayout layout;
  SPECD_RETURN_IF_ERROR_(table_->PrepareForward(items, &layout));
  if (items.empty()) return absl::OkStatus();
  return ForwardTopKLaidOut(items, layout, out->k, out);
}

absl::Status CudaBackend::EnsureHostOut(size_t count) {
  if (host_out_count_ >= count) return absl::OkStatus();
  // Every step ends with a stream synchronisation, so no copy still targets the old buffer.
  if (host_out_ != nullptr) cudaFreeHost(host_out_);
  host_out_ = nullptr;
  host_out_count_ = 0;
  void* p = nullptr;
  SPECD_CUDA_RETURN_(cudaMallocHost(&p, count * sizeof(int32_t)), "allocating pinned host memory");
  host_out_ = static_cast<int32_t*>(p);
  host_out_count_ = count;
  return absl::OkStatus();
}

absl::Status CudaBackend::ForwardTopKLaidOut(absl::Span<const ForwardItem> items,
                                             const StepLayout& layout, int k, TopKRows* out) {
  SPECD_CUDA_RETURN_(cudaSetDevice(device_), "selecting the device");
  std::vector<int64_t> item_tokens;
  for (const ForwardItem& it : items) {
    item_tokens.push_back(static_cast<int64_t>(std::max(it.tokens.size(), it.logit_rows.size())));
  }
  CudaStep step;
  step.topk_k = k;
  StepPacker pack;
  PlanForward(items, layout, item_tokens, &step, &pack);
  // The level's rows: the requested ones in order, then the step's others (padding, rows
  // nobody asked for), so that the top-k's launch depends on the bucket and k alone and a
  // repeated level replays one graph whatever its rows; the extra rows' results stay on the
  // device. The list travels in the step's one metadata copy.
  std::vector<int32_t> rows;
  rows.reserve(step.R);
  std::vector<char> requested(step.R, 0);
  for (size_t b = 0; b < items.size(); ++b) {
    for (size_t j = 0; j < items[b].logit_rows.size(); ++j) {
      const int64_t r = step.item_row_begin[b] + static_cast<int64_t>(j);
      rows.push_back(static_cast<int32_t>(r));
      requested[r] = 1;
    }
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t r = 0; r < step.R; ++r) {
    if (!requested[r]) rows.push_back(static_cast<int32_t>(r));
  }
  step.topk_rows = static_cast<int64_t>(rows.size());
  if (step.topk_rows == 0) step.topk_k = 0;
  step.o_topk_rows = pack.Add(rows);
  SPECD_RETURN_IF_ERROR_(forward_->PrepareBuffers(step, pack.bytes().size()));
  SPECD_RETURN_IF_ERROR_(forward_->UploadMeta(pack));
  // The forward and the top-k: one graph for a bucketed step.
  SPECD_RETURN_IF_ERROR_(Execute(step));
  const cudaStream_t stream = forward_->stream();
  if (out == nullptr || n == 0) {
    SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream), "forward pass");
    return absl::OkStatus();
  }
  // One copy down: [topk_rows, k] ids then [topk_rows, k] log-probabilities, of which the
  // first n rows of each are the requested ones.
  const size_t words = 2 * static_cast<size_t>(step.topk_rows) * k;
  SPECD_RETURN_IF_ERROR_(EnsureHostOut(words));
  SPECD_CUDA_RETURN_(cudaMemcpyAsync(host_out_, forward_->buffers().topk.ptr,
                                     words * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
                     "copying top-k rows");
  SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream), "forward pass");
  const size_t n_words = static_cast<size_t>(n) * k;
  out->ids.assign(host_out_, host_out_ + n_words);
  const float* lps = reinterpret_cast<const float*>(host_out_ + words / 2);
  out->logprobs.assign(lps, lps + n_words);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Verify on the device: one metadata upload, one graph (or the same launches
// eagerly), one copy of the outcomes back.

absl::StatusOr<std::vector<VerifyOutcome>> CudaBackend::Verify(absl::Span<const VerifyItem> items) {
  SPECD_RETURN_IF_ERROR_(CheckOwnsTable());
  return VerifyOnDevice(items);
}

absl::StatusOr<std::vector<VerifyOutcome>> CudaBackend::VerifyOnDevice(
    absl::Span<const VerifyItem> items) {
  const auto t_enter = std::chrono::steady_clock::now();
  VerifyPlan plan;
  SPECD_RETURN_IF_ERROR_(PrepareVerify(*this, table_.get(), items, &plan));
  if (items.empty()) return std::vector<VerifyOutcome>{};
  absl::StatusOr<std::vector<VerifyOutcome>> outcomes =
      RunVerify(items, plan, /*export_taps=*/true, t_enter);
  if (!outcomes.ok()) return outcomes.status();
  SPECD_RETURN_IF_ERROR_(CommitVerify(table_.get(), items, *outcomes));
  return outcomes;
}

absl::Status CudaBackend::PrepareVerify(const Backend& backend, PagedKvTable* table,
                                        absl::Span<const VerifyItem> items, VerifyPlan* plan) {
  plan->forward.assign(items.size(), ForwardItem());
  plan->committed.assign(items.size(), 0);
  for (size_t b = 0; b < items.size(); ++b) {
    absl::StatusOr<int64_t> first = MakeVerifyForward(backend, items[b], b, &plan->forward[b]);
    if (!first.ok()) return first.status();
    // The tree's KV slots follow the pending tokens right after the committed prefix.
    const absl::StatusOr<int64_t> scratch = table->ScratchLength(items[b].seq);
    if (!scratch.ok()) return scratch.status();
    if (*scratch > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("verify item ", b, ": sequence ", items[b].seq, " has ", *scratch,
                       " uncommitted scratch nodes; Commit() them before Verify()"));
    }
    plan->committed[b] = *first - static_cast<int64_t>(items[b].pending.size());
  }
  return table->PrepareForward(plan->forward, &plan->layout);
}

absl::Status CudaBackend::ExportTaps(absl::Span<const VerifyItem> items, const CudaStep& step,
                                     absl::Span<const int64_t> committed,
                                     std::vector<VerifyOutcome>* outcomes) {
  const std::vector<int>& all = step.tap_layers;
  const int64_t H = config_.hidden_size, width = static_cast<int64_t>(all.size()) * H;
  // The committed tokens' rows of every item that asks, in one pass of copies: its pending
  // chain, then its accepted nodes (scratch index = token row offset in the item). Rows an item
  // holds stay on the device (stream-ordered before any later step overwrites the buffer).
  std::vector<int64_t> rows, item_rows;
  std::vector<size_t> first(items.size());
  for (size_t b = 0; b < items.size(); ++b) {
    first[b] = rows.size();
    if (items[b].tap_layers.empty()) continue;
    item_rows.clear();
    for (int32_t token :
         AcceptedScratchPath(static_cast<int>(items[b].pending.size()), (*outcomes)[b])) {
      item_rows.push_back(step.item_token_begin[b] + token);
    }
    if (items[b].hold_tap_rows > 0) {
      if (held_taps_ == nullptr) {
        held_taps_ = std::make_unique<DeviceHeldTaps>(device_, H, kMaxDeviceHeldTapBytes);
      }
      absl::StatusOr<bool> held =
          held_taps_->Append(items[b].seq, committed[b], items[b].tap_layers, all,
                             static_cast<const float*>(forward_->buffers().taps.ptr), item_rows,
                             items[b].hold_tap_rows, forward_->stream());
      if (!held.ok()) {
        // The rows queued for the items before this one are counted as held: copy them.
        (void)held_taps_->Flush(forward_->stream());
        return held.status();
      }
      if (*held) continue;  // else no room: copied down with the others
    }
    rows.insert(rows.end(), item_rows.begin(), item_rows.end());
  }
  // Every held item's copies in one launch, before a later step overwrites the tap buffer.
  if (held_taps_ != nullptr) SPECD_RETURN_IF_ERROR_(held_taps_->Flush(forward_->stream()));
  if (rows.empty()) return absl::OkStatus();  // every item held its rows
  std::vector<float> host(rows.size() * width);
  SPECD_RETURN_IF_ERROR_(CopyTapRows(rows, width, host.data()));
  for (size_t b = 0; b < items.size(); ++b) {
    const std::vector<int>& want = items[b].tap_layers;
    const size_t n = (b + 1 < items.size() ? first[b + 1] : rows.size()) - first[b];
    if (want.empty() || n == 0) continue;
    std::vector<float>& out = (*outcomes)[b].taps;
    out.resize(n * want.size() * H);
    float* dst = out.data();
    for (size_t j = 0; j < n; ++j) {
      const float* src = host.data() + (first[b] + j) * width;
      for (int layer : want) {
        const int64_t u = std::lower_bound(all.begin(), all.end(), layer) - all.begin();
        std::copy_n(src + u * H, H, dst);
        dst += H;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CommitVerify(PagedKvTable* table, absl::Span<const VerifyItem> items,
                                       const std::vector<VerifyOutcome>& outcomes) {
  for (size_t b = 0; b < items.size(); ++b) {
    // The compaction kernel has already moved the accepted nodes' K/V into place.
    std::vector<int64_t> src, dst;
    SPECD_RETURN_IF_ERROR_(table->PrepareCommit(
        items[b].seq, AcceptedScratchPath(static_cast<int>(items[b].pending.size()), outcomes[b]),
        &src, &dst));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<VerifyOutcome>> CudaBackend::RunVerify(
    absl::Span<const VerifyItem> items, const VerifyPlan& plan, bool export_taps,
    std::chrono::steady_clock::time_point t_enter) {
  const int vocab = config_.vocab_size;
  const std::vector<ForwardItem>& forward = plan.forward;
  const std::vector<int64_t>& committed = plan.committed;
  const StepLayout& layout = plan.layout;
  SPECD_CUDA_RETURN_(cudaSetDevice(device_), "selecting the device");
  const cudaStream_t stream = forward_->stream();
  CudaForward::Buffers& buf = forward_->buffers();

  CudaStep step;
  step.verify = true;
  // A group's ranks each hold a slice of a row: the processors, the filters and the
  // log-probabilities need whole rows, so such steps gather them (on every rank, which then all
  // sample alike; rank 0 alone computes the log-probabilities).
  bool any_processors = false, any_processed_logprobs = false;
  for (const VerifyItem& it : items) {
    if (world_ > 1 && (!VocabParallelSamplingSupported(it.sampling) || it.logprobs >= 0)) {
      step.gather_logits = true;
    }
    any_processors = any_processors || it.sampling.has_processors();
    any_processed_logprobs = any_processed_logprobs ||
                             (it.logprobs >= 0 && it.logprobs_mode == LogprobsMode::kProcessed);
    // Taps: one device copy of the union of the layers the items ask for (sorted), sliced per
    // item once the accepted paths are known.
    if (export_taps) {
      step.tap_layers.insert(step.tap_layers.end(), it.tap_layers.begin(), it.tap_layers.end());
    }
  }
  std::sort(step.tap_layers.begin(), step.tap_layers.end());
  step.tap_layers.erase(std::unique(step.tap_layers.begin(), step.tap_layers.end()),
                        step.tap_layers.end());
  std::vector<int64_t> item_tokens;
  for (const ForwardItem& f : forward) item_tokens.push_back(static_cast<int64_t>(f.tokens.size()));
  StepPacker pack;
  PlanForward(forward, layout, item_tokens, &step, &pack);

  // Sampling rows (the last pending token's, then one per tree node, at the item's logit rows),
  // then the packed trees and the outputs (LayoutVerify). Padding rows and sequences sample
  // greedily from rows no one reads.
  const int64_t num_seqs = static_cast<int64_t>(items.size());
  const std::vector<VerifyRow> rows = VerifyRows(items, committed, step);
  std::vector<cuda::SampleRowParams> row_params(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    if (rows[r].item < 0) continue;
    const SamplingParams& sampling = items[rows[r].item].sampling;
    cuda::SampleRowParams& p = row_params[r];
    p.seed = sampling.seed;
    p.position = rows[r].position;
    p.temperature = sampling.temperature;
    p.top_p = sampling.top_p;
    p.top_k = sampling.top_k;
    p.min_p = sampling.min_p;
  }
  step.o_row_params = pack.Add(row_params);
  LayoutVerify(items, committed, &step, &pack);
  if (any_processed_logprobs) {
    step.kept_lower = true;
    step.o_kept_lower = pack.Add(std::vector<uint64_t>(step.R));
  }
  if (any_processors) PackProcessors(items, &step, &pack);
  const size_t out_count = VerifyOutCount(step);

  SPECD_RETURN_IF_ERROR_(forward_->PrepareBuffers(step, pack.bytes().size()));

  // Log-probabilities: raw ones from the logits, processed ones from the rows that were sampled,
  // on rank 0 of a group (its gathered rows are whole). The row lists go up before the step is
  // launched, so nothing waits on the host in between.
  LogprobGroup groups[2];  // raw, processed
  size_t topk_bytes = 0;
  const bool logprobs_here = forward_->rank() == 0;
  for (int g = 0; g < 2; ++g) {
    LogprobGroup& group = groups[g];
    const LogprobsMode mode = g == 0 ? LogprobsMode::kRaw : LogprobsMode::kProcessed;
    group.first.assign(num_seqs, -1);
    for (int64_t b = 0; b < num_seqs && logprobs_here; ++b) {
      if (items[b].logprobs < 0 || items[b].logprobs_mode != mode) continue;
      group.first[b] = group.n();
      for (int j = 0; j <= items[b].tree.size(); ++j) {
        group.rows.push_back(static_cast<int32_t>(step.item_row_begin[b] + j));
      }
      group.k = std::max(group.k, items[b].logprobs);
    }
    group.k = std::min(group.k, vocab);
    group.offset = topk_bytes;
    group.index_bytes = (group.n() * sizeof(int32_t) + 15) / 16 * 16;
    group.result_bytes = group.n() * (group.k + 1) * (sizeof(int32_t) + sizeof(float));
    group.host.resize(group.result_bytes);
    topk_bytes += group.index_bytes + (group.result_bytes + 15) / 16 * 16;
  }
  if (topk_bytes > 0) SPECD_RETURN_IF_ERROR_(forward_->Ensure(&buf.topk, topk_bytes));
  for (const LogprobGroup& group : groups) {
    if (group.n() == 0) continue;
    SPECD_CUDA_RETURN_(
        cudaMemcpyAsync(static_cast<char*>(buf.topk.ptr) + group.offset, group.rows.data(),
                        group.n() * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
        "uploading logprob rows");
  }
  const bool timing = phase_timing_ && world_ == 1;
  if (timing) {
    for (cudaEvent_t& e : phase_events_) {
      if (e == nullptr) SPECD_CUDA_RETURN_(cudaEventCreate(&e), "creating a timing event");
    }
    SPECD_CUDA_RETURN_(cudaEventRecord(phase_events_[0], stream), "recording a timing event");
  }
  const auto t_upload = std::chrono::steady_clock::now();
  SPECD_RETURN_IF_ERROR_(forward_->UploadMeta(pack));
  SPECD_RETURN_IF_ERROR_(Execute(step));
  for (int g = 0; g < 2; ++g) {
    LogprobGroup& group = groups[g];
    if (group.n() == 0) continue;
    const int64_t n = group.n();
    char* base = static_cast<char*>(buf.topk.ptr) + group.offset;
    cuda::TopKLogprobsParams p;
    p.logits = forward_->VerifyLogits(step, /*processed=*/g == 1, &p.logits_stride);
    p.row_index = reinterpret_cast<const int32_t*>(base);
    p.num_rows = n;
    p.vocab_size = vocab;
    p.k = group.k;
    p.ids = reinterpret_cast<int32_t*>(base + group.index_bytes);
    p.logprobs = reinterpret_cast<float*>(p.ids + n * group.k);
    p.tokens = At<int32_t>(buf.meta.ptr, step.o_sampled);
    p.token_logprobs = p.logprobs + n * group.k;
    p.token_ranks = reinterpret_cast<int32_t*>(p.token_logprobs + n);
    if (group.k == 0) {
      p.ids = nullptr;
      p.logprobs = nullptr;
    }
    if (g == 1) {
      p.sampling = At<cuda::SampleRowParams>(buf.meta.ptr, step.o_row_params);
      p.kept_lower = At<uint64_t>(buf.meta.ptr, step.o_kept_lower);
    }
    SPECD_CUDA_RETURN_(cuda::TopKLogprobsCuda(p, stream), "logprobs launch");
    SPECD_CUDA_RETURN_(cudaMemcpyAsync(group.host.data(), base + group.index_bytes,
                                       group.result_bytes, cudaMemcpyDeviceToHost, stream),
                       "copying logprobs");
  }
  SPECD_RETURN_IF_ERROR_(EnsureHostOut(out_count));
  SPECD_CUDA_RETURN_(cudaMemcpyAsync(host_out_, At<int32_t>(buf.meta.ptr, step.o_out),
                                     out_count * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
                     "copying verify outcomes");
  if (timing) {
    SPECD_CUDA_RETURN_(cudaEventRecord(phase_events_[1], stream), "recording a timing event");
  }
  const auto t_launched = std::chrono::steady_clock::now();
  SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream), "verify step");
  const auto t_synced = std::chrono::steady_clock::now();

  const int32_t* out = host_out_;
  const int64_t launched = step.batch, stride = step.out_stride;
  std::vector<VerifyOutcome> outcomes(num_seqs);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int n = out[b];
    const int32_t* toks = out + launched + b * stride;
    const int32_t* nodes = out + launched + (launched + b) * stride;
    VerifyOutcome& o = outcomes[b];
    o.tokens.assign(toks, toks + n + 1);
    o.accepted_nodes.assign(nodes, nodes + n);
    o.accepted_draft = n;
    for (const LogprobGroup& group : groups) {
      if (group.first[b] < 0) continue;
      // Token j was drawn from the row of its parent on the accepted path.
      const int k = group.k;
      for (int j = 0; j <= n; ++j) {
        const int64_t e = group.first[b] + (j == 0 ? 0 : o.accepted_nodes[j - 1] + 1);
        TokenLogprobs& t = o.logprobs.emplace_back();
        t.logprob = group.token_logprobs()[e];
        t.rank = group.ranks()[e];
        for (int m = 0; m < std::min(items[b].logprobs, k); ++m) {
          // Probability 0 (a -inf logit, or a token the filters dropped) is never listed, as
          // on the host.
          const float lp = group.logprobs()[e * k + m];
          if (std::isinf(lp)) break;
          t.top.push_back({group.ids()[e * k + m], lp});
        }
      }
    }
  }
  if (!step.tap_layers.empty()) {
    SPECD_RETURN_IF_ERROR_(ExportTaps(items, step, committed, &outcomes));
  }
  if (timing) {
    const auto us = [](auto a, auto b) {
      return std::chrono::duration<double, std::micro>(b - a).count();
    };
    float device_ms = 0;
    SPECD_CUDA_RETURN_(cudaEventElapsedTime(&device_ms, phase_events_[0], phase_events_[1]),
                       "reading a timing event");
    last_phases_.prepare_us = us(t_enter, t_upload);
    last_phases_.launch_us = us(t_upload, t_launched);
    last_phases_.wait_us = us(t_launched, t_synced);
    last_phases_.finish_us = us(t_synced, std::chrono::steady_clock::now());
    last_phases_.device_us = 1e3 * device_ms;
  }
  return outcomes;
}

}  // namespace specd
