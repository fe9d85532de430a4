// Tree acceptance on the GPU (the host reference is engine/backend.h AcceptTree): starting
// at the last pending token, take the token sampled from the current node's logits; if a child
// of the node carries it (the lowest-index such child), descend and repeat; otherwise stop.
// The output is the accepted draft path plus the last sampled token (the bonus). With the
// per-row samples from SampleCuda, a verify step needs no host round trip per node.
#ifndef SPECD_KERNELS_CUDA_TREE_ACCEPT_H_
#define SPECD_KERNELS_CUDA_TREE_ACCEPT_H_

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

struct TreeAcceptParams {
  // [*] int32, device: token sampled from each logits row. Sequence s's rows start at
  // sample_offset[s]: first the row of its last pending token, then one per tree node in order.
  const int32_t* sampled = nullptr;
  const int32_t* sample_offset = nullptr;  // [num_seqs] int32, device
  // [*] int32, device: every sequence's tree, packed; sequence s's nodes are at
  // [node_offset[s], node_offset[s] + num_nodes[s]), each with its token and its parent
  // (index within the tree, -1 for a child of the last pending token; parents precede children).
  const int32_t* tree_tokens = nullptr;
  const int32_t* tree_parents = nullptr;
  const int32_t* node_offset = nullptr;  // [num_seqs] int32, device
  const int32_t* num_nodes = nullptr;    // [num_seqs] int32, device
  // [num_seqs, out_stride] int32, device: accepted draft tokens then the bonus token.
  int32_t* out_tokens = nullptr;
  // [num_seqs, out_stride] int32, device: tree index of each accepted draft token.
  int32_t* out_nodes = nullptr;
  int32_t* out_accepted = nullptr;  // [num_seqs] int32, device: accepted draft tokens
  int64_t out_stride = 0;           // >= the largest num_nodes + 1
  int64_t num_seqs = 0;
};

cudaError_t TreeAcceptCuda(const TreeAcceptParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_TREE_ACCEPT_H_
