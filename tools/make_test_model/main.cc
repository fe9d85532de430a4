// specd-make-test-model: writes a random-weight target model and a draft model for it as
// Hugging Face folders (config.json, model.safetensors, tokenizer.json,
// generation_config.json), so the cluster can run where no trained model is at hand.
//
//   specd-make-test-model --target_dir /tmp/m/target --draft_dir /tmp/m/draft
//
// The draft is the target's first --draft_layers layers with the target's embedding, final
// norm and LM head (layer skipping, as in self-speculative decoding). The target's remaining
// layers have their output projections (o_proj, down_proj) scaled by --tail_scale, so they
// nudge the residual stream rather than rewrite it: the draft then agrees with the target
// often, but not always, which gives speculative decoding something real to accept and to
// reject at a fraction of the target's cost. The numbers mean nothing about trained models.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/io/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/random_checkpoint.h"

ABSL_FLAG(std::string, target_dir, "", "folder to write the target model to");
ABSL_FLAG(std::string, draft_dir, "", "folder to write the draft model to (optional)");
ABSL_FLAG(int, vocab_size, 320, "vocabulary: 256 byte tokens, <|eos|>, <|bos|>, specials");
ABSL_FLAG(int, hidden_size, 128, "hidden size");
ABSL_FLAG(int, intermediate_size, 344, "MLP width");
ABSL_FLAG(int, num_layers, 6, "target layers");
ABSL_FLAG(int, draft_layers, 1, "draft layers: the target's first ones");
ABSL_FLAG(double, tail_scale, 0.25,
          "scale of o_proj and down_proj in the target layers the draft skips");
ABSL_FLAG(int, num_heads, 4, "query heads");
ABSL_FLAG(int, num_kv_heads, 2, "key/value heads");
ABSL_FLAG(int, max_position_embeddings, 4096, "context length");
ABSL_FLAG(double, init_std, 0.08, "weight scale");
ABSL_FLAG(uint64_t, seed, 1, "random seed");

namespace specd {
namespace {

namespace fs = std::filesystem;

absl::Status CopyFile(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) return absl::InternalError(absl::StrCat(from.string(), ": ", ec.message()));
  return absl::OkStatus();
}

// Layer index of "model.layers.N.*", or -1.
int LayerOf(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (!absl::StartsWith(name, prefix)) return -1;
  const size_t dot = name.find('.', prefix.size());
  int layer = -1;
  if (!absl::SimpleAtoi(name.substr(prefix.size(), dot - prefix.size()), &layer)) return -1;
  return layer;
}

absl::Status Make() {
  const std::string target_dir = absl::GetFlag(FLAGS_target_dir);
  const std::string draft_dir = absl::GetFlag(FLAGS_draft_dir);
  const int layers = absl::GetFlag(FLAGS_num_layers);
  const int draft_layers = absl::GetFlag(FLAGS_draft_layers);
  if (target_dir.empty()) return absl::InvalidArgumentError("--target_dir: required");
  if (draft_layers < 1 || draft_layers > layers) {
    return absl::InvalidArgumentError("--draft_layers: must be in [1, --num_layers]");
  }
  RandomCheckpointSpec spec;
  spec.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  spec.hidden_size = absl::GetFlag(FLAGS_hidden_size);
  spec.intermediate_size = absl::GetFlag(FLAGS_intermediate_size);
  spec.num_layers = layers;
  spec.num_heads = absl::GetFlag(FLAGS_num_heads);
  spec.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  spec.max_position_embeddings = absl::GetFlag(FLAGS_max_position_embeddings);
  spec.seed = absl::GetFlag(FLAGS_seed);
  spec.init_std = static_cast<float>(absl::GetFlag(FLAGS_init_std));
  if (absl::Status s = WriteRandomCheckpoint(target_dir, spec); !s.ok()) return s;

  // Read the tensors back, scale the tail layers' output projections, and split.
  std::vector<TensorToWrite> target, draft;
  {
    absl::StatusOr<std::unique_ptr<TensorStore>> store = TensorStore::OpenFolder(target_dir);
    if (!store.ok()) return store.status();
    const float scale = static_cast<float>(absl::GetFlag(FLAGS_tail_scale));
    for (const std::string& name : (*store)->Names()) {
      absl::StatusOr<const TensorView*> view = (*store)->Get(name);
      if (!view.ok()) return view.status();
      TensorToWrite t;
      t.name = name;
      t.dtype = DType::kF32;
      t.shape = (*view)->shape;
      t.data.resize((*view)->numel() * sizeof(float));
      if (absl::Status s =
              (*store)->ReadF32(name, t.shape, reinterpret_cast<float*>(t.data.data()));
          !s.ok()) {
        return s;
      }
      const int layer = LayerOf(name);
      if (layer >= draft_layers &&
          (absl::EndsWith(name, "o_proj.weight") || absl::EndsWith(name, "down_proj.weight"))) {
        float* w = reinterpret_cast<float*>(t.data.data());
        for (int64_t i = 0; i < (*view)->numel(); ++i) w[i] *= scale;
      }
      if (layer < draft_layers) draft.push_back(t);
      target.push_back(std::move(t));
    }
  }
  if (absl::Status s = WriteSafetensors((fs::path(target_dir) / "model.safetensors").string(),
                                        target, {{"format", "pt"}});
      !s.ok()) {
    return s;
  }
  std::printf("target: %s (%d layers)\n", target_dir.c_str(), layers);
  if (draft_dir.empty()) return absl::OkStatus();

  std::error_code ec;
  fs::create_directories(draft_dir, ec);
  for (const char* file : {"tokenizer.json", "generation_config.json"}) {
    if (absl::Status s = CopyFile(fs::path(target_dir) / file, fs::path(draft_dir) / file);
        !s.ok()) {
      return s;
    }
  }
  std::ifstream in(fs::path(target_dir) / "config.json");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json config = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded()) return absl::InternalError("target config.json: not JSON");
  config["num_hidden_layers"] = draft_layers;
  std::ofstream out(fs::path(draft_dir) / "config.json");
  out << config.dump(2);
  if (!out) return absl::InternalError(absl::StrCat(draft_dir, "/config.json: write failed"));
  out.close();
  if (absl::Status s = WriteSafetensors((fs::path(draft_dir) / "model.safetensors").string(), draft,
                                        {{"format", "pt"}});
      !s.ok()) {
    return s;
  }
  std::printf("draft: %s (%d layers)\n", draft_dir.c_str(), draft_layers);
  return absl::OkStatus();
}

}  // namespace
}  // namespace specd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("specd-make-test-model --target_dir DIR [--draft_dir DIR]");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = specd::Make(); !s.ok()) {
    std::fprintf(stderr, "specd-make-test-model: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
