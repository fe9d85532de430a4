// The paged KV cache as the CUDA kernels see it: specd/kernels/paged_kv.h's PagedKvT over bf16
// pools in device memory, block tables in device memory too.
#ifndef SPECD_KERNELS_CUDA_PAGED_KV_H_
#define SPECD_KERNELS_CUDA_PAGED_KV_H_

#include "specd/kernels/cuda/common.h"
#include "specd/kernels/paged_kv.h"

namespace specd {
namespace cuda {

using PagedKvView = PagedKvT<const bf16>;   // kernels that only read the cache
using MutablePagedKvView = PagedKvT<bf16>;  // kernels that move slots

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_PAGED_KV_H_
