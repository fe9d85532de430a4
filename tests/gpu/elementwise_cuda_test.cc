// Embedding, RMSNorm (+ fused residual), RoPE (+ fused q/k norm) and SwiGLU on the GPU against
// the fp32 CPU references of kernels/cpu, on random data with awkward sizes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/model_config.h"
#include "engine/tp/tp_plan.h"
#include "specd/kernels/cuda/embedding.h"
#include "specd/kernels/cuda/kv_cache.h"
#include "specd/kernels/cuda/rmsnorm.h"
#include "specd/kernels/cuda/rope.h"
#include "specd/kernels/cuda/swiglu.h"
#include "specd/kernels/embedding.h"
#include "specd/kernels/rmsnorm.h"
#include "specd/kernels/rope.h"
#include "specd/kernels/swiglu.h"
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

class ElementwiseCudaTest : public gpu_test::GpuTest {
 protected:
  // Runs RmsNormCuda(p), whose input row sums to x (host, fp32), and expects its output to match
  // RmsNormCpu's on x, and, when `residual` is given (the host copy of what d_res held before),
  // d_res to hold the reference's updated residual within residual_tol.
  void ExpectRmsNormMatchesCpu(const cuda::RmsNormParams& p, const std::vector<float>& x,
                               const std::vector<float>& w, std::vector<float>* residual,
                               DeviceBuffer<float>& d_res, DeviceBuffer<bf16>& d_out,
                               float residual_tol, const std::string& what) {
    SPECD_CUDA_OK(cuda::RmsNormCuda(p, stream_));
    Sync();
    std::vector<float> want(x.size());
    RmsNormParams ref;
    ref.x = x.data();
    ref.residual = residual != nullptr ? residual->data() : nullptr;
    ref.weight = w.data();
    ref.out = want.data();
    ref.rows = p.rows;
    ref.dim = p.dim;
    ref.eps = p.eps;
    RmsNormCpu(ref);
    EXPECT_TRUE(AllClose(ToFloat(d_out.Download()), want, 1e-3f, kBf16Rtol)) << what;
    if (residual != nullptr) {
      EXPECT_TRUE(AllClose(d_res.Download(), *residual, residual_tol, residual_tol))
          << "residual, " << what;
    }
  }
};

TEST_F(ElementwiseCudaTest, EmbeddingGathersRows) {
  std::mt19937_64 rng(11);
  for (int hidden : {136, 37}) {  // 16-byte vector path and scalar path
    const int vocab = 1001, n = 97;
    const std::vector<float> table =
        RoundBf16(RandomNormal(static_cast<size_t>(vocab) * hidden, rng));
    std::vector<int32_t> tokens(n);
    std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
    for (int32_t& t : tokens) t = pick(rng);
    tokens[3] = tokens[5];  // a repeated id
    tokens[7] = vocab - 1;
    DeviceBuffer<bf16> d_table(ToBf16(table));
    DeviceBuffer<int32_t> d_tokens(tokens);
    DeviceBuffer<bf16> d_out(static_cast<size_t>(n) * hidden);
    cuda::EmbeddingParams p;
    p.tokens = d_tokens.get();
    p.table = d_table.get();
    p.out = d_out.get();
    p.num_tokens = n;
    p.vocab_size = vocab;
    p.hidden = hidden;
    SPECD_CUDA_OK(cuda::EmbeddingCuda(p, stream_));
    Sync();
    std::vector<float> want(static_cast<size_t>(n) * hidden);
    EmbeddingParams ref;
    ref.tokens = tokens.data();
    ref.table = table.data();
    ref.out = want.data();
    ref.num_tokens = n;
    ref.vocab_size = vocab;
    ref.hidden = hidden;
    EmbeddingCpu(ref);
    EXPECT_TRUE(AllClose(ToFloat(d_out.Download()), want, 0.0f, 0.0f)) << "hidden " << hidden;
  }
}

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

