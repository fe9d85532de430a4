#include "engine/cuda/custom_allreduce.h"

#include <algorithm>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace specd {
namespace {

constexpr int64_t kAlign = 256;

int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

absl::Status CudaError(cudaError_t e, const std::string& what) {
  return absl::InternalError(absl::StrCat("custom all-reduce: ", what, ": ", cudaGetErrorName(e),
                                          " (", cudaGetErrorString(e), ")"));
}

// Restores the calling thread's current device when it goes out of scope.
class DeviceRestorer {
 public:
  DeviceRestorer() {
    if (cudaGetDevice(&device_) != cudaSuccess) device_ = -1;
  }
  ~DeviceRestorer() {
    if (device_ >= 0) cudaSetDevice(device_);
  }
  DeviceRestorer(const DeviceRestorer&) = delete;
  DeviceRestorer& operator=(const DeviceRestorer&) = delete;

 private:
  int device_ = -1;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CustomAllReduceGroup>> CustomAllReduceGroup::Create(
    const std::vector<int>& devices, int num_sites, int64_t max_bytes) {
  const int n = static_cast<int>(devices.size());
  if (n < 1 || n > cuda::kAllReduceMaxRanks) {
    return absl::InvalidArgumentError(absl::StrCat("custom all-reduce: ", n, " ranks; 1..",
                                                   cuda::kAllReduceMaxRanks, " are supported"));
  }
  if (num_sites < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("custom all-reduce: num_sites ", num_sites, " < 2"));
  }
  if (max_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("custom all-reduce: max_bytes ", max_bytes, " <= 0"));
  }
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return CudaError(e, "cudaGetDeviceCount");
  std::map<int, int> ranks_on;  // device -> number of ranks on it
  for (int d : devices) {
    if (d < 0 || d >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("custom all-reduce: device ", d, " of ", count, " visible devices"));
    }
    ++ranks_on[d];
  }
  DeviceRestorer restore;

  // Each rank reads every other rank's inputs and writes its flags: peer access both ways.
  for (const auto& [a, unused_a] : ranks_on) {
    for (const auto& [b, unused_b] : ranks_on) {
      if (a == b) continue;
      int can = 0;
      e = cudaDeviceCanAccessPeer(&can, a, b);
      if (e != cudaSuccess) return CudaError(e, "cudaDeviceCanAccessPeer");
      if (!can) {
        return absl::FailedPreconditionError(
            absl::StrCat("custom all-reduce: device ", a, " cannot access the memory of device ", b,
                         " (no peer access: no NVLink/PCIe P2P between them); use NCCL instead"));
      }
      e = cudaSetDevice(a);
      if (e != cudaSuccess) return CudaError(e, absl::StrCat("cudaSetDevice(", a, ")"));
      e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // not an error here; clear it so later checks do not see it
      } else if (e != cudaSuccess) {
        return CudaError(e, absl::StrCat("cudaDeviceEnablePeerAccess(", a, " -> ", b, ")"));
      }
    }
  }

  std::unique_ptr<CustomAllReduceGroup> g(new CustomAllReduceGroup());
  g->devices_ = devices;
  g->num_sites_ = num_sites;
  g->max_bytes_ = RoundUp(max_bytes, 16);
  int most = 0;
  for (const auto& [d, k] : ranks_on) most = std::max(most, k);
  // Ranks sharing a device run their kernels side by side and spin in the barrier until all
  // have arrived, so all their blocks must fit at once: split the default grid between them.
  g->max_blocks_ = most <= 1 ? 0 : std::max(1, cuda::kAllReduceDefaultBlocks / most);
  g->signal_stride_ = RoundUp(cuda::AllReduceSignalBytes(), kAlign);
  const int64_t input_stride = RoundUp(g->max_bytes_, kAlign);
  g->push_max_bytes_ = std::min(g->max_bytes_, cuda::kAllReducePushMaxBytes);
  g->mailbox_stride_ = RoundUp(cuda::AllReduceMailboxBytes(n, g->push_max_bytes_), kAlign);
  const int64_t bytes = num_sites * (g->signal_stride_ + input_stride + g->mailbox_stride_);
  g->base_.assign(n, nullptr);
  for (int r = 0; r < n; ++r) {
    e = cudaSetDevice(devices[r]);
    if (e != cudaSuccess) return CudaError(e, absl::StrCat("cudaSetDevice(", devices[r], ")"));
    e = cudaMalloc(&g->base_[r], static_cast<size_t>(bytes));
    if (e != cudaSuccess) {
      g->base_[r] = nullptr;
      return CudaError(e, absl::StrCat("cudaMalloc of ", bytes, " bytes on device ", devices[r]));
    }
    // The flags and counters must start at zero; the inputs are zeroed too so that a stray
    // read never sees garbage.
    e = cudaMemset(g->base_[r], 0, static_cast<size_t>(bytes));
    if (e != cudaSuccess) return CudaError(e, "cudaMemset");
    // The mailboxes start empty (allreduce.h's push mode).
    e = cuda::AllReduceMailboxInitCuda(g->mailbox(r, 0), num_sites * g->mailbox_stride_, nullptr);
    if (e != cudaSuccess) return CudaError(e, "emptying the mailboxes");
  }
  // The zeroing must be complete before any rank's kernel runs, also on non-blocking streams
  // that do not wait for the legacy default stream.
  for (const auto& [d, unused] : ranks_on) {
    e = cudaSetDevice(d);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) return CudaError(e, absl::StrCat("synchronizing device ", d));
  }
  return g;
}

CustomAllReduceGroup::~CustomAllReduceGroup() {
  DeviceRestorer restore;
  for (size_t r = 0; r < base_.size(); ++r) {
    if (base_[r] == nullptr) continue;
    cudaSetDevice(devices_[r]);
    cudaFree(base_[r]);
  }
}

uint32_t* CustomAllReduceGroup::signal(int rank, int site) const {
  return reinterpret_cast<uint32_t*>(static_cast<char*>(base_[rank]) + site * signal_stride_);
}

CustomAllReduceGroup::bf16* CustomAllReduceGroup::input(int rank, int site) const {
  const int64_t offset = num_sites_ * signal_stride_ + site * RoundUp(max_bytes_, kAlign);
  return reinterpret_cast<bf16*>(static_cast<char*>(base_[rank]) + offset);
}

CustomAllReduceGroup::bf16* CustomAllReduceGroup::mailbox(int rank, int site) const {
  const int64_t offset =
      num_sites_ * (signal_stride_ + RoundUp(max_bytes_, kAlign)) + site * mailbox_stride_;
  return reinterpret_cast<bf16*>(static_cast<char*>(base_[rank]) + offset);
}

cuda::AllReduceParams CustomAllReduceGroup::Params(int rank, int site) const {
  cuda::AllReduceParams p;
  p.world_size = world_size();
  p.rank = rank;
  for (int r = 0; r < world_size(); ++r) {
    p.inputs[r] = input(r, site);
    p.signals[r] = signal(r, site);
    p.mailboxes[r] = mailbox(r, site);
  }
  p.push_max_bytes = push_max_bytes_;
  p.max_blocks = max_blocks_;
  return p;
}

}  // namespace specd
