// Declarations of the generated Unicode tables in common/text/unicode_tables.cc
// (tools/codegen/gen_unicode_tables.py). Use the functions of common/text/unicode.h instead.
#ifndef SPECD_COMMON_TEXT_UNICODE_TABLES_H_
#define SPECD_COMMON_TEXT_UNICODE_TABLES_H_

#include <cstddef>
#include <cstdint>

namespace specd::unicode_internal {

struct ClassRange {
  uint32_t lo;
  uint32_t hi;  // inclusive
  uint8_t value;
};

struct Decomposition {
  uint32_t cp;
  uint8_t len;
  uint32_t parts[4];
};

struct Composition {
  uint32_t first;
  uint32_t second;
  uint32_t composite;
};

extern const char kUnicodeVersion[];
// Sorted, disjoint; code points not covered have value 0.
extern const ClassRange kClassRanges[];
extern const size_t kClassRangesSize;
extern const ClassRange kCombiningClassRanges[];
extern const size_t kCombiningClassRangesSize;
extern const Decomposition kDecompositions[];
extern const size_t kDecompositionsSize;
extern const Composition kCompositions[];
extern const size_t kCompositionsSize;

}  // namespace specd::unicode_internal

#endif  // SPECD_COMMON_TEXT_UNICODE_TABLES_H_
