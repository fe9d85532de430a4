// Replays a scenario of tests/fixtures/eagle3/oracle.json (tools/oracle/make_eagle_fixtures.py)
// on an EagleHead and compares every output with the PyTorch reference's: a prefill chain from
// the target's features, tree levels fed with the head's own outputs (as the drafter feeds
// them), commits. Shared by the CPU head's test (1e-4) and the CUDA head's (2e-2).
#ifndef SPECD_TESTS_TESTUTIL_EAGLE_REPLAY_H_
#define SPECD_TESTS_TESTUTIL_EAGLE_REPLAY_H_

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/io/safetensors.h"
#include "engine/draft/eagle_head.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/hf_fixtures.h"

namespace specd {
namespace testutil {

inline std::filesystem::path EagleFixtureDir() {
  return RepoRoot() / "tests" / "fixtures" / "eagle3";
}

// A float tensor of the oracle file, with its shape.
inline std::vector<float> Tensor(const TensorStore& store, const std::string& name,
                                 std::vector<int64_t>* shape = nullptr) {
  absl::StatusOr<const TensorView*> v = store.Get(name);
  EXPECT_TRUE(v.ok()) << v.status();
  if (!v.ok()) return {};
  std::vector<float> out((*v)->numel());
  EXPECT_TRUE(store.ReadF32(name, (*v)->shape, out.data()).ok());
  if (shape != nullptr) *shape = (*v)->shape;
  return out;
}

inline std::vector<double> Row(const std::vector<float>& t, int64_t width, int64_t row) {
  return std::vector<double>(t.begin() + row * width, t.begin() + (row + 1) * width);
}

// Replays one scenario of oracle.json on `head`, every output within `tol` (relative, per row)
// of the reference's. With `twin`, every feed and commit also runs for a second sequence (id +
// 100) in the same call, with the same nodes listed first; its outputs must equal the first
// sequence's bit for bit (twin_tol 0), or within twin_tol.
class Replay {
 public:
  Replay(EagleHead* head, const TensorStore* oracle, const nlohmann::json& scenario, bool twin,
         double tol, double twin_tol = 0)
      : head_(head),
        oracle_(oracle),
        scenario_(scenario),
        twin_(twin),
        tol_(tol),
        twin_tol_(twin_tol) {
    features_ = Tensor(*oracle, scenario["features"].get<std::string>(), &feature_shape_);
  }

  void Run() {
    const nlohmann::json& calls = scenario_["calls"];
    outputs_.resize(calls.size());
    for (size_t c = 0; c < calls.size(); ++c) {
      SCOPED_TRACE(absl::StrCat("call ", c));
      const nlohmann::json& call = calls[c];
      const SeqId seq = call["seq"].get<SeqId>();
      for (SeqId s : Seqs(seq)) {
        if (!head_->HasSequence(s)) ASSERT_TRUE(head_->AddSequence(s).ok());
      }
      if (call["op"] == "commit") {
        const auto path = call["path"].get<std::vector<int32_t>>();
        for (SeqId s : Seqs(seq)) ASSERT_TRUE(head_->Commit(s, path).ok());
        continue;
      }
      Feed(c, call);
      if (HasFailure()) return;
    }
  }

 private:
  std::vector<SeqId> Seqs(SeqId seq) const {
    return twin_ ? std::vector<SeqId>{seq + 100, seq} : std::vector<SeqId>{seq};
  }
  static bool HasFailure() { return ::testing::Test::HasFailure(); }

