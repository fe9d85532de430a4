#include "engine/tp/weight_shard.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace specd {

absl::StatusOr<const TensorView*> GetShardTensor(const TensorStore& store, const std::string& name,
                                                 const std::vector<int64_t>& shape) {
  absl::StatusOr<const TensorView*> view = store.Get(name);
  if (!view.ok()) return view.status();
  if ((*view)->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        (*view)->file, ": tensor ", name, " has shape [", absl::StrJoin((*view)->shape, ", "),
        "], expected [", absl::StrJoin(shape, ", "), "]"));
  }
  return view;
}

int64_t ShardElements(const std::vector<int64_t>& shape, ShardSlice slice, TpRange range) {
  switch (slice) {
    case ShardSlice::kAll: {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      return n;
    }
    case ShardSlice::kRows:
      return range.size() * (shape.size() > 1 ? shape[1] : 1);
    case ShardSlice::kCols:
      return shape[0] * range.size();
  }
  return 0;
}

absl::Status CheckShardRange(const std::string& name, const std::vector<int64_t>& shape,
                             ShardSlice slice, TpRange range) {
  if (slice == ShardSlice::kAll) return absl::OkStatus();
  const bool cols = slice == ShardSlice::kCols;
  const int64_t extent = cols ? (shape.size() == 2 ? shape[1] : -1) : (shape.empty() ? 1 : shape[0]);
  if (range.begin < 0 || range.begin > range.end || range.end > extent) {
    return absl::InternalError(absl::StrCat(cols ? "columns [" : "rows [", range.begin, ", ",
                                            range.end, ") are not inside tensor ", name));
  }
  return absl::OkStatus();
}

absl::Status ReadShard(const TensorStore& store, const std::string& name,
                       std::vector<int64_t> shape, ShardSlice slice, TpRange range,
                       std::vector<float>* out) {
  absl::StatusOr<const TensorView*> view = GetShardTensor(store, name, shape);
  if (!view.ok()) return view.status();
  out->assign(ShardElements(shape, slice, range), 0.0f);
  switch (slice) {
    case ShardSlice::kAll:
      return store.ReadF32(name, shape, out->data());
    case ShardSlice::kRows:
      return store.ReadRowsF32(name, range.begin, range.end, out->data());
    case ShardSlice::kCols:
      return store.ReadColsF32(name, range.begin, range.end, out->data());
  }
  return absl::InternalError("unknown slice");
}

}  // namespace specd
