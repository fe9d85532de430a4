// ParseCudaTuning: every SPECD_* switch of the CUDA backend read the way the backend always read
// it (docs/tuning.md), from a lookup table instead of the process environment.
#include "engine/cuda/cuda_tuning.h"

#include <map>
#include <string>

#include "gtest/gtest.h"
#include "specd/kernels/cuda/launch_tuning.h"

namespace specd {
namespace {

CudaTuning Parse(const std::map<std::string, std::string>& env) {
  return ParseCudaTuning([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(CudaTuningTest, DefaultsWhenNothingIsSet) {
  const CudaTuning t = Parse({});
  const CudaTuning d;
  EXPECT_TRUE(t.cuda_graphs);
  EXPECT_TRUE(t.l2_discard);
  EXPECT_EQ(t.l2_discard_min_tokens, 16);
  EXPECT_EQ(t.residual_splits, 2);
  EXPECT_TRUE(t.gemm_bucket_classes);
  EXPECT_TRUE(t.gemm_timed_picks);
  EXPECT_TRUE(t.gemm_retile);
  EXPECT_FALSE(t.gemm_summary);
  EXPECT_TRUE(t.shared_spine);
  EXPECT_EQ(t.attn_chunks_per_cta, 0);
  EXPECT_TRUE(t.launch.pdl);
  EXPECT_EQ(t.launch.pdl_off_sites, 0u);
  EXPECT_EQ(t.launch.smem_carveout, 100);
  EXPECT_EQ(t.l2_discard_min_tokens, d.l2_discard_min_tokens);
  EXPECT_EQ(t.residual_splits, d.residual_splits);
}

TEST(CudaTuningTest, SwitchesTurnOffOnlyAtTheirExactValue) {
  const CudaTuning off = Parse({{"SPECD_CUDA_GRAPHS", "0"},
                                {"SPECD_L2_DISCARD", "0"},
                                {"SPECD_GEMM_CLASSES", "pow2"},
                                {"SPECD_GEMM_TIMING", "0"},
                                {"SPECD_GEMM_RETILE", "0"},
                                {"SPECD_GEMM_SUMMARY", "1"},
                                {"SPECD_SHARED_SPINE", "0"},
                                {"SPECD_PDL", "0"}});
  EXPECT_FALSE(off.cuda_graphs);
  EXPECT_FALSE(off.l2_discard);
  EXPECT_FALSE(off.gemm_bucket_classes);
  EXPECT_FALSE(off.gemm_timed_picks);
  EXPECT_FALSE(off.gemm_retile);
  EXPECT_TRUE(off.gemm_summary);
  EXPECT_FALSE(off.shared_spine);
  EXPECT_FALSE(off.launch.pdl);
  EXPECT_FALSE(off.launch.PdlAt("rope"));

  const CudaTuning other = Parse({{"SPECD_CUDA_GRAPHS", "no"},
                                  {"SPECD_L2_DISCARD", "false"},
                                  {"SPECD_GEMM_CLASSES", "0"},
                                  {"SPECD_GEMM_TIMING", "00"},
                                  {"SPECD_GEMM_SUMMARY", "yes"},
                                  {"SPECD_PDL", "off"}});
  EXPECT_TRUE(other.cuda_graphs);
  EXPECT_TRUE(other.l2_discard);
  EXPECT_TRUE(other.gemm_bucket_classes);
  EXPECT_TRUE(other.gemm_timed_picks);
  EXPECT_FALSE(other.gemm_summary);
  EXPECT_TRUE(other.launch.pdl);
}

TEST(CudaTuningTest, NumbersAreClampedToTheirRange) {
  EXPECT_EQ(Parse({{"SPECD_L2_DISCARD_MIN_TOKENS", "1"}}).l2_discard_min_tokens, 1);
  EXPECT_EQ(Parse({{"SPECD_L2_DISCARD_MIN_TOKENS", "0"}}).l2_discard_min_tokens, 1);
  EXPECT_EQ(Parse({{"SPECD_L2_DISCARD_MIN_TOKENS", "65"}}).l2_discard_min_tokens, 65);
  EXPECT_EQ(Parse({{"SPECD_RESIDUAL_SPLITS", "1"}}).residual_splits, 1);
  EXPECT_EQ(Parse({{"SPECD_RESIDUAL_SPLITS", "4"}}).residual_splits, 4);
  EXPECT_EQ(Parse({{"SPECD_RESIDUAL_SPLITS", "99"}}).residual_splits, 8);
  EXPECT_EQ(Parse({{"SPECD_RESIDUAL_SPLITS", "-3"}}).residual_splits, 1);
  EXPECT_EQ(Parse({{"SPECD_ATTN_CHUNKS_PER_CTA", "3"}}).attn_chunks_per_cta, 3);
  EXPECT_EQ(Parse({{"SPECD_ATTN_CHUNKS_PER_CTA", "-2"}}).attn_chunks_per_cta, 0);
  EXPECT_EQ(Parse({{"SPECD_SMEM_CARVEOUT", "0"}}).launch.smem_carveout, 0);
  EXPECT_EQ(Parse({{"SPECD_SMEM_CARVEOUT", "50"}}).launch.smem_carveout, 50);
  EXPECT_EQ(Parse({{"SPECD_SMEM_CARVEOUT", "101"}}).launch.smem_carveout, -1);
  EXPECT_EQ(Parse({{"SPECD_SMEM_CARVEOUT", "-1"}}).launch.smem_carveout, -1);
}

TEST(CudaTuningTest, PdlOffListsWholeSiteNames) {
  const CudaTuning t = Parse({{"SPECD_PDL_OFF", "attention,combine,bogus,rms"}});
  EXPECT_TRUE(t.launch.pdl);
  EXPECT_FALSE(t.launch.PdlAt("attention"));
  EXPECT_FALSE(t.launch.PdlAt("combine"));
  EXPECT_TRUE(t.launch.PdlAt("rmsnorm"));  // "rms" is not a whole entry
  EXPECT_TRUE(t.launch.PdlAt("rope"));
  EXPECT_TRUE(t.launch.PdlAt("allreduce"));
  EXPECT_EQ(t.launch.pdl_off_sites, (1u << cuda::LaunchSiteIndex("attention")) |
                                        (1u << cuda::LaunchSiteIndex("combine")));
  const CudaTuning one = Parse({{"SPECD_PDL_OFF", "allreduce"}});
  EXPECT_FALSE(one.launch.PdlAt("allreduce"));
  EXPECT_TRUE(one.launch.PdlAt("embedding"));
  EXPECT_EQ(Parse({{"SPECD_PDL_OFF", ""}}).launch.pdl_off_sites, 0u);
  EXPECT_EQ(Parse({{"SPECD_PDL_OFF", ",,rope,"}}).launch.pdl_off_sites,
            1u << cuda::LaunchSiteIndex("rope"));
}

TEST(CudaTuningTest, LaunchTuningIsProcessWide) {
  const cuda::LaunchTuning saved = cuda::GetLaunchTuning();
  cuda::LaunchTuning t;
  t.pdl = true;
  t.pdl_off_sites = 1u << cuda::LaunchSiteIndex("swiglu");
  t.smem_carveout = 25;
  cuda::SetLaunchTuning(t);
  const cuda::LaunchTuning got = cuda::GetLaunchTuning();
  EXPECT_FALSE(got.PdlAt("swiglu"));
  EXPECT_TRUE(got.PdlAt("rmsnorm"));
  EXPECT_EQ(got.smem_carveout, 25);
  cuda::SetLaunchTuning(saved);
}

TEST(CudaTuningTest, VariablesListedAreTheOnesParsed) {
  // Each listed variable, set to a value other than its default, changes the parse; so the
  // list (which docs/tuning.md documents) names no variable the parser ignores.
  const std::map<std::string, std::string> odd = {
      {"SPECD_CUDA_GRAPHS", "0"},         {"SPECD_L2_DISCARD", "0"},
      {"SPECD_L2_DISCARD_MIN_TOKENS", "3"}, {"SPECD_RESIDUAL_SPLITS", "3"},
      {"SPECD_GEMM_CLASSES", "pow2"},     {"SPECD_GEMM_TIMING", "0"},
      {"SPECD_GEMM_RETILE", "0"},         {"SPECD_GEMM_SUMMARY", "1"},
      {"SPECD_SHARED_SPINE", "0"},        {"SPECD_ATTN_CHUNKS_PER_CTA", "2"},
      {"SPECD_PDL", "0"},                 {"SPECD_PDL_OFF", "rope"},
      {"SPECD_SMEM_CARVEOUT", "7"}};
  ASSERT_EQ(CudaTuningVariables().size(), odd.size());
  auto same = [](const CudaTuning& a, const CudaTuning& b) {
    return a.cuda_graphs == b.cuda_graphs && a.l2_discard == b.l2_discard &&
           a.l2_discard_min_tokens == b.l2_discard_min_tokens &&
           a.residual_splits == b.residual_splits &&
           a.gemm_bucket_classes == b.gemm_bucket_classes &&
           a.gemm_timed_picks == b.gemm_timed_picks && a.gemm_retile == b.gemm_retile &&
           a.gemm_summary == b.gemm_summary && a.shared_spine == b.shared_spine &&
           a.attn_chunks_per_cta == b.attn_chunks_per_cta && a.launch.pdl == b.launch.pdl &&
           a.launch.pdl_off_sites == b.launch.pdl_off_sites &&
           a.launch.smem_carveout == b.launch.smem_carveout;
  };
  const CudaTuning defaults = Parse({});
  for (const std::string& name : CudaTuningVariables()) {
    auto it = odd.find(name);
    ASSERT_NE(it, odd.end()) << name;
    EXPECT_FALSE(same(Parse({*it}), defaults)) << name << " is listed but not parsed";
  }
}

}  // namespace
}  // namespace specd
