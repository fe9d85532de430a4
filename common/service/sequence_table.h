// Which sequences a draft or verify service holds, for which stream, until when.
//
// Sequence ids on the wire are chosen by each router, so the table keys them by (stream,
// seq_id) and hands the model an id of its own. It also remembers, per stream, the ids it freed
// on its own (deadline passed) so that a later step for such an id is answered with an error
// instead of silently starting a new sequence from a mid-sequence token.
#ifndef SPECD_COMMON_SERVICE_SEQUENCE_TABLE_H_
#define SPECD_COMMON_SERVICE_SEQUENCE_TABLE_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

namespace specd {

class SequenceTable {
 public:
  using Key = std::pair<uint64_t, uint64_t>;  // (stream, wire seq_id)

  // The model-side id of a live sequence.
  std::optional<int64_t> Find(uint64_t stream, uint64_t seq_id) const;

  // Registers a new sequence and returns its model-side id (never reused).
  int64_t Add(uint64_t stream, uint64_t seq_id);

  // 0 clears it. A sequence's deadline is the latest its router sent.
  void SetDeadline(uint64_t stream, uint64_t seq_id, int64_t deadline_unix_ms);

  // Forgets the sequence (and any tombstone of the id); returns its model-side id if it was
  // live.
  std::optional<int64_t> Remove(uint64_t stream, uint64_t seq_id);

  // Forgets every sequence and tombstone of the stream; returns the live ones' model-side ids.
  std::vector<int64_t> RemoveStream(uint64_t stream);

  // Forgets everything; returns the live sequences' model-side ids.
  std::vector<int64_t> RemoveAll();

  // Removes live sequences whose deadline is before `now_unix_ms`, tombstoning their ids;
  // returns their model-side ids.
  std::vector<int64_t> RemoveExpired(int64_t now_unix_ms);

  // If the service freed this id on its own and the router has not released it since, the
  // error later steps for it get (the reason it was freed, e.g. DEADLINE_EXCEEDED); else OK.
  absl::Status Tombstone(uint64_t stream, uint64_t seq_id) const;
  void SetTombstone(uint64_t stream, uint64_t seq_id, absl::StatusCode reason);

  int size() const { return static_cast<int>(live_.size()); }

 private:
  struct Entry {
    int64_t id = 0;
    int64_t deadline_unix_ms = 0;
  };
  // Bounds the memory of tombstones a router never releases.
  static constexpr size_t kMaxTombstones = 1 << 16;

  absl::flat_hash_map<Key, Entry> live_;
  absl::flat_hash_map<Key, absl::StatusCode> tombstones_;
  std::deque<Key> tombstone_order_;
  int64_t next_id_ = 1;
};

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_SEQUENCE_TABLE_H_
