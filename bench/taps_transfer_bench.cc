// What the EAGLE-3 taps cost on the wire, against applying the head's fc in the verify service
// (docs/eagle.md, "Serving": which one specd does and why).
//
// BM_TapsRoundTrip: one verify step over a real gRPC stream on loopback, as the router and the
// verify service hold it (common/service/grpc_util.h: the services' channel and server options,
// the Verifier service of proto/specd/v1/verify.proto): the client writes a VerifyStepRequest of
// one sequence, the server answers with a VerifyStepResponse whose result carries `rows` tap rows
// of `width` bf16 values, encoded from fp32 rows by HiddenStatesToProto as the verify service
// does, and the client decodes them with HiddenStatesFromProto as the draft service does. At the
// Llama-3.1-8B shape (H 4096) width 12288 is the three taps (3H, what travels today) and 4096 is
// fc(taps) (H, what would travel with fc in the verify service); width 0 is the step without
// taps. Rows: 1, 5, 16 and 64 committed tokens a step, and a 2048-token prompt. The router
// relays the same bytes to the draft service (a second hop of the same size), not timed here.
//
// BM_TapsCodec: the encode and decode alone, without gRPC.
//
// BM_FcCpu: the fc GEMM on the CPU, [rows, 3 Ht] x [H, 3 Ht]^T in fp32 through LinearCpu (the
// CPU backend's batch-invariant GEMM), at the reference shape (pycoder: Ht = H = 320) and the
// 8B shape (4096). Its GPU cost: BM_Gemm of cuda_kernels_bench at n 4096, k 12288.
//
// Run: build/bench/taps_transfer_bench --benchmark_repetitions=5
//      --benchmark_report_aggregates_only
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "common/service/grpc_util.h"
#include "common/service/hidden_states_proto.h"
#include "grpcpp/grpcpp.h"
#include "specd/kernels/linear.h"
#include "specd/v1/verify.grpc.pb.h"

namespace specd {
namespace {

constexpr int64_t kHidden8B = 4096;

std::vector<float> RandomRows(int64_t n, uint64_t seed) {
  std::vector<float> v(n);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : v) x = normal(rng);
  return v;
}

// A Verifier whose Step answers each request with one result carrying the taps the benchmark
// set: rows x width bf16, encoded per reply from fp32 rows as the verify service encodes them.
class TapsVerifier final : public v1::Verifier::Service {
 public:
  void Set(int64_t rows, int64_t width) {
    rows_ = rows;
    width_ = width;
    source_ = RandomRows(rows * width, 7);
  }

  grpc::Status Step(
      grpc::ServerContext* /*context*/,
      grpc::ServerReaderWriter<v1::VerifyStepResponse, v1::VerifyStepRequest>* stream) override {
    v1::VerifyStepRequest request;
    while (stream->Read(&request)) {
      v1::VerifyStepResponse reply;
      reply.set_step_id(request.step_id());
      v1::VerifySequenceResult* result = reply.add_results();
      result->set_seq_id(request.steps(0).seq_id());
      // A decode step's outcome: accepted tokens and the bonus token.
      for (int i = 0; i < 5; ++i) result->add_tokens(100 + i);
      result->set_accepted_draft(4);
      if (width_ > 0) {
        const std::vector<int> layers =
            width_ == 3 * kHidden8B ? std::vector<int>{2, 16, 29} : std::vector<int>{-1};
        HiddenStatesToProto(source_, rows_, width_, layers, /*first_position=*/0,
                            v1::TENSOR_DTYPE_BF16, result->mutable_taps());
      }
      if (!stream->Write(reply)) break;
    }
    return grpc::Status::OK;
  }

