// SequenceTable: ids scoped by stream, deadlines, tombstones.
#include "common/service/sequence_table.h"

#include <algorithm>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specd {
namespace {

using ::testing::HasSubstr;

std::vector<int64_t> Sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

TEST(SequenceTable, SameWireIdOnTwoStreamsIsTwoSequences) {
  SequenceTable t;
  const int64_t a = t.Add(1, 7);
  const int64_t b = t.Add(2, 7);
  EXPECT_NE(a, b);
  EXPECT_EQ(t.Find(1, 7), a);
  EXPECT_EQ(t.Find(2, 7), b);
  EXPECT_EQ(t.Find(3, 7), std::nullopt);
  EXPECT_EQ(t.size(), 2);
  EXPECT_EQ(t.Remove(1, 7), a);
  EXPECT_EQ(t.Remove(1, 7), std::nullopt);
  EXPECT_EQ(t.Find(2, 7), b);
  // Model-side ids are never reused.
  EXPECT_NE(t.Add(1, 7), a);
}

TEST(SequenceTable, RemoveStreamTakesOnlyThatStream) {
  SequenceTable t;
  const int64_t a = t.Add(1, 1);
  const int64_t b = t.Add(1, 2);
  const int64_t c = t.Add(2, 1);
  EXPECT_EQ(Sorted(t.RemoveStream(1)), (std::vector<int64_t>{a, b}));
  EXPECT_EQ(t.size(), 1);
  EXPECT_EQ(t.Find(2, 1), c);
  EXPECT_EQ(Sorted(t.RemoveAll()), (std::vector<int64_t>{c}));
  EXPECT_EQ(t.size(), 0);
}

TEST(SequenceTable, ExpiredSequencesAreRemovedAndTombstoned) {
  SequenceTable t;
  const int64_t a = t.Add(1, 1);
  const int64_t b = t.Add(1, 2);
  t.Add(1, 3);  // no deadline
  t.SetDeadline(1, 1, 1000);
  t.SetDeadline(1, 2, 3000);
  EXPECT_EQ(Sorted(t.RemoveExpired(999)), (std::vector<int64_t>{}));
  EXPECT_EQ(Sorted(t.RemoveExpired(2000)), (std::vector<int64_t>{a}));
  EXPECT_EQ(t.size(), 2);
  const absl::Status s = t.Tombstone(1, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("deadline"));
  EXPECT_TRUE(t.Tombstone(1, 2).ok());
  EXPECT_TRUE(t.Tombstone(2, 1).ok());
  // A release (Remove) clears the tombstone, and so does a new Add.
  t.Remove(1, 1);
  EXPECT_TRUE(t.Tombstone(1, 1).ok());
  t.SetTombstone(1, 9, absl::StatusCode::kInternal);
  EXPECT_EQ(t.Tombstone(1, 9).code(), absl::StatusCode::kInternal);
  t.Add(1, 9);
  EXPECT_TRUE(t.Tombstone(1, 9).ok());
  EXPECT_EQ(Sorted(t.RemoveExpired(4000)), (std::vector<int64_t>{b}));
  t.RemoveStream(1);
  EXPECT_TRUE(t.Tombstone(1, 2).ok());
}

}  // namespace
}  // namespace specd
