#include "tools/make_test_model/synthetic_pair.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/io/safetensors.h"
#include "engine/backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/spec/generator.h"
#include "nlohmann/json.hpp"

namespace specd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::vector<SyntheticShape> AllShapes() {
  std::vector<SyntheticShape> shapes;
  // models/pycoder-target's sizes (the project's reference target).
  shapes.push_back({"reference", 8192, 320, 864, 5, 5, 1, 64, 1024, 10000.0, 0.0, 8192});
  shapes.push_back(
      {"llama-3.2-1b", 128256, 2048, 8192, 16, 32, 8, 64, 131072, 500000.0, 32.0, 8192});
  shapes.push_back(
      {"llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8, 128, 131072, 500000.0, 8.0, 8192});
  shapes.push_back(
      {"llama-3.1-70b", 128256, 8192, 28672, 80, 64, 8, 128, 131072, 500000.0, 8.0, 8192});
  return shapes;
}

// One tensor of the plan: its values are N(mean, std) * scale, drawn from a generator keyed by
// (seed, name) alone, so the draft's copy of a target tensor has the same bits whatever else
// either model holds.
struct TensorPlan {
  std::string name;
  std::vector<int64_t> shape;
  float mean = 0.0f;
  float std = 0.0f;
  float scale = 1.0f;
  bool in_draft = false;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t nbytes() const { return numel() * 2; }
};

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t HashName(uint64_t seed, const std::string& name) {
  uint64_t h = SplitMix64(seed);
  for (unsigned char c : name) h = SplitMix64(h ^ c);
  return h;
}

// Element i of a tensor keyed by `key`: a standard normal (Box-Muller on two counter-based
// uniforms), so any slice can be generated on its own and threads need no shared state.
float NormalAt(uint64_t key, int64_t i) {
  const uint64_t r = SplitMix64(key ^ (static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull));
  const double u1 = (static_cast<double>(r >> 40) + 1.0) / 16777217.0;  // (0, 1]
  const double u2 = static_cast<double>(r & 0xFFFFFF) / 16777216.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

void Generate(const TensorPlan& t, uint64_t key, int64_t begin, int64_t end, int threads,
              uint16_t* out) {
  auto work = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float v = t.std == 0.0f ? t.mean : t.mean + t.std * NormalAt(key, i);
      out[i - begin] = F32ToBF16(v * t.scale);
    }
  };
  const int64_t n = end - begin;
  if (threads <= 1 || n < (1 << 16)) {
    work(begin, end);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (n + threads - 1) / threads;
  for (int k = 0; k < threads; ++k) {
    const int64_t b = begin + k * per, e = std::min(end, b + per);
    if (b < e) pool.emplace_back(work, b, e);
  }
  for (std::thread& th : pool) th.join();
}

std::vector<TensorPlan> Plan(const SyntheticPairOptions& o) {
  const SyntheticShape& s = o.shape;
  const int64_t h = s.hidden_size, q = int64_t{s.num_heads} * s.head_dim,
                kv = int64_t{s.num_kv_heads} * s.head_dim, f = s.intermediate_size;
  // Inputs of every projection are unit-RMS (RMSNorm outputs, attention averages of unit
  // values, SwiGLU of unit pre-activations), so 1/sqrt(fan_in) keeps every layer's output near
  // the embedding's unit scale: each layer moves the residual stream by about as much as any
  // other, and the skipped layers' weight in the target's output is what epsilon scales.
  const float in_std = static_cast<float>(1.0 / std::sqrt(static_cast<double>(h)));
  const float o_std = static_cast<float>(1.0 / std::sqrt(static_cast<double>(q)));
  const float down_std = static_cast<float>(1.0 / std::sqrt(static_cast<double>(f)));
  std::vector<TensorPlan> plan;
  plan.push_back({"model.embed_tokens.weight", {s.vocab_size, h}, 0.0f, 1.0f, 1.0f, true});
  for (int l = 0; l < s.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const bool in_draft = l < o.draft_layers;
    const float tail = in_draft ? 1.0f : static_cast<float>(o.epsilon);
    plan.push_back({p + "input_layernorm.weight", {h}, 1.0f, 0.0f, 1.0f, in_draft});
    plan.push_back({p + "self_attn.q_proj.weight", {q, h}, 0.0f, in_std, 1.0f, in_draft});
    plan.push_back({p + "self_attn.k_proj.weight", {kv, h}, 0.0f, in_std, 1.0f, in_draft});
    plan.push_back({p + "self_attn.v_proj.weight", {kv, h}, 0.0f, in_std, 1.0f, in_draft});
    plan.push_back({p + "self_attn.o_proj.weight", {h, q}, 0.0f, o_std, tail, in_draft});
    plan.push_back({p + "post_attention_layernorm.weight", {h}, 1.0f, 0.0f, 1.0f, in_draft});
    plan.push_back({p + "mlp.gate_proj.weight", {f, h}, 0.0f, in_std, 1.0f, in_draft});
    plan.push_back({p + "mlp.up_proj.weight", {f, h}, 0.0f, in_std, 1.0f, in_draft});
    plan.push_back({p + "mlp.down_proj.weight", {h, f}, 0.0f, down_std, tail, in_draft});
  }
  plan.push_back({"model.norm.weight", {h}, 1.0f, 0.0f, 1.0f, true});
  // Untied, unlike Llama-3.2-1B and the reference: a tied random LM head scores the current
  // token's own embedding highest, and greedy decoding would repeat one token forever. The
  // cost is the same GEMM either way.
  plan.push_back({"lm_head.weight",
                  {s.vocab_size, h},
                  0.0f,
                  static_cast<float>(o.logit_std / std::sqrt(static_cast<double>(h))),
                  1.0f,
                  true});
  return plan;
}

// Writes one model's tensors, in plan order, into shards of at most max_shard_bytes (a tensor
// larger than that gets a shard of its own).
class ShardedWriter {
 public:
  ShardedWriter(std::string dir, int64_t max_shard_bytes)
      : dir_(std::move(dir)), max_shard_bytes_(max_shard_bytes) {}

  void Add(const TensorPlan* t) { tensors_.push_back(t); }

  absl::Status Begin() {
    std::vector<const TensorPlan*> current;
    int64_t bytes = 0;
    for (const TensorPlan* t : tensors_) {
      if (!current.empty() && bytes + t->nbytes() > max_shard_bytes_) {
        shards_.push_back(std::move(current));
        current.clear();
        bytes = 0;
      }
      current.push_back(t);
      bytes += t->nbytes();
    }
    if (!current.empty()) shards_.push_back(std::move(current));
    for (size_t k = 0; k < shards_.size(); ++k) {
      for (const TensorPlan* t : shards_[k]) shard_of_[t] = k;
    }
    if (shards_.size() > 1) {
      json weight_map = json::object();
      for (size_t k = 0; k < shards_.size(); ++k) {
        for (const TensorPlan* t : shards_[k]) weight_map[t->name] = ShardName(k);
      }
      int64_t total = 0;
      for (const TensorPlan* t : tensors_) total += t->nbytes();
      json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
      std::ofstream out(fs::path(dir_) / "model.safetensors.index.json");
      out << index.dump(2);
      if (!out) return absl::InternalError(absl::StrCat(dir_, ": cannot write the index"));
    }
    return absl::OkStatus();
  }

  bool Wants(const TensorPlan* t) const { return shard_of_.count(t) > 0; }

  // Called for each of its tensors in plan order, once before its data.
  absl::Status StartTensor(const TensorPlan* t) {
    const size_t k = shard_of_.at(t);
    if (out_ == nullptr || k != open_shard_) {
      if (absl::Status s = Close(); !s.ok()) return s;
      return Open(k);
    }
    return absl::OkStatus();
  }

  absl::Status Write(const uint16_t* data, int64_t count) {
    out_->write(reinterpret_cast<const char*>(data), count * 2);
    if (!*out_) return absl::DataLossError(absl::StrCat(path_, ": write failed"));
    return absl::OkStatus();
  }

  absl::Status Close() {
    if (out_ == nullptr) return absl::OkStatus();
    out_->close();
    const bool ok = static_cast<bool>(*out_);
    out_.reset();
    if (!ok) return absl::DataLossError(absl::StrCat(path_, ": write failed"));
    return absl::OkStatus();
  }

 private:
  std::string ShardName(size_t k) const {
    if (shards_.size() == 1) return "model.safetensors";
    return absl::StrFormat("model-%05d-of-%05d.safetensors", k + 1, shards_.size());
  }

  absl::Status Open(size_t k) {
    open_shard_ = k;
    path_ = (fs::path(dir_) / ShardName(k)).string();
    json header = json::object();
    header["__metadata__"] = {{"format", "pt"}};
    uint64_t offset = 0;
    for (const TensorPlan* t : shards_[k]) {
      header[t->name] = {{"dtype", "BF16"},
                         {"shape", t->shape},
                         {"data_offsets", {offset, offset + static_cast<uint64_t>(t->nbytes())}}};
      offset += t->nbytes();
    }
    std::string text = header.dump();
    while (text.size() % 8 != 0) text.push_back(' ');  // keeps the data 8-byte aligned
    out_ = std::make_unique<std::ofstream>(path_, std::ios::binary | std::ios::trunc);
    if (!*out_) return absl::PermissionDeniedError(absl::StrCat(path_, ": cannot write"));
    const uint64_t len = text.size();
    out_->write(reinterpret_cast<const char*>(&len), 8);
    out_->write(text.data(), text.size());
    if (!*out_) return absl::DataLossError(absl::StrCat(path_, ": write failed"));
    return absl::OkStatus();
  }

  std::string dir_;
  int64_t max_shard_bytes_;
  std::vector<const TensorPlan*> tensors_;
  std::vector<std::vector<const TensorPlan*>> shards_;
  std::map<const TensorPlan*, size_t> shard_of_;
  std::unique_ptr<std::ofstream> out_;
  size_t open_shard_ = 0;
  std::string path_;
};

absl::StatusOr<json> ReadJson(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot read"));
  std::stringstream text;
  text << in.rdbuf();
  json j = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not JSON"));
  }
  return j;
}

absl::Status WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) return absl::InternalError(absl::StrCat(path.string(), ": write failed"));
  return absl::OkStatus();
}

