#include "engine/cuda/cuda_tuning.h"

#include <algorithm>
#include <cstdlib>
#include <string_view>

namespace specd {
namespace {

// Whether `name` is set to exactly `value`.
bool Is(absl::FunctionRef<const char*(const char*)> lookup, const char* name, const char* value) {
  const char* v = lookup(name);
  return v != nullptr && std::string_view(v) == value;
}

}  // namespace

const std::vector<std::string>& CudaTuningVariables() {
  static const std::vector<std::string>* const names = new std::vector<std::string>{
      "SPECD_CUDA_GRAPHS",         "SPECD_L2_DISCARD",   "SPECD_L2_DISCARD_MIN_TOKENS",
      "SPECD_RESIDUAL_SPLITS",     "SPECD_GEMM_CLASSES", "SPECD_GEMM_TIMING",
      "SPECD_GEMM_RETILE",         "SPECD_GEMM_SUMMARY", "SPECD_SHARED_SPINE",
      "SPECD_ATTN_CHUNKS_PER_CTA", "SPECD_PDL",          "SPECD_PDL_OFF",
      "SPECD_SMEM_CARVEOUT"};
  return *names;
}

CudaTuning ParseCudaTuning(absl::FunctionRef<const char*(const char*)> lookup) {
  CudaTuning t;
  t.cuda_graphs = !Is(lookup, "SPECD_CUDA_GRAPHS", "0");
  t.l2_discard = !Is(lookup, "SPECD_L2_DISCARD", "0");
  if (const char* v = lookup("SPECD_L2_DISCARD_MIN_TOKENS")) {
    t.l2_discard_min_tokens = std::max(1, std::atoi(v));
  }
  if (const char* v = lookup("SPECD_RESIDUAL_SPLITS")) {
    t.residual_splits = std::clamp(std::atoi(v), 1, 8);
  }
  t.gemm_bucket_classes = !Is(lookup, "SPECD_GEMM_CLASSES", "pow2");
  t.gemm_timed_picks = !Is(lookup, "SPECD_GEMM_TIMING", "0");
  t.gemm_retile = !Is(lookup, "SPECD_GEMM_RETILE", "0");
  t.gemm_summary = Is(lookup, "SPECD_GEMM_SUMMARY", "1");
  t.shared_spine = !Is(lookup, "SPECD_SHARED_SPINE", "0");
  if (const char* v = lookup("SPECD_ATTN_CHUNKS_PER_CTA")) {
    t.attn_chunks_per_cta = std::max(0, std::atoi(v));
  }
  t.launch.pdl = !Is(lookup, "SPECD_PDL", "0");
  if (const char* v = lookup("SPECD_PDL_OFF")) {
    std::string_view list(v);
    while (!list.empty()) {
      const size_t comma = list.find(',');
      const int site = cuda::LaunchSiteIndex(list.substr(0, comma));
      if (site >= 0) t.launch.pdl_off_sites |= 1u << site;
      if (comma == std::string_view::npos) break;
      list.remove_prefix(comma + 1);
    }
  }
  if (const char* v = lookup("SPECD_SMEM_CARVEOUT")) {
    const int p = std::atoi(v);
    t.launch.smem_carveout = p >= 0 && p <= 100 ? p : -1;
  }
  return t;
}

CudaTuning CudaTuningFromEnvironment() {
  // The one place the CUDA backend's switches are read from the environment.
  return ParseCudaTuning([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace specd
