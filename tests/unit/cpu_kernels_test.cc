// The CPU reference kernels against straightforward double-precision formulas on random data
// with awkward sizes (the linear layer has its own tests: linear_cpu_test.cc).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "specd/kernels/embedding.h"
#include "specd/kernels/kv_cache.h"
#include "specd/kernels/rmsnorm.h"
#include "specd/kernels/rope.h"
#include "specd/kernels/swiglu.h"
#include "specd/kernels/tree_attention.h"

namespace specd {
namespace {

std::vector<float> Random(size_t n, uint64_t seed, float stddev = 1.0f, float mean = 0.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(mean, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// |got - want| <= tol * max(1, |want|); NaN never passes.
void ExpectClose(const std::vector<float>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << i;
    ASSERT_LE(std::abs(got[i] - want[i]), tol * std::max(1.0, std::abs(want[i])))
        << "index " << i << ": " << got[i] << " vs " << want[i];
  }
}

TEST(EmbeddingCpuTest, GathersRows) {
  const int64_t vocab = 37, hidden = 13;
  const std::vector<float> table = Random(vocab * hidden, 1);
  const std::vector<int32_t> tokens = {5, 0, 36, 5, 17};
  std::vector<float> out(tokens.size() * hidden, NAN);
  EmbeddingParams p;
  p.tokens = tokens.data();
  p.table = table.data();
  p.out = out.data();
  p.num_tokens = static_cast<int64_t>(tokens.size());
  p.vocab_size = vocab;
  p.hidden = hidden;
  EmbeddingCpu(p);
  for (size_t t = 0; t < tokens.size(); ++t) {
    for (int64_t i = 0; i < hidden; ++i) {
      EXPECT_EQ(out[t * hidden + i], table[tokens[t] * hidden + i]);
    }
  }
}

TEST(RmsNormCpuTest, MatchesFormulaAndFusedResidualEqualsAddThenNorm) {
  const int64_t rows = 7, dim = 99;
  const std::vector<float> x = Random(rows * dim, 2, 3.0f);
  const std::vector<float> w = Random(dim, 3, 0.1f, 1.0f);
  std::vector<double> want(rows * dim);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += double{x[r * dim + i]} * x[r * dim + i];
    for (int64_t i = 0; i < dim; ++i) {
      want[r * dim + i] = x[r * dim + i] / std::sqrt(ss / dim + 1e-6) * w[i];
    }
  }
  std::vector<float> out(rows * dim);
  RmsNormParams p;
  p.x = x.data();
  p.weight = w.data();
  p.out = out.data();
  p.rows = rows;
  p.dim = dim;
  p.eps = 1e-6f;
  RmsNormCpu(p);
  ExpectClose(out, want, 1e-6);

  // Fused: residual <- a + residual, out = norm(residual).
  const std::vector<float> a = Random(rows * dim, 4);
  std::vector<float> res = Random(rows * dim, 5);
  std::vector<float> sum(rows * dim);
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = a[i] + res[i];
  std::vector<float> separate(rows * dim), fused(rows * dim);
  p.x = sum.data();
  p.out = separate.data();
  RmsNormCpu(p);
  p.x = a.data();
  p.residual = res.data();
  p.out = fused.data();
  RmsNormCpu(p);
  EXPECT_EQ(res, sum);
  EXPECT_EQ(fused, separate);
}

TEST(RopeCpuTest, MatchesRotationFormulaWithStridedRows) {
  const int64_t tokens = 5, heads = 3, hd = 10, stride = heads * hd + 7;
  std::vector<float> x = Random(tokens * stride, 6);
  const std::vector<float> orig = x;
  const std::vector<int32_t> pos = {0, 1, 17, 300, 4095};
  std::vector<float> inv(hd / 2);
  for (int64_t i = 0; i < hd / 2; ++i) inv[i] = std::pow(10000.0f, -2.0f * i / hd);
  RopeParams p;
  p.x = x.data();
  p.positions = pos.data();
  p.inv_freq = inv.data();
  p.num_tokens = tokens;
  p.num_heads = heads;
  p.head_dim = hd;
  p.row_stride = stride;
  RopeCpu(p);
  std::vector<double> want(orig.begin(), orig.end());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < hd / 2; ++i) {
        // The angle is rounded to fp32 first, as transformers does.
        const double a = static_cast<float>(static_cast<float>(pos[t]) * inv[i]);
        const size_t lo = t * stride + h * hd + i, hi = lo + hd / 2;
        want[lo] = orig[lo] * std::cos(a) - orig[hi] * std::sin(a);
        want[hi] = orig[hi] * std::cos(a) + orig[lo] * std::sin(a);
      }
    }
  }
  ExpectClose(x, want, 1e-6);
  // Position 0 is the identity; the padding past heads * head_dim is untouched.
  for (int64_t i = 0; i < heads * hd; ++i) EXPECT_EQ(x[i], orig[i]);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = heads * hd; i < stride; ++i)
      EXPECT_EQ(x[t * stride + i], orig[t * stride + i]);
  }
}

