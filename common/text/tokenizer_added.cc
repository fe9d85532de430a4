#include "common/text/tokenizer_added.h"

#include <algorithm>

#include "common/text/tokenizer_util.h"
#include "common/text/unicode.h"

namespace specd::tokenizer_internal {

// Splits `s` around added-token matches like tokenizers' AddedVocabulary::find_matches.
std::vector<Segment> SplitOnAdded(std::string_view s, const AddedMatcher& m) {
  std::vector<Segment> out;
  if (s.empty()) return out;
  if (m.empty()) {
    out.push_back({0, s.size(), nullptr});
    return out;
  }
  size_t start_offset = 0;
  size_t pos = 0;
  while (pos < s.size()) {
    const AddedToken* t = m.LongestAt(s, pos);
    if (t == nullptr) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + t->pattern.size();
    // The search resumes after the raw match, even when the match is discarded below or
    // rstrip extends it: tokenizers then emits overlapping tokens, and so do we.
    pos = stop;
    if (t->single_word) {
      const bool start_ok = start == 0 || !unicode::IsWordChar(LastChar(s.substr(0, start)));
      const bool stop_ok = stop == s.size() || !unicode::IsWordChar(unicode::DecodeAt(s, stop).cp);
      if (!start_ok || !stop_ok) continue;
    }
    if (t->lstrip) start = std::max(TrailingSpaceStart(s.substr(0, start)), start_offset);
    if (t->rstrip) stop += LeadingSpaceBytes(s.substr(stop));
    if (start_offset < start) out.push_back({start_offset, start, nullptr});
    out.push_back({start, stop, t});
    start_offset = stop;
  }
  if (start_offset < s.size()) out.push_back({start_offset, s.size(), nullptr});
  return out;
}

}  // namespace specd::tokenizer_internal
