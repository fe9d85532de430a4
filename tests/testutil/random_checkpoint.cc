#include "tests/testutil/random_checkpoint.h"

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace specd {
namespace {

using nlohmann::json;

// GPT-2's reversible byte -> printable code point map used by byte-level BPE vocabularies.
std::string ByteToUnicode(int b) {
  int cp;
  if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) {
    cp = b;
  } else {
    int n = 0;
    for (int x = 0; x < b; ++x) {
      if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF))) ++n;
    }
    cp = 256 + n;
  }
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

class Writer {
 public:
  Writer(const RandomCheckpointSpec& spec) : spec_(spec), rng_(spec.seed) {}

  void Add(const std::string& name, std::vector<int64_t> shape, float mean, float std) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::normal_distribution<float> dist(mean, std);
    TensorToWrite t;
    t.name = name;
    t.dtype = spec_.dtype;
    t.shape = std::move(shape);
    t.data.resize(n * DTypeSize(spec_.dtype));
    for (int64_t i = 0; i < n; ++i) {
      const float v = dist(rng_);
      if (spec_.dtype == DType::kF32) {
        std::memcpy(t.data.data() + i * 4, &v, 4);
      } else {
        const uint16_t h = spec_.dtype == DType::kBF16 ? F32ToBF16(v) : F32ToF16(v);
        std::memcpy(t.data.data() + i * 2, &h, 2);
      }
    }
    tensors_.push_back(std::move(t));
  }

  std::vector<TensorToWrite>& tensors() { return tensors_; }

 private:
  const RandomCheckpointSpec& spec_;
  std::mt19937_64 rng_;
  std::vector<TensorToWrite> tensors_;
};

absl::Status WriteText(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) return absl::InternalError(absl::StrCat(path.string(), ": write failed"));
  return absl::OkStatus();
}

}  // namespace

RandomCheckpointSpec PycoderTargetShape() {
  RandomCheckpointSpec spec;
  spec.vocab_size = 8192;
  spec.hidden_size = 320;
  spec.intermediate_size = 864;
  spec.num_layers = 5;
  spec.num_heads = 5;
  spec.num_kv_heads = 1;
  spec.head_dim = 64;
  spec.tie_word_embeddings = true;
  return spec;
}

std::string MakeTempDir(const std::string& prefix) {
  const char* tmp = getenv("TMPDIR");
  std::string tmpl = absl::StrCat(tmp && *tmp ? tmp : "/tmp", "/", prefix, "XXXXXX");
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const char* made = mkdtemp(buf.data());
  return made ? std::string(made) : std::string();
}

