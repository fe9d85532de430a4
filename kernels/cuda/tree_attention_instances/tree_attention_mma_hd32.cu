// Tree attention's MMA kernel for head_dim 32 (kernels/cuda/tree_attention_mma.cuh): one file
// per head size, so that the sizes compile in parallel.
#include "kernels/cuda/tree_attention_mma.cuh"

namespace specd {
namespace cuda {
namespace tree_attn {

template cudaError_t LaunchMma<32>(const TreeAttentionParams& p, cudaStream_t stream);
#ifdef SPECD_ATTN_PROFILE
template cudaError_t ReadMmaProfile<32>(unsigned long long* records, int64_t ctas);
#endif

}  // namespace tree_attn
}  // namespace cuda
}  // namespace specd
