// The custom one-shot all-reduce (specd/kernels/cuda/allreduce.h, engine/cuda/custom_allreduce.h)
// against a CPU reference: the rank-order fp32 sum (plain mode, exact), and the fused residual
// update (exact) and RMSNorm (bf16 accuracy, and bit-identical to RmsNormCuda). Every rank must
// get the same bits, and a row's result must not depend on how many rows are in the call or on
// the grid. NCCL's group is checked too.
//
// "Ranks" run as separate streams on ONE GPU (devices {0, 0, ...}) for world sizes 1, 2, 3 and
// 7, so a single-GPU host exercises the barrier; with two or more GPUs the same checks run on
// real groups of 2..min(8, count) GPUs (and a mixed group {0, 1, 0, 1}). One host thread
// enqueues every rank's work. A barrier that deadlocks does not hang the suite: Wait() gives up
// after 20 s, prints what it was waiting for and ends the process with a failure.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cuda/custom_allreduce.h"
#include "engine/cuda/nccl_group.h"
#include "specd/kernels/cuda/allreduce.h"
#include "specd/kernels/cuda/rmsnorm.h"
#include "specd/kernels/rmsnorm.h"
#include "tests/gpu/gpu_test_util.h"

namespace specd {
namespace {

using gpu_test::AllClose;
using gpu_test::bf16;
using gpu_test::DeviceBuffer;
using gpu_test::RandomNormal;
using gpu_test::RoundBf16;
using gpu_test::ToBf16;
using gpu_test::ToFloat;

// Ranks sharing a GPU spin in the barrier until all have arrived, so their kernels must run
// concurrently: each stream needs its own hardware queue (the default is 8 queues; a kernel
// queued behind a spinning kernel of another stream would never start). Set before the first
// CUDA call, which comes after static initialisation.
[[maybe_unused]] const bool kConnectionsSet = [] {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
  return true;
}();

// bf16 outputs carry a relative rounding error of up to 2^-9; twice that as the tolerance.
constexpr float kBf16Rtol = 1.0f / 256;
constexpr double kDeadlineSeconds = 20;

std::vector<int> Repeat(int device, int n) { return std::vector<int>(n, device); }
std::vector<int> Iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}
std::string Describe(const std::vector<int>& devices) {
  std::string s = "devices {";
  for (size_t i = 0; i < devices.size(); ++i) absl::StrAppend(&s, i ? "," : "", devices[i]);
  return s + "}";
}
int DeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// Waits until every stream is idle. A stream still busy after kDeadlineSeconds means a barrier
// that will never open (or a kernel that never ends): the process cannot recover from a
// spinning kernel, so report and exit instead of hanging the suite.
::testing::AssertionResult Wait(const std::vector<cudaStream_t>& streams, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    std::string busy;
    for (size_t r = 0; r < streams.size(); ++r) {
      const cudaError_t e = cudaStreamQuery(streams[r]);
      if (e == cudaErrorNotReady) {
        absl::StrAppend(&busy, " ", r);
      } else if (e != cudaSuccess) {
        return ::testing::AssertionFailure()
               << what << ": rank " << r << "'s stream failed: " << cudaGetErrorName(e) << " ("
               << cudaGetErrorString(e) << ")";
      }
    }
    if (busy.empty()) return ::testing::AssertionSuccess();
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > kDeadlineSeconds) {
      std::fprintf(stderr,
                   "\nFATAL: allreduce_cuda_test: %s: ranks' streams {%s } still busy after %.0f "
                   "s: the all-reduce barrier deadlocked (or, with ranks sharing a GPU, their "
                   "kernels did not run concurrently). Test: %s. Exiting.\n",
                   what.c_str(), busy.c_str(), waited,
                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
      std::fflush(stderr);
      std::_Exit(1);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// A group, one non-blocking stream per rank (non-blocking so that the tests' synchronous
// copies on the legacy stream never wait for a rank spinning in the barrier), and helpers.
class Harness {
 public:
  explicit Harness(std::vector<int> devices, int64_t max_bytes = int64_t{8} << 20)
      : devices_(std::move(devices)) {
    absl::StatusOr<std::unique_ptr<CustomAllReduceGroup>> g =
        CustomAllReduceGroup::Create(devices_, /*num_sites=*/3, max_bytes);
    status_ = g.status();
    if (!g.ok()) return;
    group_ = std::move(*g);
    for (int d : devices_) {
      cudaStream_t s = nullptr;
      cudaSetDevice(d);
      if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        status_ = absl::InternalError("cudaStreamCreate failed");
      }
      streams_.push_back(s);
    }
    cudaSetDevice(0);
  }
  ~Harness() {
    for (size_t r = 0; r < streams_.size(); ++r) {
      if (streams_[r] == nullptr) continue;
      cudaSetDevice(devices_[r]);
      cudaStreamDestroy(streams_[r]);
    }
    cudaSetDevice(0);
  }

  const absl::Status& status() const { return status_; }
  int n() const { return static_cast<int>(devices_.size()); }
  const std::vector<int>& devices() const { return devices_; }
  CustomAllReduceGroup& group() { return *group_; }
  cudaStream_t stream(int r) const { return streams_[r]; }
  const std::vector<cudaStream_t>& streams() const { return streams_; }
  void Use(int r) const { cudaSetDevice(devices_[r]); }
  // Makes the legacy-stream uploads (DeviceBuffer) visible to the non-blocking streams.
  ::testing::AssertionResult SyncDevices() const {
    for (int d : devices_) {
      cudaSetDevice(d);
      const cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) {
        return ::testing::AssertionFailure() << "device " << d << ": " << cudaGetErrorString(e);
      }
    }
    cudaSetDevice(0);
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult Wait(const std::string& what) const {
    return specd::Wait(streams_, what);
  }

 private:
  std::vector<int> devices_;
  absl::Status status_;
  std::unique_ptr<CustomAllReduceGroup> group_;
  std::vector<cudaStream_t> streams_;
};

enum Mode { kPlain = 0, kFused = 1, kFusedInit = 2 };
const char* ModeName(int mode) {
  return mode == kPlain ? "plain" : (mode == kFused ? "fused" : "fused+init");
}

// One all-reduce call of a sequence, with its host data.
struct Call {
  int site = 0;
  int64_t rows = 0;
  int64_t dim = 0;
  int mode = kPlain;
  int max_blocks = -1;      // -1: the group's
  int64_t push_bytes = -1;  // -1: the group's push_max_bytes; 0: push mode off
  int64_t delay_rank = -1;  // this rank first runs a memset of delay_bytes, a straggler
  int64_t delay_bytes = 0;
  std::vector<std::vector<float>> partials;  // [rank][rows * dim], bf16 values
  std::vector<float> residual;               // [rows * dim] fp32, the residual before the call
  std::vector<float> weight;                 // [dim] fp32
  // Element offsets of this call's slices in the per-rank device buffers.
  int64_t off = 0;
  int64_t weight_off = 0;
  int64_t size() const { return rows * dim; }
  std::string Name(int index) const {
    return absl::StrCat("call ", index, " (site ", site, ", rows ", rows, ", dim ", dim, ", ",
                        ModeName(mode), ", max_blocks ", max_blocks, ")");
  }
};

Call RandomCall(int n, int site, int64_t rows, int64_t dim, int mode, std::mt19937_64& rng) {
  Call c;
  c.site = site;
  c.rows = rows;
  c.dim = dim;
  c.mode = mode;
  for (int r = 0; r < n; ++r) c.partials.push_back(RoundBf16(RandomNormal(rows * dim, rng)));
  if (mode != kPlain) {
    c.residual = RandomNormal(rows * dim, rng, 3.0f);
    // fp32, as the kernel reads it: the CPU reference multiplies by the very same values.
    c.weight = RandomNormal(dim, rng, 0.5f);
    for (float& w : c.weight) w += 1.0f;
  }
  return c;
}

// The CPU reference of one call: the fp32 sum in rank order, then either its bf16 rounding
// (plain) or the residual update and RmsNormCpu of the new residual (fused; out unrounded).
void Reference(const Call& c, std::vector<float>* out, std::vector<float>* residual) {
  const int64_t m = c.size();
  std::vector<float> sum(m);
  for (int64_t i = 0; i < m; ++i) {
    float acc = c.partials[0][i];
    for (size_t q = 1; q < c.partials.size(); ++q) acc += c.partials[q][i];
    sum[i] = acc;
  }
  out->assign(m, 0.0f);
  if (c.mode == kPlain) {
    *out = RoundBf16(sum);
    residual->clear();
    return;
  }
  residual->assign(m, 0.0f);
  for (int64_t i = 0; i < m; ++i) {
    (*residual)[i] = c.mode == kFusedInit ? sum[i] : c.residual[i] + sum[i];
  }
  RmsNormParams ref;
  ref.x = residual->data();
  ref.weight = c.weight.data();
  ref.out = out->data();
  ref.rows = c.rows;
  ref.dim = c.dim;
  ref.eps = 1e-5f;
  RmsNormCpu(ref);
}

// A sequence of calls laid out in per-rank device buffers: each call's partials (copied into
// the group's input buffer of its site right before the call, as a GEMM would write them), its
// initial residual (copied into its residual slice, since the call updates it in place), and
// slices for its outputs, pre-filled with NaN so that an element never written fails.
class Sequence {
 public:
  Sequence(Harness* h, std::vector<Call> calls) : h_(h), calls_(std::move(calls)) {
    int64_t total = 0, weights = 0;
    for (Call& c : calls_) {
      c.off = total;
      total += c.size();
      c.weight_off = weights;
      weights += c.dim;
    }
    for (int r = 0; r < h_->n(); ++r) {
      // At least one element each, so that no buffer is null.
      std::vector<float> src(total + 8, 0.0f), res(total + 8, 0.0f), w(weights + 8, 0.0f);
      for (const Call& c : calls_) {
        std::copy(c.partials[r].begin(), c.partials[r].end(), src.begin() + c.off);
        std::copy(c.residual.begin(), c.residual.end(), res.begin() + c.off);
        std::copy(c.weight.begin(), c.weight.end(), w.begin() + c.weight_off);
      }
      h_->Use(r);
      src_.push_back(std::make_unique<DeviceBuffer<bf16>>(ToBf16(src)));
      res_init_.push_back(std::make_unique<DeviceBuffer<float>>(res));
      res_.push_back(std::make_unique<DeviceBuffer<float>>(src.size()));
      out_.push_back(std::make_unique<DeviceBuffer<bf16>>(src.size()));
      weight_.push_back(std::make_unique<DeviceBuffer<float>>(w));
      delay_.push_back(std::make_unique<DeviceBuffer<uint8_t>>(size_t{64} << 20));
    }
    cudaSetDevice(0);
  }

  const std::vector<Call>& calls() const { return calls_; }

  // Fills every rank's outputs with NaN (on the ranks' streams).
  cudaError_t Poison() {
    for (int r = 0; r < h_->n(); ++r) {
      h_->Use(r);
      cudaError_t e =
          cudaMemsetAsync(out_[r]->get(), 0xff, out_[r]->size() * sizeof(bf16), h_->stream(r));
      if (e == cudaSuccess) {
        e = cudaMemsetAsync(res_[r]->get(), 0xff, res_[r]->size() * sizeof(float), h_->stream(r));
      }
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }

  // Enqueues call i of rank r on its stream (the rank's device must be current).
  cudaError_t Enqueue(int r, int i) {
    const Call& c = calls_[i];
    CustomAllReduceGroup& g = h_->group();
    const cudaStream_t s = h_->stream(r);
    cudaError_t e = cudaSuccess;
    if (c.delay_rank == r && c.delay_bytes > 0) {
      e = cudaMemsetAsync(delay_[r]->get(), i & 0xff, c.delay_bytes, s);
      if (e != cudaSuccess) return e;
    }
    e = cudaMemcpyAsync(g.input(r, c.site), src_[r]->get() + c.off, c.size() * sizeof(bf16),
                        cudaMemcpyDeviceToDevice, s);
    if (e != cudaSuccess) return e;
    cuda::AllReduceParams p = g.Params(r, c.site);
    p.rows = c.rows;
    p.dim = c.dim;
    p.out = out_[r]->get() + c.off;
    if (c.max_blocks >= 0) p.max_blocks = c.max_blocks;
    if (c.push_bytes >= 0) p.push_max_bytes = c.push_bytes;
    if (c.mode != kPlain) {
      e = cudaMemcpyAsync(res_[r]->get() + c.off, res_init_[r]->get() + c.off,
                          c.size() * sizeof(float), cudaMemcpyDeviceToDevice, s);
      if (e != cudaSuccess) return e;
      p.residual = res_[r]->get() + c.off;
      p.residual_init = c.mode == kFusedInit;
      p.norm_weight = weight_[r]->get() + c.weight_off;
      p.eps = 1e-5f;
    }
    return cuda::AllReduceCuda(p, s);
  }

  // Enqueues the whole sequence eagerly, call by call across ranks (interleaved, so that no
  // stream's launch queue fills up while the others' are empty), and waits for it.
  ::testing::AssertionResult RunEager(const std::string& what) {
    for (size_t i = 0; i < calls_.size(); ++i) {
      for (int r = 0; r < h_->n(); ++r) {
        h_->Use(r);
        const cudaError_t e = Enqueue(r, static_cast<int>(i));
        if (e != cudaSuccess) {
          // The ranks enqueued so far would wait forever for this one.
          std::fprintf(stderr, "FATAL: %s: enqueue of %s on rank %d failed: %s\n", what.c_str(),
                       calls_[i].Name(static_cast<int>(i)).c_str(), r, cudaGetErrorString(e));
          std::fflush(stderr);
          std::_Exit(1);
        }
      }
    }
    cudaSetDevice(0);
    return h_->Wait(what);
  }

  // Checks every call's outputs on every rank: rank 0 against the CPU reference, every other
  // rank bit for bit against rank 0.
  ::testing::AssertionResult Check(const std::string& what) const {
    std::vector<std::vector<bf16>> out(h_->n());
    std::vector<std::vector<float>> res(h_->n());
    for (int r = 0; r < h_->n(); ++r) {
      out[r] = out_[r]->Download();
      res[r] = res_[r]->Download();
    }
    int failures = 0;
    ::testing::AssertionResult result = ::testing::AssertionSuccess();
    for (size_t i = 0; i < calls_.size() && failures < 3; ++i) {
      const Call& c = calls_[i];
      const std::string name = absl::StrCat(what, ", ", c.Name(static_cast<int>(i)));
      std::vector<float> want_out, want_res;
      Reference(c, &want_out, &want_res);
      const std::vector<bf16> got_out(out[0].begin() + c.off, out[0].begin() + c.off + c.size());
      ::testing::AssertionResult ok = c.mode == kPlain
                                          ? AllClose(ToFloat(got_out), want_out, 0.0f, 0.0f)
                                          : AllClose(ToFloat(got_out), want_out, 1e-5f, kBf16Rtol);
      if (!ok) {
        ++failures;
        result = ::testing::AssertionFailure()
                 << name << ": out of rank 0 vs CPU: " << ok.message();
        continue;
      }
      if (c.mode != kPlain) {
        const std::vector<float> got_res(res[0].begin() + c.off, res[0].begin() + c.off + c.size());
        ok = AllClose(got_res, want_res, 0.0f, 0.0f);
        if (!ok) {
          ++failures;
          result = ::testing::AssertionFailure()
                   << name << ": residual of rank 0 vs CPU (must be exact): " << ok.message();
          continue;
        }
      }
      for (int r = 1; r < h_->n(); ++r) {
        const bool same_out =
            std::memcmp(out[r].data() + c.off, out[0].data() + c.off, c.size() * sizeof(bf16)) == 0;
        const bool same_res =
            c.mode == kPlain || std::memcmp(res[r].data() + c.off, res[0].data() + c.off,
                                            c.size() * sizeof(float)) == 0;
        if (!same_out || !same_res) {
          ++failures;
          result = ::testing::AssertionFailure()
                   << name << ": rank " << r << "'s " << (same_out ? "residual" : "out")
                   << " differs from rank 0's bits";
          break;
        }
      }
    }
    return result;
  }

  DeviceBuffer<bf16>& out(int r) { return *out_[r]; }
  DeviceBuffer<float>& residual(int r) { return *res_[r]; }

 private:
  Harness* h_;
  std::vector<Call> calls_;
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> src_, out_;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> res_init_, res_, weight_;
  std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> delay_;
};

// Creates the harness or skips/fails the test: no peer access is a property of the host
// (skip); anything else is a failure.
#define SPECD_MAKE_HARNESS(h, devices)                                     \
  Harness h(devices);                                                      \
  if (absl::IsFailedPrecondition(h.status())) GTEST_SKIP() << h.status();  \
  ASSERT_TRUE(h.status().ok()) << Describe(devices) << ": " << h.status(); \
  ASSERT_TRUE(h.SyncDevices())

// Ends the process if a test is still running after `seconds`: catches hangs that Wait()
// cannot, e.g. a host thread blocked in a launch while the GPU waits for a barrier.
class Watchdog {
 public:
  explicit Watchdog(double seconds)
      : name_(::testing::UnitTest::GetInstance()->current_test_info()->name()),
        thread_([this, seconds] {
          std::unique_lock<std::mutex> lock(mu_);
          if (!cv_.wait_for(lock, std::chrono::duration<double>(seconds),
                            [this] { return done_; })) {
            std::fprintf(stderr,
                         "\nFATAL: allreduce_cuda_test: %s still running after %.0f s "
                         "(hang). Exiting.\n",
                         name_.c_str(), seconds);
            std::fflush(stderr);
            std::_Exit(1);
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string name_;
  std::thread thread_;  // last: starts once the members above exist
};

class AllReduceCudaTest : public gpu_test::GpuTest {
 protected:
  void SetUp() override {
    gpu_test::GpuTest::SetUp();
    if (!IsSkipped()) watchdog_ = std::make_unique<Watchdog>(300);
  }
  void TearDown() override {
    watchdog_.reset();
    gpu_test::GpuTest::TearDown();
  }

  // The groups the barrier tests run on: ranks as streams of GPU 0, then real multi-GPU
  // groups (and one that mixes both) when the host has them.
  static std::vector<std::vector<int>> Groups(bool include_world1) {
    std::vector<std::vector<int>> groups;
    for (int n : {1, 2, 3, 7}) {
      if (n > 1 || include_world1) groups.push_back(Repeat(0, n));
    }
    const int count = std::min(DeviceCount(), cuda::kAllReduceMaxRanks);
    for (int n = 2; n <= count; ++n) groups.push_back(Iota(n));
    if (count >= 2) groups.push_back({0, 1, 0, 1});
    return groups;
  }

  std::unique_ptr<Watchdog> watchdog_;
};

TEST_F(AllReduceCudaTest, RejectsBrokenPreconditions) {
  Harness h(Repeat(0, 2));
  ASSERT_TRUE(h.status().ok()) << h.status();
  DeviceBuffer<bf16> out(64 * 8 + 8);
  DeviceBuffer<float> res(64 * 8 + 8), w(64 + 8);
  auto base = [&] {
    cuda::AllReduceParams p = h.group().Params(0, 0);
    p.rows = 8;
    p.dim = 64;
    p.out = out.get();
    return p;
  };
  auto fused = [&] {
    cuda::AllReduceParams p = base();
    p.residual = res.get();
    p.norm_weight = w.get();
    return p;
  };
  struct Bad {
    const char* what;
    cuda::AllReduceParams p;
  };
  std::vector<Bad> bad;
  bad.push_back({"dim % 8 != 0", [&] {
                   auto p = base();
                   p.dim = 100;
                   return p;
                 }()});
  bad.push_back({"dim == 0", [&] {
                   auto p = base();
                   p.dim = 0;
                   return p;
                 }()});
  bad.push_back({"rows < 0", [&] {
                   auto p = base();
                   p.rows = -1;
                   return p;
                 }()});
  bad.push_back({"world_size 0", [&] {
                   auto p = base();
                   p.world_size = 0;
                   return p;
                 }()});
  bad.push_back({"world_size 9", [&] {
                   auto p = base();
                   p.world_size = 9;
                   return p;
                 }()});
  bad.push_back({"rank == world_size", [&] {
                   auto p = base();
                   p.rank = 2;
                   return p;
                 }()});
  bad.push_back({"null input", [&] {
                   auto p = base();
                   p.inputs[1] = nullptr;
                   return p;
                 }()});
  bad.push_back({"null signal", [&] {
                   auto p = base();
                   p.signals[1] = nullptr;
                   return p;
                 }()});
  bad.push_back({"null out", [&] {
                   auto p = base();
                   p.out = nullptr;
                   return p;
                 }()});
  bad.push_back({"misaligned out", [&] {
                   auto p = base();
                   p.out = out.get() + 4;
                   return p;
                 }()});
  bad.push_back({"misaligned input", [&] {
                   auto p = base();
                   p.inputs[0] = p.inputs[0] + 1;
                   return p;
                 }()});
  bad.push_back({"max_blocks > max", [&] {
                   auto p = base();
                   p.max_blocks = cuda::kAllReduceMaxBlocks + 1;
                   return p;
                 }()});
  bad.push_back({"fused without weight", [&] {
                   auto p = fused();
                   p.norm_weight = nullptr;
                   return p;
                 }()});
  bad.push_back({"fused, misaligned residual", [&] {
                   auto p = fused();
                   p.residual = res.get() + 2;
                   return p;
                 }()});
  bad.push_back({"fused, negative eps", [&] {
                   auto p = fused();
                   p.eps = -1.0f;
                   return p;
                 }()});
  for (const Bad& b : bad) {
    EXPECT_EQ(cuda::AllReduceCuda(b.p, stream_), cudaErrorInvalidValue) << b.what;
  }
  // Nothing was launched: a launched kernel would wait forever for rank 1.
  EXPECT_TRUE(Wait({stream_}, "rejected calls"));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(AllReduceCudaTest, GroupRejectsBadArguments) {
  EXPECT_FALSE(CustomAllReduceGroup::Create({}, 2, 1024).ok());
  EXPECT_FALSE(CustomAllReduceGroup::Create(Repeat(0, 9), 2, 1024).ok());
  EXPECT_FALSE(CustomAllReduceGroup::Create({0, 0}, 1, 1024).ok());
  EXPECT_FALSE(CustomAllReduceGroup::Create({0, 0}, 2, 0).ok());
  EXPECT_FALSE(CustomAllReduceGroup::Create({0, DeviceCount()}, 2, 1024).ok());
  absl::StatusOr<std::unique_ptr<CustomAllReduceGroup>> g =
      CustomAllReduceGroup::Create({0, 0, 0}, 3, 1000);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->world_size(), 3);
  EXPECT_EQ((*g)->num_sites(), 3);
  EXPECT_GE((*g)->max_bytes(), 1000);
  // Distinct, 16-byte aligned buffers for every (rank, site).
  std::vector<uintptr_t> seen;
  for (int r = 0; r < 3; ++r) {
    for (int s = 0; s < 3; ++s) {
      seen.push_back(reinterpret_cast<uintptr_t>((*g)->input(r, s)));
      seen.push_back(reinterpret_cast<uintptr_t>((*g)->signal(r, s)));
      EXPECT_EQ(seen.back() % 16, 0u);
      EXPECT_EQ(seen[seen.size() - 2] % 16, 0u);
      const cuda::AllReduceParams p = (*g)->Params(r, s);
      EXPECT_EQ(p.world_size, 3);
      EXPECT_EQ(p.rank, r);
      EXPECT_EQ(p.inputs[1], (*g)->input(1, s));
      EXPECT_GT(p.max_blocks, 0) << "ranks share a device: the grid must be split";
    }
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::unique(seen.begin(), seen.end()), seen.end());
}

// Plain and fused calls of awkward shapes (rows 0, 1, 37, 200; dims 64 .. 12288; a dim that is
// a multiple of 8 but not of 64) on every group, each checked against the CPU reference and
// across ranks.
TEST_F(AllReduceCudaTest, MatchesReferenceOnEveryGroup) {
  for (const std::vector<int>& devices : Groups(/*include_world1=*/true)) {
    SCOPED_TRACE(Describe(devices));
    std::mt19937_64 rng(100 + devices.size());
    const int n = static_cast<int>(devices.size());
    std::vector<Call> calls;
    struct Shape {
      int64_t rows, dim;
    };
    int site = 0;
    for (const Shape s : {Shape{1, 4096}, Shape{37, 520}, Shape{200, 64}, Shape{0, 256},
                          Shape{3, 8192}, Shape{2, 12288}, Shape{65, 1024}}) {
      for (int mode : {kPlain, kFused, kFusedInit}) {
        calls.push_back(RandomCall(n, site, s.rows, s.dim, mode, rng));
        site = (site + 1) % 3;
      }
    }
    SPECD_MAKE_HARNESS(h, devices);
    Sequence seq(&h, std::move(calls));
    ASSERT_TRUE(h.SyncDevices());
    ASSERT_EQ(seq.Poison(), cudaSuccess);
    ASSERT_TRUE(seq.RunEager(Describe(devices)));
    EXPECT_TRUE(seq.Check(Describe(devices)));
  }
}

// The fused mode's norm is RmsNormCuda's arithmetic bit for bit: on the residual the
// all-reduce produced (the CPU reference's, which the previous test proves exact), RmsNormCuda
// gives the same bf16 outputs. With one rank, all-reduce + norm is RmsNormCuda on (x, residual)
// itself, so tensor parallelism 1 through this path changes nothing.
TEST_F(AllReduceCudaTest, FusedNormIsRmsNormCudaBitForBit) {
  for (int n : {1, 2, 3}) {
    for (const int64_t dim : {64, 520, 4096, 8192, 12288}) {
      SCOPED_TRACE(absl::StrCat(n, " ranks on GPU 0, dim ", dim));
      std::mt19937_64 rng(200 + n * 7 + dim);
      const int64_t rows = 9;
      std::vector<Call> calls;
      calls.push_back(RandomCall(n, 0, rows, dim, kFused, rng));
      calls.push_back(RandomCall(n, 1, rows, dim, kFusedInit, rng));
      SPECD_MAKE_HARNESS(h, Repeat(0, n));
      Sequence seq(&h, calls);
      ASSERT_TRUE(h.SyncDevices());
      ASSERT_EQ(seq.Poison(), cudaSuccess);
      ASSERT_TRUE(seq.RunEager("fused vs RmsNormCuda"));
      ASSERT_TRUE(seq.Check("fused vs RmsNormCuda"));
      const std::vector<bf16> got = seq.out(0).Download();
      for (size_t i = 0; i < seq.calls().size(); ++i) {
        const Call& c = seq.calls()[i];
        std::vector<float> want_out, want_res;
        Reference(c, &want_out, &want_res);
        // x and residual for RmsNormCuda: with one rank the call's own (x = the partials,
        // residual = the residual before the call); else x = 0 and the final residual.
        std::vector<float> x(c.size(), 0.0f), res = want_res;
        bool init = false;
        if (n == 1) {
          x = c.partials[0];
          res = c.mode == kFusedInit ? std::vector<float>(c.size(), 0.0f) : c.residual;
          init = c.mode == kFusedInit;
        }
        DeviceBuffer<bf16> d_x(ToBf16(x)), d_out(c.size());
        DeviceBuffer<float> d_w(c.weight);
        DeviceBuffer<float> d_res(res);
        cuda::RmsNormParams p;
        p.x = d_x.get();
        p.residual = d_res.get();
        p.residual_init = init;
        p.weight = d_w.get();
        p.out = d_out.get();
        p.rows = c.rows;
        p.dim = c.dim;
        p.eps = 1e-5f;
        SPECD_CUDA_OK(cuda::RmsNormCuda(p, stream_));
        Sync();
        const std::vector<bf16> one(got.begin() + c.off, got.begin() + c.off + c.size());
        EXPECT_TRUE(AllClose(ToFloat(one), ToFloat(d_out.Download()), 0.0f, 0.0f))
            << "call " << i << " (" << ModeName(c.mode) << "): fused all-reduce vs RmsNormCuda";
      }
    }
  }
}

// A row's results do not depend on the other rows of the call or on the grid: the same row
// alone, in a call of 37 rows, and in that call on a grid of one block, gives the same bits.
TEST_F(AllReduceCudaTest, RowsAreInvariantToBatchAndGrid) {
  for (const std::vector<int>& devices : Groups(/*include_world1=*/true)) {
    SCOPED_TRACE(Describe(devices));
    const int n = static_cast<int>(devices.size());
    std::mt19937_64 rng(300 + n);
    const int64_t rows = 37;
    const std::vector<int64_t> picks = {0, 5, 36};
    for (int mode : {kPlain, kFused, kFusedInit}) {
      for (const int64_t dim : {1024, 4096}) {
        std::vector<Call> calls;
        Call big = RandomCall(n, 0, rows, dim, mode, rng);
        calls.push_back(big);
        Call one_block = big;
        one_block.site = 1;
        one_block.max_blocks = 1;
        calls.push_back(one_block);
        int site = 2;
        for (int64_t k : picks) {
          Call row;
          row.site = site;
          site = site == 2 ? 0 : site + 1;
          row.rows = 1;
          row.dim = dim;
          row.mode = mode;
          for (int r = 0; r < n; ++r) {
            row.partials.emplace_back(big.partials[r].begin() + k * dim,
                                      big.partials[r].begin() + (k + 1) * dim);
          }
          if (mode != kPlain) {
            row.residual.assign(big.residual.begin() + k * dim,
                                big.residual.begin() + (k + 1) * dim);
            row.weight = big.weight;
          }
          calls.push_back(row);
        }
        SPECD_MAKE_HARNESS(h, devices);
        Sequence seq(&h, calls);
        ASSERT_TRUE(h.SyncDevices());
        ASSERT_EQ(seq.Poison(), cudaSuccess);
        ASSERT_TRUE(seq.RunEager("row invariance"));
        ASSERT_TRUE(seq.Check("row invariance"));
        const std::vector<bf16> out = seq.out(0).Download();
        const std::vector<float> res = seq.residual(0).Download();
        const Call& b = seq.calls()[0];
        const Call& g = seq.calls()[1];
        EXPECT_EQ(std::memcmp(out.data() + b.off, out.data() + g.off, b.size() * sizeof(bf16)), 0)
            << ModeName(mode) << ", dim " << dim << ": 37 rows on the default grid vs one block";
        for (size_t j = 0; j < picks.size(); ++j) {
          const Call& c = seq.calls()[2 + j];
          const int64_t k = picks[j];
          EXPECT_EQ(
              std::memcmp(out.data() + c.off, out.data() + b.off + k * dim, dim * sizeof(bf16)), 0)
              << ModeName(mode) << ", dim " << dim << ": row " << k << " alone vs in 37 rows";
          if (mode != kPlain) {
            EXPECT_EQ(
                std::memcmp(res.data() + c.off, res.data() + b.off + k * dim, dim * sizeof(float)),
                0)
                << ModeName(mode) << ", dim " << dim << ": residual of row " << k;
          }
        }
      }
    }
  }
}

// Many back-to-back calls cycling over 3 sites with varying rows, dims and modes, with
// stragglers (a random rank first runs a large memset), to shake out barrier races: a flag
// seen too early, a rank overwriting its input while another still reads it, counters out of
// step. Everything is enqueued before anything is waited for.
// Push mode (messages up to the group's push_max_bytes) and barrier mode give the same bits on
// the same inputs, and partials holding -0.0 (the mailboxes' empty value) neither hang push
// mode nor change a sum: each shape runs twice, push mode then barrier mode, sites rotating.
TEST_F(AllReduceCudaTest, PushModeEqualsBarrierModeBitForBit) {
  for (const std::vector<int>& devices : Groups(/*include_world1=*/false)) {
    SCOPED_TRACE(Describe(devices));
    const int n = static_cast<int>(devices.size());
    std::mt19937_64 rng(500 + n);
    std::vector<Call> calls;
    struct Shape {
      int64_t rows, dim;
    };
    int site = 0;
    for (const Shape s : {Shape{1, 4096}, Shape{7, 520}, Shape{32, 4096}, Shape{1, 64}}) {
      for (int mode : {kPlain, kFused, kFusedInit}) {
        Call c = RandomCall(n, site, s.rows, s.dim, mode, rng);
        for (int64_t i = 0; i < c.size(); i += 97) {
          for (int r = 0; r < n; ++r) c.partials[r][i] = -0.0f;  // a sum of -0.0s
        }
        if (c.size() > 5) c.partials[0][5] = -0.0f;  // -0.0 next to data
        Call barrier = c;
        barrier.site = (site + 1) % 3;
        barrier.push_bytes = 0;
        calls.push_back(std::move(c));
        calls.push_back(std::move(barrier));
        site = (site + 2) % 3;
      }
    }
    SPECD_MAKE_HARNESS(h, devices);
    ASSERT_GE(h.group().push_max_bytes(), 32 * 4096 * 2);
    Sequence seq(&h, std::move(calls));
    ASSERT_TRUE(h.SyncDevices());
    ASSERT_EQ(seq.Poison(), cudaSuccess);
    ASSERT_TRUE(seq.RunEager(Describe(devices)));
    ASSERT_TRUE(seq.Check(Describe(devices)));
    const std::vector<bf16> out = seq.out(0).Download();
    const std::vector<float> res = seq.residual(0).Download();
    for (size_t i = 0; i + 1 < seq.calls().size(); i += 2) {
      const Call& a = seq.calls()[i];
      const Call& b = seq.calls()[i + 1];
      EXPECT_EQ(std::memcmp(out.data() + a.off, out.data() + b.off, a.size() * sizeof(bf16)), 0)
          << a.Name(static_cast<int>(i)) << ": push and barrier outputs differ";
      if (a.mode != kPlain) {
        EXPECT_EQ(
            std::memcmp(res.data() + a.off, res.data() + b.off, a.size() * sizeof(float)), 0)
            << a.Name(static_cast<int>(i)) << ": push and barrier residuals differ";
      }
    }
  }
}

TEST_F(AllReduceCudaTest, ManyCallsCyclingSites) {
  for (const std::vector<int>& devices : Groups(/*include_world1=*/false)) {
    SCOPED_TRACE(Describe(devices));
    const int n = static_cast<int>(devices.size());
    std::mt19937_64 rng(400 + n);
    const int64_t rows_cycle[] = {1, 7, 65, 200};
    const int64_t dim_cycle[] = {512, 4096, 1024};
    std::vector<Call> calls;
    for (int i = 0; i < 48; ++i) {
      Call c = RandomCall(n, i % 3, rows_cycle[i % 4], dim_cycle[i % 3], (i / 2) % 3, rng);
      if (i % 5 == 2) {
        c.delay_rank = static_cast<int64_t>(rng() % n);
        c.delay_bytes = int64_t{1} << (20 + rng() % 7);  // 1 .. 64 MiB
      }
      calls.push_back(std::move(c));
    }
    SPECD_MAKE_HARNESS(h, devices);
    Sequence seq(&h, std::move(calls));
    ASSERT_TRUE(h.SyncDevices());
    for (int round = 0; round < 3; ++round) {
      const std::string what = absl::StrCat(Describe(devices), ", round ", round);
      ASSERT_EQ(seq.Poison(), cudaSuccess);
      ASSERT_TRUE(seq.RunEager(what));
      ASSERT_TRUE(seq.Check(what));
    }
  }
}

// Each rank captures a sequence of calls (with the copies of its partials and residuals) into
// a CUDA graph; the graphs are replayed several times, with eager calls in between. The
// barrier's counters live on the device, so replays stay in step with no host input.
TEST_F(AllReduceCudaTest, GraphReplays) {
  for (const std::vector<int>& devices : Groups(/*include_world1=*/false)) {
    SCOPED_TRACE(Describe(devices));
    const int n = static_cast<int>(devices.size());
    std::mt19937_64 rng(500 + n);
    std::vector<Call> calls;
    const int64_t rows_cycle[] = {1, 7, 65, 200, 3, 16};
    for (int i = 0; i < 6; ++i) {
      calls.push_back(RandomCall(n, i % 3, rows_cycle[i], i % 2 ? 2048 : 512, i % 3, rng));
    }
    SPECD_MAKE_HARNESS(h, devices);
    Sequence seq(&h, calls);
    // An eager call between replays: the graph ends with site 2 and starts with site 0, so
    // the eager call uses site 1 (never the same site twice in a row).
    std::vector<Call> between_calls = {RandomCall(n, 1, 5, 1024, kFused, rng)};
    Sequence between(&h, between_calls);
    ASSERT_TRUE(h.SyncDevices());

    std::vector<cudaGraphExec_t> execs(n, nullptr);
    for (int r = 0; r < n; ++r) {
      h.Use(r);
      cudaGraph_t graph = nullptr;
      SPECD_CUDA_OK(cudaStreamBeginCapture(h.stream(r), cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < static_cast<int>(calls.size()); ++i) {
        const cudaError_t e = seq.Enqueue(r, i);
        if (e != cudaSuccess) {
          cudaStreamEndCapture(h.stream(r), &graph);
          FAIL() << "capture of rank " << r << ", call " << i << ": " << cudaGetErrorString(e);
        }
      }
      SPECD_CUDA_OK(cudaStreamEndCapture(h.stream(r), &graph));
      SPECD_CUDA_OK(cudaGraphInstantiate(&execs[r], graph, 0));
      cudaGraphDestroy(graph);
    }
    for (int replay = 0; replay < 5; ++replay) {
      const std::string what = absl::StrCat(Describe(devices), ", graph replay ", replay);
      ASSERT_EQ(seq.Poison(), cudaSuccess);
      for (int r = 0; r < n; ++r) {
        h.Use(r);
        SPECD_CUDA_OK(cudaGraphLaunch(execs[r], h.stream(r)));
      }
      ASSERT_TRUE(h.Wait(what));
      ASSERT_TRUE(seq.Check(what));
      if (replay % 2 == 1) {
        ASSERT_EQ(between.Poison(), cudaSuccess);
        ASSERT_TRUE(between.RunEager(what + ", eager call after it"));
        ASSERT_TRUE(between.Check(what + ", eager call after it"));
      }
    }
    // Two replays back to back, without waiting in between.
    ASSERT_EQ(seq.Poison(), cudaSuccess);
    for (int twice = 0; twice < 2; ++twice) {
      for (int r = 0; r < n; ++r) {
        h.Use(r);
        SPECD_CUDA_OK(cudaGraphLaunch(execs[r], h.stream(r)));
      }
    }
    ASSERT_TRUE(h.Wait("two replays back to back"));
    EXPECT_TRUE(seq.Check("two replays back to back"));
    for (int r = 0; r < n; ++r) {
      h.Use(r);
      cudaGraphExecDestroy(execs[r]);
    }
    cudaSetDevice(0);
  }
}

// NCCL: a group of one GPU anywhere, and of all GPUs (up to 8) when there are several. From one
// thread, so the ranks' parts are bracketed by GroupStart/GroupEnd.
TEST_F(AllReduceCudaTest, NcclGroupAllReduceAndAllGather) {
  EXPECT_FALSE(NcclGroup::Create({0, 0}).ok()) << "one rank per device";
  std::vector<std::vector<int>> groups = {{0}};
  const int count = std::min(DeviceCount(), cuda::kAllReduceMaxRanks);
  if (count >= 2) groups.push_back(Iota(count));
  for (const std::vector<int>& devices : groups) {
    SCOPED_TRACE(Describe(devices));
    absl::StatusOr<std::unique_ptr<NcclGroup>> g = NcclGroup::Create(devices);
    if (absl::IsUnimplemented(g.status())) GTEST_SKIP() << g.status();
    ASSERT_TRUE(g.ok()) << g.status();
    const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
    EXPECT_TRUE(nvls != nullptr && std::string(nvls) == "0");
    const int n = (*g)->world_size();
    ASSERT_EQ(n, static_cast<int>(devices.size()));
    const size_t count_elems = 3 * 4096 + 8;
    std::mt19937_64 rng(600 + n);
    std::vector<std::vector<float>> in(n);
    std::vector<float> sum(count_elems, 0.0f);
    for (int r = 0; r < n; ++r) {
      in[r] = RoundBf16(RandomNormal(count_elems, rng));
      for (size_t i = 0; i < count_elems; ++i) sum[i] += in[r][i];
    }
    std::vector<cudaStream_t> streams(n);
    std::vector<std::unique_ptr<DeviceBuffer<bf16>>> b_in, b_out, b_gather;
    std::vector<std::unique_ptr<DeviceBuffer<float>>> f_inout;
    for (int r = 0; r < n; ++r) {
      cudaSetDevice(devices[r]);
      SPECD_CUDA_OK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
      b_in.push_back(std::make_unique<DeviceBuffer<bf16>>(ToBf16(in[r])));
      b_out.push_back(std::make_unique<DeviceBuffer<bf16>>(count_elems));
      b_gather.push_back(std::make_unique<DeviceBuffer<bf16>>(count_elems * n));
      f_inout.push_back(std::make_unique<DeviceBuffer<float>>(in[r]));
      SPECD_CUDA_OK(cudaDeviceSynchronize());
    }
    ASSERT_TRUE(NcclGroup::GroupStart().ok());
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(
          (*g)->AllReduceSum(r, b_in[r]->get(), b_out[r]->get(), count_elems, streams[r]).ok());
      ASSERT_TRUE(
          (*g)->AllReduceSum(r, f_inout[r]->get(), f_inout[r]->get(), count_elems, streams[r])
              .ok());
      ASSERT_TRUE(
          (*g)->AllGather(r, b_in[r]->get(), b_gather[r]->get(), count_elems, streams[r]).ok());
    }
    ASSERT_TRUE(NcclGroup::GroupEnd().ok());
    ASSERT_TRUE(Wait(streams, "NCCL collectives"));
    for (int r = 0; r < n; ++r) {
      // NCCL's order of summation (and bf16 rounding of partial sums on the ring) is its own.
      EXPECT_TRUE(AllClose(ToFloat(b_out[r]->Download()), sum, 0.02f * n, 0.01f * n))
          << "bf16, rank " << r;
      EXPECT_TRUE(AllClose(f_inout[r]->Download(), sum, 1e-5f, 1e-5f)) << "fp32, rank " << r;
      const std::vector<float> gathered = ToFloat(b_gather[r]->Download());
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(AllClose(std::vector<float>(gathered.begin() + q * count_elems,
                                                gathered.begin() + (q + 1) * count_elems),
                             in[q], 0.0f, 0.0f))
            << "all-gather on rank " << r << ", block of rank " << q;
      }
    }
    for (int r = 0; r < n; ++r) {
      cudaSetDevice(devices[r]);
      cudaStreamDestroy(streams[r]);
    }
    cudaSetDevice(0);
  }
}

}  // namespace
}  // namespace specd
