#include "engine/tp/rank_workers.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace specd {

RankWorkers::RankWorkers(int num_ranks) : results_(num_ranks) {
  for (int r = 0; r < num_ranks; ++r) threads_.emplace_back([this, r] { Loop(r); });
}

RankWorkers::~RankWorkers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void RankWorkers::Loop(int rank) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<absl::Status(int)>* task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      task = task_;
    }
    absl::Status s = (*task)(rank);
    {
      std::lock_guard<std::mutex> lock(mu_);
      results_[rank] = std::move(s);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

absl::Status RankWorkers::Run(const std::function<absl::Status(int)>& fn) {
  std::unique_lock<std::mutex> lock(mu_);
  task_ = &fn;
  pending_ = size();
  ++generation_;
  start_cv_.notify_all();
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  task_ = nullptr;
  for (int r = 0; r < size(); ++r) {
    if (!results_[r].ok()) {
      return absl::Status(results_[r].code(),
                          absl::StrCat("rank ", r, ": ", results_[r].message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace specd
