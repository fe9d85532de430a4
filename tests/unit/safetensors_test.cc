#include "common/io/safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using ::testing::HasSubstr;

std::vector<uint8_t> F32Bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteAll(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

TEST(SafetensorsTest, RoundTripsAllFloatTypes) {
  const std::string dir = MakeTempDir("st_");
  const std::vector<float> vals = {1.0f, -2.5f, 0.15625f, 3e-3f, 65504.0f, -0.0f};
  std::vector<TensorToWrite> ts;
  ts.push_back({"a", DType::kF32, {2, 3}, F32Bytes(vals)});
  TensorToWrite bf{"b", DType::kBF16, {6}, {}};
  TensorToWrite hf{"c", DType::kF16, {3, 2}, {}};
  for (float v : vals) {
    uint16_t x = F32ToBF16(v), y = F32ToF16(v);
    bf.data.insert(bf.data.end(), reinterpret_cast<uint8_t*>(&x), reinterpret_cast<uint8_t*>(&x) + 2);
    hf.data.insert(hf.data.end(), reinterpret_cast<uint8_t*>(&y), reinterpret_cast<uint8_t*>(&y) + 2);
  }
  ts.push_back(bf);
  ts.push_back(hf);
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", ts).ok());
  auto store = TensorStore::OpenFolder(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  std::vector<float> out(6);
  ASSERT_TRUE((*store)->ReadF32("a", {2, 3}, out.data()).ok());
  EXPECT_EQ(out, vals);
  ASSERT_TRUE((*store)->ReadF32("b", {6}, out.data()).ok());
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(out[i], vals[i], std::abs(vals[i]) / 128 + 1e-6);
  ASSERT_TRUE((*store)->ReadF32("c", {3, 2}, out.data()).ok());
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(out[i], vals[i], std::abs(vals[i]) / 1024 + 1e-6);
  std::vector<float> rows(3);
  ASSERT_TRUE((*store)->ReadRowsF32("a", 1, 2, rows.data()).ok());
  EXPECT_EQ(rows, std::vector<float>(vals.begin() + 3, vals.end()));
}

// EAGLE-3 heads store t2d as torch.bool ("BOOL", one byte an element).
TEST(SafetensorsTest, ReadsBoolTensorsAndRefusesThemAsFloats) {
  const std::string dir = MakeTempDir("st_");
  ASSERT_TRUE(
      WriteSafetensors(dir + "/model.safetensors", {{"mask", DType::kBool, {4}, {1, 0, 0, 1}}})
          .ok());
  auto store = TensorStore::OpenFolder(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  const TensorView* v = *(*store)->Get("mask");
  EXPECT_EQ(v->dtype, DType::kBool);
  EXPECT_STREQ(DTypeName(v->dtype), "BOOL");
  EXPECT_EQ(std::vector<uint8_t>(v->data, v->data + v->nbytes),
            (std::vector<uint8_t>{1, 0, 0, 1}));
  std::vector<float> out(4);
  const absl::Status s = (*store)->ReadF32("mask", {4}, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("dtype BOOL is not a floating-point type"));
}

TEST(SafetensorsTest, ShapeMismatchNamesTensorAndFile) {
  const std::string dir = MakeTempDir("st_");
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               {{"w", DType::kF32, {2, 2}, F32Bytes({1, 2, 3, 4})}})
                  .ok());
  auto store = TensorStore::OpenFolder(dir);
  ASSERT_TRUE(store.ok());
  std::vector<float> out(4);
  absl::Status s = (*store)->ReadF32("w", {4, 1}, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tensor w"));
  EXPECT_THAT(s.message(), HasSubstr("model.safetensors"));
  absl::Status missing = (*store)->ReadF32("nope", {1}, out.data());
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("nope"));
}

TEST(SafetensorsTest, TruncatedAndMalformedFilesGiveClearErrors) {
  const std::string dir = MakeTempDir("st_");
  const std::string path = dir + "/model.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, {{"w", DType::kF32, {4, 4}, F32Bytes(std::vector<float>(16, 1))}}).ok());
  const std::string good = ReadAll(path);

  WriteAll(path, good.substr(0, good.size() - 5));
  auto truncated = SafetensorsFile::Open(path);
  ASSERT_FALSE(truncated.ok());
  EXPECT_THAT(truncated.status().message(), HasSubstr("tensor w"));
  EXPECT_THAT(truncated.status().message(), HasSubstr(path));

  WriteAll(path, good.substr(0, 4));
  EXPECT_FALSE(SafetensorsFile::Open(path).ok());

  std::string bad_json = good;
  bad_json[8] = '#';  // the opening brace of the header
  WriteAll(path, bad_json);
  auto malformed = SafetensorsFile::Open(path);
  ASSERT_FALSE(malformed.ok());
  EXPECT_THAT(malformed.status().message(), HasSubstr("malformed"));

  std::string huge_header = good;
  uint64_t len = 1ull << 40;
  std::memcpy(huge_header.data(), &len, 8);
  WriteAll(path, huge_header);
  EXPECT_FALSE(SafetensorsFile::Open(path).ok());

  std::string bad_dtype = good;
  const size_t at = bad_dtype.find("\"F32\"");
  ASSERT_NE(at, std::string::npos);
  bad_dtype.replace(at, 5, "\"F99\"");
  WriteAll(path, bad_dtype);
  auto unknown = SafetensorsFile::Open(path);
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(unknown.status().message(), HasSubstr("unknown dtype"));
  EXPECT_THAT(unknown.status().message(), HasSubstr("tensor w"));
}

// Row-parallel tensor-parallel weights are read as column slices of [out, in] tensors.
TEST(SafetensorsTest, ReadsColumnSlicesAndRejectsBadOnesByName) {
  const std::string dir = MakeTempDir("st_");
  std::vector<float> w(3 * 5);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.5f - 3.0f;
  TensorToWrite bf{"wb", DType::kBF16, {3, 5}, {}};
  for (float v : w) {
    const uint16_t x = F32ToBF16(v);
    bf.data.insert(bf.data.end(), reinterpret_cast<const uint8_t*>(&x),
                   reinterpret_cast<const uint8_t*>(&x) + 2);
  }
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               {{"w", DType::kF32, {3, 5}, F32Bytes(w)}, bf,
                                {"v", DType::kF32, {5}, F32Bytes({1, 2, 3, 4, 5})}})
                  .ok());
  auto store = TensorStore::OpenFolder(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  for (const char* name : {"w", "wb"}) {
    std::vector<float> out(3 * 3, -1.0f);
    ASSERT_TRUE((*store)->ReadColsF32(name, 1, 4, out.data()).ok());
    for (int r = 0; r < 3; ++r) {
      for (int c = 0; c < 3; ++c) EXPECT_EQ(out[r * 3 + c], w[r * 5 + 1 + c]) << name;
    }
  }
  std::vector<float> none(1, 7.0f);
  EXPECT_TRUE((*store)->ReadColsF32("w", 2, 2, none.data()).ok());
  EXPECT_EQ(none[0], 7.0f);  // an empty slice writes nothing
  std::vector<float> out(16);
  absl::Status s = (*store)->ReadColsF32("w", 3, 6, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tensor w"));
  EXPECT_THAT(s.message(), HasSubstr("[3, 6)"));
  s = (*store)->ReadColsF32("v", 0, 1, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tensor v"));
  EXPECT_EQ((*store)->ReadColsF32("nope", 0, 1, out.data()).code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, ShardedFolderWithIndex) {
  const std::string dir = MakeTempDir("ckpt_");
  RandomCheckpointSpec spec;
  spec.shards = 3;
  spec.dtype = DType::kBF16;
  ASSERT_TRUE(WriteRandomCheckpoint(dir, spec).ok());
  EXPECT_TRUE(std::filesystem::exists(dir + "/model.safetensors.index.json"));
  auto store = TensorStore::OpenFolder(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE((*store)->Has("model.embed_tokens.weight"));
  EXPECT_TRUE((*store)->Has("lm_head.weight"));
  EXPECT_TRUE((*store)->Has("model.layers.1.mlp.down_proj.weight"));
}

TEST(ModelConfigTest, ParsesFamiliesAndRejectsBadFields) {
  const std::string dir = MakeTempDir("cfg_");
  RandomCheckpointSpec spec;
  spec.model_type = "qwen3";
  spec.num_heads = 3;
  spec.num_kv_heads = 1;
  spec.hidden_size = 48;
  spec.head_dim = 32;
  spec.llama3_rope_scaling = true;
  ASSERT_TRUE(WriteRandomCheckpoint(dir, spec).ok());
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->head_dim, 32);
  EXPECT_EQ(c->rope_scaling.type, "llama3");
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{256});

  auto q2 = ParseModelConfig(R"({"model_type":"qwen2","vocab_size":10,"hidden_size":8,
    "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2})", "x.json");
  ASSERT_TRUE(q2.ok());
  EXPECT_TRUE(q2->attention_bias);
  EXPECT_EQ(q2->num_kv_heads, 2);

  auto missing = ParseModelConfig(R"({"model_type":"llama","vocab_size":10})", "cfg.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("cfg.json"));
  EXPECT_THAT(missing.status().message(), HasSubstr("hidden_size"));
  auto unknown = ParseModelConfig(R"({"model_type":"gpt2"})", "cfg.json");
  EXPECT_THAT(unknown.status().message(), HasSubstr("gpt2"));
}

// Contexts of 0 or beyond int (2^40 used to truncate to 0) and end-of-sequence ids outside the
// vocabulary used to load and leave a service that refused every request; they are refused at
// load, naming the file and the field.
TEST(ModelConfigTest, RefusesUnusableContextAndEosIds) {
  const std::string base = R"({"model_type":"llama","vocab_size":10,"hidden_size":8,
    "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2)";
  for (const char* bad : {R"(,"max_position_embeddings":0})", R"(,"max_position_embeddings":-5})",
                          R"(,"max_position_embeddings":1099511627776})",
                          R"(,"max_position_embeddings":33554432})"}) {
    auto c = ParseModelConfig(base + bad, "cfg.json");
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_THAT(c.status().message(), HasSubstr("cfg.json")) << bad;
    EXPECT_THAT(c.status().message(), HasSubstr("max_position_embeddings")) << bad;
  }
  EXPECT_TRUE(ParseModelConfig(base + R"(,"max_position_embeddings":16777216})", "c").ok());
  for (const char* bad :
       {R"(,"eos_token_id":10})", R"(,"eos_token_id":[2,-1]})", R"(,"eos_token_id":4294967298})"}) {
    auto c = ParseModelConfig(base + bad, "cfg.json");
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_THAT(c.status().message(), HasSubstr("eos_token_id")) << bad;
  }
  auto good = ParseModelConfig(base + R"(,"eos_token_id":[2,9]})", "cfg.json");
  ASSERT_TRUE(good.ok()) << good.status();
  ModelConfig c = *good;
  absl::Status gen = ApplyGenerationConfig(R"({"eos_token_id":12})", "gen.json", &c);
  EXPECT_EQ(gen.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(gen.message(), HasSubstr("gen.json"));
  EXPECT_THAT(gen.message(), HasSubstr("eos_token_id 12"));
  EXPECT_FALSE(ApplyGenerationConfig("[1]", "gen.json", &c).ok());
  ASSERT_TRUE(ApplyGenerationConfig(R"({"eos_token_id":3,"bos_token_id":1})", "g", &c).ok());
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>{3});
  EXPECT_EQ(c.bos_token_id, 1);

  // Through LoadModelConfig: generation_config.json is checked against config.json's vocabulary.
  const std::string dir = MakeTempDir("cfg_eos_");
  WriteAll(dir + "/config.json", base + "}");
  WriteAll(dir + "/generation_config.json", R"({"eos_token_id":[1,100]})");
  auto loaded = LoadModelConfig(dir);
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(loaded.status().message(), HasSubstr("generation_config.json"));
}

// Sliding-window models are served up to their window only (full attention is then exact).
TEST(ModelConfigTest, ActiveSlidingWindowCapsTheContext) {
  const std::string sizes = R"("vocab_size":10,"hidden_size":8,"intermediate_size":16,
    "num_hidden_layers":1,"num_attention_heads":2,"max_position_embeddings":32768)";
  auto mistral = ParseModelConfig(
      R"({"model_type":"mistral","sliding_window":4096,)" + sizes + "}", "m.json");
  ASSERT_TRUE(mistral.ok()) << mistral.status();
  EXPECT_EQ(mistral->sliding_window, 4096);
  EXPECT_EQ(mistral->max_position_embeddings, 4096);
  auto mistral_null = ParseModelConfig(
      R"({"model_type":"mistral","sliding_window":null,)" + sizes + "}", "m.json");
  ASSERT_TRUE(mistral_null.ok());
  EXPECT_EQ(mistral_null->max_position_embeddings, 32768);
  // Qwen2 carries a window it does not use unless use_sliding_window is true.
  auto qwen_off = ParseModelConfig(
      R"({"model_type":"qwen2","sliding_window":4096,"use_sliding_window":false,)" + sizes + "}",
      "q.json");
  ASSERT_TRUE(qwen_off.ok());
  EXPECT_EQ(qwen_off->sliding_window, 0);
  EXPECT_EQ(qwen_off->max_position_embeddings, 32768);
  auto qwen_on = ParseModelConfig(
      R"({"model_type":"qwen2","sliding_window":4096,"use_sliding_window":true,)" + sizes + "}",
      "q.json");
  ASSERT_TRUE(qwen_on.ok());
  EXPECT_EQ(qwen_on->max_position_embeddings, 4096);
  auto negative = ParseModelConfig(
      R"({"model_type":"mistral","sliding_window":-1,)" + sizes + "}", "m.json");
  EXPECT_THAT(negative.status().message(), HasSubstr("sliding_window"));
}

TEST(ModelConfigTest, Llama3RopeScalingMatchesTransformersFormula) {
  ModelConfig c;
  c.head_dim = 128;
  c.rope_theta = 500000.0f;
  c.rope_scaling = {"llama3", 8.0f, 1.0f, 4.0f, 8192};
  const std::vector<float> inv = RopeInvFreq(c);
  // High frequencies are untouched, the lowest are divided by the factor.
  EXPECT_FLOAT_EQ(inv[0], 1.0f);
  const float base_last = std::pow(500000.0, -126.0 / 128.0);
  EXPECT_NEAR(inv[63], base_last / 8.0f, 1e-12);
}

}  // namespace
}  // namespace specd