TEST(SwiGluCpuTest, MatchesFormula) {
  const int64_t n = 1001;
  const std::vector<float> g = Random(n, 7, 4.0f), u = Random(n, 8);
  std::vector<float> out(n);
  SwiGluParams p;
  p.gate = g.data();
  p.up = u.data();
  p.out = out.data();
  p.n = n;
  SwiGluCpu(p);
  std::vector<double> want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = g[i] / (1.0 + std::exp(-double{g[i]})) * u[i];
  ExpectClose(out, want, 1e-6);
}

TEST(KvCacheCpuTest, WritesAndCopiesSlots) {
  const int64_t kv_dim = 6, slots = 10;
  std::vector<float> kc(slots * kv_dim, 0.0f), vc(slots * kv_dim, 0.0f);
  const std::vector<float> k = Random(3 * kv_dim, 14), v = Random(3 * kv_dim, 15);
  const std::vector<int64_t> where = {7, 2, 9};
  KvCacheWriteParams w;
  w.k = k.data();
  w.v = v.data();
  w.k_cache = kc.data();
  w.v_cache = vc.data();
  w.slots = where.data();
  w.num_tokens = 3;
  w.kv_dim = kv_dim;
  KvCacheWriteCpu(w);
  for (int t = 0; t < 3; ++t) {
    for (int64_t i = 0; i < kv_dim; ++i) {
      EXPECT_EQ(kc[where[t] * kv_dim + i], k[t * kv_dim + i]);
      EXPECT_EQ(vc[where[t] * kv_dim + i], v[t * kv_dim + i]);
    }
  }
  // Compaction: 7 -> 2 after 2 -> 1 (ordered so no source is overwritten first).
  const std::vector<int64_t> src = {2, 7}, dst = {1, 2};
  KvCacheCopyParams c;
  c.k_cache = kc.data();
  c.v_cache = vc.data();
  c.src_slots = src.data();
  c.dst_slots = dst.data();
  c.num_copies = 2;
  c.kv_dim = kv_dim;
  KvCacheCopyCpu(c);
  for (int64_t i = 0; i < kv_dim; ++i) {
    EXPECT_EQ(kc[1 * kv_dim + i], k[1 * kv_dim + i]);
    EXPECT_EQ(kc[2 * kv_dim + i], k[0 * kv_dim + i]);
    EXPECT_EQ(vc[2 * kv_dim + i], v[0 * kv_dim + i]);
  }
}

// Dense attention of one query over an explicit list of logical keys, in double.
std::vector<double> DenseAttention(const std::vector<float>& q, const std::vector<float>& keys,
                                   const std::vector<float>& values,
                                   const std::vector<int>& key_list, int64_t heads,
                                   int64_t kv_heads, int64_t hd) {
  std::vector<double> out(heads * hd, 0.0);
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t kvh = h / (heads / kv_heads);
    std::vector<double> s;
    for (int j : key_list) {
      double dot = 0;
      for (int64_t i = 0; i < hd; ++i)
        dot += double{q[h * hd + i]} * keys[(j * kv_heads + kvh) * hd + i];
      s.push_back(dot / std::sqrt(double(hd)));
    }
    const double mx = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (double& x : s) sum += x = std::exp(x - mx);
    for (size_t n = 0; n < key_list.size(); ++n) {
      for (int64_t i = 0; i < hd; ++i) {
        out[h * hd + i] += s[n] / sum * values[(key_list[n] * kv_heads + kvh) * hd + i];
      }
    }
  }
  return out;
}