absl::Status WriteConfigs(const SyntheticPairOptions& o, const std::string& dir, int layers) {
  const SyntheticShape& s = o.shape;
  const fs::path tok(o.tokenizer_dir);
  std::error_code ec;
  for (const char* file : {"tokenizer.json", "tokenizer_config.json"}) {
    if (!fs::exists(tok / file)) {
      if (std::string(file) == "tokenizer.json") {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer_dir: ", (tok / file).string(), " does not exist"));
      }
      continue;
    }
    fs::copy_file(tok / file, fs::path(dir) / file, fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::InternalError(absl::StrCat((tok / file).string(), ": ", ec.message()));
  }
  // Special ids from the tokenizer's model, so EOS means what the tokenizer says it means.
  json bos = 0, eos = 0;
  json gen = {{"do_sample", false}};
  if (fs::exists(tok / "generation_config.json")) {
    absl::StatusOr<json> g = ReadJson(tok / "generation_config.json");
    if (!g.ok()) return g.status();
    gen = *g;
  }
  if (gen.contains("bos_token_id")) bos = gen["bos_token_id"];
  if (gen.contains("eos_token_id")) eos = gen["eos_token_id"];
  gen["bos_token_id"] = bos;
  gen["eos_token_id"] = eos;
  json config = {{"architectures", {"LlamaForCausalLM"}},
                 {"model_type", "llama"},
                 {"vocab_size", s.vocab_size},
                 {"hidden_size", s.hidden_size},
                 {"intermediate_size", s.intermediate_size},
                 {"num_hidden_layers", layers},
                 {"num_attention_heads", s.num_heads},
                 {"num_key_value_heads", s.num_kv_heads},
                 {"head_dim", s.head_dim},
                 {"hidden_act", "silu"},
                 {"rms_norm_eps", 1e-5},
                 {"rope_theta", s.rope_theta},
                 {"max_position_embeddings", s.max_position_embeddings},
                 {"tie_word_embeddings", false},
                 {"attention_bias", false},
                 {"mlp_bias", false},
                 {"bos_token_id", bos},
                 {"eos_token_id", eos},
                 {"torch_dtype", "bfloat16"},
                 {"specd_synthetic",
                  {{"shape", s.name},
                   {"draft_layers", o.draft_layers},
                   {"epsilon", o.epsilon},
                   {"seed", o.seed},
                   {"logit_std", o.logit_std},
                   {"note", "random weights; acceptance set by construction (epsilon)"}}}};
  if (s.llama3_rope_factor > 0) {
    config["rope_scaling"] = {{"rope_type", "llama3"},
                              {"factor", s.llama3_rope_factor},
                              {"low_freq_factor", 1.0},
                              {"high_freq_factor", 4.0},
                              {"original_max_position_embeddings", s.llama3_original_max_position}};
  }
  if (absl::Status st = WriteText(fs::path(dir) / "config.json", config.dump(2)); !st.ok()) {
    return st;
  }
  return WriteText(fs::path(dir) / "generation_config.json", gen.dump(2));
}

// Removes shards an earlier write with another shard count left behind; they would otherwise
// be picked up by loaders that read every *.safetensors of a folder.
void RemoveOldWeights(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 12 && name.substr(name.size() - 12) == ".safetensors") {
      fs::remove(entry.path(), ec);
    }
    if (name == "model.safetensors.index.json") fs::remove(entry.path(), ec);
  }
}

}  // namespace

