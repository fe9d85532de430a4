// libFuzzer: config.json and generation_config.json text (the input split at its first NUL)
// through ParseModelConfig and ApplyGenerationConfig; an accepted config must satisfy what the
// engine relies on (positive sizes, a context in range, end-of-sequence ids in the vocabulary).
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string config = input.substr(0, nul);
  auto c = specd::ParseModelConfig(config, "config.json");
  if (!c.ok()) return 0;
  if (nul != std::string::npos) {
    if (!specd::ApplyGenerationConfig(input.substr(nul + 1), "generation_config.json", &*c).ok()) {
      return 0;
    }
  }
  if (c->vocab_size <= 0 || c->hidden_size <= 0 || c->num_layers <= 0 || c->head_dim <= 0 ||
      c->max_position_embeddings <= 0 ||
      c->max_position_embeddings > specd::kMaxPositionEmbeddings) {
    __builtin_trap();
  }
  for (int32_t id : c->eos_token_ids) {
    if (id < 0 || id >= c->vocab_size) __builtin_trap();
  }
  static volatile int64_t sink;
  sink = c->ParameterCount();
  if (c->head_dim <= 4096) sink = static_cast<int64_t>(specd::RopeInvFreq(*c).size());
  return 0;
}
