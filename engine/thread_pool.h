// A small fixed pool of worker threads for data-parallel loops on the CPU backend. Workers
// sleep on a condition variable between loops (no spinning: CI machines are shared), and the
// calling thread takes a share of every loop.
#ifndef SPECD_ENGINE_THREAD_POOL_H_
#define SPECD_ENGINE_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace specd {

class ThreadPool {
 public:
  // `num_threads` counts the caller: 1 runs everything inline.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) on disjoint ranges covering [0, n), in parallel, and returns when all
  // are done. Ranges are contiguous and at least `min_chunk` long (except the last). Not
  // reentrant: fn must not call ParallelFor.
  void ParallelFor(int64_t n, int64_t min_chunk, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace specd

#endif  // SPECD_ENGINE_THREAD_POOL_H_