 private:
  std::atomic<int64_t> rows_{0}, width_{0};
  std::vector<float> source_;
};

struct Loopback {
  TapsVerifier service;
  std::unique_ptr<GrpcServer> server;
  std::unique_ptr<v1::Verifier::Stub> stub;
};

Loopback& Shared() {
  static Loopback* lb = [] {
    auto* l = new Loopback();
    GrpcServerOptions o;
    o.address = "127.0.0.1:0";
    o.services = {&l->service};
    absl::StatusOr<std::unique_ptr<GrpcServer>> s = GrpcServer::Start(o);
    if (!s.ok()) std::abort();
    l->server = *std::move(s);
    l->stub = v1::Verifier::NewStub(
        CreateServiceChannel("127.0.0.1:" + std::to_string(l->server->port())));
    return l;
  }();
  return *lb;
}

void BM_TapsRoundTrip(benchmark::State& state) {
  const int64_t rows = state.range(0), width = state.range(1);
  Loopback& lb = Shared();
  lb.service.Set(rows, width);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::VerifyStepRequest, v1::VerifyStepResponse>> stream =
      lb.stub->Step(&context);
  v1::VerifyStepRequest request;
  v1::VerifySequenceStep* step = request.add_steps();
  step->set_seq_id(1);
  step->add_pending(42);
  for (int i = 0; i < 16; ++i) {
    step->mutable_tree()->add_tokens(i);
    step->mutable_tree()->add_parents(i / 4 - 1);
  }
  for (int layer : {2, 16, 29}) step->add_tap_layers(layer);
  step->set_tap_dtype(v1::TENSOR_DTYPE_BF16);
  v1::VerifyStepResponse reply;
  std::vector<float> decoded;
  uint64_t id = 0;
  for (auto _ : state) {
    request.set_step_id(++id);
    if (!stream->Write(request) || !stream->Read(&reply)) {
      state.SkipWithError("stream broke");
      break;
    }
    if (width > 0) {
      const absl::Status s =
          HiddenStatesFromProto(reply.results(0).taps(), width, "results[0].taps", &decoded);
      if (!s.ok() || static_cast<int64_t>(decoded.size()) != rows * width) {
        state.SkipWithError("bad taps");
        break;
      }
    }
  }
  stream->WritesDone();
  (void)stream->Finish();
  const int64_t bytes = rows * width * 2;
  state.counters["tap_KiB"] = static_cast<double>(bytes) / 1024.0;
  state.counters["tap_MBps"] = benchmark::Counter(static_cast<double>(bytes) * 1e-6,
                                                  benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_TapsRoundTrip)
    ->ArgNames({"rows", "width"})
    ->Args({1, 0})
    ->ArgsProduct({{1, 5, 16, 64, 2048}, {3 * kHidden8B, kHidden8B}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->MinTime(0.2);

// The encode and decode of BM_TapsRoundTrip alone (no gRPC): fp32 rows to bf16 bytes in the
// proto (the verify service), bytes back to fp32 rows (the draft service).
void BM_TapsCodec(benchmark::State& state) {
  const int64_t rows = state.range(0), width = state.range(1);
  const std::vector<float> source = RandomRows(rows * width, 7);
  const std::vector<int> layers = {2, 16, 29};
  v1::HiddenStates proto;
  std::vector<float> decoded;
  for (auto _ : state) {
    HiddenStatesToProto(source, rows, width, layers, 0, v1::TENSOR_DTYPE_BF16, &proto);
    if (!HiddenStatesFromProto(proto, width, "taps", &decoded).ok()) {
      state.SkipWithError("bad taps");
      break;
    }
  }
  state.counters["tap_KiB"] = static_cast<double>(rows * width * 2) / 1024.0;
}
BENCHMARK(BM_TapsCodec)
    ->ArgNames({"rows", "width"})
    ->ArgsProduct({{1, 5, 16, 64, 2048}, {3 * kHidden8B, kHidden8B}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->MinTime(0.2);

void BM_FcCpu(benchmark::State& state) {
  const int64_t rows = state.range(0), h = state.range(1);
  const std::vector<float> w = RandomRows(h * 3 * h, 1), x = RandomRows(rows * 3 * h, 2);
  std::vector<float> y(rows * h);
  LinearParams p;
  p.x = x.data();
  p.w = w.data();
  p.y = y.data();
  p.rows = rows;
  p.in_features = 3 * h;
  p.out_features = h;
  for (auto _ : state) {
    LinearCpu(p);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GFLOPs"] = benchmark::Counter(2.0 * rows * 3 * h * h * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_FcCpu)
    ->ArgNames({"rows", "H"})
    ->ArgsProduct({{1, 5, 16, 64, 2048}, {320}})
    ->ArgsProduct({{1, 5, 16, 64}, {kHidden8B}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->MinTime(0.2);
// 2048 rows at the 8B shape: 206 GFLOP, seconds on a CPU; one iteration a repetition.
BENCHMARK(BM_FcCpu)
    ->ArgNames({"rows", "H"})
    ->Args({2048, kHidden8B})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(1);

}  // namespace
}  // namespace specd

BENCHMARK_MAIN();