std::vector<std::string> SyntheticShapeNames() {
  std::vector<std::string> names;
  for (const SyntheticShape& s : AllShapes()) names.push_back(s.name);
  return names;
}

absl::StatusOr<SyntheticShape> SyntheticShapeByName(const std::string& name) {
  for (const SyntheticShape& s : AllShapes()) {
    if (s.name == name) return s;
  }
  return absl::InvalidArgumentError(absl::StrCat("shape: \"", name, "\" is not one of ",
                                                 absl::StrJoin(SyntheticShapeNames(), ", ")));
}

absl::Status WriteSyntheticPair(const SyntheticPairOptions& o, const std::string& target_dir,
                                const std::string& draft_dir) {
  const SyntheticShape& s = o.shape;
  if (target_dir.empty()) return absl::InvalidArgumentError("target_dir: required");
  if (s.num_layers < 1 || s.hidden_size < 1 || s.vocab_size < 1 || s.num_heads < 1 ||
      s.num_kv_heads < 1 || s.num_heads % s.num_kv_heads != 0 || s.head_dim < 1) {
    return absl::InvalidArgumentError(absl::StrCat("shape: ", s.name, " has invalid sizes"));
  }
  if (o.draft_layers < 1 || o.draft_layers > s.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("draft_layers: ", o.draft_layers, " is not in [1, ", s.num_layers, "]"));
  }
  if (!(o.epsilon >= 0.0) || !std::isfinite(o.epsilon)) {
    return absl::InvalidArgumentError("epsilon: must be finite and >= 0");
  }
  if (o.max_shard_bytes < 1) return absl::InvalidArgumentError("max_shard_bytes: must be > 0");
  const int threads = o.num_threads > 0
                          ? o.num_threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::error_code ec;
  for (const std::string& dir : {target_dir, draft_dir}) {
    if (dir.empty()) continue;
    fs::create_directories(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat(dir, ": ", ec.message()));
    RemoveOldWeights(dir);
  }
  if (absl::Status st = WriteConfigs(o, target_dir, s.num_layers); !st.ok()) return st;
  if (!draft_dir.empty()) {
    if (absl::Status st = WriteConfigs(o, draft_dir, o.draft_layers); !st.ok()) return st;
  }

  const std::vector<TensorPlan> plan = Plan(o);
  ShardedWriter target(target_dir, o.max_shard_bytes), draft(draft_dir, o.max_shard_bytes);
  for (const TensorPlan& t : plan) {
    target.Add(&t);
    if (t.in_draft && !draft_dir.empty()) draft.Add(&t);
  }
  if (absl::Status st = target.Begin(); !st.ok()) return st;
  if (!draft_dir.empty()) {
    if (absl::Status st = draft.Begin(); !st.ok()) return st;
  }
  // Slices of 16 Mi elements (32 MiB of bf16) bound the memory whatever the shape.
  constexpr int64_t kSlice = int64_t{1} << 24;
  std::vector<uint16_t> buf;
  for (const TensorPlan& t : plan) {
    const bool to_draft = !draft_dir.empty() && draft.Wants(&t);
    if (absl::Status st = target.StartTensor(&t); !st.ok()) return st;
    if (to_draft) {
      if (absl::Status st = draft.StartTensor(&t); !st.ok()) return st;
    }
    const uint64_t key = HashName(o.seed, t.name);
    const int64_t n = t.numel();
    for (int64_t b = 0; b < n; b += kSlice) {
      const int64_t e = std::min(n, b + kSlice);
      buf.resize(e - b);
      Generate(t, key, b, e, threads, buf.data());
      if (absl::Status st = target.Write(buf.data(), e - b); !st.ok()) return st;
      if (to_draft) {
        if (absl::Status st = draft.Write(buf.data(), e - b); !st.ok()) return st;
      }
    }
  }
  if (absl::Status st = target.Close(); !st.ok()) return st;
  return draft.Close();
}

