// specd-make-synthetic-pair's library (tools/make_test_model/synthetic_pair.h): a small pair
// writes, loads in the CPU engine, its draft is the target's first layers bit for bit, sharding
// changes no byte, epsilon = 0 makes every draft token acceptable and a larger epsilon lowers
// tau, and bad options are INVALID_ARGUMENT naming the field.
#include "tools/make_test_model/synthetic_pair.h"

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include "common/io/safetensors.h"
#include "engine/backend.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// Small enough to write and decode in well under a second, with the reference's tokenizer
// (ctest runs in the source root, where models/pycoder-target lives).
SyntheticPairOptions Small(double epsilon) {
  SyntheticPairOptions o;
  o.shape.name = "test";
  o.shape.vocab_size = 512;
  o.shape.hidden_size = 64;
  o.shape.intermediate_size = 128;
  o.shape.num_layers = 4;
  o.shape.num_heads = 4;
  o.shape.num_kv_heads = 2;
  o.shape.head_dim = 16;
  o.shape.max_position_embeddings = 1024;
  o.draft_layers = 1;
  o.epsilon = epsilon;
  o.seed = 3;
  o.tokenizer_dir = "models/pycoder-target";
  o.num_threads = 2;
  return o;
}

class SyntheticPairTest : public ::testing::Test {
 protected:
  void SetUp() override { root_ = MakeTempDir("specd_synthetic_"); }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  std::string Dir(const std::string& name) const { return root_ + "/" + name; }

  std::string root_;
};

std::unique_ptr<TensorStore> Open(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<TensorStore>> s = TensorStore::OpenFolder(dir);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

bool SameBytes(const TensorView& a, const TensorView& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.nbytes == b.nbytes &&
         std::memcmp(a.data, b.data, a.nbytes) == 0;
}

TEST_F(SyntheticPairTest, DraftIsTheTargetsFirstLayersBitForBitAndBothLoad) {
  SyntheticPairOptions o = Small(0.5);
  o.draft_layers = 2;
  ASSERT_TRUE(WriteSyntheticPair(o, Dir("t"), Dir("d")).ok());
  std::unique_ptr<TensorStore> target = Open(Dir("t")), draft = Open(Dir("d"));
  ASSERT_TRUE(target && draft);
  // Embedding, 2 layers of 9 tensors, final norm, LM head.
  EXPECT_EQ(draft->Names().size(), 2u + 2 * 9 + 1);
  EXPECT_EQ(target->Names().size(), 2u + 4 * 9 + 1);
  for (const std::string& name : draft->Names()) {
    const TensorView* d = *draft->Get(name);
    absl::StatusOr<const TensorView*> t = target->Get(name);
    ASSERT_TRUE(t.ok()) << name;
    EXPECT_EQ(d->dtype, DType::kBF16) << name;
    EXPECT_TRUE(SameBytes(*d, **t)) << name;
  }
  EXPECT_FALSE(draft->Has("model.layers.2.self_attn.q_proj.weight"));
  for (const std::string& dir : {Dir("t"), Dir("d")}) {
    BackendOptions bo;
    bo.num_threads = 1;
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, bo);
    EXPECT_TRUE(b.ok()) << dir << ": " << b.status();
  }
  EXPECT_TRUE(fs::exists(Dir("d") + "/tokenizer.json"));

  // Epsilon scales exactly the skipped layers' output projections.
  SyntheticPairOptions full = o;
  full.epsilon = 1.0;
  ASSERT_TRUE(WriteSyntheticPair(full, Dir("t1"), "").ok());
  std::unique_ptr<TensorStore> t1 = Open(Dir("t1"));
  ASSERT_TRUE(t1);
  for (const std::string& name : t1->Names()) {
    const TensorView* a = *t1->Get(name);
    const TensorView* b = *target->Get(name);
    const bool skipped_layer =
        name.rfind("model.layers.2.", 0) == 0 || name.rfind("model.layers.3.", 0) == 0;
    const bool output_projection =
        name.find("o_proj") != std::string::npos || name.find("down_proj") != std::string::npos;
    if (!(skipped_layer && output_projection)) {
      EXPECT_TRUE(SameBytes(*a, *b)) << name;
      continue;
    }
    std::vector<float> va(a->numel()), vb(b->numel());
    ASSERT_TRUE(t1->ReadF32(name, a->shape, va.data()).ok());
    ASSERT_TRUE(target->ReadF32(name, b->shape, vb.data()).ok());
    for (size_t i = 0; i < va.size(); ++i) {
      ASSERT_NEAR(vb[i], 0.5f * va[i], 0.01f * std::abs(va[i]) + 1e-30f) << name << " " << i;
    }
  }
}

