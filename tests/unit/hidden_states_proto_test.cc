// The EAGLE taps on the wire (common/service/hidden_states_proto.h): fp32 rows keep their bits,
// bf16 rounds to nearest even, malformed messages are INVALID_ARGUMENT naming the field, and the
// router's accumulation appends only what continues the rows it holds.
#include "common/service/hidden_states_proto.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specd {
namespace {

using ::testing::HasSubstr;

TEST(HiddenStatesProtoTest, Fp32KeepsTheBits) {
  const std::vector<float> rows = {1.0f, -0.0f, 3.14159274f, 1e-40f, -7.5e30f, 0.1f};
  v1::HiddenStates proto;
  HiddenStatesToProto(rows, 2, 3, {4, 9, 1}, 17, v1::TENSOR_DTYPE_FP32, &proto);
  EXPECT_EQ(proto.first_position(), 17);
  EXPECT_EQ(proto.tokens(), 2u);
  EXPECT_EQ(proto.width(), 3u);
  EXPECT_THAT(proto.layers(), ::testing::ElementsAre(4, 9, 1));
  std::vector<float> back;
  ASSERT_TRUE(HiddenStatesFromProto(proto, 3, "taps", &back).ok());
  ASSERT_EQ(back.size(), rows.size());
  EXPECT_EQ(std::memcmp(back.data(), rows.data(), rows.size() * sizeof(float)), 0);
}

TEST(HiddenStatesProtoTest, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 lies halfway between two bf16 values (1 and 1 + 2^-7): even wins, 1. 1 + 3 * 2^-8
  // is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
  const std::vector<float> rows = {1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8),
                                   -2.5f, 0.0f};
  v1::HiddenStates proto;
  HiddenStatesToProto(rows, 1, 4, {2}, 0, v1::TENSOR_DTYPE_BF16, &proto);
  EXPECT_EQ(proto.data().size(), 8u);
  std::vector<float> back;
  ASSERT_TRUE(HiddenStatesFromProto(proto, 0, "taps", &back).ok());
  EXPECT_THAT(back, ::testing::ElementsAre(1.0f, 1.0f + std::ldexp(1.0f, -6), -2.5f, 0.0f));
}

TEST(HiddenStatesProtoTest, MalformedMessagesNameTheField) {
  v1::HiddenStates proto;
  HiddenStatesToProto(std::vector<float>(6, 1.0f), 2, 3, {1}, 0, v1::TENSOR_DTYPE_FP32, &proto);
  std::vector<float> rows;
  absl::Status s = HiddenStatesFromProto(proto, 4, "steps[1].taps", &rows);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("steps[1].taps.width"));

  v1::HiddenStates short_data = proto;
  short_data.mutable_data()->pop_back();
  s = HiddenStatesFromProto(short_data, 3, "taps", &rows);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("taps.data"));

  v1::HiddenStates bad_dtype = proto;
  bad_dtype.set_dtype(static_cast<v1::TensorDtype>(7));
  s = HiddenStatesFromProto(bad_dtype, 3, "taps", &rows);
  EXPECT_THAT(s.message(), HasSubstr("taps.dtype"));

  v1::HiddenStates negative = proto;
  negative.set_first_position(-1);
  s = HiddenStatesFromProto(negative, 3, "taps", &rows);
  EXPECT_THAT(s.message(), HasSubstr("taps.first_position"));
}

TEST(HiddenStatesProtoTest, AppendKeepsOnlyContiguousRows) {
  auto chunk = [](int64_t first, int64_t tokens, float value) {
    v1::HiddenStates p;
    HiddenStatesToProto(std::vector<float>(tokens * 2, value), tokens, 2, {1, 3}, first,
                        v1::TENSOR_DTYPE_FP32, &p);
    return p;
  };
  v1::HiddenStates acc;
  AppendHiddenStates(chunk(0, 3, 1.0f), &acc);
  AppendHiddenStates(chunk(3, 2, 2.0f), &acc);  // continues: appended
  EXPECT_EQ(acc.first_position(), 0);
  EXPECT_EQ(acc.tokens(), 5u);
  std::vector<float> rows;
  ASSERT_TRUE(HiddenStatesFromProto(acc, 2, "acc", &rows).ok());
  EXPECT_EQ(rows[0], 1.0f);
  EXPECT_EQ(rows[9], 2.0f);
  AppendHiddenStates(chunk(9, 1, 3.0f), &acc);  // a gap: only the new rows can still be used
  EXPECT_EQ(acc.first_position(), 9);
  EXPECT_EQ(acc.tokens(), 1u);
  AppendHiddenStates(v1::HiddenStates(), &acc);  // nothing new: unchanged
  EXPECT_EQ(acc.tokens(), 1u);
}

}  // namespace
}  // namespace specd
