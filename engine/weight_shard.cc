#include "engine/weight_shard.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace specd {

absl::Status ReadShard(const TensorStore& store, const std::string& name,
                       std::vector<int64_t> shape, ShardSlice slice, TpRange range,
                       std::vector<float>* out) {
  absl::StatusOr<const TensorView*> view = store.Get(name);
  if (!view.ok()) return view.status();
  if ((*view)->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        (*view)->file, ": tensor ", name, " has shape [", absl::StrJoin((*view)->shape, ", "),
        "], expected [", absl::StrJoin(shape, ", "), "]"));
  }
  switch (slice) {
    case ShardSlice::kAll: {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      out->assign(n, 0.0f);
      return store.ReadF32(name, shape, out->data());
    }
    case ShardSlice::kRows: {
      const int64_t row = shape.size() > 1 ? shape[1] : 1;
      out->assign(range.size() * row, 0.0f);
      return store.ReadRowsF32(name, range.begin, range.end, out->data());
    }
    case ShardSlice::kCols:
      out->assign(shape[0] * range.size(), 0.0f);
      return store.ReadColsF32(name, range.begin, range.end, out->data());
  }
  return absl::InternalError("unknown slice");
}

}  // namespace specd
