#include "engine/tp/rank_workers.h"

#include <algorithm>
#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specd {
namespace {

using ::testing::HasSubstr;

TEST(RankWorkersTest, EveryRankRunsOnItsOwnLongLivedThread) {
  RankWorkers workers(4);
  ASSERT_EQ(workers.size(), 4);
  std::vector<std::thread::id> first(4), second(4);
  ASSERT_TRUE(workers.Run([&](int r) {
                first[r] = std::this_thread::get_id();
                return absl::OkStatus();
              }).ok());
  ASSERT_TRUE(workers.Run([&](int r) {
                second[r] = std::this_thread::get_id();
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(first, second);  // a rank keeps its thread (and so its bound GPU)
  EXPECT_EQ(std::set<std::thread::id>(first.begin(), first.end()).size(), 4u);
  EXPECT_EQ(std::count(first.begin(), first.end(), std::this_thread::get_id()), 0);
}

TEST(RankWorkersTest, RanksRunConcurrently) {
  // A barrier every rank must reach: it completes only if all four run at once, as ranks
  // meeting in a collective do.
  RankWorkers workers(4);
  std::atomic<int> arrived{0};
  ASSERT_TRUE(workers.Run([&](int) {
                arrived.fetch_add(1);
                while (arrived.load() < 4) std::this_thread::yield();
                return absl::OkStatus();
              }).ok());
}

TEST(RankWorkersTest, TheLowestFailingRankIsReportedAndTheWorkersStayUsable) {
  RankWorkers workers(3);
  absl::Status s = workers.Run([](int r) {
    return r == 0 ? absl::OkStatus() : absl::InternalError(absl::StrCat("boom ", r));
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("rank 1: boom 1"));
  EXPECT_TRUE(workers.Run([](int) { return absl::OkStatus(); }).ok());
}

}  // namespace
}  // namespace specd