TEST_F(ElementwiseCudaTest, RmsNormWithAndWithoutResidual) {
  std::mt19937_64 rng(12);
  struct Case {
    int rows, dim;
  };
  for (const Case c : {Case{1, 4096}, Case{7, 64}, Case{33, 100}, Case{5, 8192}, Case{3, 1000}}) {
    for (int mode = 0; mode < 3; ++mode) {  // 0: plain, 1: residual add, 2: residual init
      const size_t n = static_cast<size_t>(c.rows) * c.dim;
      const std::vector<float> x = RoundBf16(RandomNormal(n, rng, 2.0f));
      const std::vector<float> w = RandomNormal(c.dim, rng, 0.5f);  // fp32 weights
      std::vector<float> residual = RandomNormal(n, rng, 3.0f);
      if (mode == 2) std::fill(residual.begin(), residual.end(), 0.0f);
      DeviceBuffer<bf16> d_x(ToBf16(x));
      DeviceBuffer<float> d_w(w);
      DeviceBuffer<float> d_res(mode == 2 ? RandomNormal(n, rng) : residual);  // init overwrites
      DeviceBuffer<bf16> d_out(n);
      cuda::RmsNormParams p;
      p.x = d_x.get();
      p.residual = mode == 0 ? nullptr : d_res.get();
      p.residual_init = mode == 2;
      p.weight = d_w.get();
      p.out = d_out.get();
      p.rows = c.rows;
      p.dim = c.dim;
      p.eps = 1e-5f;
      ExpectRmsNormMatchesCpu(p, x, w, mode == 0 ? nullptr : &residual, d_res, d_out, 1e-6f,
                              "rows " + std::to_string(c.rows) + " dim " +
                                  std::to_string(c.dim) + " mode " + std::to_string(mode));
    }
  }
}

// The norm of a K-split GEMM's output: the input row is the sum of fp32 slabs
// (RmsNormParams::partials), added in slab order, with the residual add and without.
TEST_F(ElementwiseCudaTest, RmsNormOfKSplitPartials) {
  std::mt19937_64 rng(14);
  struct Case {
    int rows, dim, parts;
  };
  for (const Case c : {Case{1, 4096, 2}, Case{65, 4096, 2}, Case{7, 64, 3}, Case{33, 100, 2},
                       Case{3, 1000, 4}, Case{2, 2048, 1}}) {
    // 0: plain, 1: residual add, 2: residual add, the slabs and a dead buffer dropped from L2
    // after they are read (RmsNormParams::discard_partials, dead), as the backend runs it.
    for (int mode = 0; mode < 3; ++mode) {
      const size_t n = static_cast<size_t>(c.rows) * c.dim;
      const std::vector<float> parts = RandomNormal(n * c.parts, rng, 2.0f);
      const std::vector<float> w = RandomNormal(c.dim, rng, 0.5f);
      std::vector<float> residual = RandomNormal(n, rng, 3.0f);
      DeviceBuffer<float> d_parts(parts), d_w(w), d_res(residual);
      DeviceBuffer<bf16> d_out(n);
      cuda::RmsNormParams p;
      p.partials = d_parts.get();
      p.num_partials = c.parts;
      p.residual = mode == 0 ? nullptr : d_res.get();
      DeviceBuffer<bf16> d_dead(n);
      if (mode == 2) {
        p.discard_partials = true;
        p.dead[1] = {d_dead.get(), static_cast<int64_t>(c.dim * sizeof(bf16))};
      }
      p.weight = d_w.get();
      p.out = d_out.get();
      p.rows = c.rows;
      p.dim = c.dim;
      p.eps = 1e-5f;
      std::vector<float> x(n);
      for (size_t i = 0; i < n; ++i) {
        float sum = parts[i];
        for (int s = 1; s < c.parts; ++s) sum += parts[s * n + i];
        x[i] = sum;
      }
      // The residual exactly: the slabs' sum in slab order plus the residual is the same fp32
      // operations on both sides.
      ExpectRmsNormMatchesCpu(p, x, w, mode == 0 ? nullptr : &residual, d_res, d_out, 0.0f,
                              "rows " + std::to_string(c.rows) + " dim " +
                                  std::to_string(c.dim) + " parts " + std::to_string(c.parts) +
                                  " mode " + std::to_string(mode));
    }
  }
}