absl::StatusOr<TauMeasurement> MeasureTau(const std::string& target_dir,
                                          const std::string& draft_dir, const TauOptions& o) {
  BackendOptions bo;
  bo.device = o.device;
  bo.num_threads = o.num_threads;
  bo.kv_capacity_tokens = int64_t{o.num_prompts} * (o.prompt_tokens + o.max_new_tokens + 512);
  absl::StatusOr<std::unique_ptr<Backend>> target = CreateBackend(target_dir, bo);
  if (!target.ok()) return target.status();
  absl::StatusOr<std::unique_ptr<Backend>> draft_model = CreateBackend(draft_dir, bo);
  if (!draft_model.ok()) return draft_model.status();
  DraftModelDrafter drafter(draft_model->get());
  absl::StatusOr<std::unique_ptr<Generator>> gen = Generator::Create(target->get(), &drafter);
  if (!gen.ok()) return gen.status();

  // Random prompts: the models are random, so no text is more typical than any other.
  const int vocab = drafter.vocab_size();
  std::vector<GenerationRequest> requests(o.num_prompts);
  for (int p = 0; p < o.num_prompts; ++p) {
    GenerationRequest& r = requests[p];
    for (int i = 0; i < o.prompt_tokens; ++i) {
      r.prompt.push_back(static_cast<int32_t>(SplitMix64(o.seed * 1000003u + p * 131u + i) %
                                              static_cast<uint64_t>(vocab)));
    }
    r.max_new_tokens = o.max_new_tokens;
    r.ignore_eos = true;
    r.draft = o.draft;
  }
  absl::StatusOr<std::vector<GenerationResult>> results = (*gen)->Generate(requests);
  if (!results.ok()) return results.status();
  SpecStats total;
  int64_t tokens = 0, distinct = 0;
  for (const GenerationResult& r : *results) {
    total.Add(r.stats);
    tokens += r.tokens.size();
    distinct += std::set<int32_t>(r.tokens.begin(), r.tokens.end()).size();
  }
  TauMeasurement m;
  m.steps = total.draft_steps;
  if (total.draft_steps > 0) {
    m.tau = static_cast<double>(total.accepted_tokens + total.draft_steps) / total.draft_steps;
  }
  if (total.draft_tokens > 0) {
    m.acceptance = static_cast<double>(total.accepted_tokens) / total.draft_tokens;
  }
  if (tokens > 0) m.distinct_fraction = static_cast<double>(distinct) / tokens;
  return m;
}

}  // namespace specd
