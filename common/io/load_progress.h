// Progress of a long model load, logged as it goes: a large checkpoint takes minutes to read
// and place, and a service that says nothing meanwhile looks hung (vLLM logs the same: what is
// read, what lands on which device, how long it took).
#ifndef SPECD_COMMON_IO_LOAD_PROGRESS_H_
#define SPECD_COMMON_IO_LOAD_PROGRESS_H_

#include <cstdint>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace specd {

// "1.5 GiB", "12.0 MiB", "512 B".
std::string HumanBytes(int64_t bytes);

// Not thread-safe: one loader thread (one per device) owns each.
class LoadProgress {
 public:
  // `where` names the destination in every line ("cuda:0", "cpu"). `total_tensors`: how many
  // tensors will be placed, 0 when unknown.
  explicit LoadProgress(std::string where, int64_t total_tensors = 0);

  // `tensors` more tensors, `bytes` of them as placed, are in place; logs a progress line at
  // most every kInterval.
  void Add(int64_t bytes, int64_t tensors = 1);
  // Logs the summary: tensors, bytes, time, throughput.
  void Finish();

  int64_t tensors() const { return tensors_; }
  int64_t bytes() const { return bytes_; }

  static constexpr absl::Duration kInterval = absl::Seconds(5);

 private:
  const std::string where_;
  const int64_t total_tensors_;
  const absl::Time start_ = absl::Now();
  absl::Time last_log_ = absl::Now();
  int64_t tensors_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace specd

#endif  // SPECD_COMMON_IO_LOAD_PROGRESS_H_
