// specd-make-synthetic-pair: writes a bf16 target/draft pair at a real model's shape whose
// acceptance is set by construction (tools/make_test_model/synthetic_pair.h), and measures the
// mean accepted length tau it gives at the router's default draft tree.
//
//   specd-make-synthetic-pair --shape llama-3.1-8b --draft_layers 1 --epsilon 0.3 \
//       --target_dir /data/syn8b-target --draft_dir /data/syn8b-draft
//   specd-make-synthetic-pair --shape reference --target_tau 3 --target_dir t --draft_dir d
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "tools/make_test_model/synthetic_pair.h"

ABSL_FLAG(std::string, shape, "reference",
          "reference (models/pycoder-target's sizes), llama-3.2-1b, llama-3.1-8b, llama-3.1-70b");
ABSL_FLAG(int, layers, 0, "target layers instead of the shape's (e.g. a 70B cut to fit a disk)");
ABSL_FLAG(int, draft_layers, 1, "draft layers: the target's first ones");
ABSL_FLAG(double, epsilon, 0.5,
          "scale of o_proj and down_proj in the target layers the draft skips (0: the target "
          "computes what the draft does, every draft token is accepted)");
ABSL_FLAG(double, logit_std, 6.0, "spread of the logits the LM head produces");
ABSL_FLAG(uint64_t, seed, 1, "weights seed");
ABSL_FLAG(std::string, target_dir, "", "folder to write the target to (required)");
ABSL_FLAG(std::string, draft_dir, "", "folder to write the draft to (required with --measure_tau)");
ABSL_FLAG(std::string, tokenizer_dir, "models/pycoder-target",
          "folder whose tokenizer.json is copied into both models");
ABSL_FLAG(double, max_shard_gb, 4.0, "largest safetensors shard, GiB");
ABSL_FLAG(int, num_threads, 0, "threads for weight generation and the CPU engine (0 = all)");
ABSL_FLAG(bool, measure_tau, false,
          "after writing, decode random prompts greedily with the draft's trees verified by the "
          "target in-process and print tau");
ABSL_FLAG(double, target_tau, 0.0,
          "search epsilon (bisection, rewriting the pair each time) for this tau (> 1); implies "
          "--measure_tau");
ABSL_FLAG(std::string, device, "cpu", "engine device for measuring: cpu or cuda:N");
ABSL_FLAG(int, tree_depth, 4, "draft tree depth for measuring (the router's default)");
ABSL_FLAG(int, tree_top_k, 4, "draft tree children per node for measuring (router's default)");
ABSL_FLAG(int, tree_max_nodes, 16, "draft tree nodes for measuring (the router's default)");
ABSL_FLAG(int, tau_prompts, 4, "prompts for measuring");
ABSL_FLAG(int, tau_new_tokens, 48, "new tokens per prompt for measuring");

