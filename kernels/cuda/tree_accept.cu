#include "specd/kernels/cuda/tree_accept.h"

#include "kernels/cuda/device_utils.cuh"

namespace specd {
namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

// One warp per sequence. Each step scans the nodes after the current one (children follow
// their parent) 32 at a time and takes the lowest matching index from a ballot.
__global__ void TreeAcceptKernel(TreeAcceptParams p) {
  const int64_t s = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + (threadIdx.x >> 5);
  if (s >= p.num_seqs) return;
  const int lane = threadIdx.x & 31;
  const int32_t* sampled = p.sampled + p.sample_offset[s];
  const int32_t* tokens = p.tree_tokens + p.node_offset[s];
  const int32_t* parents = p.tree_parents + p.node_offset[s];
  const int n = p.num_nodes[s];
  int32_t* out_tokens = p.out_tokens + s * p.out_stride;
  int32_t* out_nodes = p.out_nodes + s * p.out_stride;
  int node = -1;
  int accepted = 0;
  while (true) {
    const int32_t y = sampled[node + 1];
    if (lane == 0) out_tokens[accepted] = y;
    int next = -1;
    for (int base = node + 1; base < n && next < 0; base += 32) {
      const int i = base + lane;
      const bool match = i < n && parents[i] == node && tokens[i] == y;
      const unsigned ballot = __ballot_sync(internal::kFullMask, match);
      if (ballot != 0) next = base + __ffs(ballot) - 1;
    }
    if (next < 0) break;
    if (lane == 0) out_nodes[accepted] = next;
    ++accepted;
    node = next;
  }
  if (lane == 0) p.out_accepted[s] = accepted;
}

}  // namespace

cudaError_t TreeAcceptCuda(const TreeAcceptParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.out_stride < 1) return cudaErrorInvalidValue;
  if (p.num_seqs == 0) return cudaSuccess;
  if (p.sampled == nullptr || p.sample_offset == nullptr || p.tree_tokens == nullptr ||
      p.tree_parents == nullptr || p.node_offset == nullptr || p.num_nodes == nullptr ||
      p.out_tokens == nullptr || p.out_nodes == nullptr || p.out_accepted == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = (p.num_seqs + kWarpsPerBlock - 1) / kWarpsPerBlock;
  TreeAcceptKernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specd
