// NCCL communicators for one tensor-parallel group in one process (docs/architecture.md: one
// process, one worker thread per GPU): one communicator per device, made together by
// ncclCommInitAll. NCCL carries the messages too large for the custom one-shot all-reduce
// (engine/cuda/custom_allreduce.h) and is the fallback where that is unavailable (no peer access).
// NVLink multicast (NVLS) stays off: Create sets NCCL_NVLS_ENABLE=0 first, because a program that
// uses it can take the host's shared GPUs out of service.
//
// Collectives: every rank calls the same collectives in the same order. From one thread per
// rank (the engine) call them directly; to issue several ranks' parts from one thread (tests),
// bracket them with GroupStart()/GroupEnd(), or each call waits for the others forever.
// NCCL's collectives may be captured into CUDA graphs.
//
// Built without NCCL (libnccl not found at configure time; SPECD_WITH_NCCL undefined), Create
// returns UNIMPLEMENTED.
#ifndef SPECD_ENGINE_CUDA_NCCL_GROUP_H_
#define SPECD_ENGINE_CUDA_NCCL_GROUP_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// nccl.h's own declaration (identical redeclarations are fine), so that this header does not
// need nccl.h.
typedef struct ncclComm* ncclComm_t;

namespace specd {

class NcclGroup {
 public:
  using bf16 = __nv_bfloat16;

  // devices[r] is rank r's CUDA device; they must be distinct (NCCL allows one rank per
  // device in a communicator). Sets NCCL_NVLS_ENABLE=0 (overwriting any value) and creates
  // the communicators from the calling thread; restores its current device.
  static absl::StatusOr<std::unique_ptr<NcclGroup>> Create(const std::vector<int>& devices);

  // Destroys the communicators. No collective may still be running.
  ~NcclGroup();

  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int world_size() const { return static_cast<int>(devices_.size()); }
  int device(int rank) const { return devices_[rank]; }
  ncclComm_t comm(int rank) const { return comms_[rank]; }

  // Rank `rank`'s part of a sum all-reduce of `count` elements, enqueued on `stream` (of the
  // rank's device). send: [count], recv: [count], device of the rank; recv may equal send.
  absl::Status AllReduceSum(int rank, const bf16* send, bf16* recv, size_t count,
                            cudaStream_t stream) const;
  absl::Status AllReduceSum(int rank, const float* send, float* recv, size_t count,
                            cudaStream_t stream) const;
  // Rank `rank`'s part of an all-gather: send: [send_count], recv: [world_size * send_count]
  // (rank r's block at r * send_count), device of the rank; send may be recv's own block.
  absl::Status AllGather(int rank, const bf16* send, bf16* recv, size_t send_count,
                         cudaStream_t stream) const;
  absl::Status AllGather(int rank, const float* send, float* recv, size_t send_count,
                         cudaStream_t stream) const;
  absl::Status AllGather(int rank, const int32_t* send, int32_t* recv, size_t send_count,
                         cudaStream_t stream) const;

  // ncclGroupStart / ncclGroupEnd, for issuing several ranks' parts from one thread.
  static absl::Status GroupStart();
  static absl::Status GroupEnd();

 private:
  NcclGroup() = default;

  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_NCCL_GROUP_H_
