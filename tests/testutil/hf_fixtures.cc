#include "tests/testutil/hf_fixtures.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <utility>

#include "gtest/gtest.h"

namespace specd {
namespace testutil {

namespace fs = std::filesystem;

fs::path RepoRoot() {
  fs::path dir = fs::current_path();
  for (int i = 0; i < 6; ++i) {
    if (fs::exists(dir / "tests" / "fixtures" / "README.md"))
      return dir;
    if (!dir.has_parent_path() || dir.parent_path() == dir)
      break;
    dir = dir.parent_path();
  }
  return {};
}

nlohmann::json ReadJson(const fs::path &path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  if (!in.good())
    return nullptr;
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

double RelError(absl::Span<const float> got, const std::vector<double> &want) {
  if (got.size() < want.size())
    return INFINITY;
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i]))
      return INFINITY;
    max_diff =
        std::max(max_diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    max_ref = std::max(max_ref, std::fabs(want[i]));
  }
  return max_diff / std::max(max_ref, 1e-30);
}

int32_t Argmax(absl::Span<const float> row) {
  int32_t best = 0;
  for (size_t i = 1; i < row.size(); ++i) {
    if (row[i] > row[best])
      best = static_cast<int32_t>(i);
  }
  return best;
}

ForwardItem Chain(SeqId seq, const std::vector<int32_t> &tokens,
                  std::vector<int32_t> rows) {
  ForwardItem it;
  it.seq = seq;
  it.tokens = tokens;
  for (size_t i = 0; i < tokens.size(); ++i)
    it.parents.push_back(static_cast<int32_t>(i) - 1);
  it.logit_rows = std::move(rows);
  return it;
}

std::vector<int32_t> Greedy(Backend &b, SeqId seq,
                            const std::vector<int32_t> &prompt, int steps) {
  const int vocab = b.config().vocab_size;
  std::vector<int32_t> out;
  EXPECT_TRUE(b.AddSequence(seq).ok());
  std::vector<float> logits;
  const int n = static_cast<int>(prompt.size());
  absl::Status s = b.Forward({Chain(seq, prompt, {n - 1})}, &logits);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok())
    return out;
  std::vector<int32_t> path(n);
  for (int i = 0; i < n; ++i)
    path[i] = i;
  EXPECT_TRUE(b.Commit(seq, path).ok());
  out.push_back(Argmax(absl::MakeConstSpan(logits).first(vocab)));
  while (static_cast<int>(out.size()) < steps) {
    s = b.Forward({Chain(seq, {out.back()}, {0})}, &logits);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok())
      break;
    EXPECT_TRUE(b.Commit(seq, {0}).ok());
    out.push_back(Argmax(logits));
  }
  EXPECT_TRUE(b.RemoveSequence(seq).ok());
  return out;
}

} // namespace testutil
} // namespace specd
