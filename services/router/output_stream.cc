#include "services/router/output_stream.h"

#include <algorithm>
#include <utility>

namespace specd {
namespace {

bool Contains(const std::vector<int32_t>& ids, int32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

// Length of the longest proper prefix of `stop` that `text` ends with.
size_t PartialStopSuffix(const std::string& text, const std::string& stop) {
  const size_t max_len = std::min(text.size(), stop.size() - 1);
  for (size_t len = max_len; len > 0; --len) {
    if (text.compare(text.size() - len, len, stop, 0, len) == 0) return len;
  }
  return 0;
}

}  // namespace

SequenceOutput::SequenceOutput(std::unique_ptr<TokenTextDecoder> decoder, StreamStopConditions stop)
    : decoder_(std::move(decoder)), stop_(std::move(stop)) {
  for (const std::string& s : stop_.stop) longest_stop_ = std::max(longest_stop_, s.size());
}

bool SequenceOutput::Push(int32_t token) {
  if (finished()) return false;
  ++generated_;
  if (Contains(stop_.eos_token_ids, token)) {
    Finish(v1::FINISH_REASON_EOS);
    return false;
  }
  if (Contains(stop_.stop_token_ids, token)) {
    Finish(v1::FINISH_REASON_STOP_TOKEN);
    return false;
  }
  const std::string piece = decoder_->Next(token);
  held_text_ += piece;
  if (!piece.empty()) {
    for (auto it = held_tokens_.rbegin(); it != held_tokens_.rend() && !it->resolved; ++it) {
      it->end = held_text_.size();
      it->resolved = true;
    }
  }
  held_tokens_.push_back({token, held_text_.size(), !piece.empty()});

  if (!stop_.stop.empty()) {
    // Held text never contains a whole stop string (it would have matched before), so any
    // match ends in the new piece; the earliest start wins.
    size_t best = std::string::npos;
    const std::string* which = nullptr;
    for (const std::string& s : stop_.stop) {
      const size_t pos = held_text_.find(s);
      if (pos != std::string::npos && (best == std::string::npos || pos < best)) {
        best = pos;
        which = &s;
      }
    }
    if (which != nullptr) {
      matched_stop_ = *which;
      Release(best);
      held_tokens_.clear();
      held_text_.clear();
      finish_ = v1::FINISH_REASON_STOP_STRING;
      return false;
    }
    size_t hold = 0;
    for (const std::string& s : stop_.stop) hold = std::max(hold, PartialStopSuffix(held_text_, s));
    Release(held_text_.size() - hold);
  } else {
    Release(held_text_.size());
  }

  if (generated_ >= stop_.max_new_tokens) {
    Finish(v1::FINISH_REASON_LENGTH);
    return false;
  }
  if (stop_.max_total_tokens > 0 && stop_.prompt_tokens + generated_ >= stop_.max_total_tokens) {
    Finish(v1::FINISH_REASON_CONTEXT);
    return false;
  }
  return true;
}

void SequenceOutput::Finish(v1::FinishReason reason) {
  // Whatever is still held back could only have been the start of a stop string that never
  // completed, so it belongs to the output, as does an incomplete last character.
  held_text_ += decoder_->Flush();
  for (HeldToken& t : held_tokens_) {
    t.end = held_text_.size();
    t.resolved = true;
  }
  Release(held_text_.size());
  finish_ = reason;
}

void SequenceOutput::Release(size_t bytes) {
  ready_.text.append(held_text_, 0, bytes);
  held_text_.erase(0, bytes);
  while (!held_tokens_.empty() && held_tokens_.front().resolved &&
         held_tokens_.front().end <= bytes) {
    ready_.token_ids.push_back(held_tokens_.front().id);
    held_tokens_.pop_front();
  }
  for (HeldToken& t : held_tokens_) t.end -= bytes;
}

OutputChunk SequenceOutput::TakeReady() {
  OutputChunk out = std::move(ready_);
  ready_ = OutputChunk();
  return out;
}

}  // namespace specd
