// The op table: every CUDA kernel against its fp32 CPU reference (kernels/cpu) on one table of
// cases -- op, shape, output dtype, tolerance -- in the manner of llama.cpp's test-backend-ops.
// Each case is a test of its own (OpTable/OpsCudaTest.MatchesCpuReference/<op>_<shape>...), on
// random data with awkward sizes. An op's runner builds the inputs from the case's shape, runs the
// launcher on the GPU and the reference on the host, and returns the outputs to compare; the table
// holds the tolerances. What is not a comparison with the CPU reference stays in the op's own file
// (tests/gpu/<op>_cuda_test.cc): bit identity across splits and batches, graphs, tensor
// parallelism, the params' checks.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/model_config.h"
#include "specd/kernels/cuda/embedding.h"
#include "specd/kernels/cuda/gemm.h"
#include "specd/kernels/cuda/kv_cache.h"
#include "specd/kernels/cuda/rmsnorm.h"
#include "specd/kernels/cuda/rope.h"
#include "specd/kernels/cuda/swiglu.h"
#include "specd/kernels/cuda/tree_attention.h"
#include "specd/kernels/embedding.h"
#include "specd/kernels/kv_cache.h"
#include "specd/kernels/linear.h"
#include "specd/kernels/rmsnorm.h"
#include "specd/kernels/rope.h"
#include "specd/kernels/swiglu.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/tree_attention_batch.h"

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

// One row of the table. `shape` holds the op's dimensions in the order its runner names them;
// `variant` is the op's switch (a residual mode, a bias, a batch kind: see each runner). The main
// output must satisfy |got - want| <= atol + rtol |want| elementwise (0 and 0: bit-exact).
struct OpCase {
  std::string op;
  std::vector<int64_t> shape;
  std::string dtype;  // of the main output: "bf16" or "f32"
  int variant = 0;
  float atol = 0.0f, rtol = 0.0f;
};

// An output of a run: the GPU's values and the reference's, with their tolerance.
struct Compared {
  std::string what;
  std::vector<float> got, want;
  float atol = 0.0f, rtol = 0.0f;
};

