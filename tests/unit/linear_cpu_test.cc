// LinearCpu, on every instruction set this CPU runs: against the double-accumulation oracle for
// many shapes (odd k and n, 1 to 300 rows), and its batch invariance bit for bit (a row alone,
// at every position of batches of many sizes, under any column split), which lossless
// speculation needs.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "specd/kernels/linear.h"

namespace specd {
namespace {

std::vector<float> Random(size_t n, uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

LinearParams MakeLinear(const std::vector<float>& x, const std::vector<float>& w,
                        const std::vector<float>* bias, std::vector<float>* y, int64_t rows,
                        int64_t in, int64_t out) {
  LinearParams p;
  p.x = x.data();
  p.w = w.data();
  p.bias = bias != nullptr ? bias->data() : nullptr;
  p.y = y->data();
  p.rows = rows;
  p.in_features = in;
  p.out_features = out;
  return p;
}

std::vector<LinearIsa> SupportedIsas() {
  std::vector<LinearIsa> isas;
  for (LinearIsa isa : {LinearIsa::kScalar, LinearIsa::kAvx2, LinearIsa::kAvx512}) {
    if (LinearIsaSupported(isa)) isas.push_back(isa);
  }
  return isas;
}

void RunIsa(const LinearParams& p, LinearIsa isa) {
  LinearCpuColumnsIsa(p, 0, p.out_features, isa);
}

// Shapes (k, n): odd ones around the lane counts (8, 16) and the tile widths, and the reference
// target's.
const std::vector<std::pair<int64_t, int64_t>>& Shapes() {
  static const auto* shapes = new std::vector<std::pair<int64_t, int64_t>>{
      {1, 1},  {3, 5},   {7, 9},    {8, 8},    {15, 17},  {16, 16},  {17, 33},
      {31, 7}, {37, 53}, {100, 13}, {320, 64}, {320, 67}, {864, 45}, {1000, 30}};
  return *shapes;
}

TEST(LinearCpuTest, ProcessUsesTheWidestSupportedIsa) {
  const LinearIsa isa = LinearCpuIsa();
  EXPECT_TRUE(LinearIsaSupported(isa));
  if (LinearIsaSupported(LinearIsa::kAvx512)) EXPECT_EQ(isa, LinearIsa::kAvx512);
  if (!LinearIsaSupported(LinearIsa::kAvx512) && LinearIsaSupported(LinearIsa::kAvx2)) {
    EXPECT_EQ(isa, LinearIsa::kAvx2);
  }
  EXPECT_EQ(isa, LinearCpuIsa()) << "chosen once";
}

TEST(LinearCpuTest, MatchesDoubleOracleWithAndWithoutBias) {
  for (LinearIsa isa : SupportedIsas()) {
    for (auto [in, out] : Shapes()) {
      for (int64_t rows : {1, 2, 3, 4, 5, 7, 8, 9, 17, 33, 64, 130, 300}) {
        if (isa == LinearIsa::kScalar && rows * in * out > 2000000) continue;  // slow path
        const std::vector<float> x = Random(rows * in, 1 + rows), w = Random(out * in, 2 + in),
                                 b = Random(out, 3 + out);
        for (const std::vector<float>* bias :
             {&b, static_cast<const std::vector<float>*>(nullptr)}) {
          std::vector<float> y(rows * out, NAN);
          RunIsa(MakeLinear(x, w, bias, &y, rows, in, out), isa);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < out; ++j) {
              double want = 0.0, scale = 0.0;
              for (int64_t i = 0; i < in; ++i) {
                want += double{x[r * in + i]} * w[j * in + i];
                scale += std::abs(double{x[r * in + i]} * w[j * in + i]);
              }
              if (bias != nullptr) want += (*bias)[j];
              const float got = y[r * out + j];
              // fp32 accumulation: error bounded by k ulps of the absolute sum (loose).
              ASSERT_LE(std::abs(got - want), 1e-6 * (in + 4) * scale + 1e-6 * std::abs(want))
                  << LinearIsaName(isa) << " k " << in << " n " << out << " rows " << rows << " ("
                  << r << ", " << j << ")";
            }
          }
        }
      }
    }
  }
}

TEST(LinearCpuTest, BiasIsAddedLast) {
  // y with bias == (y without bias) + bias[j], bit for bit: the bias joins after the reduction.
  const int64_t in = 77, out = 29, rows = 6;
  const std::vector<float> x = Random(rows * in, 4), w = Random(out * in, 5), b = Random(out, 6);
  for (LinearIsa isa : SupportedIsas()) {
    std::vector<float> with(rows * out), without(rows * out);
    RunIsa(MakeLinear(x, w, &b, &with, rows, in, out), isa);
    RunIsa(MakeLinear(x, w, nullptr, &without, rows, in, out), isa);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < out; ++j) {
        const float want = without[r * out + j] + b[j];
        ASSERT_EQ(0, std::memcmp(&with[r * out + j], &want, sizeof(float)))
            << LinearIsaName(isa) << " " << r << " " << j;
      }
    }
  }
}