namespace specd {
namespace {

absl::StatusOr<TauMeasurement> WriteAndMeasure(SyntheticPairOptions& o, const TauOptions& tau,
                                               bool measure) {
  const std::string target_dir = absl::GetFlag(FLAGS_target_dir);
  const std::string draft_dir = absl::GetFlag(FLAGS_draft_dir);
  if (absl::Status s = WriteSyntheticPair(o, target_dir, draft_dir); !s.ok()) return s;
  std::printf("wrote %s: shape %s, %d layers; %s: %d layers; epsilon %g\n", target_dir.c_str(),
              o.shape.name.c_str(), o.shape.num_layers,
              draft_dir.empty() ? "(no draft)" : draft_dir.c_str(), o.draft_layers, o.epsilon);
  if (!measure) return TauMeasurement();
  absl::StatusOr<TauMeasurement> m = MeasureTau(target_dir, draft_dir, tau);
  if (!m.ok()) return m.status();
  std::printf(
      "epsilon %.4f: tau %.3f, acceptance %.3f over %lld speculative steps "
      "(tree depth %d, top_k %d, nodes %d; distinct tokens %.2f)\n",
      o.epsilon, m->tau, m->acceptance, static_cast<long long>(m->steps), tau.draft.depth,
      tau.draft.top_k, tau.draft.max_nodes, m->distinct_fraction);
  std::fflush(stdout);
  return m;
}

absl::Status Run() {
  absl::StatusOr<SyntheticShape> shape = SyntheticShapeByName(absl::GetFlag(FLAGS_shape));
  if (!shape.ok()) return shape.status();
  SyntheticPairOptions o;
  o.shape = *shape;
  if (absl::GetFlag(FLAGS_layers) < 0) return absl::InvalidArgumentError("layers: must be >= 0");
  if (absl::GetFlag(FLAGS_layers) > 0) o.shape.num_layers = absl::GetFlag(FLAGS_layers);
  o.draft_layers = absl::GetFlag(FLAGS_draft_layers);
  o.epsilon = absl::GetFlag(FLAGS_epsilon);
  o.logit_std = absl::GetFlag(FLAGS_logit_std);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.tokenizer_dir = absl::GetFlag(FLAGS_tokenizer_dir);
  o.max_shard_bytes = static_cast<int64_t>(absl::GetFlag(FLAGS_max_shard_gb) * (1 << 30));
  o.num_threads = absl::GetFlag(FLAGS_num_threads);
  TauOptions tau;
  tau.device = absl::GetFlag(FLAGS_device);
  tau.num_threads = o.num_threads;
  tau.num_prompts = absl::GetFlag(FLAGS_tau_prompts);
  tau.max_new_tokens = absl::GetFlag(FLAGS_tau_new_tokens);
  tau.draft.depth = absl::GetFlag(FLAGS_tree_depth);
  tau.draft.top_k = absl::GetFlag(FLAGS_tree_top_k);
  tau.draft.max_nodes = absl::GetFlag(FLAGS_tree_max_nodes);
  if (absl::Status s = ValidateDraftParams(tau.draft); !s.ok()) return s;
  const double want = absl::GetFlag(FLAGS_target_tau);
  const bool measure = absl::GetFlag(FLAGS_measure_tau) || want > 0;
  if (measure && absl::GetFlag(FLAGS_draft_dir).empty()) {
    return absl::InvalidArgumentError("draft_dir: required to measure tau");
  }
  if (want <= 0) return WriteAndMeasure(o, tau, measure).status();

  if (want <= 1.0 || want > tau.draft.depth + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_tau: must be in (1, tree_depth + 1 = ", tau.draft.depth + 1, "]"));
  }
  // tau falls as epsilon grows (coarsely: a handful of prompts is a noisy ruler), so bisect on
  // [0, hi] after doubling hi until it brackets the wanted value.
  double lo = 0.0, hi = 1.0, best_eps = 0.0, best_err = 1e9;
  auto probe = [&](double eps) -> absl::StatusOr<double> {
    o.epsilon = eps;
    absl::StatusOr<TauMeasurement> m = WriteAndMeasure(o, tau, true);
    if (!m.ok()) return m.status();
    if (std::abs(m->tau - want) < best_err) {
      best_err = std::abs(m->tau - want);
      best_eps = eps;
    }
    return m->tau;
  };
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<double> t = probe(hi);
    if (!t.ok()) return t.status();
    if (*t <= want) break;
    lo = hi;
    hi *= 2;
  }
  for (int i = 0; i < 6 && best_err > 0.05; ++i) {
    const double mid = 0.5 * (lo + hi);
    absl::StatusOr<double> t = probe(mid);
    if (!t.ok()) return t.status();
    (*t > want ? lo : hi) = mid;
  }
  o.epsilon = best_eps;
  std::printf("closest: epsilon %g (|tau - %g| = %.3f); rewriting the pair with it\n", best_eps,
              want, best_err);
  return WriteAndMeasure(o, tau, true).status();
}

}  // namespace
}  // namespace specd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "specd-make-synthetic-pair --shape NAME --target_dir DIR --draft_dir DIR "
      "[--epsilon E | --target_tau T] [--measure_tau]");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = specd::Run(); !s.ok()) {
    std::fprintf(stderr, "specd-make-synthetic-pair: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
