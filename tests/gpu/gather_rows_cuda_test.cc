// GatherRowsCuda (the batched strided row copies behind the CUDA backend's held EAGLE taps)
// against the same copies on the host, bit for bit: many copies of different lengths (none
// included) into destinations of different strides, more than one launch's worth of descriptors,
// on the float4 path and on the scalar one (a width or a source that is not 16-byte aligned);
// every element outside the copies' rows keeps its old value; bad arguments are refused.
#include <cstdint>
#include <random>
#include <vector>

#include "specd/kernels/cuda/gather_rows.h"
#include "tests/gpu/gpu_test_util.h"

namespace specd {
namespace {

using gpu_test::DeviceBuffer;
using gpu_test::RandomNormal;

class GatherRowsCudaTest : public gpu_test::GpuTest {
 protected:
  // `num_copies` copies of `width` elements a row out of a [src_rows, src_stride] buffer that
  // starts `src_offset` elements into its allocation.
  void Check(int num_copies, int64_t width, int64_t src_stride, int64_t src_offset) {
    std::mt19937_64 rng(static_cast<uint64_t>(num_copies * 1000 + width));
    constexpr int64_t kSrcRows = 40;
    const std::vector<float> src_host = RandomNormal(src_offset + kSrcRows * src_stride, rng);
    DeviceBuffer<float> src(src_host);
    // Each copy's destination region follows the previous one's, with its own stride.
    struct Plan {
      int64_t src_row, rows, dst_offset, dst_stride;
    };
    std::vector<Plan> plans(num_copies);
    int64_t dst_size = 0;
    for (int k = 0; k < num_copies; ++k) {
      Plan& p = plans[k];
      p.rows = static_cast<int64_t>(rng() % 6);  // 0 to 5 rows
      p.src_row = static_cast<int64_t>(rng() % static_cast<uint64_t>(kSrcRows - p.rows + 1));
      p.dst_stride = width + 4 * (k % 3);
      p.dst_offset = dst_size + 4 * (k % 2);
      dst_size = p.dst_offset + p.rows * p.dst_stride;
    }
    std::vector<float> want(static_cast<size_t>(dst_size), -7.0f);
    DeviceBuffer<float> dst(want);
    std::vector<cuda::GatherRowsCopy> copies(num_copies);
    for (int k = 0; k < num_copies; ++k) {
      const Plan& p = plans[k];
      copies[k].src = src.get() + src_offset + p.src_row * src_stride;
      copies[k].dst = dst.get() + p.dst_offset;
      copies[k].rows = static_cast<int32_t>(p.rows);
      copies[k].dst_stride = static_cast<int32_t>(p.dst_stride);
      for (int64_t r = 0; r < p.rows; ++r) {
        for (int64_t c = 0; c < width; ++c) {
          want[p.dst_offset + r * p.dst_stride + c] =
              src_host[src_offset + (p.src_row + r) * src_stride + c];
        }
      }
    }
    SPECD_CUDA_OK(cuda::GatherRowsCuda(copies.data(), num_copies, width, src_stride, stream_));
    Sync();
    const std::vector<float> got = dst.Download();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << "element " << i << " of " << got.size() << ", " << num_copies
                                 << " copies of width " << width;
    }
  }
};

TEST_F(GatherRowsCudaTest, MatchesHostCopiesOnTheVectorPath) {
  Check(1, 128, 3 * 128, 0);
  Check(48, 128, 3 * 128, 0);  // 16 sequences x 3 layers, one run each
  Check(cuda::GatherRowsParams::kMaxCopies, 256, 2 * 256, 0);
  Check(2 * cuda::GatherRowsParams::kMaxCopies + 5, 128, 4 * 128, 0);  // three launches
}

TEST_F(GatherRowsCudaTest, MatchesHostCopiesOnTheScalarPath) {
  Check(40, 130, 3 * 130, 0);  // width not a multiple of 4
  Check(40, 128, 3 * 128, 1);  // source rows not 16-byte aligned
  Check(cuda::GatherRowsParams::kMaxCopies + 1, 5, 7, 0);
}

TEST_F(GatherRowsCudaTest, NothingToCopy) {
  SPECD_CUDA_OK(cuda::GatherRowsCuda(nullptr, 0, 128, 128, stream_));
}

TEST_F(GatherRowsCudaTest, RefusesBadArguments) {
  DeviceBuffer<float> buf(64);
  cuda::GatherRowsCopy c;
  c.src = buf.get();
  c.dst = buf.get() + 32;
  c.rows = 1;
  c.dst_stride = 8;
  EXPECT_EQ(cuda::GatherRowsCuda(&c, 1, 8, 8, stream_), cudaSuccess);
  EXPECT_EQ(cuda::GatherRowsCuda(&c, 1, 0, 8, stream_), cudaErrorInvalidValue);    // width
  EXPECT_EQ(cuda::GatherRowsCuda(&c, 1, 8, 4, stream_), cudaErrorInvalidValue);    // src_stride
  EXPECT_EQ(cuda::GatherRowsCuda(&c, 1, 16, 16, stream_), cudaErrorInvalidValue);  // dst_stride
  EXPECT_EQ(cuda::GatherRowsCuda(&c, -1, 8, 8, stream_), cudaErrorInvalidValue);
  cuda::GatherRowsCopy no_dst = c;
  no_dst.dst = nullptr;
  EXPECT_EQ(cuda::GatherRowsCuda(&no_dst, 1, 8, 8, stream_), cudaErrorInvalidValue);
  cuda::GatherRowsCopy negative = c;
  negative.rows = -1;
  EXPECT_EQ(cuda::GatherRowsCuda(&negative, 1, 8, 8, stream_), cudaErrorInvalidValue);
  Sync();
}

}  // namespace
}  // namespace specd
