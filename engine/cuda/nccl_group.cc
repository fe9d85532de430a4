#include "engine/cuda/nccl_group.h"

#include <cstdlib>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"

#ifdef SPECD_WITH_NCCL
#include <nccl.h>
#endif

namespace specd {

#ifdef SPECD_WITH_NCCL

namespace {

absl::Status NcclError(ncclResult_t r, const std::string& what, ncclComm_t comm = nullptr) {
  std::string detail;
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && last[0] != '\0') detail = absl::StrCat("; ", last);
  }
  return absl::InternalError(absl::StrCat("nccl: ", what, ": ", ncclGetErrorString(r), detail));
}

template <typename T>
struct NcclType;
template <>
struct NcclType<__nv_bfloat16> {
  static constexpr ncclDataType_t kValue = ncclBfloat16;
};
template <>
struct NcclType<float> {
  static constexpr ncclDataType_t kValue = ncclFloat32;
};
template <>
struct NcclType<int32_t> {
  static constexpr ncclDataType_t kValue = ncclInt32;
};

template <typename T>
absl::Status AllReduce(ncclComm_t comm, const T* send, T* recv, size_t count, cudaStream_t stream) {
  const ncclResult_t r =
      ncclAllReduce(send, recv, count, NcclType<T>::kValue, ncclSum, comm, stream);
  return r == ncclSuccess ? absl::OkStatus() : NcclError(r, "ncclAllReduce", comm);
}

template <typename T>
absl::Status Gather(ncclComm_t comm, const T* send, T* recv, size_t send_count,
                    cudaStream_t stream) {
  const ncclResult_t r = ncclAllGather(send, recv, send_count, NcclType<T>::kValue, comm, stream);
  return r == ncclSuccess ? absl::OkStatus() : NcclError(r, "ncclAllGather", comm);
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclGroup>> NcclGroup::Create(const std::vector<int>& devices) {
  const int n = static_cast<int>(devices.size());
  if (n < 1) return absl::InvalidArgumentError("nccl: no devices");
  if (std::set<int>(devices.begin(), devices.end()).size() != devices.size()) {
    return absl::InvalidArgumentError("nccl: a communicator takes one rank per device");
  }
  // Never NVLink multicast (docs/architecture.md, engine); overwrite whatever the environment says.
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) current = -1;
  std::unique_ptr<NcclGroup> g(new NcclGroup());
  g->devices_ = devices;
  g->comms_.assign(n, nullptr);
  const ncclResult_t r = ncclCommInitAll(g->comms_.data(), n, devices.data());
  if (current >= 0) cudaSetDevice(current);
  if (r != ncclSuccess) {
    g->comms_.clear();
    return NcclError(r, absl::StrCat("ncclCommInitAll of ", n, " devices"));
  }
  return g;
}

NcclGroup::~NcclGroup() {
  for (ncclComm_t c : comms_) {
    if (c != nullptr) ncclCommDestroy(c);
  }
}

absl::Status NcclGroup::AllReduceSum(int rank, const bf16* send, bf16* recv, size_t count,
                                     cudaStream_t stream) const {
  return AllReduce(comms_[rank], send, recv, count, stream);
}
absl::Status NcclGroup::AllReduceSum(int rank, const float* send, float* recv, size_t count,
                                     cudaStream_t stream) const {
  return AllReduce(comms_[rank], send, recv, count, stream);
}
absl::Status NcclGroup::AllGather(int rank, const bf16* send, bf16* recv, size_t send_count,
                                  cudaStream_t stream) const {
  return Gather(comms_[rank], send, recv, send_count, stream);
}
absl::Status NcclGroup::AllGather(int rank, const float* send, float* recv, size_t send_count,
                                  cudaStream_t stream) const {
  return Gather(comms_[rank], send, recv, send_count, stream);
}
absl::Status NcclGroup::AllGather(int rank, const int32_t* send, int32_t* recv, size_t send_count,
                                  cudaStream_t stream) const {
  return Gather(comms_[rank], send, recv, send_count, stream);
}

absl::Status NcclGroup::GroupStart() {
  const ncclResult_t r = ncclGroupStart();
  return r == ncclSuccess ? absl::OkStatus() : NcclError(r, "ncclGroupStart");
}
absl::Status NcclGroup::GroupEnd() {
  const ncclResult_t r = ncclGroupEnd();
  return r == ncclSuccess ? absl::OkStatus() : NcclError(r, "ncclGroupEnd");
}

#else  // !SPECD_WITH_NCCL

namespace {
absl::Status NoNccl() {
  return absl::UnimplementedError("nccl: specd was built without NCCL (libnccl not found)");
}
}  // namespace

absl::StatusOr<std::unique_ptr<NcclGroup>> NcclGroup::Create(const std::vector<int>&) {
  return NoNccl();
}
NcclGroup::~NcclGroup() = default;
absl::Status NcclGroup::AllReduceSum(int, const bf16*, bf16*, size_t, cudaStream_t) const {
  return NoNccl();
}
absl::Status NcclGroup::AllReduceSum(int, const float*, float*, size_t, cudaStream_t) const {
  return NoNccl();
}
absl::Status NcclGroup::AllGather(int, const bf16*, bf16*, size_t, cudaStream_t) const {
  return NoNccl();
}
absl::Status NcclGroup::AllGather(int, const float*, float*, size_t, cudaStream_t) const {
  return NoNccl();
}
absl::Status NcclGroup::AllGather(int, const int32_t*, int32_t*, size_t, cudaStream_t) const {
  return NoNccl();
}
absl::Status NcclGroup::GroupStart() { return NoNccl(); }
absl::Status NcclGroup::GroupEnd() { return NoNccl(); }

#endif  // SPECD_WITH_NCCL

}  // namespace specd