absl::Status WriteRandomCheckpoint(const std::string& dir, const RandomCheckpointSpec& s) {
  namespace fs = std::filesystem;
  if (s.vocab_size < 257) return absl::InvalidArgumentError("vocab_size must be >= 257");
  std::error_code ec;
  fs::create_directories(dir, ec);
  const int hd = s.head_dim > 0 ? s.head_dim : s.hidden_size / s.num_heads;
  const int64_t h = s.hidden_size, q = int64_t{s.num_heads} * hd,
                kv = int64_t{s.num_kv_heads} * hd, f = s.intermediate_size;

  json config = {{"architectures", {s.model_type == "qwen2"   ? "Qwen2ForCausalLM"
                                    : s.model_type == "qwen3" ? "Qwen3ForCausalLM"
                                    : s.model_type == "mistral" ? "MistralForCausalLM"
                                                                : "LlamaForCausalLM"}},
                 {"model_type", s.model_type},
                 {"vocab_size", s.vocab_size},
                 {"hidden_size", s.hidden_size},
                 {"intermediate_size", s.intermediate_size},
                 {"num_hidden_layers", s.num_layers},
                 {"num_attention_heads", s.num_heads},
                 {"num_key_value_heads", s.num_kv_heads},
                 {"head_dim", hd},
                 {"hidden_act", "silu"},
                 {"rms_norm_eps", 1e-5},
                 {"rope_theta", s.rope_theta},
                 {"max_position_embeddings", s.max_position_embeddings},
                 {"tie_word_embeddings", s.tie_word_embeddings},
                 {"bos_token_id", 257},
                 {"eos_token_id", 256},
                 {"torch_dtype", s.dtype == DType::kF32    ? "float32"
                                 : s.dtype == DType::kBF16 ? "bfloat16"
                                                           : "float16"}};
  if (s.model_type == "llama" || s.model_type == "mistral") config["attention_bias"] = false;
  if (s.llama3_rope_scaling) {
    config["rope_scaling"] = {{"rope_type", "llama3"},
                              {"factor", 8.0},
                              {"low_freq_factor", 1.0},
                              {"high_freq_factor", 4.0},
                              {"original_max_position_embeddings", 256}};
  }
  if (absl::Status st = WriteText(fs::path(dir) / "config.json", config.dump(2)); !st.ok()) {
    return st;
  }
  json gen = {{"bos_token_id", 257}, {"eos_token_id", {256}}, {"do_sample", false}};
  if (absl::Status st = WriteText(fs::path(dir) / "generation_config.json", gen.dump(2));
      !st.ok()) {
    return st;
  }

  // Tokenizer: byte-level BPE, 256 byte tokens, then <|eos|> (256), <|bos|> (257) and unused
  // specials up to vocab_size.
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteToUnicode(b)] = b;
  json added = json::array();
  for (int id = 256; id < s.vocab_size; ++id) {
    const std::string content = id == 256   ? "<|eos|>"
                                : id == 257 ? "<|bos|>"
                                            : absl::StrCat("<|special_", id, "|>");
    vocab[content] = id;
    added.push_back({{"id", id},
                     {"content", content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  json tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
        {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder",
       {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true},
        {"use_regex", true}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
        {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", json::array()}}}};
  if (absl::Status st = WriteText(fs::path(dir) / "tokenizer.json", tokenizer.dump(2));
      !st.ok()) {
    return st;
  }

  Writer w(s);
  w.Add("model.embed_tokens.weight", {s.vocab_size, h}, 0.0f, 1.0f);
  for (int l = 0; l < s.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    w.Add(p + "input_layernorm.weight", {h}, 1.0f, 0.1f);
    w.Add(p + "self_attn.q_proj.weight", {q, h}, 0.0f, s.init_std);
    w.Add(p + "self_attn.k_proj.weight", {kv, h}, 0.0f, s.init_std);
    w.Add(p + "self_attn.v_proj.weight", {kv, h}, 0.0f, s.init_std);
    if (s.model_type == "qwen2") {
      w.Add(p + "self_attn.q_proj.bias", {q}, 0.0f, s.init_std);
      w.Add(p + "self_attn.k_proj.bias", {kv}, 0.0f, s.init_std);
      w.Add(p + "self_attn.v_proj.bias", {kv}, 0.0f, s.init_std);
    }
    if (s.model_type == "qwen3") {
      w.Add(p + "self_attn.q_norm.weight", {hd}, 1.0f, 0.1f);
      w.Add(p + "self_attn.k_norm.weight", {hd}, 1.0f, 0.1f);
    }
    w.Add(p + "self_attn.o_proj.weight", {h, q}, 0.0f, s.init_std);
    w.Add(p + "post_attention_layernorm.weight", {h}, 1.0f, 0.1f);
    w.Add(p + "mlp.gate_proj.weight", {f, h}, 0.0f, s.init_std);
    w.Add(p + "mlp.up_proj.weight", {f, h}, 0.0f, s.init_std);
    w.Add(p + "mlp.down_proj.weight", {h, f}, 0.0f, s.init_std);
  }
  w.Add("model.norm.weight", {h}, 1.0f, 0.1f);
  if (!s.tie_word_embeddings) w.Add("lm_head.weight", {s.vocab_size, h}, 0.0f, s.init_std);

  std::vector<TensorToWrite>& all = w.tensors();
  if (s.shards <= 1) {
    return WriteSafetensors((fs::path(dir) / "model.safetensors").string(), all,
                            {{"format", "pt"}});
  }
  json weight_map = json::object();
  const size_t per = (all.size() + s.shards - 1) / s.shards;
  for (int k = 0; k < s.shards; ++k) {
    const std::string name = absl::StrFormat("model-%05d-of-%05d.safetensors", k + 1, s.shards);
    std::vector<TensorToWrite> part;
    for (size_t i = k * per; i < std::min(all.size(), (k + 1) * per); ++i) {
      weight_map[all[i].name] = name;
      part.push_back(std::move(all[i]));
    }
    if (absl::Status st = WriteSafetensors((fs::path(dir) / name).string(), part,
                                           {{"format", "pt"}});
        !st.ok()) {
      return st;
    }
  }
  json index = {{"metadata", json::object()}, {"weight_map", weight_map}};
  return WriteText(fs::path(dir) / "model.safetensors.index.json", index.dump(2));
}

}  // namespace specd
