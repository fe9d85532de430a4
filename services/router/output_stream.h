// What a sequence streams back to its client: token ids and text deltas, cut at the first stop
// condition. The router feeds every token the verifier emits, one at a time, in order; once a
// stop condition fires, later tokens (emitted in the same verify step after the stop) are
// ignored.
//
// Stop strings are matched on the decoded text, so a stop string split across several tokens is
// still caught. Text that could be the beginning of a stop string is held back until the next
// tokens resolve it (vLLM and TGI do the same), so the stop string itself is never streamed.
// Token ids are held back with their text: a token is streamed once all of its text has been
// released, and the tokens that carry any byte of a matched stop string are not streamed. EOS
// and stop_token_ids end generation and are not streamed either (they are counted in
// completion_tokens).
#ifndef SPECD_SERVICES_ROUTER_OUTPUT_STREAM_H_
#define SPECD_SERVICES_ROUTER_OUTPUT_STREAM_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "specd/v1/generation.pb.h"

namespace specd {

// Turns a stream of token ids into text, one token at a time, emitting only whole UTF-8
// characters. Implemented over the tokenizer's DecodeStream.
class TokenTextDecoder {
 public:
  virtual ~TokenTextDecoder() = default;
  // The text this token completes; empty while a multi-byte character is still incomplete.
  virtual std::string Next(int32_t token) = 0;
  // Text still held at the end of generation (an incomplete character, as U+FFFD).
  virtual std::string Flush() = 0;
};

struct StreamStopConditions {
  int max_new_tokens = 0;              // > 0
  std::vector<int32_t> eos_token_ids;  // empty when the request sets ignore_eos
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop;  // non-empty strings
  // Generation also ends when prompt + generated tokens reach this (the model's context).
  int64_t max_total_tokens = 0;
  int64_t prompt_tokens = 0;
};

struct OutputChunk {
  std::vector<int32_t> token_ids;
  std::string text;
  bool empty() const { return token_ids.empty() && text.empty(); }
};

class SequenceOutput {
 public:
  SequenceOutput(std::unique_ptr<TokenTextDecoder> decoder, StreamStopConditions stop);

  // Consumes one generated token. Returns false once the sequence has finished (this token
  // ended it, or an earlier one did and this one was ignored).
  bool Push(int32_t token);

  // Tokens and text released since the last call. After a stop, this includes everything that
  // was held back and turned out not to be part of a stop string.
  OutputChunk TakeReady();

  bool finished() const { return finish_ != v1::FINISH_REASON_UNSPECIFIED; }
  v1::FinishReason finish_reason() const { return finish_; }
  const std::string& matched_stop() const { return matched_stop_; }
  // Tokens consumed from the model, including the one that ended generation.
  int generated() const { return generated_; }

 private:
  void Finish(v1::FinishReason reason);
  // Releases the first `bytes` bytes of held_text_ and every held token wholly inside them.
  void Release(size_t bytes);

  std::unique_ptr<TokenTextDecoder> decoder_;
  StreamStopConditions stop_;
  size_t longest_stop_ = 0;
  int generated_ = 0;
  v1::FinishReason finish_ = v1::FINISH_REASON_UNSPECIFIED;
  std::string matched_stop_;

  // Text not yet released, and the tokens whose text ends inside it, each with the offset in
  // held_text_ where its text ends. A token that only began a multi-byte character has no
  // text of its own yet; it is unresolved until the token that completes the character
  // arrives, and then shares that token's end.
  std::string held_text_;
  struct HeldToken {
    int32_t id;
    size_t end;
    bool resolved;
  };
  std::deque<HeldToken> held_tokens_;
  OutputChunk ready_;
};

}  // namespace specd

#endif  // SPECD_SERVICES_ROUTER_OUTPUT_STREAM_H_