TEST(LinearCpuTest, EachRowIsBitIdenticalAloneAndAtEveryPositionOfEveryBatch) {
  for (LinearIsa isa : SupportedIsas()) {
    for (auto [in, out] : {std::pair<int64_t, int64_t>{1000, 37}, {320, 67}, {17, 19}, {9, 5}}) {
      const int64_t max_rows = isa == LinearIsa::kScalar ? 40 : 300;
      const std::vector<float> w = Random(out * in, 7 + in, 0.05f), b = Random(out, 8);
      const std::vector<float> x = Random(max_rows * in, 9 + out);
      // Every row computed alone: the bits each must have at any position of any batch.
      std::vector<float> alone(max_rows * out), one(out);
      for (int64_t r = 0; r < max_rows; ++r) {
        LinearParams p = MakeLinear(x, w, &b, &one, 1, in, out);
        p.x = x.data() + r * in;
        RunIsa(p, isa);
        std::memcpy(&alone[r * out], one.data(), sizeof(float) * out);
      }
      for (int64_t rows : {2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 33, 64, 177, 300}) {
        if (rows > max_rows) continue;
        for (int64_t shift : {int64_t{0}, rows / 2 + 1}) {
          // Rows in a rotated order, so each row also lands at other positions.
          std::vector<float> xs(rows * in), ys(rows * out, NAN);
          std::vector<int64_t> src(rows);
          for (int64_t i = 0; i < rows; ++i) {
            src[i] = (i + shift * 7) % max_rows;
            std::memcpy(&xs[i * in], &x[src[i] * in], sizeof(float) * in);
          }
          RunIsa(MakeLinear(xs, w, &b, &ys, rows, in, out), isa);
          for (int64_t i = 0; i < rows; ++i) {
            ASSERT_EQ(0, std::memcmp(&ys[i * out], &alone[src[i] * out], sizeof(float) * out))
                << LinearIsaName(isa) << " k " << in << " n " << out << " rows " << rows
                << " position " << i;
          }
        }
      }
    }
  }
}

TEST(LinearCpuTest, AnyColumnSplitGivesTheSameBits) {
  const int64_t in = 333, out = 101, rows = 23;
  const std::vector<float> x = Random(rows * in, 10), w = Random(out * in, 11), b = Random(out, 12);
  for (LinearIsa isa : SupportedIsas()) {
    std::vector<float> whole(rows * out);
    RunIsa(MakeLinear(x, w, &b, &whole, rows, in, out), isa);
    for (int64_t parts : {2, 3, 7, 101}) {
      std::vector<float> split(rows * out, NAN);
      const LinearParams p = MakeLinear(x, w, &b, &split, rows, in, out);
      for (int64_t i = 0; i < parts; ++i) {
        LinearCpuColumnsIsa(p, out * i / parts, out * (i + 1) / parts, isa);
      }
      ASSERT_EQ(0, std::memcmp(split.data(), whole.data(), sizeof(float) * rows * out))
          << LinearIsaName(isa) << " in " << parts << " parts";
    }
  }
}

