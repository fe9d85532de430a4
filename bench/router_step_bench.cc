// The router's own work per speculation step, without the network: what RouterLoop::Plan,
// DraftStep, VerifyStep and ApplyVerifyResult/Emit do for every running sequence, with the
// services' answers made up. The engine/spec core (SequenceState, GoodputPolicy), the metrics
// (RouterMetrics on a real prometheus registry), the text stream (SequenceOutput on the
// reference tokenizer) and the protos (built, serialized, parsed) are the router's own code; the
// loop that strings them together follows router_loop.cc step for step (no gRPC, no threads),
// leaving out what costs `off` and `auto` alike and needs a live request: the cancellation and
// deadline checks, EAGLE taps, logprobs, and handing chunks to the gRPC reactors.
// At 128 streams an 8B verify step on an H200 takes ~16 ms, so every 0.1 ms of router work a
// step costs `auto` 0.6% against `off`.
//
// Three modes: speculation off; `auto` where the acceptance is too low for drafts to pay (the
// policy keeps every sequence plain but for probes); `auto` where chains pay (acceptance 0.9).
// Sequences finish after 256 tokens and are replaced, as continuous batching does.
//
// Wall times on a shared machine are noise; count instructions of the router's parts only (the
// made-up services are outside the functions named Router*), from the repository root:
//   valgrind --tool=callgrind --toggle-collect='*RouterPart*<true>*' \
//       build/bench/router_step_bench --benchmark_filter='RouterStep/128/1$' \
//       --benchmark_min_time=0.05
// and divide the instructions by the "counted steps" it prints last (the warm-up steps run
// other instances of the same code, which the toggle leaves out).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "benchmark/benchmark.h"
#include "common/service/tree_proto.h"
#include "common/text/tokenizer.h"
#include "common/token_tree.h"
#include "engine/spec/policy.h"
#include "engine/spec/sequence_state.h"
#include "prometheus/registry.h"
#include "services/router/output_stream.h"
#include "services/router/router_metrics.h"
#include "services/verify/sampling_proto.h"
#include "specd/v1/draft.pb.h"
#include "specd/v1/generation.pb.h"
#include "specd/v1/verify.pb.h"

namespace specd {
namespace {

// The made-up services never send anything the router would reject; if they did, the numbers
// would not be the router's path.
void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "router_step_bench: %s\n", what);
    std::abort();
  }
}

constexpr int kPromptTokens = 200;
constexpr int kNewTokens = 256;

enum Mode { kOff = 0, kAutoPlain = 1, kAutoChains = 2 };

class Decoder : public TokenTextDecoder {
 public:
  explicit Decoder(const Tokenizer* tokenizer) : stream_(tokenizer, true) {}
  std::string Next(int32_t token) override { return stream_.Push(token); }
  std::string Flush() override { return stream_.Flush(); }

 private:
  DecodeStream stream_;
};

struct Seq {
  uint64_t id = 0;
  std::unique_ptr<SequenceState> core;
  std::unique_ptr<SequenceOutput> output;
  SamplingParams sampling;
  TokenTree tree;
  bool drafted = false;  // the draft service was sent this sequence this step
};

struct Router {
  Mode mode;
  double acceptance;
  std::mt19937 rng{42};
  const Tokenizer* tokenizer;
  prometheus::Registry registry;
  RouterMetrics metrics{registry};
  GoodputPolicy policy;
  std::vector<Seq> running;
  uint64_t next_id = 1;
  uint64_t next_step = 1;
  int vocab = 0;
  // Per step: the messages on the wire.
  v1::DraftStepRequest draft_request;
  std::string draft_wire, draft_reply_wire, verify_wire, verify_reply_wire;
  absl::flat_hash_map<uint64_t, Seq*> by_id;
  int64_t drafted_steps = 0, steps = 0;
  // FNV-1a over every decision's shapes and reasons: the same in two builds means the policy
  // decided the same, step for step (the bench is deterministic).
  uint32_t digest = 2166136261u;
  void Fold(uint32_t x) { digest = (digest ^ x) * 16777619u; }

  Router(Mode m, int n, const Tokenizer* t)
      : mode(m), acceptance(m == kAutoChains ? 0.9 : 0.02), tokenizer(t), policy(Options()) {
    vocab = 8192;
    for (int i = 0; i < n; ++i) running.push_back(NewSeq());
    // Measured costs as a served run leaves them (VerifySeconds; a draft level 0.7 ms), so that
    // chains pay at acceptance 0.9 and nothing pays at 0.2.
    for (int rows : {1, 16, 64, 128, 256}) {
      for (int tokens_per_row : {1, 2, 3, 5}) {
        for (int k = 0; k < 3; ++k) {
          policy.costs().ObserveVerify(rows, rows * tokens_per_row,
                                       VerifySeconds(rows, rows * tokens_per_row));
        }
      }
      for (int k = 0; k < 3; ++k) policy.costs().ObserveDraft(rows, 3, rows * 3, rows, 2e-3);
    }
  }

