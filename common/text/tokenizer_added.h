// Added tokens (tokenizer.json's added_tokens): matched in the text before the model sees it,
// as tokenizers' AddedVocabulary does. Private to common/text/tokenizer*.cc.
#ifndef SPECD_COMMON_TEXT_TOKENIZER_ADDED_H_
#define SPECD_COMMON_TEXT_TOKENIZER_ADDED_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace specd::tokenizer_internal {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  std::string pattern;  // what is matched: content, normalized if `normalized`
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// Leftmost-longest matcher over the added tokens of one kind (normalized or not).
class AddedMatcher {
 public:
  void Build(const std::vector<AddedToken>& tokens, bool normalized) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i].normalized != normalized || tokens[i].pattern.empty()) continue;
      by_first_byte_[static_cast<uint8_t>(tokens[i].pattern[0])].push_back(&tokens[i]);
      empty_ = false;
    }
    for (auto& list : by_first_byte_) {
      std::stable_sort(list.begin(), list.end(), [](const AddedToken* a, const AddedToken* b) {
        return a->pattern.size() > b->pattern.size();
      });
    }
  }
  bool empty() const { return empty_; }

  // Longest token whose pattern starts at `pos`, or nullptr.
  const AddedToken* LongestAt(std::string_view s, size_t pos) const {
    for (const AddedToken* t : by_first_byte_[static_cast<uint8_t>(s[pos])]) {
      if (s.compare(pos, t->pattern.size(), t->pattern) == 0) return t;
    }
    return nullptr;
  }

 private:
  std::vector<const AddedToken*> by_first_byte_[256];
  bool empty_ = true;
};

struct Segment {
  size_t begin, end;
  const AddedToken* token;  // nullptr for plain text
};

// Splits `s` around added-token matches like tokenizers' AddedVocabulary::find_matches.
std::vector<Segment> SplitOnAdded(std::string_view s, const AddedMatcher& m);

}  // namespace specd::tokenizer_internal

#endif  // SPECD_COMMON_TEXT_TOKENIZER_ADDED_H_
