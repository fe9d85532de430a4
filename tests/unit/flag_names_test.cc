#include "common/flag_names.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace specd {
namespace {

std::vector<std::string> Rewrite(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  AcceptDashedFlagNames(static_cast<int>(argv.size()), argv.data());
  return {args.begin(), args.end()};
}

TEST(FlagNamesTest, DashesInNamesBecomeUnderscores) {
  EXPECT_EQ(Rewrite({"specd-verify", "--tensor-parallel=7", "--devices", "1,2", "--kv-capacity-tokens",
                     "4096"}),
            (std::vector<std::string>{"specd-verify", "--tensor_parallel=7", "--devices", "1,2",
                                      "--kv_capacity_tokens", "4096"}));
}

TEST(FlagNamesTest, ValuesPositionalsAndArgsAfterDoubleDashAreKept) {
  EXPECT_EQ(Rewrite({"x", "--model=/models/llama-3-8b", "-v", "file-name", "--", "--not-a-flag"}),
            (std::vector<std::string>{"x", "--model=/models/llama-3-8b", "-v", "file-name", "--",
                                      "--not-a-flag"}));
  EXPECT_EQ(Rewrite({"x", "--custom-allreduce-max-bytes=-1"}),
            (std::vector<std::string>{"x", "--custom_allreduce_max_bytes=-1"}));
}

}  // namespace
}  // namespace specd
