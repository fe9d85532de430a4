// EAGLE tap rows a CUDA backend holds on its device for sequences whose taps nobody reads yet
// (VerifyItem::hold_tap_rows): the verify service's plain steps of an EAGLE sequence (the policy
// did not draft it) leave their committed rows here instead of copying them to the host each
// step; when the sequence is drafted again, TakeHeldTaps() copies them down in one copy. A step's
// rows of all held sequences go into their stores in one kernel launch (GatherRowsCuda), so that
// holding costs the step one API call rather than one per sequence, tap layer and run of rows.
//
// Bounded twice: per sequence by the item's hold_tap_rows (past it the older half is dropped, as
// the verify service's host bound does, so the drafter restarts its head after the gap), and for
// all sequences together by the store's byte budget: a step whose rows do not fit is not held
// (the backend returns its rows to the host as a plain export, and the service holds them in its
// own memory, behind the rows taken from here first). Memory comes from the stream-ordered
// allocator outside any captured graph (after a step's acceptance round trip), so nothing is
// reserved up front and a full device (the KV pool takes most of it) only means rows go to the
// host.
#ifndef SPECD_ENGINE_CUDA_CUDA_HELD_TAPS_H_
#define SPECD_ENGINE_CUDA_CUDA_HELD_TAPS_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "specd/kernels/cuda/gather_rows.h"

namespace specd {

class DeviceHeldTaps {
 public:
  // All sequences' rows together take at most `max_bytes` of device memory.
  DeviceHeldTaps(int device, int64_t hidden, int64_t max_bytes)
      : device_(device), hidden_(hidden), max_bytes_(max_bytes) {}
  ~DeviceHeldTaps();
  DeviceHeldTaps(const DeviceHeldTaps&) = delete;
  DeviceHeldTaps& operator=(const DeviceHeldTaps&) = delete;

  // Appends rows `rows` of a step's tap buffer `taps` ([step tokens, all.size() * hidden] fp32,
  // device, columns in the order of `all`, sorted) to `seq`'s held rows, keeping the columns of
  // `layers` (each in `all`) in that order; the first appended row is sequence position
  // `first_position`. Held rows that these do not continue (other layers, a position gap) are
  // dropped first. At most `max_rows` stay (past it the newest max_rows / 2). Returns false when
  // the device has no room for them (the byte budget, or the allocator): then the rows are not
  // held and the caller exports them; the rows held before stay.
  // The copies wait in a queue until Flush() (or any other call that touches the rows), which
  // issues every queued sequence's copies in one kernel launch: one API call a step instead of
  // one per sequence, layer and run of rows. So `taps` must stay unchanged until then in
  // `stream` order.
  absl::StatusOr<bool> Append(SeqId seq, int64_t first_position, const std::vector<int>& layers,
                              const std::vector<int>& all, const float* taps,
                              absl::Span<const int64_t> rows, int64_t max_rows,
                              cudaStream_t stream);
  // Issues the copies queued by Append() on `stream`.
  absl::Status Flush(cudaStream_t stream);
  // `seq`'s rows, copied to the host (waits on `stream`), and no longer held.
  absl::StatusOr<HeldTapRows> Take(SeqId seq, cudaStream_t stream);
  void Drop(SeqId seq, cudaStream_t stream);
  bool Holds(SeqId seq) const { return seqs_.contains(seq); }
  int64_t bytes() const { return bytes_; }

 private:
  struct Rows {
    int64_t first_position = 0;
    std::vector<int> layers;
    float* data = nullptr;  // [capacity, layers.size() * hidden] fp32, device
    int64_t rows = 0;
    int64_t capacity = 0;
  };
  int64_t RowBytes(const Rows& r) const {
    return static_cast<int64_t>(r.layers.size()) * hidden_ * static_cast<int64_t>(sizeof(float));
  }
  // Moves `r`'s newest `keep` rows into a new allocation of `capacity` rows; false without
  // room (r unchanged).
  absl::StatusOr<bool> Reallocate(Rows& r, int64_t keep, int64_t capacity, cudaStream_t stream);

  int device_;
  int64_t hidden_;
  int64_t max_bytes_;
  int64_t bytes_ = 0;  // capacity bytes allocated, all sequences
  // Copies queued by Append() for Flush(): all read the same step's tap buffer, with its row
  // stride; each writes into a sequence's Rows::data.
  std::vector<cuda::GatherRowsCopy> pending_;
  int64_t pending_width_ = 0;       // elements a row of each copy (the hidden size)
  int64_t pending_src_stride_ = 0;  // elements between tap buffer rows
  absl::flat_hash_map<SeqId, Rows> seqs_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_CUDA_HELD_TAPS_H_