// RoPE over q and k of a fused QKV row, with llama3-scaled frequencies and positions up to
// 2e5, optionally with Qwen3's per-head norm fused in front.
TEST_F(ElementwiseCudaTest, RopeMatchesReference) {
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

    // Reference: RmsNormCpu over [tokens * heads, head_dim] (when fused), then RopeCpu.
    std::vector<float> q(static_cast<size_t>(c.tokens) * q_dim),
        k(static_cast<size_t>(c.tokens) * k_dim);
    for (int t = 0; t < c.tokens; ++t) {
      std::copy_n(&qkv[static_cast<size_t>(t) * stride], q_dim, &q[static_cast<size_t>(t) * q_dim]);
      std::copy_n(&qkv[static_cast<size_t>(t) * stride + q_dim], k_dim,
                  &k[static_cast<size_t>(t) * k_dim]);
    }
    if (c.qk_norm) {
      for (auto [buf, heads, weight] :
           {std::make_tuple(&q, c.q_heads, &q_norm), std::make_tuple(&k, c.k_heads, &k_norm)}) {
        RmsNormParams n;
        n.x = buf->data();
        n.weight = weight->data();
        n.out = buf->data();
        n.rows = int64_t{c.tokens} * heads;
        n.dim = c.head_dim;
        n.eps = 1e-6f;
        RmsNormCpu(n);
      }
    }
    for (auto [buf, heads] : {std::make_pair(&q, c.q_heads), std::make_pair(&k, c.k_heads)}) {
      RopeParams r;
      r.x = buf->data();
      r.positions = positions.data();
      r.inv_freq = inv_freq.data();
      r.num_tokens = c.tokens;
      r.num_heads = heads;
      r.head_dim = c.head_dim;
      r.row_stride = int64_t{heads} * c.head_dim;
      RopeCpu(r);
    }
    const std::vector<float> got = ToFloat(d_qkv.Download());
    std::vector<float> got_q(q.size()), got_k(k.size()), got_v, want_v;
    for (int t = 0; t < c.tokens; ++t) {
      std::copy_n(&got[static_cast<size_t>(t) * stride], q_dim,
                  &got_q[static_cast<size_t>(t) * q_dim]);
      std::copy_n(&got[static_cast<size_t>(t) * stride + q_dim], k_dim,
                  &got_k[static_cast<size_t>(t) * k_dim]);
      for (int i = q_dim + k_dim; i < stride; ++i) {
        got_v.push_back(got[static_cast<size_t>(t) * stride + i]);
        want_v.push_back(qkv[static_cast<size_t>(t) * stride + i]);
      }
    }
    const std::string what = "tokens " + std::to_string(c.tokens) + " heads " +
                             std::to_string(c.q_heads) + "/" + std::to_string(c.k_heads) +
                             " head_dim " + std::to_string(c.head_dim);
    EXPECT_TRUE(AllClose(got_q, q, 2e-2f, kBf16Rtol)) << "q, " << what;
    EXPECT_TRUE(AllClose(got_k, k, 2e-2f, kBf16Rtol)) << "k, " << what;
    EXPECT_TRUE(AllClose(got_v, want_v, 0.0f, 0.0f)) << "v untouched, " << what;

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

TEST_F(ElementwiseCudaTest, SwiGluMatchesReference) {
  std::mt19937_64 rng(14);
  // discard: gate_up and a dead buffer dropped from L2 after they are read
  // (SwiGluParams::discard_gate_up, dead), as the backend runs it.
  for (auto [rows, dim, discard] :
       {std::tuple{5, 1000, false}, std::tuple{3, 77, false}, std::tuple{64, 2816, false},
        std::tuple{5, 1000, true}, std::tuple{3, 77, true}, std::tuple{65, 14336, true},
        std::tuple{2, 56, true}}) {
    const std::vector<float> gate_up =
        RoundBf16(RandomNormal(static_cast<size_t>(rows) * 2 * dim, rng, 3.0f));
    DeviceBuffer<bf16> d_in(ToBf16(gate_up));
    DeviceBuffer<bf16> d_out(static_cast<size_t>(rows) * dim);
    DeviceBuffer<bf16> d_dead(static_cast<size_t>(rows) * 40);
    cuda::SwiGluParams p;
    p.gate_up = d_in.get();
    p.out = d_out.get();
    p.rows = rows;
    p.dim = dim;
    if (discard) {
      p.discard_gate_up = true;
      p.dead = {d_dead.get(), static_cast<int64_t>(40 * sizeof(bf16))};
    }
    SPECD_CUDA_OK(cuda::SwiGluCuda(p, stream_));
    Sync();
    std::vector<float> gate(static_cast<size_t>(rows) * dim), up(static_cast<size_t>(rows) * dim),
        want(static_cast<size_t>(rows) * dim);
    for (int r = 0; r < rows; ++r) {
      std::copy_n(&gate_up[static_cast<size_t>(r) * 2 * dim], dim,
                  &gate[static_cast<size_t>(r) * dim]);
      std::copy_n(&gate_up[static_cast<size_t>(r) * 2 * dim + dim], dim,
                  &up[static_cast<size_t>(r) * dim]);
    }
    SwiGluParams ref;
    ref.gate = gate.data();
    ref.up = up.data();
    ref.out = want.data();
    ref.n = int64_t{rows} * dim;
    SwiGluCpu(ref);
    EXPECT_TRUE(AllClose(ToFloat(d_out.Download()), want, 1e-3f, kBf16Rtol))
        << "rows " << rows << " dim " << dim << " discard " << discard;
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

}  // namespace
}  // namespace specd
