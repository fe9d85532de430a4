// engine/cuda/tree_mask.h: whichever spine end a token's mask is encoded from, it selects exactly the
// token's keys (the committed prefix, then its ancestors, ascending); one shared spine end gives
// a breadth-first draft tree's masked tokens one mask_begin, where their own ends alternate.
#include "engine/cuda/tree_mask.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace specd {
namespace {

constexpr int kMaskBits = 256;  // the CUDA kernel's (kTreeAttentionMaskBits)
constexpr int kWords = kMaskBits / 32;

// A sequence's scratch tree: a pending chain, then a tree below its last token.
struct Scratch {
  std::vector<int32_t> parents, depth;
  void Add(int32_t parent) {
    parents.push_back(parent);
    depth.push_back(parent < 0 ? 0 : depth[parent] + 1);
  }
};

// The keys the encoding selects: [0, committed + a + 1), then committed + a + 1 + bit.
std::vector<int64_t> Decode(int64_t committed, int32_t a, const std::vector<uint32_t>& words) {
  std::vector<int64_t> keys;
  for (int64_t k = 0; k < committed + a + 1; ++k) keys.push_back(k);
  for (int bit = 0; bit < kMaskBits; ++bit) {
    if (words[bit / 32] >> (bit % 32) & 1u) keys.push_back(committed + a + 1 + bit);
  }
  return keys;
}

// The token's keys by definition: the committed prefix and its ancestors, itself included.
std::vector<int64_t> Expected(int64_t committed, const Scratch& s, int32_t index) {
  std::set<int64_t> keys;
  for (int64_t k = 0; k < committed; ++k) keys.insert(k);
  for (int32_t x = index; x >= 0; x = s.parents[x]) keys.insert(committed + x);
  return {keys.begin(), keys.end()};
}

// Encodes every token of the step (scratch nodes first .. end) both ways, checks the keys, and
// returns the distinct mask_begin offsets (a + 1) of the masked tokens with the shared end.
std::set<int32_t> CheckStep(const Scratch& s, int32_t first, int64_t committed,
                            int* own_distinct) {
  const int32_t end = static_cast<int32_t>(s.parents.size());
  std::vector<int32_t> own;
  for (int32_t i = first; i < end; ++i) own.push_back(SpineEnd(s.parents, s.depth, i));
  const std::optional<int32_t> shared = SharedSpineEnd(own, first);
  std::set<int32_t> shared_begins, own_begins;
  for (int32_t i = first; i < end; ++i) {
    const int32_t mine = own[i - first];
    if (i - mine > kMaskBits) continue;  // the engine refuses such a step
    for (bool use_shared : {false, true}) {
      const int32_t a = use_shared ? MaskSpineEnd(i, mine, shared, kMaskBits) : mine;
      EXPECT_LE(a, mine);
      EXPECT_LE(i - a, kMaskBits);
      std::vector<uint32_t> words(kWords, 0u);
      SetTreeMaskBits(s.parents, i, a, absl::MakeSpan(words));
      EXPECT_EQ(Decode(committed, a, words), Expected(committed, s, i))
          << "token " << i << (use_shared ? " (shared spine end " : " (own spine end ") << a
          << ")";
      if (i > mine) (use_shared ? shared_begins : own_begins).insert(a + 1);
    }
  }
  *own_distinct = static_cast<int>(own_begins.size());
  return shared_begins;
}

TEST(TreeMask, FourAryDraftTreeSharesOneMaskBegin) {
  for (int pending : {1, 2, 3}) {
    for (int nodes : {16, 64, 255}) {
      Scratch s;
      for (int i = 0; i < pending; ++i) s.Add(i - 1);
      // cuda_step_bench's draft tree: four roots below the last pending token, breadth first.
      for (int j = 0; j < nodes; ++j) s.Add(j < 4 ? pending - 1 : pending + j / 4 - 1);
      int own_distinct = 0;
      const std::set<int32_t> begins = CheckStep(s, 0, 2048, &own_distinct);
      EXPECT_EQ(begins.size(), 1u) << pending << " pending, " << nodes << " nodes";
      // The first root continues the spine, so the tokens' own ends alternate between two.
      EXPECT_EQ(own_distinct, 2) << pending << " pending, " << nodes << " nodes";
    }
  }
}

TEST(TreeMask, RandomTreesKeepTheirKeysEitherWay) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    Scratch s;
    // Scratch nodes left by earlier steps (a drafter's tree grown step by step), then this step's.
    const int earlier = static_cast<int>(rng() % 4);
    const int pending = 1 + static_cast<int>(rng() % 3);
    const int nodes = 1 + static_cast<int>(rng() % 300);
    for (int i = 0; i < earlier + pending; ++i) s.Add(i - 1);
    for (int j = 0; j < nodes; ++j) {
      const int32_t size = static_cast<int32_t>(s.parents.size());
      // Mostly below recent nodes (deep trees), sometimes a chain continuing the spine.
      const int32_t parent = rng() % 4 == 0 ? size - 1 : size - 1 - static_cast<int32_t>(rng() % std::min(size, 40));
      s.Add(parent);
    }
    int own_distinct = 0;
    const std::set<int32_t> begins = CheckStep(s, earlier, 100 + trial, &own_distinct);
    EXPECT_LE(begins.size(), std::max<size_t>(1, static_cast<size_t>(own_distinct)));
  }
}

TEST(TreeMask, ChainsNeedNoMask) {
  Scratch s;
  for (int i = 0; i < 300; ++i) s.Add(i - 1);
  std::vector<int32_t> own;
  for (int32_t i = 0; i < 300; ++i) {
    own.push_back(SpineEnd(s.parents, s.depth, i));
    EXPECT_EQ(own.back(), i);  // every prefill token is its own spine end: no mask bits
  }
  EXPECT_FALSE(SharedSpineEnd(own, 0).has_value());
  EXPECT_EQ(MaskSpineEnd(7, 7, std::nullopt, kMaskBits), 7);
}

TEST(TreeMask, SharedEndOutOfReachKeepsTheOwn) {
  // A token 300 nodes past the shared end cannot encode from it with 256 bits.
  EXPECT_EQ(MaskSpineEnd(400, 200, 0, kMaskBits), 200);
  EXPECT_EQ(MaskSpineEnd(250, 200, 0, kMaskBits), 0);
  // A spine token (index == own end) is unmasked and stays so.
  EXPECT_EQ(MaskSpineEnd(5, 5, 0, kMaskBits), 5);
}

}  // namespace
}  // namespace specd