TEST(LinearCpuTest, ScalarPathHasTheAvx2Bits) {
  // The portable path emulates the 8-lane arithmetic: a machine without AVX2 computes what an
  // AVX2 one does.
  if (!LinearIsaSupported(LinearIsa::kAvx2)) GTEST_SKIP() << "no AVX2 here";
  for (auto [in, out] : Shapes()) {
    const int64_t rows = 5;
    const std::vector<float> x = Random(rows * in, 13), w = Random(out * in, 14),
                             b = Random(out, 15);
    std::vector<float> scalar(rows * out), avx2(rows * out);
    RunIsa(MakeLinear(x, w, &b, &scalar, rows, in, out), LinearIsa::kScalar);
    RunIsa(MakeLinear(x, w, &b, &avx2, rows, in, out), LinearIsa::kAvx2);
    ASSERT_EQ(0, std::memcmp(scalar.data(), avx2.data(), sizeof(float) * rows * out))
        << "k " << in << " n " << out;
  }
}

// Weights rounded to bf16 (the top 16 bits of each fp32), and those bits.
void RoundToBf16(std::vector<float>* w, std::vector<uint16_t>* bits) {
  bits->resize(w->size());
  for (size_t i = 0; i < w->size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &(*w)[i], sizeof(u));
    u &= 0xffff0000u;
    std::memcpy(&(*w)[i], &u, sizeof(u));
    (*bits)[i] = static_cast<uint16_t>(u >> 16);
  }
}

TEST(LinearCpuTest, Bf16WeightsGiveTheBitsOfTheirFp32Values) {
  // The CPU model keeps a bf16 checkpoint's matrices as bf16 (engine/cpu/cpu_model.h): every
  // ISA and tile, k tails included, must give what the same weights as fp32 give.
  for (LinearIsa isa : SupportedIsas()) {
    for (auto [in, out] : Shapes()) {
      for (int64_t rows : {1, 4, 5, 6, 7, 17}) {
        std::vector<float> w = Random(out * in, 18 + in);
        std::vector<uint16_t> bits;
        RoundToBf16(&w, &bits);
        const std::vector<float> x = Random(rows * in, 19 + rows), b = Random(out, 20);
        std::vector<float> fp32(rows * out, NAN), bf16(rows * out, NAN);
        RunIsa(MakeLinear(x, w, &b, &fp32, rows, in, out), isa);
        LinearParams p = MakeLinear(x, w, &b, &bf16, rows, in, out);
        p.w = nullptr;
        p.w_bf16 = bits.data();
        RunIsa(p, isa);
        ASSERT_EQ(0, std::memcmp(fp32.data(), bf16.data(), sizeof(float) * rows * out))
            << LinearIsaName(isa) << " k " << in << " n " << out << " rows " << rows;
        std::vector<float> naive(rows * out);
        LinearNaiveCpu(MakeLinear(x, w, &b, &naive, rows, in, out));
        LinearNaiveCpu(p);
        ASSERT_EQ(0, std::memcmp(naive.data(), p.y, sizeof(float) * rows * out));
      }
    }
  }
}

TEST(LinearCpuTest, ZeroRowsAndEmptyColumnRangesWriteNothing) {
  const std::vector<float> x = Random(8, 16), w = Random(8, 17);
  std::vector<float> y(4, 7.0f);
  LinearParams p = MakeLinear(x, w, nullptr, &y, 0, 4, 2);
  LinearCpu(p);
  p.rows = 2;
  LinearCpuColumns(p, 1, 1);
  for (float v : y) EXPECT_EQ(v, 7.0f);
}

}  // namespace
}  // namespace specd
