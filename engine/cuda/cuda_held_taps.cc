#include "engine/cuda/cuda_held_taps.h"

#include <algorithm>

#include "engine/cuda/cuda_status.h"

namespace specd {

DeviceHeldTaps::~DeviceHeldTaps() {
  if (seqs_.empty()) return;
  cudaSetDevice(device_);
  for (auto& [seq, r] : seqs_) cudaFree(r.data);
}

absl::StatusOr<bool> DeviceHeldTaps::Reallocate(Rows& r, int64_t keep, int64_t capacity,
                                                cudaStream_t stream) {
  // Queued copies may write into r.data, which this moves and frees.
  SPECD_RETURN_IF_ERROR_(Flush(stream));
  const int64_t row_bytes = RowBytes(r);
  const int64_t bytes = capacity * row_bytes;
  if (bytes_ - r.capacity * row_bytes + bytes > max_bytes_) return false;
  void* data = nullptr;
  if (cudaMallocAsync(&data, static_cast<size_t>(bytes), stream) != cudaSuccess) {
    (void)cudaGetLastError();  // out of memory is not sticky: the rows go to the host instead
    return false;
  }
  if (keep > 0) {
    SPECD_CUDA_RETURN_(
        cudaMemcpyAsync(data, r.data + (r.rows - keep) * (row_bytes / 4),
                        static_cast<size_t>(keep * row_bytes), cudaMemcpyDeviceToDevice, stream),
        "moving held taps");
  }
  if (r.data != nullptr) SPECD_CUDA_RETURN_(cudaFreeAsync(r.data, stream), "freeing held taps");
  bytes_ += bytes - r.capacity * row_bytes;
  r.data = static_cast<float*>(data);
  r.capacity = capacity;
  r.rows = keep;
  return true;
}

absl::StatusOr<bool> DeviceHeldTaps::Append(SeqId seq, int64_t first_position,
                                            const std::vector<int>& layers,
                                            const std::vector<int>& all, const float* taps,
                                            absl::Span<const int64_t> rows, int64_t max_rows,
                                            cudaStream_t stream) {
  if (layers.empty() || max_rows < 1) {
    return absl::InvalidArgumentError("held taps: no layers, or max_rows < 1");
  }
  auto it = seqs_.find(seq);
  if (it != seqs_.end() && (it->second.layers != layers ||
                            it->second.first_position + it->second.rows != first_position)) {
    Drop(seq, stream);
    it = seqs_.end();
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  if (n == 0) return true;
  Rows fresh;
  fresh.layers = layers;
  Rows& r = it != seqs_.end() ? it->second : fresh;
  // The rows kept are the newest `keep` of the held ones followed by the new ones.
  const int64_t concat_first = first_position - r.rows;
  const int64_t total = r.rows + n;
  const int64_t keep = total > max_rows ? max_rows / 2 : total;
  const int64_t keep_old = std::max<int64_t>(0, keep - n);
  const int64_t skip = std::max<int64_t>(0, n - keep);
  if (keep > r.capacity || keep_old < r.rows) {
    const int64_t capacity =
        std::min(max_rows, std::max({keep, 2 * r.capacity, static_cast<int64_t>(64)}));
    absl::StatusOr<bool> room = Reallocate(r, keep_old, capacity, stream);
    if (!room.ok() || !*room) return room;
  }
  const int64_t h = hidden_, width = static_cast<int64_t>(layers.size()) * h;
  const int64_t all_width = static_cast<int64_t>(all.size()) * h;
  std::vector<int64_t> column(layers.size());
  for (size_t j = 0; j < layers.size(); ++j) {
    column[j] = std::lower_bound(all.begin(), all.end(), layers[j]) - all.begin();
  }
  // One queued copy per layer and run of consecutive token rows.
  if (!pending_.empty() && pending_src_stride_ != all_width) {
    SPECD_RETURN_IF_ERROR_(Flush(stream));  // another step's buffer layout
  }
  pending_width_ = h;
  pending_src_stride_ = all_width;
  for (int64_t i = skip; i < n;) {
    int64_t e = i + 1;
    while (e < n && rows[e] == rows[e - 1] + 1) ++e;
    float* dst = r.data + (r.rows + i - skip) * width;
    for (size_t j = 0; j < layers.size(); ++j) {
      cuda::GatherRowsCopy& c = pending_.emplace_back();
      c.src = taps + rows[i] * all_width + column[j] * h;
      c.dst = dst + j * h;
      c.rows = static_cast<int32_t>(e - i);
      c.dst_stride = static_cast<int32_t>(width);
    }
    i = e;
  }
  r.rows += n - skip;
  r.first_position = concat_first + (total - keep);
  if (it == seqs_.end()) seqs_.emplace(seq, std::move(fresh));
  return true;
}

absl::Status DeviceHeldTaps::Flush(cudaStream_t stream) {
  if (pending_.empty()) return absl::OkStatus();
  const cudaError_t e = cuda::GatherRowsCuda(pending_.data(), static_cast<int64_t>(pending_.size()),
                                             pending_width_, pending_src_stride_, stream);
  pending_.clear();
  SPECD_CUDA_RETURN_(e, "holding taps");
  return absl::OkStatus();
}

absl::StatusOr<HeldTapRows> DeviceHeldTaps::Take(SeqId seq, cudaStream_t stream) {
  HeldTapRows out;
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return out;
  SPECD_CUDA_RETURN_(cudaSetDevice(device_), "selecting the device");
  SPECD_RETURN_IF_ERROR_(Flush(stream));
  const Rows& r = it->second;
  out.first_position = r.first_position;
  out.layers = r.layers;
  const int64_t width = static_cast<int64_t>(r.layers.size()) * hidden_;
  out.rows.resize(static_cast<size_t>(r.rows * width));
  if (r.rows > 0) {
    SPECD_CUDA_RETURN_(cudaMemcpyAsync(out.rows.data(), r.data, out.rows.size() * sizeof(float),
                                       cudaMemcpyDeviceToHost, stream),
                       "copying held taps");
  }
  Drop(seq, stream);
  SPECD_CUDA_RETURN_(cudaStreamSynchronize(stream), "copying held taps");
  return out;
}

void DeviceHeldTaps::Drop(SeqId seq, cudaStream_t stream) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  cudaSetDevice(device_);
  // Queued copies into the rows freed here go first. A failed launch leaves a sticky error that
  // the next step reports.
  (void)Flush(stream);
  if (it->second.data != nullptr) (void)cudaFreeAsync(it->second.data, stream);
  bytes_ -= it->second.capacity * RowBytes(it->second);
  seqs_.erase(it);
}

}  // namespace specd
