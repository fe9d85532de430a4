// The tree-attention mask encoding of a verify or prefill step's tokens (the CUDA kernel's, in
// specd/kernels/cuda/tree_attention.h): a query at scratch node `index` of its sequence sees the
// keys [0, committed + a + 1) in full, then, through mask bits counted from that end, its
// ancestors after scratch node a (itself included). Node a lies on the spine (the scratch nodes
// whose depth equals their index, i.e. the chain 0, 1, 2, ... from the committed end), so every
// spine node up to a is an ancestor too; which spine node serves as a is free within the mask's
// reach, and any choice selects the same keys in the same (ascending) order.
#ifndef SPECD_ENGINE_CUDA_TREE_MASK_H_
#define SPECD_ENGINE_CUDA_TREE_MASK_H_

#include <cstdint>
#include <optional>

#include "absl/types/span.h"

namespace specd {

// The deepest spine node among scratch node `index`'s ancestors (itself included), or -1 when
// none is; depth[i] and parents[i] describe scratch node i (parents[i] < i, -1 at the committed
// end).
int32_t SpineEnd(absl::Span<const int32_t> parents, absl::Span<const int32_t> depth, int32_t index);

// One spine end for all the step's masked tokens of a sequence (those past their own spine end:
// tree nodes), the lowest of theirs; nullopt when the step has none. The attention kernel forms
// one window group per run of equal mask_begin among a tile's queries, and runs the groups one
// after another; a breadth-first tree's own spine ends alternate (bench/history/15-gpu-run-09.md).
// spine_ends[j] is the own spine end of the step's token j, at scratch node first_index + j.
std::optional<int32_t> SharedSpineEnd(absl::Span<const int32_t> spine_ends, int32_t first_index);

// The spine end that token `index` (own spine end `own`) encodes its mask from: `shared` where
// the token is masked and its mask of `mask_bits` bits reaches back to it, else its own.
int32_t MaskSpineEnd(int32_t index, int32_t own, std::optional<int32_t> shared, int mask_bits);

// Sets, in `words` (zeroed by the caller), bit x - (a + 1) for each ancestor x > a of scratch
// node `index` (itself included).
void SetTreeMaskBits(absl::Span<const int32_t> parents, int32_t index, int32_t a,
                     absl::Span<uint32_t> words);

}  // namespace specd

#endif  // SPECD_ENGINE_CUDA_TREE_MASK_H_