  static PolicyOptions Options() {
    PolicyOptions o;
    o.padded_rows = true;  // as the CUDA verify backend reports
    return o;
  }
  static double VerifySeconds(int rows, int tokens) { return 8e-3 + 2e-5 * rows + 2e-5 * tokens; }

  Seq NewSeq() {
    Seq s;
    s.id = next_id++;
    std::uniform_int_distribution<int32_t> token(300, 8000);
    std::vector<int32_t> prompt(kPromptTokens);
    for (int32_t& t : prompt) t = token(rng);
    StopConditions stop;
    stop.max_new_tokens = kNewTokens;
    stop.eos_token_ids = {2};
    stop.max_total_tokens = 4096;
    absl::StatusOr<SequenceState> core = SequenceState::Create(prompt, stop, vocab);
    Require(core.ok(), "SequenceState::Create");
    s.core = std::make_unique<SequenceState>(*std::move(core));
    StreamStopConditions ss;
    ss.max_new_tokens = kNewTokens;
    ss.eos_token_ids = {2};
    ss.max_total_tokens = 4096;
    ss.prompt_tokens = kPromptTokens;
    s.output = std::make_unique<SequenceOutput>(std::make_unique<Decoder>(tokenizer), ss);
    return s;
  }
};

// ---- The router's parts (counted) ----

// Calls of each instance: also keeps the compiler from folding the counted instances into the
// others (identical code), which would leave callgrind no name to toggle on.
int64_t part_calls[2] = {};  // NOLINT: one process, one thread

// RouterLoop::Plan.
template <bool kCounted>
__attribute__((noinline)) void RouterPartPlan(Router& r) {
  ++part_calls[kCounted];
  std::vector<PolicySequence> inputs;
  inputs.reserve(r.running.size());
  for (Seq& s : r.running) {
    s.tree = TokenTree();
    s.drafted = false;
    PolicySequence p = s.core->PolicyInput(/*model_draft=*/true);
    if (r.mode == kOff) p.fixed = true;
    inputs.push_back(p);
  }
  const PolicyDecision decision = r.policy.Decide(inputs);
  for (size_t i = 0; i < decision.shapes.size(); ++i) {
    const SpecShape& shape = decision.shapes[i];
    r.Fold(static_cast<uint32_t>(shape.depth) << 24 | static_cast<uint32_t>(shape.top_k) << 16 |
           static_cast<uint32_t>(shape.max_nodes) << 8 |
           static_cast<uint32_t>(decision.reasons[i]));
  }
  for (size_t i = 0; i < r.running.size(); ++i) {
    r.running[i].core->Plan(decision.shapes[i], decision.reasons[i]);
  }
  r.metrics.policy_goodput.Set(decision.predicted_goodput);
  r.metrics.policy_verify_one_token.Set(r.policy.costs().VerifyOneTokenSeconds());
  r.metrics.policy_verify_chain4.Set(r.policy.costs().VerifyChain4Seconds());
  r.metrics.policy_draft_level.Set(r.policy.costs().DraftLevelSeconds());
}

// RouterLoop::DraftStep up to the round trip: the message to the draft service.
template <bool kCounted>
__attribute__((noinline)) void RouterPartDraftRequest(Router& r) {
  ++part_calls[kCounted];
  r.draft_request.Clear();
  r.by_id.clear();
  for (Seq& s : r.running) {
    const SpecShape shape = s.core->planned();
    if (shape.none()) continue;
    const absl::Span<const int32_t> fresh = s.core->DrafterPending();
    v1::DraftSequenceStep* step = r.draft_request.add_steps();
    step->set_seq_id(s.id);
    step->mutable_new_tokens()->Assign(fresh.begin(), fresh.end());
    step->set_method(v1::DRAFT_METHOD_MODEL);
    step->set_depth(shape.depth);
    step->set_top_k(shape.top_k);
    step->set_max_nodes(shape.max_nodes);
    s.core->MarkDrafterFed();
    s.drafted = true;
    r.by_id[s.id] = &s;
  }
  r.draft_wire.clear();
  if (r.draft_request.steps_size() > 0) {
    r.draft_request.set_step_id(r.next_step);
    r.draft_request.SerializeToString(&r.draft_wire);
  }
}

