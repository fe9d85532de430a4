// Logits processors on the GPU: steps 1-3 of engine/sampling.h ProcessLogits (min_tokens' EOS
// mask, logit_bias, then the repetition, frequency and presence penalties) applied to the rows of
// a verify step before they are sampled, so that only the sampled tokens (and the requested
// log-probabilities) leave the device.
//
// Each row belongs to a sequence (a verify item) and continues a path: for a tree node, its
// ancestors in the tree and itself (the last pending token's row: the empty path). Its penalty
// counts are the sequence's committed history plus that path, as the host counts them, which is
// what keeps verification lossless with penalties on. The arithmetic is the host's, in fp32 with
// explicitly rounded operations (no fused multiply-add), so a row processed here equals the host's
// ProcessLogits() of the same row bit for bit.
//
// One CTA a row: the row is copied from `in` to `out` (rows without a sequence are copied
// unchanged), then the edits touch only the ids the sequence's lists name. A token's penalty
// is applied once, from its count over history and path, so the order of the lists is free;
// the path is read once per history entry, which is cheap for tree depths (<= 256).
//
// All variable-length lists of a step live in one int32 array (`data`), so the launch's
// arguments depend only on the number of rows and sequences (a CUDA graph of a bucket replays
// any step of that bucket whatever its lists hold).
#ifndef SPECD_KERNELS_CUDA_LOGITS_PROCESSORS_H_
#define SPECD_KERNELS_CUDA_LOGITS_PROCESSORS_H_

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

// One sequence's processors (engine/sampling.h SamplingParams) and where its lists sit in
// LogitsProcessorsParams::data (word offsets).
struct LogitsProcessorSeq {
  float repetition_penalty = 1.0f;  // > 0; 1: off
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int32_t min_tokens = 0;
  int64_t output_length = 0;  // the history's output tokens (TokenHistory::output_length)
  // History entries: history_count triples (token, output count, in prompt 0/1), sorted by
  // token ascending, distinct tokens. Read only when a penalty is on.
  int32_t history_begin = 0;
  int32_t history_count = 0;
  // logit_bias: bias_count pairs (token, bias as the int32 bits of an fp32), distinct tokens.
  int32_t bias_begin = 0;
  int32_t bias_count = 0;
  // min_tokens_stop_ids: stop_count tokens, masked to -inf while output_length + the row's
  // path length < min_tokens.
  int32_t stop_begin = 0;
  int32_t stop_count = 0;
};

// One row: its sequence (index into `seqs`; -1: copy the row unchanged) and its path's tokens
// (path_len tokens from data[path_begin], any order).
struct LogitsProcessorRow {
  int32_t seq = -1;
  int32_t path_begin = 0;
  int32_t path_len = 0;
  int32_t pad = 0;
};

struct LogitsProcessorsParams {
  const float* in = nullptr;  // [num_rows, in_stride] fp32, device: columns [0, vocab_size)
  int64_t in_stride = 0;
  float* out = nullptr;  // [num_rows, out_stride] fp32, device; must not overlap `in`
  int64_t out_stride = 0;
  int64_t num_rows = 0;
  int64_t vocab_size = 0;                    // every token id in the lists is in [0, vocab_size)
  const LogitsProcessorRow* rows = nullptr;  // [num_rows] device
  const LogitsProcessorSeq* seqs = nullptr;  // [sequences] device
  const int32_t* data = nullptr;             // the lists, device
};

cudaError_t LogitsProcessorsCuda(const LogitsProcessorsParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_LOGITS_PROCESSORS_H_
