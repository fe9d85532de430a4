// Reading one tensor-parallel rank's part of a checkpoint tensor (engine/tp/tp_plan.h says which
// part), shared by the CPU model and the CUDA backend so both shard exactly alike.
#ifndef SPECD_ENGINE_TP_WEIGHT_SHARD_H_
#define SPECD_ENGINE_TP_WEIGHT_SHARD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/io/safetensors.h"
#include "engine/tp/tp_plan.h"

namespace specd {

// Which part of a checkpoint tensor a rank reads: all of it, rows (dim 0: column-parallel
// weights, vocabulary shards) or columns (dim 1: row-parallel weights).
enum class ShardSlice { kAll, kRows, kCols };

// The tensor `name` after checking its full shape is `shape`: INVALID_ARGUMENT naming the file,
// the tensor and both shapes otherwise.
absl::StatusOr<const TensorView*> GetShardTensor(const TensorStore& store, const std::string& name,
                                                 const std::vector<int64_t>& shape);

// Elements of the slice of a tensor of full shape `shape`.
int64_t ShardElements(const std::vector<int64_t>& shape, ShardSlice slice, TpRange range);

// The range lies inside the sliced dimension (for kCols, of a 2-D tensor); INTERNAL naming the
// tensor otherwise (plans make ranges, so a bad one is a bug). Readers that copy the mapping
// directly check this; ReadShard leaves it to the store's row and column reads.
absl::Status CheckShardRange(const std::string& name, const std::vector<int64_t>& shape,
                             ShardSlice slice, TpRange range);

// Reads `name` as fp32 after checking its full shape is `shape` (INVALID_ARGUMENT naming the
// file and tensor otherwise), keeping rows or columns [range.begin, range.end) for kRows / kCols.
absl::Status ReadShard(const TensorStore& store, const std::string& name,
                       std::vector<int64_t> shape, ShardSlice slice, TpRange range,
                       std::vector<float>* out);

}  // namespace specd

#endif  // SPECD_ENGINE_TP_WEIGHT_SHARD_H_