// RouterLoop::DraftStep after the round trip: the trees taken in.
template <bool kCounted>
__attribute__((noinline)) void RouterPartDraftReply(Router& r, double seconds) {
  ++part_calls[kCounted];
  if (r.draft_wire.empty()) return;
  v1::DraftStepResponse response;
  Require(response.ParseFromString(r.draft_reply_wire), "draft reply");
  int levels = 0, nodes = 0, fed = 0;
  for (const v1::DraftSequenceStep& step : r.draft_request.steps()) {
    levels = std::max(levels, static_cast<int>(step.depth()));
    nodes += static_cast<int>(step.max_nodes());
    fed += step.new_tokens_size();
  }
  r.policy.costs().ObserveDraft(r.draft_request.steps_size(), levels, nodes, fed, seconds);
  for (const v1::DraftSequenceResult& result : response.results()) {
    auto it = r.by_id.find(result.seq_id());
    if (it == r.by_id.end()) continue;
    TokenTree tree = TreeFromProto(result.tree());
    Require(ValidateTree(tree, r.vocab).ok(), "draft tree");
    it->second->tree = std::move(tree);
  }
}

// RouterLoop::VerifyStep up to the round trip.
template <bool kCounted>
__attribute__((noinline)) void RouterPartVerifyRequest(Router& r, v1::VerifyStepRequest& request,
                                                       int* tokens, int* longest) {
  ++part_calls[kCounted];
  request.Clear();
  *tokens = 0;
  *longest = 0;
  for (Seq& s : r.running) {
    v1::VerifySequenceStep* step = request.add_steps();
    step->set_seq_id(s.id);
    const absl::Span<const int32_t> pending = s.core->TargetPending();
    step->mutable_pending()->Assign(pending.begin(), pending.end());
    *tokens += static_cast<int>(pending.size() + s.tree.size());
    *longest = std::max(*longest, static_cast<int>(pending.size() + s.tree.size()));
    if (!s.tree.empty()) TreeToProto(s.tree, step->mutable_tree());
    SamplingToProto(s.sampling, {}, step->mutable_sampling());
    step->set_deadline_unix_ms(0);
  }
  request.set_step_id(r.next_step++);
  request.SerializeToString(&r.verify_wire);
}

// RouterLoop::VerifyStep after the round trip, ApplyVerifyResult and Emit.
template <bool kCounted>
__attribute__((noinline)) void RouterPartVerifyReply(Router& r, int rows, int tokens, int longest,
                                                     double seconds) {
  ++part_calls[kCounted];
  r.policy.costs().ObserveVerify(
      rows, VerifyStepTokens(r.policy.options().padded_rows, rows, tokens, longest), seconds);
  v1::VerifyStepResponse response;
  Require(response.ParseFromString(r.verify_reply_wire), "verify reply");
  absl::flat_hash_map<uint64_t, Seq*> by_id;
  for (Seq& s : r.running) by_id[s.id] = &s;
  for (const v1::VerifySequenceResult& result : response.results()) {
    auto it = by_id.find(result.seq_id());
    if (it == by_id.end()) continue;
    Seq& s = *it->second;
    VerifyOutcome outcome;
    outcome.tokens.assign(result.tokens().begin(), result.tokens().end());
    outcome.accepted_draft = static_cast<int>(result.accepted_draft());
    outcome.accepted_nodes.assign(result.accepted_nodes().begin(), result.accepted_nodes().end());
    Require(SequenceState::CheckOutcome(outcome, s.tree, r.vocab).ok(), "verify outcome");
    const SpecShape planned = s.core->planned();
    const ShapeReason reason = s.core->planned_reason();
    const int nodes = static_cast<int>(s.tree.size());
    r.metrics.CountStep(TreeSizeBucket(nodes), ShapeReasonName(reason, planned.none()));
    if (!s.tree.empty()) {
      r.metrics.spec_decode_steps.Increment();
      r.metrics.spec_decode_draft_tokens.Increment(nodes);
      r.metrics.spec_decode_accepted_tokens.Increment(outcome.accepted_draft);
      r.metrics.CountAcceptedPositions(outcome.accepted_draft);
    } else {
      r.metrics.CountTargetOnlyStep(reason == ShapeReason::kOff ? TargetOnlyReason::kOff
                                                                : TargetOnlyReason::kNoDraft);
    }
    for (int32_t t : s.core->Apply(outcome, s.tree)) {
      if (!s.output->Push(t)) break;
    }
    // Emit.
    OutputChunk chunk = s.output->TakeReady();
    if (chunk.empty() && !s.output->finished()) continue;
    v1::GenerateResponse chunk_response;
    chunk_response.mutable_token_ids()->Assign(chunk.token_ids.begin(), chunk.token_ids.end());
    chunk_response.set_text(std::move(chunk.text));
    r.metrics.generation_tokens.Increment(static_cast<double>(chunk.token_ids.size()));
    benchmark::DoNotOptimize(chunk_response);
  }
}

