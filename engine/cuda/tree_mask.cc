#include "engine/cuda/tree_mask.h"

#include <algorithm>

namespace specd {

int32_t SpineEnd(absl::Span<const int32_t> parents, absl::Span<const int32_t> depth,
                 int32_t index) {
  int32_t a = index;
  while (a >= 0 && depth[a] != a) a = parents[a];
  return a;
}

std::optional<int32_t> SharedSpineEnd(absl::Span<const int32_t> spine_ends, int32_t first_index) {
  std::optional<int32_t> shared;
  for (size_t j = 0; j < spine_ends.size(); ++j) {
    const int32_t index = first_index + static_cast<int32_t>(j);
    if (index > spine_ends[j]) shared = std::min(shared.value_or(spine_ends[j]), spine_ends[j]);
  }
  return shared;
}

int32_t MaskSpineEnd(int32_t index, int32_t own, std::optional<int32_t> shared, int mask_bits) {
  if (index > own && shared.has_value() && *shared < own && index - *shared <= mask_bits) {
    return *shared;
  }
  return own;
}

void SetTreeMaskBits(absl::Span<const int32_t> parents, int32_t index, int32_t a,
                     absl::Span<uint32_t> words) {
  for (int32_t x = index; x > a; x = parents[x]) {
    const int32_t bit = x - (a + 1);
    words[bit / 32] |= 1u << (bit % 32);
  }
}

}  // namespace specd
