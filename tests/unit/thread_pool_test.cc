#include "engine/thread_pool.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace specd {
namespace {

TEST(ThreadPoolTest, CoversEveryIndexOnceForManyShapes) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {0, 1, 2, 7, 64, 1001}) {
      for (int64_t min_chunk : {1, 5, 2000}) {
        std::vector<std::atomic<int>> hits(n);
        pool.ParallelFor(n, min_chunk, [&](int64_t begin, int64_t end) {
          ASSERT_LE(0, begin);
          ASSERT_LT(begin, end);
          ASSERT_LE(end, n);
          for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(hits[i].load(), 1) << threads << " threads, n " << n << ", index " << i;
        }
      }
    }
  }
}

TEST(ThreadPoolTest, UsesSeveralThreadsWhenWorkIsSplit) {
  ThreadPool pool(4);
  std::atomic<int> calls{0};
  pool.ParallelFor(4, 1, [&](int64_t, int64_t) { calls.fetch_add(1); });
  EXPECT_EQ(calls.load(), 4);
  calls = 0;
  pool.ParallelFor(4, 4, [&](int64_t, int64_t) { calls.fetch_add(1); });
  EXPECT_EQ(calls.load(), 1);
}

}  // namespace
}  // namespace specd
