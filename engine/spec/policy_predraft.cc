// The goodput policy's overlap planning (docs/architecture.md, the overlapped step): how many
// outcome guesses to pre-draft beside a verify step, and how deep. The decision itself is in
// policy.cc.
#include <algorithm>
#include <vector>

#include "engine/spec/policy.h"

namespace specd {

int GoodputPolicy::PreDraftFanOut(int drafting, int levels, int nodes, int verify_rows,
                                  int verify_tokens, int max_fan_out) const {
  if (drafting <= 0 || levels <= 0) return 0;
  const double verify = costs_.VerifySeconds(verify_rows, verify_tokens);
  // With several sequences the draft call is saved only when every one of them hits, which a
  // further guess each (a rejection's outcome, a few hits in a hundred) barely changes, while
  // its rows run beside verify and slow it where the two share memory: one guess each.
  if (drafting > 1) max_fan_out = std::min(max_fan_out, 1);
  int fan_out = 0;
  while (fan_out < max_fan_out && costs_.PreDraftSeconds(drafting * (fan_out + 1), levels,
                                                         nodes * (fan_out + 1)) <= verify) {
    ++fan_out;
  }
  return fan_out;
}

GoodputPolicy::PreDraftWork GoodputPolicy::PreDraftWorkOf(absl::Span<const SpecShape> shapes,
                                                          int fan_out) {
  PreDraftWork work;
  for (const SpecShape& s : shapes) {
    if (s.none()) continue;
    ++work.drafting;
    work.levels = std::max(work.levels, s.depth + 1);
    work.nodes += Clamp(s, s.depth).max_nodes + s.depth + 1;
  }
  work.drafting *= fan_out;
  work.nodes *= fan_out;
  return work;
}

GoodputPolicy::PreDraftPlan GoodputPolicy::PlanPreDraft(absl::Span<const SpecShape> shapes,
                                                        int verify_rows, int verify_tokens,
                                                        int max_fan_out) const {
  PreDraftPlan plan;
  if (max_fan_out < 1) return plan;
  int deepest = 0;
  for (const SpecShape& s : shapes) deepest = std::max(deepest, s.none() ? 0 : s.depth);
  const double verify = costs_.VerifySeconds(verify_rows, verify_tokens);
  std::vector<SpecShape> cut(shapes.size());
  for (int depth = deepest; depth >= 1; --depth) {
    for (size_t i = 0; i < shapes.size(); ++i) cut[i] = Clamp(shapes[i], depth);
    const PreDraftWork one = PreDraftWorkOf(cut, 1);
    if (costs_.PreDraftSeconds(one.drafting, one.levels, one.nodes) > verify) continue;
    plan.depth = depth;
    plan.fan_out = depth < deepest
                       ? 1
                       : std::max(1, PreDraftFanOut(one.drafting, one.levels, one.nodes,
                                                    verify_rows, verify_tokens, max_fan_out));
    return plan;
  }
  return plan;
}

}  // namespace specd
