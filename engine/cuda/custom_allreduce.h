// The buffers of the custom one-shot all-reduce (specd/kernels/cuda/allreduce.h) for one
// tensor-parallel group in one process: on every rank's device, num_sites input buffers (where
// the rank's row-parallel GEMM writes its partial sums), num_sites zeroed signal areas and
// num_sites push-mode mailboxes, with peer access enabled between all the group's devices so
// that each rank reads the others' inputs and writes their flags and mailboxes directly over
// NVLink. No NVLink multicast.
//
// Sites. A site is one all-reduce call point per step that may be in flight while another is
// being prepared, e.g. site 0 for the attention output and site 1 for the FFN output of every
// layer. The kernel's contract (allreduce.h): all ranks call sites in the same order and never
// the same site twice in a row, so alternating two sites is enough; a third lets a rank write
// the partials of the next-but-one call early.
//
// Typical use on rank r (its own worker thread, its device current, its stream):
//   GEMM(..., out = group->input(r, site));                 // this rank's partial sums
//   cuda::AllReduceParams p = group->Params(r, site);
//   p.rows = tokens; p.dim = hidden; p.out = normed; p.residual = residual;
//   p.norm_weight = next_norm_weight; p.eps = eps;
//   cuda::AllReduceCuda(p, stream);
//   site ^= 1;
// rows * dim * 2 must not exceed max_bytes(); larger messages go through NCCL.
//
// Thread-safety: Create and the destructor from one thread; the accessors are const and may be
// called from the rank threads concurrently.
#ifndef SPECD_ENGINE_CUDA_CUSTOM_ALLREDUCE_H_
#define SPECD_ENGINE_CUDA_CUSTOM_ALLREDUCE_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "specd/kernels/cuda/allreduce.h"

namespace specd {

class CustomAllReduceGroup {
 public:
  using bf16 = __nv_bfloat16;

  // devices[r] is rank r's CUDA device; devices may repeat (several ranks on one device, as the
  // tests do on a single-GPU host). Enables peer access between all distinct pairs
  // (FAILED_PRECONDITION naming the pair when the hardware cannot), allocates on each rank's
  // device num_sites input buffers of max_bytes and num_sites zeroed signal areas, and waits for
  // the zeroing to finish. 1 <= devices.size() <= kAllReduceMaxRanks, num_sites >= 2,
  // max_bytes > 0 (rounded up to a multiple of 16). The calling thread's current device is
  // restored before returning.
  static absl::StatusOr<std::unique_ptr<CustomAllReduceGroup>> Create(
      const std::vector<int>& devices, int num_sites, int64_t max_bytes);

  // Frees everything. No call of this group may still be running (synchronize the ranks'
  // streams first).
  ~CustomAllReduceGroup();

  CustomAllReduceGroup(const CustomAllReduceGroup&) = delete;
  CustomAllReduceGroup& operator=(const CustomAllReduceGroup&) = delete;

  int world_size() const { return static_cast<int>(devices_.size()); }
  int num_sites() const { return num_sites_; }
  int64_t max_bytes() const { return max_bytes_; }
  int device(int rank) const { return devices_[rank]; }

  // [max_bytes] bytes (max_bytes / 2 bf16), device of `rank`, 256-byte aligned: where `rank`
  // writes its partial sums for `site`.
  bf16* input(int rank, int site) const;
  // AllReduceSignalBytes() bytes, device of `rank`: the signal area of `site` on `rank`.
  uint32_t* signal(int rank, int site) const;
  // AllReduceMailboxBytes(world_size(), push_max_bytes()) bytes, device of `rank`: the push-mode
  // mailbox of `site` on `rank`, emptied at creation.
  bf16* mailbox(int rank, int site) const;
  // Messages up to this size take the kernel's push mode (min(max_bytes,
  // kAllReducePushMaxBytes)); Params sets it.
  int64_t push_max_bytes() const { return push_max_bytes_; }

  // Params for `rank` at `site`: world_size, rank, inputs and signals filled in, and
  // max_blocks lowered when ranks share a device (so that all their blocks fit on it at once);
  // the caller sets rows, dim, out and, for the fused mode, residual, residual_init,
  // norm_weight and eps.
  cuda::AllReduceParams Params(int rank, int site) const;

 private:
  CustomAllReduceGroup() = default;

  std::vector<int> devices_;
  int num_sites_ = 0;
  int64_t max_bytes_ = 0;
  int max_blocks_ = 0;
  // One allocation per rank: num_sites signal areas, num_sites input buffers, then num_sites
  // mailboxes.
  std::vector<void*> base_;
  int64_t signal_stride_ = 0;  // bytes between two sites' signal areas
  int64_t push_max_bytes_ = 0;
  int64_t mailbox_stride_ = 0;  // bytes between two sites' mailboxes
};

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_CUSTOM_ALLREDUCE_H_
