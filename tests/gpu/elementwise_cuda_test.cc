// Embedding, RMSNorm, RoPE and SwiGLU on the GPU, their special cases: vocabulary-parallel
// embedding shards, RoPE's fused KV-cache write against the unfused one, the params' checks.
// Their results against the fp32 CPU references of kernels/cpu are op-table cases
// (ops_cuda_test.cc).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/model_config.h"
#include "engine/tp/tp_plan.h"
#include "specd/kernels/cuda/embedding.h"
#include "specd/kernels/cuda/kv_cache.h"
#include "specd/kernels/cuda/rmsnorm.h"
#include "specd/kernels/cuda/rope.h"
#include "specd/kernels/rope.h"
#include "tests/gpu/gpu_test_util.h"

namespace specd {
namespace {

using gpu_test::AllClose;
using gpu_test::bf16;
using gpu_test::DeviceBuffer;
using gpu_test::RandomNormal;
using gpu_test::RoundBf16;
using gpu_test::ToBf16;
using gpu_test::ToFloat;

// bf16 outputs carry a relative rounding error of up to 2^-8.
constexpr float kBf16Rtol = 1.0f / 128;

class ElementwiseCudaTest : public gpu_test::GpuTest {};

// Vocabulary-parallel embedding: each shard's table gives its own tokens' rows and zeros for
// the rest (and for ids outside the vocabulary), so the shards' outputs sum to the full gather
// exactly, for 3 and 7 uneven shards on both the vector and scalar paths.
TEST_F(ElementwiseCudaTest, EmbeddingShardsSumToTheFullGather) {
  std::mt19937_64 rng(17);
  for (int hidden : {136, 37}) {
    const int vocab = 1001, n = 200;
    const std::vector<float> table =
        RoundBf16(RandomNormal(static_cast<size_t>(vocab) * hidden, rng));
    std::vector<int32_t> tokens(n);
    std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
    for (int32_t& t : tokens) t = pick(rng);
    tokens[0] = 0;
    tokens[1] = vocab - 1;
    tokens[2] = -1;     // outside every shard: a zero row
    tokens[3] = vocab;  // likewise
    DeviceBuffer<int32_t> d_tokens(tokens);
    // The full gather on the host (EmbeddingCpu aborts on ids outside the vocabulary).
    std::vector<float> full(static_cast<size_t>(n) * hidden, 0.0f);
    for (int t = 0; t < n; ++t) {
      if (tokens[t] < 0 || tokens[t] >= vocab) continue;
      std::copy(table.begin() + static_cast<int64_t>(tokens[t]) * hidden,
                table.begin() + static_cast<int64_t>(tokens[t] + 1) * hidden,
                full.begin() + static_cast<int64_t>(t) * hidden);
    }
    for (int world : {1, 3, 7}) {
      for (int64_t align : {int64_t{1}, int64_t{64}}) {
        std::vector<float> sum(static_cast<size_t>(n) * hidden, 0.0f);
        for (const TpRange v : SplitEvenly(vocab, world, align)) {
          const std::vector<float> shard(table.begin() + v.begin * hidden,
                                         table.begin() + v.end * hidden);
          DeviceBuffer<bf16> d_table(ToBf16(shard));
          DeviceBuffer<bf16> d_out(static_cast<size_t>(n) * hidden);
          ASSERT_EQ(cudaMemset(d_out.get(), 0x7f, d_out.size() * sizeof(bf16)), cudaSuccess);
          cuda::EmbeddingParams p;
          p.tokens = d_tokens.get();
          p.table = d_table.get();
          p.out = d_out.get();
          p.num_tokens = n;
          p.vocab_size = v.size();
          p.hidden = hidden;
          p.vocab_offset = v.begin;
          SPECD_CUDA_OK(cuda::EmbeddingCuda(p, stream_));
          Sync();
          const std::vector<float> out = ToFloat(d_out.Download());
          for (int t = 0; t < n; ++t) {
            const bool mine = v.contains(tokens[t]);
            for (int i = 0; i < hidden; ++i) {
              const float got = out[static_cast<size_t>(t) * hidden + i];
              const float want = mine ? table[static_cast<size_t>(tokens[t]) * hidden + i] : 0.0f;
              ASSERT_EQ(got, want)
                  << "hidden " << hidden << " world " << world << " shard [" << v.begin << ", "
                  << v.end << ") token " << t << " (id " << tokens[t] << ") element " << i;
              sum[static_cast<size_t>(t) * hidden + i] += got;
            }
          }
        }
        EXPECT_TRUE(AllClose(sum, full, 0.0f, 0.0f))
            << "hidden " << hidden << " world " << world << " align " << align;
      }
    }
  }
}

// RoPE with the paged KV-cache write fused in gives the rotation of RoPE alone, bit for bit, and
// leaves in the cache exactly what a KvCacheWriteCuda of the rotated row would (the rotation
// itself against the CPU reference is the op table's rope cases, on these shapes).
TEST_F(ElementwiseCudaTest, RopeFusedKvWriteMatchesTheUnfusedWrite) {
  std::mt19937_64 rng(13);
  struct Case {
    int tokens, q_heads, k_heads, head_dim;
    bool llama3, qk_norm;
  };
  for (const Case c : {Case{9, 7, 1, 64, false, false}, Case{5, 12, 4, 128, true, false},
                       Case{17, 3, 3, 128, false, true}, Case{4, 5, 5, 64, true, true},
                       Case{7, 4, 2, 32, false, false}, Case{6, 5, 1, 16, false, true},
                       Case{3, 3, 1, 16, true, false}}) {
    ModelConfig config;
    config.hidden_size = c.q_heads * c.head_dim;
    config.num_heads = c.q_heads;
    config.head_dim = c.head_dim;
    config.rope_theta = 500000.0f;
    if (c.llama3) {
      config.rope_scaling.type = "llama3";
      config.rope_scaling.factor = 8.0f;
      config.rope_scaling.original_max_position_embeddings = 8192;
    }
    const std::vector<float> inv_freq = RopeInvFreq(config);
    ASSERT_EQ(inv_freq.size(), static_cast<size_t>(c.head_dim / 2));
    const int q_dim = c.q_heads * c.head_dim, k_dim = c.k_heads * c.head_dim;
    const int stride = q_dim + 2 * k_dim;  // q | k | v, as the fused projection writes them
    const std::vector<float> qkv =
        RoundBf16(RandomNormal(static_cast<size_t>(c.tokens) * stride, rng));
    std::vector<int32_t> positions(c.tokens);
    std::uniform_int_distribution<int32_t> pos(0, 200000);
    for (int32_t& x : positions) x = pos(rng);
    positions[0] = 0;
    const std::vector<float> q_norm = RandomNormal(c.head_dim, rng, 0.5f);  // fp32 weights
    const std::vector<float> k_norm = RandomNormal(c.head_dim, rng, 0.5f);

    DeviceBuffer<bf16> d_qkv(ToBf16(qkv));
    DeviceBuffer<int32_t> d_pos(positions);
    DeviceBuffer<float> d_freq(inv_freq);
    DeviceBuffer<float> d_qn(q_norm), d_kn(k_norm);
    cuda::RopeParams p;
    p.q = d_qkv.get();
    p.q_stride = stride;
    p.num_q_heads = c.q_heads;
    p.k = d_qkv.get() + q_dim;
    p.k_stride = stride;
    p.num_k_heads = c.k_heads;
    p.positions = d_pos.get();
    p.inv_freq = d_freq.get();
    if (c.qk_norm) {
      p.q_norm_weight = d_qn.get();
      p.k_norm_weight = d_kn.get();
    }
    p.norm_eps = 1e-6f;
    p.num_tokens = c.tokens;
    p.head_dim = c.head_dim;
    SPECD_CUDA_OK(cuda::RopeCuda(p, stream_));
    Sync();

    const std::string what = "tokens " + std::to_string(c.tokens) + " heads " +
                             std::to_string(c.q_heads) + "/" + std::to_string(c.k_heads) +
                             " head_dim " + std::to_string(c.head_dim);

    // The fused KV-cache write gives the same rotation, bit for bit, and leaves in the cache
    // exactly what a KvCacheWriteCuda of the rotated row would; token 1 (slot -1) is skipped.
    const int slots_n = 3 * c.tokens + 2;
    std::vector<int64_t> slots(c.tokens);
    for (int t = 0; t < c.tokens; ++t) slots[t] = t == 1 ? -1 : 3 * t + 1;
    const std::vector<bf16> sentinel(static_cast<size_t>(slots_n) * k_dim, __float2bfloat16(7.0f));
    DeviceBuffer<bf16> f_qkv(ToBf16(qkv)), f_kc(sentinel), f_vc(sentinel);
    DeviceBuffer<bf16> w_kc(sentinel), w_vc(sentinel);  // the unfused write, for comparison
    DeviceBuffer<int64_t> d_slots(slots);
    cuda::RopeParams f = p;
    f.q = f_qkv.get();
    f.k = f_qkv.get() + q_dim;
    f.v = f_qkv.get() + q_dim + k_dim;
    f.v_stride = stride;
    f.k_cache = f_kc.get();
    f.v_cache = f_vc.get();
    f.slots = d_slots.get();
    SPECD_CUDA_OK(cuda::RopeCuda(f, stream_));
    cuda::KvCacheWriteParams kw;
    kw.k = d_qkv.get() + q_dim;
    kw.k_stride = stride;
    kw.v = d_qkv.get() + q_dim + k_dim;
    kw.v_stride = stride;
    kw.k_cache = w_kc.get();
    kw.v_cache = w_vc.get();
    kw.slots = d_slots.get();
    kw.num_tokens = c.tokens;
    kw.kv_dim = k_dim;
    SPECD_CUDA_OK(cuda::KvCacheWriteCuda(kw, stream_));
    Sync();
    const auto bits = [](const std::vector<bf16>& v) {
      std::vector<uint16_t> out(v.size());
      std::memcpy(out.data(), v.data(), v.size() * sizeof(uint16_t));
      return out;
    };
    EXPECT_EQ(bits(f_qkv.Download()), bits(d_qkv.Download())) << "fused rotation, " << what;
    EXPECT_EQ(bits(f_kc.Download()), bits(w_kc.Download())) << "fused K cache, " << what;
    EXPECT_EQ(bits(f_vc.Download()), bits(w_vc.Download())) << "fused V cache, " << what;
  }
}

TEST_F(ElementwiseCudaTest, BadParamsAreRejected) {
  cuda::RmsNormParams p;  // no pointers, dim 0
  EXPECT_EQ(cuda::RmsNormCuda(p, stream_), cudaErrorInvalidValue);
  {
    // Both x and partials, or partials without a count.
    DeviceBuffer<bf16> x(8), out(8);
    DeviceBuffer<float> parts(8), w(8);
    cuda::RmsNormParams q;
    q.x = x.get();
    q.partials = parts.get();
    q.num_partials = 1;
    q.weight = w.get();
    q.out = out.get();
    q.rows = 1;
    q.dim = 8;
    EXPECT_EQ(cuda::RmsNormCuda(q, stream_), cudaErrorInvalidValue);
    q.x = nullptr;
    q.num_partials = 0;
    EXPECT_EQ(cuda::RmsNormCuda(q, stream_), cudaErrorInvalidValue);
  }
  cuda::RopeParams r;
  r.num_tokens = 1;
  r.head_dim = 7;  // odd
  EXPECT_EQ(cuda::RopeCuda(r, stream_), cudaErrorInvalidValue);
}

// ResidualAddCuda: the stream starts from the bf16 rows exactly (residual_init), then adds
// rows and a per-column bias in fp32, and `out` is the updated stream rounded to bf16; without x
// only the bias is added; bad params are refused.
TEST_F(ElementwiseCudaTest, ResidualAddUpdatesTheStreamAndRoundsIt) {
  const int64_t rows = 5, dim = 37;
  std::mt19937_64 rng(3);
  const std::vector<float> x = RoundBf16(RandomNormal(rows * dim, rng));
  const std::vector<float> y = RoundBf16(RandomNormal(rows * dim, rng));
  const std::vector<float> bias = RandomNormal(dim, rng);
  DeviceBuffer<bf16> d_x(ToBf16(x)), d_y(ToBf16(y)), d_out(rows * dim);
  DeviceBuffer<float> d_res(RandomNormal(rows * dim, rng));  // overwritten by residual_init
  DeviceBuffer<float> d_bias(bias);
  cuda::ResidualAddParams p;
  p.x = d_x.get();
  p.residual = d_res.get();
  p.residual_init = true;
  p.rows = rows;
  p.dim = dim;
  SPECD_CUDA_OK(cuda::ResidualAddCuda(p, stream_));
  SPECD_CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(d_res.Download(), x);
  p.x = d_y.get();
  p.residual_init = false;
  p.bias = d_bias.get();
  p.out = d_out.get();
  SPECD_CUDA_OK(cuda::ResidualAddCuda(p, stream_));
  SPECD_CUDA_OK(cudaStreamSynchronize(stream_));
  const std::vector<float> res = d_res.Download(), out = ToFloat(d_out.Download());
  for (int64_t i = 0; i < rows * dim; ++i) {
    ASSERT_EQ(res[i], (x[i] + y[i]) + bias[i % dim]) << i;
    ASSERT_EQ(out[i], RoundBf16({res[i]})[0]) << i;
  }
  p.x = nullptr;  // the bias alone
  SPECD_CUDA_OK(cuda::ResidualAddCuda(p, stream_));
  SPECD_CUDA_OK(cudaStreamSynchronize(stream_));
  const std::vector<float> again = d_res.Download();
  for (int64_t i = 0; i < rows * dim; ++i) ASSERT_EQ(again[i], res[i] + bias[i % dim]) << i;
  p.residual = nullptr;
  EXPECT_EQ(cuda::ResidualAddCuda(p, stream_), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace specd
