// One long-lived worker thread per tensor-parallel rank (docs/architecture.md: one process, one
// worker thread per GPU). A CUDA rank binds its device once on its own thread, and an NCCL
// communicator or a spinning all-reduce needs every rank inside the same step at once, so rank work
// always runs on all threads together: Run() hands the same function to every rank and waits for
// all.
//
// Not thread-safe: one thread calls Run() at a time.
#ifndef SPECD_ENGINE_TP_RANK_WORKERS_H_
#define SPECD_ENGINE_TP_RANK_WORKERS_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace specd {

class RankWorkers {
 public:
  explicit RankWorkers(int num_ranks);
  ~RankWorkers();
  RankWorkers(const RankWorkers&) = delete;
  RankWorkers& operator=(const RankWorkers&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }
  // Runs fn(rank) on every rank's thread and returns when all are done; the lowest failing
  // rank's status wins, its message prefixed with "rank <r>: ".
  absl::Status Run(const std::function<absl::Status(int)>& fn);

 private:
  void Loop(int rank);

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<absl::Status(int)>* task_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<absl::Status> results_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_TP_RANK_WORKERS_H_
