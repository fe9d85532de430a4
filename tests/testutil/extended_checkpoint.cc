#include "tests/testutil/extended_checkpoint.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/io/safetensors.h"
#include "nlohmann/json.hpp"

namespace specd {
namespace {

absl::StatusOr<std::string> ReadText(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status WriteText(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) return absl::InternalError(absl::StrCat(path.string(), ": write failed"));
  return absl::OkStatus();
}

TensorToWrite F32Tensor(const std::string& name, const std::vector<int64_t>& shape,
                        const std::vector<float>& values) {
  TensorToWrite t;
  t.name = name;
  t.dtype = DType::kF32;
  t.shape = shape;
  t.data.resize(values.size() * sizeof(float));
  std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}

}  // namespace

absl::Status WriteExtendedCheckpoint(const std::string& src_dir, const std::string& dst_dir,
                                     const ExtendSpec& spec) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dst_dir, ec);
  absl::StatusOr<std::string> config_text = ReadText(fs::path(src_dir) / "config.json");
  if (!config_text.ok()) return config_text.status();
  nlohmann::json config = nlohmann::json::parse(*config_text, nullptr, false);
  if (config.is_discarded() || !config.contains("num_hidden_layers")) {
    return absl::InvalidArgumentError(absl::StrCat(src_dir, "/config.json: unreadable"));
  }
  const int layers = config["num_hidden_layers"].get<int>();
  config["num_hidden_layers"] = layers + spec.extra_layers;
  if (absl::Status s = WriteText(fs::path(dst_dir) / "config.json", config.dump(2)); !s.ok()) {
    return s;
  }
  for (const char* name : {"generation_config.json", "tokenizer.json"}) {
    fs::copy_file(fs::path(src_dir) / name, fs::path(dst_dir) / name,
                  fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::InternalError(absl::StrCat("copy ", name, ": ", ec.message()));
  }

  absl::StatusOr<std::unique_ptr<TensorStore>> store = TensorStore::OpenFolder(src_dir);
  if (!store.ok()) return store.status();
  std::vector<TensorToWrite> out;
  for (const std::string& name : (*store)->Names()) {
    absl::StatusOr<const TensorView*> view = (*store)->Get(name);
    if (!view.ok()) return view.status();
    std::vector<float> values((*view)->numel());
    if (absl::Status s = (*store)->ReadF32(name, (*view)->shape, values.data()); !s.ok()) {
      return s;
    }
    out.push_back(F32Tensor(name, (*view)->shape, values));
    // Layer 0's tensors are the template of every appended layer.
    const std::string prefix = "model.layers.0.";
    if (!absl::StartsWith(name, prefix)) continue;
    const std::string suffix = name.substr(prefix.size());
    for (int l = layers; l < layers + spec.extra_layers; ++l) {
      uint64_t key = spec.seed * 1000003u + l * 7919u;
      for (char ch : suffix) key = (key ^ static_cast<uint8_t>(ch)) * 1099511628211u;  // FNV-1a
      std::mt19937_64 rng(key);
      const bool norm = absl::EndsWith(suffix, "norm.weight");
      const bool output =
          absl::StrContains(suffix, "o_proj") || absl::StrContains(suffix, "down_proj");
      std::normal_distribution<float> dist(
          norm ? 1.0f : 0.0f,
          norm ? 0.1f : spec.init_std * (output ? spec.output_scale : 1.0f));
      for (float& v : values) v = dist(rng);
      out.push_back(F32Tensor(absl::StrCat("model.layers.", l, ".", suffix), (*view)->shape,
                              values));
    }
  }
  return WriteSafetensors((fs::path(dst_dir) / "model.safetensors").string(), out,
                          {{"format", "pt"}});
}

}  // namespace specd