// A case's seed: a hash of its name, so that each case has data of its own whatever the table's
// order.
uint64_t SeedOf(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (const char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

std::string CaseName(const OpCase& c) {
  std::string name = c.op;
  for (size_t i = 0; i < c.shape.size(); ++i) {
    name += i == 0 ? "_" : "x";
    name += c.shape[i] < 0 ? "m" + std::to_string(-c.shape[i]) : std::to_string(c.shape[i]);
  }
  return name + "_" + c.dtype + "_v" + std::to_string(c.variant);
}

// gtest prints a case by its name (--gtest_list_tests, failures).
void PrintTo(const OpCase& c, std::ostream* os) { *os << CaseName(c); }

using Runner = void (*)(const OpCase& c, std::mt19937_64& rng, cudaStream_t stream,
                        std::vector<Compared>* out);

#define SPECD_RUN_OK(expr)                                                                 \
  do {                                                                                     \
    const cudaError_t specd_err_ = (expr);                                                 \
    ASSERT_EQ(specd_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(specd_err_); \
  } while (0)

// embedding: shape {vocab, tokens, hidden}. A repeated id and the last id among the tokens.
void RunEmbedding(const OpCase& c, std::mt19937_64& rng, cudaStream_t stream,
                  std::vector<Compared>* out) {
  const int vocab = static_cast<int>(c.shape[0]), n = static_cast<int>(c.shape[1]);
  const int hidden = static_cast<int>(c.shape[2]);
  const std::vector<float> table =
      RoundBf16(RandomNormal(static_cast<size_t>(vocab) * hidden, rng));
  std::vector<int32_t> tokens = gpu_test::RandomTokens(n, vocab, rng);
  tokens[3] = tokens[5];
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
  SPECD_RUN_OK(cuda::EmbeddingCuda(p, stream));
  SPECD_RUN_OK(cudaStreamSynchronize(stream));
  std::vector<float> want(static_cast<size_t>(n) * hidden);
  EmbeddingParams ref;
  ref.tokens = tokens.data();
  ref.table = table.data();
  ref.out = want.data();
  ref.num_tokens = n;
  ref.vocab_size = vocab;
  ref.hidden = hidden;
  EmbeddingCpu(ref);
  out->push_back({"out", ToFloat(d_out.Download()), want, c.atol, c.rtol});
}

// rms_norm: shape {rows, dim}; variant 0 plain, 1 residual add, 2 residual init (the residual's
// old contents are overwritten). rms_norm_partials: shape {rows, dim, parts}, the input row the
// sum of fp32 K-split slabs in slab order; variant 0 plain, 1 residual add, 2 residual add with
// the slabs and a dead buffer dropped from L2 after they are read, as the backend runs it.
void RunRmsNorm(const OpCase& c, std::mt19937_64& rng, cudaStream_t stream,
                std::vector<Compared>* out) {
  const bool partials = c.op == "rms_norm_partials";
  const int rows = static_cast<int>(c.shape[0]), dim = static_cast<int>(c.shape[1]);
  const int parts = partials ? static_cast<int>(c.shape[2]) : 0;
  const int mode = c.variant;
  const size_t n = static_cast<size_t>(rows) * dim;
  std::vector<float> x, part_values;
  if (partials) {
    part_values = RandomNormal(n * parts, rng, 2.0f);
    x.resize(n);
    for (size_t i = 0; i < n; ++i) {
      float sum = part_values[i];
      for (int s = 1; s < parts; ++s) sum += part_values[s * n + i];
      x[i] = sum;
    }
  } else {
    x = RoundBf16(RandomNormal(n, rng, 2.0f));
  }
  const std::vector<float> w = RandomNormal(dim, rng, 0.5f);  // fp32 weights
  std::vector<float> residual = RandomNormal(n, rng, 3.0f);
  const bool init = !partials && mode == 2;
  if (init) std::fill(residual.begin(), residual.end(), 0.0f);
  DeviceBuffer<bf16> d_x(ToBf16(partials ? std::vector<float>(1) : x));
  DeviceBuffer<float> d_parts(partials ? part_values : std::vector<float>(1));
  DeviceBuffer<float> d_w(w);
  DeviceBuffer<float> d_res(init ? RandomNormal(n, rng) : residual);  // init overwrites
  DeviceBuffer<bf16> d_out(n), d_dead(n);
  cuda::RmsNormParams p;
  if (partials) {
    p.partials = d_parts.get();
    p.num_partials = parts;
    if (mode == 2) {
      p.discard_partials = true;
      p.dead[1] = {d_dead.get(), static_cast<int64_t>(dim * sizeof(bf16))};
    }
  } else {
    p.x = d_x.get();
    p.residual_init = init;
  }
  p.residual = mode == 0 ? nullptr : d_res.get();
  p.weight = d_w.get();
  p.out = d_out.get();
  p.rows = rows;
  p.dim = dim;
  p.eps = 1e-5f;
  SPECD_RUN_OK(cuda::RmsNormCuda(p, stream));
  SPECD_RUN_OK(cudaStreamSynchronize(stream));
  std::vector<float> want(n);
  RmsNormParams ref;
  ref.x = x.data();
  ref.residual = mode == 0 ? nullptr : residual.data();
  ref.weight = w.data();
  ref.out = want.data();
  ref.rows = rows;
  ref.dim = dim;
  ref.eps = p.eps;
  RmsNormCpu(ref);
  out->push_back({"out", ToFloat(d_out.Download()), want, c.atol, c.rtol});
  if (mode != 0) {
    // Partials: the slabs' sum in slab order plus the residual is the same fp32 operations on
    // both sides, so the residual is exact.
    const float tol = partials ? 0.0f : 1e-6f;
    out->push_back({"residual", d_res.Download(), residual, tol, tol});
  }
}

// rope: shape {tokens, q_heads, k_heads, head_dim} over a fused q | k | v row, positions up to
// 2e5; variant bit 0: llama3-scaled frequencies, bit 1: Qwen3's per-head q/k norm fused in front.
void RunRope(const OpCase& c, std::mt19937_64& rng, cudaStream_t stream,
             std::vector<Compared>* out) {
  const int tokens = static_cast<int>(c.shape[0]), q_heads = static_cast<int>(c.shape[1]);
  const int k_heads = static_cast<int>(c.shape[2]), head_dim = static_cast<int>(c.shape[3]);
  const bool llama3 = (c.variant & 1) != 0, qk_norm = (c.variant & 2) != 0;
  ModelConfig config;
  config.hidden_size = q_heads * head_dim;
  config.num_heads = q_heads;
  config.head_dim = head_dim;
  config.rope_theta = 500000.0f;
  if (llama3) {
    config.rope_scaling.type = "llama3";
    config.rope_scaling.factor = 8.0f;
    config.rope_scaling.original_max_position_embeddings = 8192;
  }
  const std::vector<float> inv_freq = RopeInvFreq(config);
  ASSERT_EQ(inv_freq.size(), static_cast<size_t>(head_dim / 2));
  const int q_dim = q_heads * head_dim, k_dim = k_heads * head_dim;
  const int stride = q_dim + 2 * k_dim;
  const std::vector<float> qkv = RoundBf16(RandomNormal(static_cast<size_t>(tokens) * stride, rng));
  std::vector<int32_t> positions(tokens);
  std::uniform_int_distribution<int32_t> pos(0, 200000);
  for (int32_t& x : positions) x = pos(rng);
  positions[0] = 0;
  const std::vector<float> q_norm = RandomNormal(head_dim, rng, 0.5f);  // fp32 weights
  const std::vector<float> k_norm = RandomNormal(head_dim, rng, 0.5f);
  DeviceBuffer<bf16> d_qkv(ToBf16(qkv));
  DeviceBuffer<int32_t> d_pos(positions);
  DeviceBuffer<float> d_freq(inv_freq), d_qn(q_norm), d_kn(k_norm);
  cuda::RopeParams p;
  p.q = d_qkv.get();
  p.q_stride = stride;
  p.num_q_heads = q_heads;
  p.k = d_qkv.get() + q_dim;
  p.k_stride = stride;
  p.num_k_heads = k_heads;
  p.positions = d_pos.get();
  p.inv_freq = d_freq.get();
  if (qk_norm) {
    p.q_norm_weight = d_qn.get();
    p.k_norm_weight = d_kn.get();
  }
  p.norm_eps = 1e-6f;
  p.num_tokens = tokens;
  p.head_dim = head_dim;
  SPECD_RUN_OK(cuda::RopeCuda(p, stream));
  SPECD_RUN_OK(cudaStreamSynchronize(stream));
  // Reference: RmsNormCpu over [tokens * heads, head_dim] (when fused), then RopeCpu.
  std::vector<float> q(static_cast<size_t>(tokens) * q_dim), k(static_cast<size_t>(tokens) * k_dim);
  for (int t = 0; t < tokens; ++t) {
    std::copy_n(&qkv[static_cast<size_t>(t) * stride], q_dim, &q[static_cast<size_t>(t) * q_dim]);
    std::copy_n(&qkv[static_cast<size_t>(t) * stride + q_dim], k_dim,
                &k[static_cast<size_t>(t) * k_dim]);
  }
  if (qk_norm) {
    for (auto [buf, heads, weight] :
         {std::make_tuple(&q, q_heads, &q_norm), std::make_tuple(&k, k_heads, &k_norm)}) {
      RmsNormParams norm;
      norm.x = buf->data();
      norm.weight = weight->data();
      norm.out = buf->data();
      norm.rows = int64_t{tokens} * heads;
      norm.dim = head_dim;
      norm.eps = 1e-6f;
      RmsNormCpu(norm);
    }
  }
  for (auto [buf, heads] : {std::make_pair(&q, q_heads), std::make_pair(&k, k_heads)}) {
    RopeParams r;
    r.x = buf->data();
    r.positions = positions.data();
    r.inv_freq = inv_freq.data();
    r.num_tokens = tokens;
    r.num_heads = heads;
    r.head_dim = head_dim;
    r.row_stride = int64_t{heads} * head_dim;
    RopeCpu(r);
  }
  const std::vector<float> got = ToFloat(d_qkv.Download());
  std::vector<float> got_q(q.size()), got_k(k.size()), got_v, want_v;
  for (int t = 0; t < tokens; ++t) {
    std::copy_n(&got[static_cast<size_t>(t) * stride], q_dim,
                &got_q[static_cast<size_t>(t) * q_dim]);
    std::copy_n(&got[static_cast<size_t>(t) * stride + q_dim], k_dim,
                &got_k[static_cast<size_t>(t) * k_dim]);
    for (int i = q_dim + k_dim; i < stride; ++i) {
      got_v.push_back(got[static_cast<size_t>(t) * stride + i]);
      want_v.push_back(qkv[static_cast<size_t>(t) * stride + i]);
    }
  }
  out->push_back({"q", got_q, q, c.atol, c.rtol});
  out->push_back({"k", got_k, k, c.atol, c.rtol});
  out->push_back({"v untouched", got_v, want_v, 0.0f, 0.0f});
}

// swiglu: shape {rows, dim} over [rows, 2 dim] gate | up rows; variant 1: gate_up and a dead
// buffer dropped from L2 after they are read, as the backend runs it.
void RunSwiGlu(const OpCase& c, std::mt19937_64& rng, cudaStream_t stream,
               std::vector<Compared>* out) {
  const int rows = static_cast<int>(c.shape[0]), dim = static_cast<int>(c.shape[1]);
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
  if (c.variant == 1) {
    p.discard_gate_up = true;
    p.dead = {d_dead.get(), static_cast<int64_t>(40 * sizeof(bf16))};
  }
  SPECD_RUN_OK(cuda::SwiGluCuda(p, stream));
  SPECD_RUN_OK(cudaStreamSynchronize(stream));
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
  out->push_back({"out", ToFloat(d_out.Download()), want, c.atol, c.rtol});
}

// The CPU reference y [m, n] = x [m, k] w [n, k]^T (+ bias [n] where not null), host fp32.
std::vector<float> CpuProduct(const float* x, const float* w, const float* bias, int m, int n,
                              int k) {
  std::vector<float> y(static_cast<size_t>(m) * n);
  LinearParams ref;
  ref.x = x;
  ref.w = w;
  ref.bias = bias;
  ref.y = y.data();
  ref.rows = m;
  ref.in_features = k;
  ref.out_features = n;
  LinearNaiveCpu(ref);
  return y;
}

// The CUDA backend's cuBLASLt workspace (engine/cuda/cuda_forward.cc).
constexpr size_t kBackendWorkspace = size_t{128} << 20;

// gemm: shape {m, n, k, invariant_rows} (0: per-shape picks; 1024: one algorithm per row class,
// as the engine runs it, each class's algorithm first used and self-checked here); variant 1:
// with a bias; dtype f32 for the LM head's output. gemm_ksplit: shape {m, n, k, k_splits,
// invariant_rows}, each fp32 slab the product over its K range alone. Each runs twice: the second
// call reuses the cached plan.
void RunGemm(const OpCase& c, std::mt19937_64& rng, cudaStream_t stream,
             std::vector<Compared>* out) {
  const bool ksplit = c.op == "gemm_ksplit";
  const int m = static_cast<int>(c.shape[0]), n = static_cast<int>(c.shape[1]);
  const int k = static_cast<int>(c.shape[2]);
  const int splits = ksplit ? static_cast<int>(c.shape[3]) : 1;
  const int64_t invariant_rows = c.shape[ksplit ? 4 : 3];
  const bool y_fp32 = c.dtype == "f32", bias = c.variant == 1;
  std::unique_ptr<cuda::Gemm> gemm;
  ASSERT_EQ(cuda::Gemm::Create(kBackendWorkspace, &gemm, invariant_rows), CUBLAS_STATUS_SUCCESS);
  // Scaled so that the products are O(1) whatever k is.
  const std::vector<float> x = RoundBf16(RandomNormal(static_cast<size_t>(m) * k, rng));
  const std::vector<float> w =
      RoundBf16(RandomNormal(static_cast<size_t>(n) * k, rng, 1.0f / std::sqrt(float(k))));
  const std::vector<float> b = RoundBf16(RandomNormal(n, rng));
  DeviceBuffer<bf16> d_x(ToBf16(x)), d_w(ToBf16(w)), d_bias(ToBf16(b));
  DeviceBuffer<bf16> d_y16(static_cast<size_t>(m) * n);
  DeviceBuffer<float> d_y32(static_cast<size_t>(splits) * m * n);
  cuda::GemmParams p;
  p.x = d_x.get();
  p.w = d_w.get();
  p.bias = bias ? d_bias.get() : nullptr;
  p.y = y_fp32 ? static_cast<void*>(d_y32.get()) : static_cast<void*>(d_y16.get());
  p.y_fp32 = y_fp32;
  p.m = m;
  p.n = n;
  p.k = k;
  p.k_splits = splits;
  for (int rep = 0; rep < 2; ++rep) ASSERT_EQ(gemm->Run(p, stream), CUBLAS_STATUS_SUCCESS);
  SPECD_RUN_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(gemm->self_check_failures(), 0) << gemm->Summary();
  EXPECT_EQ(gemm->untimed_bases(), 0) << gemm->Summary();
  if (!ksplit) {
    out->push_back({"y", y_fp32 ? d_y32.Download() : ToFloat(d_y16.Download()),
                    CpuProduct(x.data(), w.data(), bias ? b.data() : nullptr, m, n, k), c.atol,
                    c.rtol});
    return;
  }
  const std::vector<float> got = d_y32.Download();
  const int part = k / splits;
  for (int s = 0; s < splits; ++s) {
    // The K range s of x and w as matrices of their own.
    std::vector<float> xs(static_cast<size_t>(m) * part), ws(static_cast<size_t>(n) * part);
    for (int r = 0; r < m; ++r)
      std::copy_n(x.begin() + r * k + s * part, part, xs.begin() + r * part);
    for (int r = 0; r < n; ++r)
      std::copy_n(w.begin() + r * k + s * part, part, ws.begin() + r * part);
    out->push_back({"slab " + std::to_string(s),
                    std::vector<float>(got.begin() + static_cast<size_t>(s) * m * n,
                                       got.begin() + static_cast<size_t>(s + 1) * m * n),
                    CpuProduct(xs.data(), ws.data(), nullptr, m, n, part), c.atol, c.rtol});
  }
}

// kv_cache_write: shape {kv_heads, head_dim}; 37 tokens from a fused QKV output (k and v column
// ranges of wider rows) into shuffled slots of 200, token 4 skipped (slot -1).
void RunKvCacheWrite(const OpCase& c, std::mt19937_64& rng, cudaStream_t stream,
                     std::vector<Compared>* out) {
  const int kv_dim = static_cast<int>(c.shape[0] * c.shape[1]), num_slots = 200, tokens = 37;
  const int stride = 3 * kv_dim + 8;
  const std::vector<float> qkv = RoundBf16(RandomNormal(static_cast<size_t>(tokens) * stride, rng));
  std::vector<int64_t> slots(num_slots);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(tokens);
  slots[4] = -1;
  const std::vector<float> cache0 =
      RoundBf16(RandomNormal(static_cast<size_t>(num_slots) * kv_dim, rng));
  DeviceBuffer<bf16> d_qkv(ToBf16(qkv)), d_k(ToBf16(cache0)), d_v(ToBf16(cache0));
  DeviceBuffer<int64_t> d_slots(slots);
  cuda::KvCacheWriteParams p;
  p.k = d_qkv.get() + kv_dim;
  p.k_stride = stride;
  p.v = d_qkv.get() + 2 * kv_dim;
  p.v_stride = stride;
  p.k_cache = d_k.get();
  p.v_cache = d_v.get();
  p.slots = d_slots.get();
  p.num_tokens = tokens;
  p.kv_dim = kv_dim;
  SPECD_RUN_OK(cuda::KvCacheWriteCuda(p, stream));
  SPECD_RUN_OK(cudaStreamSynchronize(stream));
  // Reference over the tokens with a slot (the CPU op has no skip).
  std::vector<float> k, v;
  std::vector<int64_t> ref_slots;
  for (int t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    ref_slots.push_back(slots[t]);
    k.insert(k.end(), &qkv[static_cast<size_t>(t) * stride + kv_dim],
             &qkv[static_cast<size_t>(t) * stride + 2 * kv_dim]);
    v.insert(v.end(), &qkv[static_cast<size_t>(t) * stride + 2 * kv_dim],
             &qkv[static_cast<size_t>(t) * stride + 3 * kv_dim]);
  }
  std::vector<float> want_k = cache0, want_v = cache0;
  KvCacheWriteParams ref;
  ref.k = k.data();
  ref.v = v.data();
  ref.k_cache = want_k.data();
  ref.v_cache = want_v.data();
  ref.slots = ref_slots.data();
  ref.num_tokens = static_cast<int64_t>(ref_slots.size());
  ref.kv_dim = kv_dim;
  KvCacheWriteCpu(ref);
  out->push_back({"k cache", ToFloat(d_k.Download()), want_k, c.atol, c.rtol});
  out->push_back({"v cache", ToFloat(d_v.Download()), want_v, c.atol, c.rtol});
}

// Copies src[i] -> dst[i], in order, in every layer of [layers, layer_stride] host pools.
void CopySlotsCpu(std::vector<float>* k, std::vector<float>* v, int layers, int64_t layer_stride,
                  const std::vector<int64_t>& src, const std::vector<int64_t>& dst, int kv_dim) {
  for (int l = 0; l < layers; ++l) {
    KvCacheCopyParams ref;
    ref.k_cache = k->data() + l * layer_stride;
    ref.v_cache = v->data() + l * layer_stride;
    ref.src_slots = src.data();
    ref.dst_slots = dst.data();
    ref.num_copies = static_cast<int64_t>(src.size());
    ref.kv_dim = kv_dim;
    KvCacheCopyCpu(ref);
  }
}

// kv_cache_copy: shape {layers, slots, kv_dim}; chained copies (a later copy reads what an
// earlier one wrote over) in every layer.
void RunKvCacheCopy(const OpCase& c, std::mt19937_64& rng, cudaStream_t stream,
                    std::vector<Compared>* out) {
  const int layers = static_cast<int>(c.shape[0]), num_slots = static_cast<int>(c.shape[1]);
  const int kv_dim = static_cast<int>(c.shape[2]);
  const int64_t layer_stride = int64_t{num_slots} * kv_dim;
  const std::vector<float> cache0 = RoundBf16(RandomNormal(layers * layer_stride, rng));
  const std::vector<int64_t> src = {5, 9, 9, 40, 2, num_slots - 1};
  const std::vector<int64_t> dst = {1, 5, 10, 9, 3, 0};
  DeviceBuffer<bf16> d_k(ToBf16(cache0)), d_v(ToBf16(cache0));
  DeviceBuffer<int64_t> d_src(src), d_dst(dst);
  cuda::KvCacheCopyParams p;
  p.k_cache = d_k.get();
  p.v_cache = d_v.get();
  p.num_layers = layers;
  p.layer_stride = layer_stride;
  p.src_slots = d_src.get();
  p.dst_slots = d_dst.get();
  p.num_copies = static_cast<int64_t>(src.size());
  p.kv_dim = kv_dim;
  SPECD_RUN_OK(cuda::KvCacheCopyCuda(p, stream));
  SPECD_RUN_OK(cudaStreamSynchronize(stream));
  std::vector<float> want_k = cache0, want_v = cache0;
  CopySlotsCpu(&want_k, &want_v, layers, layer_stride, src, dst, kv_dim);
  out->push_back({"k cache", ToFloat(d_k.Download()), want_k, c.atol, c.rtol});
  out->push_back({"v cache", ToFloat(d_v.Download()), want_v, c.atol, c.rtol});
}

// kv_cache_compact: shape {layers, kv_dim, block_size}; the accepted paths of three sequences
// (one empty), read from device arrays as TreeAcceptCuda leaves them, compacted through shuffled
// block tables with bases that the blocks do not align to; the reference is the same moves as
// copies through the block tables.
void RunKvCacheCompact(const OpCase& c, std::mt19937_64& rng, cudaStream_t stream,
                       std::vector<Compared>* out) {
  const int layers = static_cast<int>(c.shape[0]), kv_dim = static_cast<int>(c.shape[1]);
  const int block_size = static_cast<int>(c.shape[2]), max_blocks = 24, num_blocks = 80;
  const int num_slots = num_blocks * block_size;
  const int64_t layer_stride = int64_t{num_slots} * kv_dim;
  const std::vector<float> cache0 = RoundBf16(RandomNormal(layers * layer_stride, rng));
  std::vector<int32_t> blocks(num_blocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  std::vector<int32_t> table(3 * max_blocks);  // three sequences: rows 2, 0, 1
  std::copy_n(blocks.begin(), table.size(), table.begin());
  const std::vector<int32_t> seq_rows = {2, 0, 1};
  const std::vector<int32_t> base = {37, 5, 250};
  const int node_stride = 257;
  const std::vector<std::vector<int32_t>> paths = {{1, 3, 4, 9}, {}, {0, 2, 7, 30, 31, 100, 130}};
  std::vector<int32_t> nodes(3 * node_stride, -7), counts;
  for (int s = 0; s < 3; ++s) {
    std::copy(paths[s].begin(), paths[s].end(), nodes.begin() + s * node_stride);
    counts.push_back(static_cast<int32_t>(paths[s].size()));
  }
  DeviceBuffer<bf16> d_k(ToBf16(cache0)), d_v(ToBf16(cache0));
  DeviceBuffer<int32_t> d_table(table), d_rows(seq_rows), d_base(base), d_nodes(nodes),
      d_counts(counts);
  cuda::KvCacheCompactParams p;
  p.kv.k_cache = d_k.get();
  p.kv.v_cache = d_v.get();
  p.kv.block_tables = d_table.get();
  p.kv.max_blocks_per_seq = max_blocks;
  p.kv.block_size = block_size;
  p.num_layers = layers;
  p.layer_stride = layer_stride;
  p.kv_dim = kv_dim;
  p.seq_rows = d_rows.get();
  p.base_slot = d_base.get();
  p.nodes = d_nodes.get();
  p.num_nodes = d_counts.get();
  p.node_stride = node_stride;
  p.num_seqs = 3;
  SPECD_RUN_OK(cuda::KvCacheCompactCuda(p, stream));
  SPECD_RUN_OK(cudaStreamSynchronize(stream));
  std::vector<int64_t> src, dst;
  for (int s = 0; s < 3; ++s) {
    auto physical = [&](int64_t logical) {
      return int64_t{table[seq_rows[s] * max_blocks + logical / block_size]} * block_size +
             logical % block_size;
    };
    for (size_t j = 0; j < paths[s].size(); ++j) {
      src.push_back(physical(base[s] + paths[s][j]));
      dst.push_back(physical(base[s] + static_cast<int64_t>(j)));
    }
  }
  std::vector<float> want_k = cache0, want_v = cache0;
  CopySlotsCpu(&want_k, &want_v, layers, layer_stride, src, dst, kv_dim);
  out->push_back({"k cache", ToFloat(d_k.Download()), want_k, c.atol, c.rtol});
  out->push_back({"v cache", ToFloat(d_v.Download()), want_v, c.atol, c.rtol});
}

// tree_attention: shape {num_heads, num_kv_heads, head_dim, block_size, batch, index,
// force_splits}. batch (the variant's tests/gpu/tree_attention_batch.h batches): 0 decode, 1
// prefill chains, 2 verification trees (VerifyBatchAt(index)), 3 a 256-node tree over 4095 keys
// (LongTreeAt(index)); force_splits as RunTreeAttentionGpu takes it (0 the plan's, 1 unsplit, c
// > 1 at least c splits, -c every chunk split with c chunks a CTA).
std::vector<gpu_test::SeqSpec> TreeAttentionSeqs(const OpCase& c, bool generic) {
  const int batch = static_cast<int>(c.shape[4]), index = static_cast<int>(c.shape[5]);
  switch (batch) {
    case 0:
      return gpu_test::DecodeBatch();
    case 1:
      return gpu_test::PrefillBatch();
    case 2:
      return gpu_test::VerifyBatchAt(index, generic ? 5 : 4, generic ? 12 : 7);
    default:
      return {gpu_test::LongTreeAt(index, generic ? 13 : 8)};
  }
}

void RunTreeAttention(const OpCase& c, std::mt19937_64& rng, cudaStream_t stream,
                      std::vector<Compared>* out) {
  (void)rng;  // the batches are tree_attention_batch.h's, seeded by batch kind
  const gpu_test::Shape sh{static_cast<int>(c.shape[0]), static_cast<int>(c.shape[1]),
                           static_cast<int>(c.shape[2]), static_cast<int>(c.shape[3])};
  const bool generic = !cuda::TreeAttentionUsesMmaKernel(sh.head_dim);
  const int batch = static_cast<int>(c.shape[4]);
  const uint64_t seed = (generic ? 600 : 100) + 100 * static_cast<uint64_t>(batch) +
                        (batch == 3 ? 2 + static_cast<uint64_t>(c.shape[5]) % 2 : 0);
  const float scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
  // A batch's split cases are consecutive in the table: the batch and its CPU reference are
  // made for the first and kept for the others (the last batch only: they are large).
  struct Made {
    std::vector<int64_t> key;
    gpu_test::Batch batch;
    std::vector<float> want;
  };
  static Made* last = new Made;
  const std::vector<int64_t> key(c.shape.begin(), c.shape.end() - 1);
  if (last->key != key) {
    last->key.clear();
    last->batch = gpu_test::BuildBatch(sh, TreeAttentionSeqs(c, generic), seed);
    last->want = gpu_test::RunTreeAttentionCpu(sh, last->batch, scale);
    last->key = key;
  }
  const gpu_test::Batch& b = last->batch;
  std::vector<float> got = gpu_test::RunTreeAttentionGpu(
      sh, static_cast<int>(c.shape[6]), b.q, b.q_stride, b.k_cache, b.v_cache, b.tables,
      b.max_blocks, b.query_seq, b.kv_end, b.mask_begin, b.mask, scale, stream);
  out->push_back({"out", std::move(got), last->want, c.atol, c.rtol});
}

const std::map<std::string, Runner>& Runners() {
  static const auto* runners = new std::map<std::string, Runner>{
      {"embedding", RunEmbedding},
      {"rms_norm", RunRmsNorm},
      {"rms_norm_partials", RunRmsNorm},
      {"rope", RunRope},
      {"swiglu", RunSwiGlu},
      {"gemm", RunGemm},
      {"gemm_ksplit", RunGemm},
      {"kv_cache_write", RunKvCacheWrite},
      {"kv_cache_copy", RunKvCacheCopy},
      {"kv_cache_compact", RunKvCacheCompact},
      {"tree_attention", RunTreeAttention},
  };
  return *runners;
}

// The table.
std::vector<OpCase> AllCases() {
  std::vector<OpCase> cases;
  // Embedding rows are copied: exact. 136: the 16-byte vector path; 37: the scalar path.
  for (int64_t hidden : {136, 37}) cases.push_back({"embedding", {1001, 97, hidden}, "bf16", 0});
  // Normalised bf16 outputs: fp32 math then one bf16 rounding.
  for (const auto& [rows, dim] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 4096}, {7, 64}, {33, 100}, {5, 8192}, {3, 1000}}) {
    for (int mode = 0; mode < 3; ++mode) {
      cases.push_back({"rms_norm", {rows, dim}, "bf16", mode, 1e-3f, kBf16Rtol});
    }
  }
  for (const std::vector<int64_t>& s : std::vector<std::vector<int64_t>>{
           {1, 4096, 2}, {65, 4096, 2}, {7, 64, 3}, {33, 100, 2}, {3, 1000, 4}, {2, 2048, 1}}) {
    for (int mode = 0; mode < 3; ++mode) {
      cases.push_back({"rms_norm_partials", s, "bf16", mode, 1e-3f, kBf16Rtol});
    }
  }
  // RoPE at positions up to 2e5: the angle's fp32 rounding is the reference's too; the sine and
  // cosine and the bf16 output add their errors.
  for (const auto& [s, variant] :
       std::vector<std::pair<std::vector<int64_t>, int>>{{{9, 7, 1, 64}, 0},
                                                         {{5, 12, 4, 128}, 1},
                                                         {{17, 3, 3, 128}, 2},
                                                         {{4, 5, 5, 64}, 3},
                                                         {{7, 4, 2, 32}, 0},
                                                         {{6, 5, 1, 16}, 2},
                                                         {{3, 3, 1, 16}, 1}}) {
    cases.push_back({"rope", s, "bf16", variant, 2e-2f, kBf16Rtol});
  }
  for (const auto& [rows, dim, discard] :
       std::vector<std::tuple<int64_t, int64_t, int>>{{5, 1000, 0},
                                                      {3, 77, 0},
                                                      {64, 2816, 0},
                                                      {5, 1000, 1},
                                                      {3, 77, 1},
                                                      {65, 14336, 1},
                                                      {2, 56, 1}}) {
    cases.push_back({"swiglu", {rows, dim}, "bf16", discard, 1e-3f, kBf16Rtol});
  }
  // GEMMs: fp32 accumulation of O(1) sums; a bf16 output adds its rounding.
  for (int64_t invariant_rows : {0, 1024}) {
    for (const auto& [m, n, k, fp32, bias] :
         std::vector<std::tuple<int64_t, int64_t, int64_t, bool, int>>{{1, 384, 256, false, 0},
                                                                       {7, 1000, 136, false, 1},
                                                                       {64, 320, 64, true, 0},
                                                                       {257, 1001, 200, false, 0},
                                                                       {3, 4096, 1024, true, 0},
                                                                       {1, 1001, 136, true, 0},
                                                                       {65, 2048, 512, false, 1},
                                                                       {1024, 512, 256, true, 0}}) {
      cases.push_back({"gemm",
                       {m, n, k, invariant_rows},
                       fp32 ? "f32" : "bf16",
                       bias,
                       fp32 ? 1e-3f : 1e-2f,
                       fp32 ? 1e-3f : kBf16Rtol});
    }
    for (const std::vector<int64_t>& s : std::vector<std::vector<int64_t>>{{1, 4096, 1024, 2},
                                                                           {65, 1000, 512, 2},
                                                                           {7, 384, 768, 4},
                                                                           {3, 320, 384, 3},
                                                                           {257, 512, 256, 2}}) {
      std::vector<int64_t> shape = s;
      shape.push_back(invariant_rows);
      cases.push_back({"gemm_ksplit", shape, "f32", 0, 1e-3f, 1e-3f});
    }
  }
  // KV cache moves are data movement: exact.
  for (const auto& [kv_heads, head_dim] :
       std::vector<std::pair<int64_t, int64_t>>{{3, 64}, {1, 128}, {1, 36}, {2, 32}, {1, 16}}) {
    cases.push_back({"kv_cache_write", {kv_heads, head_dim}, "bf16", 0});
  }
  cases.push_back({"kv_cache_copy", {3, 64, 128}, "bf16", 0});
  cases.push_back({"kv_cache_compact", {2, 192, 16}, "bf16", 0});
  // Tree attention: outputs are convex combinations of N(0, 1) values; bf16 probabilities in the
  // P V product and the bf16 output each add about 2^-9 relative error.
  const auto attention = [&](const gpu_test::Shape& sh, int batch, int index,
                             std::vector<int> splits) {
    splits.push_back(-2);  // every chunk split, 2 and 3 chunks a CTA
    splits.push_back(-3);
    for (int force : splits) {
      cases.push_back(
          {"tree_attention",
           {sh.num_heads, sh.num_kv_heads, sh.head_dim, sh.block_size, batch, index, force},
           "bf16",
           batch,
           4e-3f,
           2e-2f});
    }
  };
  for (const gpu_test::Shape* shapes : {gpu_test::kShapes, gpu_test::kGenericShapes}) {
    const bool mma = shapes == gpu_test::kShapes;
    const int count = mma ? std::size(gpu_test::kShapes) : std::size(gpu_test::kGenericShapes);
    for (int i = 0; i < count; ++i) attention(shapes[i], 0, 0, {0, 1, 3});
    for (int i = 0; i < count; ++i) {
      if (!mma || i == 0 || i == 1 || i == 4 || i == 5 || i == 6) {
        attention(shapes[i], 1, 0, {0, 2});
      }
    }
    for (int i = 0; i < count; ++i) attention(shapes[i], 2, i, {0, 1, 4});
    const std::vector<int> long_tree_shapes =
        mma ? std::vector<int>{1, 5, 6} : std::vector<int>{0, 3, 7};
    for (size_t pos = 0; pos < long_tree_shapes.size(); ++pos) {
      for (int tree : {0, 1}) {
        attention(shapes[long_tree_shapes[pos]], 3, 2 * static_cast<int>(pos) + tree, {0});
      }
    }
  }
  return cases;
}

class OpsCudaTest : public gpu_test::GpuTest, public ::testing::WithParamInterface<OpCase> {};

TEST_P(OpsCudaTest, MatchesCpuReference) {
  const OpCase& c = GetParam();
  const auto runner = Runners().find(c.op);
  ASSERT_NE(runner, Runners().end()) << "no runner for op " << c.op;
  std::mt19937_64 rng(SeedOf(CaseName(c)));
  std::vector<Compared> outputs;
  runner->second(c, rng, stream_, &outputs);
  ASSERT_FALSE(outputs.empty()) << CaseName(c) << ": nothing to compare";
  for (const Compared& o : outputs) {
    EXPECT_TRUE(AllClose(o.got, o.want, o.atol, o.rtol)) << CaseName(c) << ": " << o.what;
  }
}

INSTANTIATE_TEST_SUITE_P(OpTable, OpsCudaTest, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) {
                           return CaseName(info.param);
                         });

// The table itself, without a GPU: every op has a runner, names are unique (each case is a test
// of its own), and every launcher of the library that compares with a CPU reference is in it.
TEST(OpTableTest, CasesAreWellFormed) {
  const std::vector<OpCase> cases = AllCases();
  std::map<std::string, int> per_op;
  std::map<std::string, int> names;
  for (const OpCase& c : cases) {
    EXPECT_TRUE(Runners().count(c.op) == 1) << c.op;
    EXPECT_TRUE(c.dtype == "bf16" || c.dtype == "f32") << CaseName(c);
    EXPECT_GE(c.atol, 0.0f);
    EXPECT_GE(c.rtol, 0.0f);
    ++per_op[c.op];
    EXPECT_EQ(++names[CaseName(c)], 1) << "duplicate case " << CaseName(c);
  }
  for (const auto& [op, runner] : Runners()) EXPECT_GT(per_op[op], 0) << op << " has no case";
}

}  // namespace
}  // namespace specd
