// Shape arithmetic the goodput policy and the acceptance estimate share (engine/spec only).
#ifndef SPECD_ENGINE_SPEC_SHAPE_MATH_H_
#define SPECD_ENGINE_SPEC_SHAPE_MATH_H_

#include <algorithm>
#include <cstdint>

#include "engine/spec/policy.h"

namespace specd {
namespace spec_internal {

// Nodes a tree of this shape can have: max_nodes, or fewer when depth and top_k cap it.
inline int ShapeNodes(const SpecShape& s) {
  if (s.none()) return 0;
  int64_t total = 0, level = 1;
  for (int d = 0; d < s.depth && total < s.max_nodes; ++d) {
    level = std::min<int64_t>(level * std::max(1, s.top_k), 1 << 20);
    total += level;
  }
  return static_cast<int>(std::min<int64_t>(total, s.max_nodes));
}

inline bool IsChain(const SpecShape& s) { return s.top_k <= 1 || ShapeNodes(s) <= s.depth; }

// Average siblings per level of a tree (1 for a chain).
inline double Width(const SpecShape& s) {
  if (s.none() || IsChain(s)) return 1.0;
  return std::clamp(static_cast<double>(ShapeNodes(s)) / s.depth, 1.0,
                    static_cast<double>(s.top_k));
}

inline double ClampRate(double p) { return std::clamp(p, 0.01, 0.99); }

}  // namespace spec_internal
}  // namespace specd

#endif  // SPECD_ENGINE_SPEC_SHAPE_MATH_H_