TEST_F(SyntheticPairTest, ShardingChangesNoByte) {
  SyntheticPairOptions o = Small(0.5);
  ASSERT_TRUE(WriteSyntheticPair(o, Dir("one"), "").ok());
  o.max_shard_bytes = 100000;
  ASSERT_TRUE(WriteSyntheticPair(o, Dir("many"), "").ok());
  EXPECT_TRUE(fs::exists(Dir("many") + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(Dir("many") + "/model.safetensors"));
  std::unique_ptr<TensorStore> one = Open(Dir("one")), many = Open(Dir("many"));
  ASSERT_TRUE(one && many);
  ASSERT_EQ(one->Names(), many->Names());
  for (const std::string& name : one->Names()) {
    EXPECT_TRUE(SameBytes(**one->Get(name), **many->Get(name))) << name;
  }
  // Writing again unsharded into the sharded folder leaves no stale shard behind.
  o.max_shard_bytes = int64_t{1} << 30;
  ASSERT_TRUE(WriteSyntheticPair(o, Dir("many"), "").ok());
  EXPECT_FALSE(fs::exists(Dir("many") + "/model.safetensors.index.json"));
  BackendOptions bo;
  bo.num_threads = 1;
  EXPECT_TRUE(CreateBackend(Dir("many"), bo).ok());
}

TEST_F(SyntheticPairTest, EpsilonSetsTau) {
  TauOptions tau;
  tau.num_threads = 2;
  double last = 0;
  for (double eps : {0.0, 1.0, 4.0}) {
    ASSERT_TRUE(WriteSyntheticPair(Small(eps), Dir("t"), Dir("d")).ok());
    absl::StatusOr<TauMeasurement> m = MeasureTau(Dir("t"), Dir("d"), tau);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_GT(m->steps, 0);
    // Greedy output of a random model that repeated one token would make tau meaningless.
    EXPECT_GT(m->distinct_fraction, 0.2) << "epsilon " << eps;
    if (eps == 0.0) {
      // The skipped layers add exactly nothing: the draft's top choice is the target's (up to
      // float ties), so nearly every step accepts the whole depth; the last step of each
      // sequence is cut short by max_new_tokens, which keeps tau below depth + 1.
      EXPECT_GT(m->tau, tau.draft.depth);
    } else {
      EXPECT_LT(m->tau, last - 0.3) << "epsilon " << eps;
    }
    last = m->tau;
  }
}

TEST_F(SyntheticPairTest, BadOptionsNameTheField) {
  SyntheticPairOptions o = Small(0.5);
  o.draft_layers = 0;
  absl::Status s = WriteSyntheticPair(o, Dir("t"), Dir("d"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("draft_layers"));
  o = Small(-1.0);
  EXPECT_THAT(WriteSyntheticPair(o, Dir("t"), Dir("d")).message(), HasSubstr("epsilon"));
  o = Small(0.5);
  o.tokenizer_dir = Dir("nowhere");
  EXPECT_THAT(WriteSyntheticPair(o, Dir("t"), Dir("d")).message(), HasSubstr("tokenizer_dir"));
  absl::StatusOr<SyntheticShape> shape = SyntheticShapeByName("llama-9");
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shape.status().message(), HasSubstr("llama-3.1-8b"));
  ASSERT_TRUE(SyntheticShapeByName("llama-3.1-70b").ok());
  EXPECT_EQ(SyntheticShapeByName("llama-3.1-70b")->num_layers, 80);
}

}  // namespace
}  // namespace specd
