// Paged KV cache writes, copies and on-device compaction of accepted paths against the CPU
// references of kernels/cpu/kv_cache.cc. These are pure data movement: results match exactly.
#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "specd/kernels/cuda/kv_cache.h"
#include "specd/kernels/kv_cache.h"
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

class KvCacheCudaTest : public gpu_test::GpuTest {};

TEST_F(KvCacheCudaTest, WriteMatchesReference) {
  std::mt19937_64 rng(21);
  for (auto [kv_heads, head_dim] : {std::pair{3, 64}, std::pair{1, 128}, std::pair{1, 36},
                                         std::pair{2, 32}, std::pair{1, 16}}) {
    const int kv_dim = kv_heads * head_dim, num_slots = 200, tokens = 37;
    // Tokens come from a fused QKV output: k and v are column ranges of wider rows.
    const int stride = 3 * kv_dim + 8;
    const std::vector<float> qkv =
        RoundBf16(RandomNormal(static_cast<size_t>(tokens) * stride, rng));
    std::vector<int64_t> slots(num_slots);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(tokens);
    slots[4] = -1;  // skipped
    const std::vector<float> cache0 =
        RoundBf16(RandomNormal(static_cast<size_t>(num_slots) * kv_dim, rng));

    DeviceBuffer<bf16> d_qkv(ToBf16(qkv));
    DeviceBuffer<bf16> d_k(ToBf16(cache0)), d_v(ToBf16(cache0));
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
    SPECD_CUDA_OK(cuda::KvCacheWriteCuda(p, stream_));
    Sync();

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
    EXPECT_TRUE(AllClose(ToFloat(d_k.Download()), want_k, 0, 0)) << "kv_dim " << kv_dim;
    EXPECT_TRUE(AllClose(ToFloat(d_v.Download()), want_v, 0, 0)) << "kv_dim " << kv_dim;
  }
}

// Chained copies (a later copy reads what an earlier one wrote over) in every layer.
TEST_F(KvCacheCudaTest, CopyInOrderAcrossLayers) {
  std::mt19937_64 rng(22);
  const int layers = 3, num_slots = 64, kv_dim = 2 * 64;
  const int64_t layer_stride = int64_t{num_slots} * kv_dim;
  const std::vector<float> cache0 = RoundBf16(RandomNormal(layers * layer_stride, rng));
  const std::vector<int64_t> src = {5, 9, 9, 40, 2, 63};
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
  SPECD_CUDA_OK(cuda::KvCacheCopyCuda(p, stream_));
  Sync();
  std::vector<float> want = cache0;
  std::vector<float> want_v = cache0;
  for (int l = 0; l < layers; ++l) {
    KvCacheCopyParams ref;
    ref.k_cache = want.data() + l * layer_stride;
    ref.v_cache = want_v.data() + l * layer_stride;
    ref.src_slots = src.data();
    ref.dst_slots = dst.data();
    ref.num_copies = static_cast<int64_t>(src.size());
    ref.kv_dim = kv_dim;
    KvCacheCopyCpu(ref);
  }
  EXPECT_TRUE(AllClose(ToFloat(d_k.Download()), want, 0, 0));
  EXPECT_TRUE(AllClose(ToFloat(d_v.Download()), want_v, 0, 0));
}

// Accepted paths of several sequences, read from device arrays as TreeAcceptCuda leaves them,
// compacted through shuffled block tables with a block size that the bases do not align to.
TEST_F(KvCacheCudaTest, CompactAcceptedPaths) {
  std::mt19937_64 rng(23);
  const int layers = 2, kv_dim = 3 * 64, block_size = 16, max_blocks = 24, num_blocks = 80;
  const int num_slots = num_blocks * block_size;
  const int64_t layer_stride = int64_t{num_slots} * kv_dim;
  const std::vector<float> cache0 = RoundBf16(RandomNormal(layers * layer_stride, rng));
  std::vector<int32_t> blocks(num_blocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  // Three sequences: rows 2, 0, 1 of the block table.
  std::vector<int32_t> table(3 * max_blocks);
  std::copy_n(blocks.begin(), table.size(), table.begin());
  const std::vector<int32_t> seq_rows = {2, 0, 1};
  const std::vector<int32_t> base = {37, 5, 250};
  const int node_stride = 257;
  std::vector<std::vector<int32_t>> paths = {{1, 3, 4, 9}, {}, {0, 2, 7, 30, 31, 100, 130}};
  std::vector<int32_t> nodes(3 * node_stride, -7), counts;
  for (int s = 0; s < 3; ++s) {
    std::copy(paths[s].begin(), paths[s].end(), nodes.begin() + s * node_stride);
    counts.push_back(static_cast<int32_t>(paths[s].size()));
  }
  DeviceBuffer<bf16> d_k(ToBf16(cache0)), d_v(ToBf16(cache0));
  DeviceBuffer<int32_t> d_table(table), d_rows(seq_rows), d_base(base), d_nodes(nodes),
      d_counts(counts);
  cuda::KvCacheCompactParams p;
  p.k_cache = d_k.get();
  p.v_cache = d_v.get();
  p.num_layers = layers;
  p.layer_stride = layer_stride;
  p.kv_dim = kv_dim;
  p.block_tables = d_table.get();
  p.max_blocks_per_seq = max_blocks;
  p.block_size = block_size;
  p.seq_rows = d_rows.get();
  p.base_slot = d_base.get();
  p.nodes = d_nodes.get();
  p.num_nodes = d_counts.get();
  p.node_stride = node_stride;
  p.num_seqs = 3;
  SPECD_CUDA_OK(cuda::KvCacheCompactCuda(p, stream_));
  Sync();

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
  std::vector<float> want = cache0, want_v = cache0;
  for (int l = 0; l < layers; ++l) {
    KvCacheCopyParams ref;
    ref.k_cache = want.data() + l * layer_stride;
    ref.v_cache = want_v.data() + l * layer_stride;
    ref.src_slots = src.data();
    ref.dst_slots = dst.data();
    ref.num_copies = static_cast<int64_t>(src.size());
    ref.kv_dim = kv_dim;
    KvCacheCopyCpu(ref);
  }
  EXPECT_TRUE(AllClose(ToFloat(d_k.Download()), want, 0, 0));
  EXPECT_TRUE(AllClose(ToFloat(d_v.Download()), want_v, 0, 0));
}

}  // namespace
}  // namespace specd
