#include "common/service/sequence_table.h"

#include "absl/strings/str_cat.h"

namespace specd {

std::optional<int64_t> SequenceTable::Find(uint64_t stream, uint64_t seq_id) const {
  auto it = live_.find(Key(stream, seq_id));
  if (it == live_.end()) return std::nullopt;
  return it->second.id;
}

int64_t SequenceTable::Add(uint64_t stream, uint64_t seq_id) {
  const int64_t id = next_id_++;
  live_[Key(stream, seq_id)] = Entry{id, 0};
  tombstones_.erase(Key(stream, seq_id));
  return id;
}

void SequenceTable::SetDeadline(uint64_t stream, uint64_t seq_id, int64_t deadline_unix_ms) {
  auto it = live_.find(Key(stream, seq_id));
  if (it != live_.end()) it->second.deadline_unix_ms = deadline_unix_ms;
}

std::optional<int64_t> SequenceTable::Remove(uint64_t stream, uint64_t seq_id) {
  tombstones_.erase(Key(stream, seq_id));
  auto it = live_.find(Key(stream, seq_id));
  if (it == live_.end()) return std::nullopt;
  const int64_t id = it->second.id;
  live_.erase(it);
  return id;
}

std::vector<int64_t> SequenceTable::RemoveStream(uint64_t stream) {
  std::vector<int64_t> ids;
  for (auto it = live_.begin(); it != live_.end();) {
    if (it->first.first == stream) {
      ids.push_back(it->second.id);
      live_.erase(it++);
    } else {
      ++it;
    }
  }
  for (auto it = tombstones_.begin(); it != tombstones_.end();) {
    if (it->first.first == stream) {
      tombstones_.erase(it++);
    } else {
      ++it;
    }
  }
  return ids;
}

std::vector<int64_t> SequenceTable::RemoveAll() {
  std::vector<int64_t> ids;
  for (const auto& [key, entry] : live_) ids.push_back(entry.id);
  live_.clear();
  tombstones_.clear();
  tombstone_order_.clear();
  return ids;
}

std::vector<int64_t> SequenceTable::RemoveExpired(int64_t now_unix_ms) {
  std::vector<Key> expired;
  for (const auto& [key, entry] : live_) {
    if (entry.deadline_unix_ms != 0 && entry.deadline_unix_ms < now_unix_ms) {
      expired.push_back(key);
    }
  }
  std::vector<int64_t> ids;
  for (const Key& key : expired) {
    ids.push_back(live_[key].id);
    live_.erase(key);
    SetTombstone(key.first, key.second, absl::StatusCode::kDeadlineExceeded);
  }
  return ids;
}

absl::Status SequenceTable::Tombstone(uint64_t stream, uint64_t seq_id) const {
  auto it = tombstones_.find(Key(stream, seq_id));
  if (it == tombstones_.end()) return absl::OkStatus();
  return absl::Status(it->second, absl::StrCat("sequence ", seq_id, " was freed by this service (",
                                               it->second == absl::StatusCode::kDeadlineExceeded
                                                   ? "its deadline passed"
                                                   : "a step failed and lost its state",
                                               "); release the id before reusing it"));
}

void SequenceTable::SetTombstone(uint64_t stream, uint64_t seq_id, absl::StatusCode reason) {
  if (!tombstones_.emplace(Key(stream, seq_id), reason).second) return;
  tombstone_order_.push_back(Key(stream, seq_id));
  while (tombstone_order_.size() > kMaxTombstones) {
    tombstones_.erase(tombstone_order_.front());
    tombstone_order_.pop_front();
  }
}

}  // namespace specd