void CheckPagedTreeAttention(int64_t hd) {
  SCOPED_TRACE(testing::Message() << "head_dim " << hd);
  const int64_t heads = 6, kv_heads = 2, block = 4, kv_dim = kv_heads * hd;
  // Two sequences: A with 9 committed tokens and a tree of 5 nodes, B with 3 committed and a
  // chain of 2. Logical K/V per sequence, scattered into a shuffled block pool.
  const int prefix[2] = {9, 3};
  const std::vector<std::vector<int>> parents = {{-1, 0, 0, 1, -1}, {-1, 0}};
  const int64_t num_blocks = 12;
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(3));
  const int64_t max_blocks = 4;
  std::vector<int32_t> tables = {perm[0], perm[1], perm[2], perm[3],
                                 perm[4], perm[5], perm[6], perm[7]};
  std::vector<float> kc = Random(num_blocks * block * kv_dim, 20);  // garbage elsewhere
  std::vector<float> vc = Random(num_blocks * block * kv_dim, 21);
  std::vector<std::vector<float>> lk(2), lv(2);
  for (int s = 0; s < 2; ++s) {
    const int n = prefix[s] + static_cast<int>(parents[s].size());
    lk[s] = Random(n * kv_dim, 30 + s);
    lv[s] = Random(n * kv_dim, 40 + s);
    for (int j = 0; j < n; ++j) {
      const int64_t slot = int64_t{tables[s * max_blocks + j / block]} * block + j % block;
      std::memcpy(&kc[slot * kv_dim], &lk[s][j * kv_dim], sizeof(float) * kv_dim);
      std::memcpy(&vc[slot * kv_dim], &lv[s][j * kv_dim], sizeof(float) * kv_dim);
    }
  }
  std::vector<int32_t> query_seq, prefix_len, offsets = {0}, keys;
  std::vector<std::vector<int>> dense_keys;
  for (int s = 0; s < 2; ++s) {
    for (int node = 0; node < static_cast<int>(parents[s].size()); ++node) {
      query_seq.push_back(s);
      prefix_len.push_back(prefix[s]);
      std::vector<int> anc;
      for (int a = node; a >= 0; a = parents[s][a]) anc.insert(anc.begin(), prefix[s] + a);
      keys.insert(keys.end(), anc.begin(), anc.end());
      offsets.push_back(static_cast<int32_t>(keys.size()));
      std::vector<int> all(prefix[s]);
      std::iota(all.begin(), all.end(), 0);
      all.insert(all.end(), anc.begin(), anc.end());
      dense_keys.push_back(all);
    }
  }
  const int64_t nq = static_cast<int64_t>(query_seq.size());
  const std::vector<float> q = Random(nq * heads * hd, 50);
  std::vector<float> out(nq * heads * hd, NAN);
  TreeAttentionParams p;
  p.q = q.data();
  p.out = out.data();
  p.kv.k_cache = kc.data();
  p.kv.v_cache = vc.data();
  p.kv.block_tables = tables.data();
  p.query_seq = query_seq.data();
  p.prefix_len = prefix_len.data();
  p.tree_key_offsets = offsets.data();
  p.tree_keys = keys.data();
  p.num_queries = nq;
  p.num_heads = heads;
  p.num_kv_heads = kv_heads;
  p.head_dim = hd;
  p.kv.block_size = block;
  p.kv.max_blocks_per_seq = max_blocks;
  p.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  TreeAttentionCpu(p);
  for (int64_t t = 0; t < nq; ++t) {
    const int s = query_seq[t];
    const std::vector<float> qt(q.begin() + t * heads * hd, q.begin() + (t + 1) * heads * hd);
    const std::vector<float> got(out.begin() + t * heads * hd, out.begin() + (t + 1) * heads * hd);
    ExpectClose(got, DenseAttention(qt, lk[s], lv[s], dense_keys[t], heads, kv_heads, hd), 1e-5);
  }
  // Split across item ranges gives the same bits as one pass.
  std::vector<float> split(out.size(), NAN);
  p.out = split.data();
  TreeAttentionCpuItems(p, 0, 13);
  TreeAttentionCpuItems(p, 13, nq * heads);
  EXPECT_EQ(0, std::memcmp(split.data(), out.data(), sizeof(float) * out.size()));
  // Describing contiguous ancestors as a longer run instead of a list gives the same bits:
  // B's chain nodes (queries 5, 6) and A's node 1 (path 0 -> 1, slots 9, 10).
  {
    std::vector<int32_t> run_prefix = prefix_len, run_offsets = {0}, run_keys;
    for (int64_t t = 0; t < nq; ++t) {
      std::vector<int32_t> list(keys.begin() + offsets[t], keys.begin() + offsets[t + 1]);
      if (t == 1 || t == 5 || t == 6) {
        run_prefix[t] += static_cast<int32_t>(list.size());
        list.clear();
      }
      run_keys.insert(run_keys.end(), list.begin(), list.end());
      run_offsets.push_back(static_cast<int32_t>(run_keys.size()));
    }
    std::vector<float> run_out(out.size(), NAN);
    TreeAttentionParams r = p;
    r.prefix_len = run_prefix.data();
    r.tree_key_offsets = run_offsets.data();
    r.tree_keys = run_keys.data();
    r.out = run_out.data();
    TreeAttentionCpu(r);
    EXPECT_EQ(0, std::memcmp(run_out.data(), out.data(), sizeof(float) * out.size()));
  }
  // A node's output ignores non-ancestors: perturb node 2 of A (sibling of 1) and check node 3
  // (child of 1) is unchanged while node 2 changes.
  const int64_t slot2 = int64_t{tables[(9 + 2) / block]} * block + (9 + 2) % block;
  for (int64_t i = 0; i < kv_dim; ++i) kc[slot2 * kv_dim + i] += 1.0f;
  std::vector<float> again(out.size());
  p.out = again.data();
  TreeAttentionCpu(p);
  const size_t n3 = 3 * heads * hd, n2 = 2 * heads * hd, len = heads * hd;
  EXPECT_EQ(0, std::memcmp(&again[n3], &out[n3], sizeof(float) * len));
  EXPECT_NE(0, std::memcmp(&again[n2], &out[n2], sizeof(float) * len));
}

TEST(TreeAttentionCpuTest, PagedTreeAttentionMatchesDenseMaskedAttention) {
  // Head sizes below one vector and with whole 64-lane blocks, a 16-lane block and a tail.
  for (int64_t hd : {12, 64, 84}) CheckPagedTreeAttention(hd);
}

}  // namespace
}  // namespace specd
