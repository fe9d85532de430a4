#include "common/io/load_progress.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace specd {

std::string HumanBytes(int64_t bytes) {
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.1f GiB", bytes / 1073741824.0);
  if (bytes >= (int64_t{1} << 20)) return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  if (bytes >= (int64_t{1} << 10)) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  return absl::StrCat(bytes, " B");
}

LoadProgress::LoadProgress(std::string where, int64_t total_tensors)
    : where_(std::move(where)), total_tensors_(total_tensors) {}

void LoadProgress::Add(int64_t bytes, int64_t tensors) {
  tensors_ += tensors;
  bytes_ += bytes;
  const absl::Time now = absl::Now();
  if (now - last_log_ < kInterval) return;
  last_log_ = now;
  SPECD_LOG(INFO) << where_ << ": " << tensors_
                  << (total_tensors_ > 0 ? absl::StrCat("/", total_tensors_) : "")
                  << " tensors placed, " << HumanBytes(bytes_) << " ("
                  << absl::FormatDuration(absl::Trunc(now - start_, absl::Seconds(1))) << ")";
}

void LoadProgress::Finish() {
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start_);
  SPECD_LOG(INFO) << where_ << ": placed " << tensors_ << " tensors, " << HumanBytes(bytes_)
                  << ", in " << absl::StrFormat("%.2f", seconds) << " s"
                  << (seconds > 0
                          ? absl::StrCat(" (", HumanBytes(static_cast<int64_t>(bytes_ / seconds)),
                                         "/s)")
                          : "");
}

}  // namespace specd
