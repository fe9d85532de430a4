// The BPE model of tokenizer.json: vocabulary, ranked merges, byte fallback and unknown
// tokens, merging one pre-tokenized word at a time as tokenizers' BPE does. Private to
// common/text/tokenizer*.cc.
#ifndef SPECD_COMMON_TEXT_TOKENIZER_BPE_H_
#define SPECD_COMMON_TEXT_TOKENIZER_BPE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/text/tokenizer_util.h"

namespace specd::tokenizer_internal {

// A BPE model; const methods are thread-safe (the word cache has its own lock).
class Bpe {
 public:
  absl::flat_hash_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // "" where no token has the id
  std::vector<bool> has_id;
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // pair -> (rank, new id)
  std::optional<int32_t> unk_id;
  std::string continuing_subword_prefix;
  std::string end_of_word_suffix;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  int32_t byte_ids[256];

  static uint64_t Key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  // Appends the ids of one pre-tokenized word (memoized for short words).
  void Tokenize(std::string_view word, std::vector<int32_t>* out) const;

  void ClearCache() const {
    absl::flat_hash_map<std::string, std::vector<int32_t>> empty;
    absl::MutexLock lock(&cache_mu_);
    cache_.swap(empty);  // frees the table too (clear() may keep it)
  }

 private:
  static constexpr size_t kMaxCachedWordBytes = 256;
  static constexpr size_t kMaxCacheEntries = 50000;

  struct Symbol {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };

  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    // std::priority_queue pops the largest: make that the lowest rank, then leftmost.
    bool operator<(const Candidate& o) const {
      if (rank != o.rank) return rank > o.rank;
      return pos > o.pos;
    }
  };

  // tokenizers' BPE::merge_word + Word::merge_all (without dropout).
  std::vector<int32_t> MergeWord(std::string_view w) const;

  mutable absl::Mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_ ABSL_GUARDED_BY(cache_mu_);
};

// Fills `bpe` from tokenizer.json's "model" object `j`.
absl::Status ParseModel(const Ctx& ctx, const json& j, Bpe* bpe);

}  // namespace specd::tokenizer_internal

#endif  // SPECD_COMMON_TEXT_TOKENIZER_BPE_H_