  void Feed(size_t c, const nlohmann::json& call) {
    const int64_t H = head_->config().head.hidden_size;
    const int64_t dv = head_->config().draft_vocab_size;
    const int vocab = head_->config().vocab_size;
    const nlohmann::json& in = call["input"];
    EagleHeadItem item;
    item.seq = call["seq"].get<SeqId>();
    std::vector<float> inputs;
    if (call.contains("tokens")) {
      item.tokens = call["tokens"].get<std::vector<int32_t>>();
      item.parents = call["parents"].get<std::vector<int32_t>>();
    } else {  // the long chain: tokens (p * 37 + 11) % vocab
      const int n = call["length"].get<int>();
      for (int p = 0; p < n; ++p) {
        item.tokens.push_back((p * 37 + 11) % vocab);
        item.parents.push_back(p - 1);
      }
    }
    const int64_t n = static_cast<int64_t>(item.tokens.size());
    const std::string kind = in["kind"].get<std::string>();
    const int64_t fw = feature_shape_[1];
    if (kind == "target" || kind == "periodic") {
      item.input = EagleInput::kTargetFeatures;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t r =
            kind == "target" ? in["rows"][j].get<int64_t>() : j % in["period"].get<int64_t>();
        inputs.insert(inputs.end(), features_.begin() + r * fw, features_.begin() + (r + 1) * fw);
      }
    } else {
      ASSERT_EQ(kind, "hidden");
      item.input = EagleInput::kHidden;
      for (const nlohmann::json& from : in["from"]) {
        const std::vector<float>& h = outputs_[from[0].get<size_t>()].hidden;
        const int64_t r = from[1].get<int64_t>();
        inputs.insert(inputs.end(), h.begin() + r * H, h.begin() + (r + 1) * H);
      }
    }
    item.inputs = inputs;
    for (int64_t j = 0; j < n; ++j) item.output_rows.push_back(static_cast<int32_t>(j));
    std::vector<EagleHeadItem> batch;
    if (twin_) {
      batch.push_back(item);
      batch.back().seq += 100;
    }
    batch.push_back(item);
    EagleHeadOutputs out;
    ASSERT_TRUE(head_->Forward(batch, &out).ok());
    ASSERT_EQ(out.hidden.size(), batch.size() * n * H);
    ASSERT_EQ(out.logits.size(), batch.size() * n * dv);
    EagleHeadOutputs& mine = outputs_[c];
    const size_t skip = twin_ ? 1 : 0;
    mine.hidden.assign(out.hidden.begin() + skip * n * H, out.hidden.end());
    mine.logits.assign(out.logits.begin() + skip * n * dv, out.logits.end());
    if (twin_ && twin_tol_ == 0) {
      EXPECT_TRUE(std::equal(mine.hidden.begin(), mine.hidden.end(), out.hidden.begin()));
      EXPECT_TRUE(std::equal(mine.logits.begin(), mine.logits.end(), out.logits.begin()));
    } else if (twin_) {
      for (int64_t j = 0; j < n; ++j) {
        const std::vector<double> h(mine.hidden.begin() + j * H, mine.hidden.begin() + (j + 1) * H);
        const std::vector<double> l(mine.logits.begin() + j * dv,
                                    mine.logits.begin() + (j + 1) * dv);
        EXPECT_LE(RelError(absl::MakeConstSpan(out.hidden).subspan(j * H, H), h), twin_tol_);
        EXPECT_LE(RelError(absl::MakeConstSpan(out.logits).subspan(j * dv, dv), l), twin_tol_);
      }
    }
    if (call.contains("draft_ids")) {
      const auto drafts = call["draft_ids"].get<std::vector<int32_t>>();
      for (int64_t j = 0; j < n; ++j) {
        EXPECT_EQ(head_->draft_to_target()[drafts[j]], item.tokens[j]) << "node " << j;
      }
    }

    const std::string key = call["out"].get<std::string>();
    const std::vector<float> want_h = Tensor(*oracle_, key + "/hidden");
    const std::vector<float> want_l = Tensor(*oracle_, key + "/logits");
    std::vector<int64_t> rows;
    if (call.contains("checked_rows")) {
      rows = call["checked_rows"].get<std::vector<int64_t>>();
    } else {
      for (int64_t j = 0; j < n; ++j) rows.push_back(j);
    }
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t r = rows[i];
      const absl::Span<const float> got_h(&mine.hidden[r * H], H);
      const absl::Span<const float> got_l(&mine.logits[r * dv], dv);
      EXPECT_LE(RelError(got_h, Row(want_h, H, i)), tol_) << key << " hidden row " << r;
      EXPECT_LE(RelError(got_l, Row(want_l, dv, i)), tol_) << key << " logits row " << r;
      worst_ = std::max(
          {worst_, RelError(got_l, Row(want_l, dv, i)), RelError(got_h, Row(want_h, H, i))});
    }
  }

 public:
  double worst() const { return worst_; }

 private:
  EagleHead* head_;
  const TensorStore* oracle_;
  const nlohmann::json& scenario_;
  const bool twin_;
  const double tol_, twin_tol_;
  std::vector<float> features_;
  std::vector<int64_t> feature_shape_;
  std::vector<EagleHeadOutputs> outputs_;
  double worst_ = 0;
};

}  // namespace testutil
}  // namespace specd

#endif  // SPECD_TESTS_TESTUTIL_EAGLE_REPLAY_H_