// ---- The services (not counted) ----

__attribute__((noinline)) void FakeDraftService(Router& r) {
  if (r.draft_wire.empty()) return;
  v1::DraftStepRequest request;
  Require(request.ParseFromString(r.draft_wire), "draft request");
  v1::DraftStepResponse response;
  std::uniform_int_distribution<int32_t> token(300, 8000);
  for (const v1::DraftSequenceStep& step : request.steps()) {
    v1::DraftSequenceResult* result = response.add_results();
    result->set_seq_id(step.seq_id());
    TokenTree tree;  // a chain (the shapes under test are chains)
    for (uint32_t d = 0; d < step.depth(); ++d) {
      tree.tokens.push_back(token(r.rng));
      tree.parents.push_back(static_cast<int32_t>(d) - 1);
      tree.draft_logprobs.push_back(-0.1f);
    }
    TreeToProto(tree, result->mutable_tree());
  }
  response.SerializeToString(&r.draft_reply_wire);
}

__attribute__((noinline)) void FakeVerifyService(Router& r) {
  v1::VerifyStepRequest request;
  Require(request.ParseFromString(r.verify_wire), "verify request");
  v1::VerifyStepResponse response;
  std::uniform_int_distribution<int32_t> token(300, 8000);
  std::bernoulli_distribution accept(r.acceptance);
  for (const v1::VerifySequenceStep& step : request.steps()) {
    v1::VerifySequenceResult* result = response.add_results();
    result->set_seq_id(step.seq_id());
    int accepted = 0;
    while (accepted < step.tree().tokens_size() && accept(r.rng)) {
      result->add_tokens(step.tree().tokens(accepted));
      result->add_accepted_nodes(accepted);
      ++accepted;
    }
    result->add_tokens(token(r.rng));
    result->set_accepted_draft(accepted);
  }
  response.SerializeToString(&r.verify_reply_wire);
}

// Steps run with the counted instances of the router's parts (RouterPart*<true>), over all the
// runs Google Benchmark makes: the divisor of callgrind's count.
int64_t counted_steps = 0;  // NOLINT: one process, one thread

// One step of the whole loop; sequences that finished are replaced (admission, not counted).
// The warm-up runs the same code as other instances (kCounted false), which callgrind's
// --toggle-collect='*RouterPart*<true>*' leaves out.
template <bool kCounted>
void Step(Router& r) {
  RouterPartPlan<kCounted>(r);
  RouterPartDraftRequest<kCounted>(r);
  FakeDraftService(r);
  RouterPartDraftReply<kCounted>(r, 2e-3);
  v1::VerifyStepRequest request;
  int tokens = 0, longest = 0;
  RouterPartVerifyRequest<kCounted>(r, request, &tokens, &longest);
  FakeVerifyService(r);
  const int rows = request.steps_size();
  RouterPartVerifyReply<kCounted>(r, rows, tokens, longest, Router::VerifySeconds(rows, tokens));
  if (kCounted) ++counted_steps;
  ++r.steps;
  for (Seq& s : r.running) {
    if (s.drafted) ++r.drafted_steps;
    if (s.core->finished() || s.output->finished()) s = r.NewSeq();
  }
}

const Tokenizer* ReferenceTokenizer() {
  static const Tokenizer* tokenizer = [] {
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromModelDir("models/pycoder-target");
    Require(t.ok(), "models/pycoder-target/tokenizer.json (run from the repository root)");
    return t->release();
  }();
  return tokenizer;
}

// Args: sequences, mode (0 off, 1 auto where drafts cannot pay, 2 auto where chains pay).
void BM_RouterStep(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  Router r(static_cast<Mode>(state.range(1)), n, ReferenceTokenizer());
  // Past the first decisions and probes: the state a long run is in.
  for (int i = 0; i < 300; ++i) Step<false>(r);
  const uint32_t warm_up_digest = r.digest;
  r.drafted_steps = 0;
  r.steps = 0;
  for (auto _ : state) Step<true>(r);
  state.counters["seqs"] = n;
  // The decisions of the warm-up steps (below 2^32: exact in the counter's double).
  state.counters["digest"] = warm_up_digest;
  state.counters["drafted_share"] =
      r.steps > 0 ? static_cast<double>(r.drafted_steps) / (static_cast<double>(r.steps) * n) : 0;
}
BENCHMARK(BM_RouterStep)
    ->ArgsProduct({{16, 64, 128, 256}, {kOff, kAutoPlain, kAutoChains}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace specd

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::printf("counted steps: %lld\n", static_cast<long long>(specd::counted_steps));
  return 0;
}
