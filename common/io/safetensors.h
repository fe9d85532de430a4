// Memory-mapped safetensors checkpoints: one file, or a folder sharded with
// model.safetensors.index.json. Every error names the file and, where there is one, the tensor.
#ifndef SPECD_COMMON_IO_SAFETENSORS_H_
#define SPECD_COMMON_IO_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace specd {

// kBool: one byte per element, 0 or 1 (torch.bool; EAGLE-3's t2d mask).
enum class DType { kF32, kF16, kBF16, kI32, kI64, kU8, kBool };

absl::StatusOr<DType> ParseDType(const std::string& name);  // "F32", "BF16", ...
const char* DTypeName(DType dtype);
size_t DTypeSize(DType dtype);

// One tensor inside a mapped file. `data` points into the mapping: [numel] of `dtype`, host.
struct TensorView {
  std::string name;
  std::string file;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
};

// One mapped .safetensors file. Open() validates the header completely (offsets inside the
// file, sizes matching dtype x shape, no overlap) so later reads cannot run off the mapping.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  size_t size() const { return map_size_; }  // bytes of the file
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const TensorView* Find(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
};

// All tensors of a Hugging Face model folder: model.safetensors, or the shards named by
// model.safetensors.index.json, or every *.safetensors file in the folder.
class TensorStore {
 public:
  static absl::StatusOr<std::unique_ptr<TensorStore>> OpenFolder(const std::string& dir);

  bool Has(const std::string& name) const;
  absl::StatusOr<const TensorView*> Get(const std::string& name) const;
  std::vector<std::string> Names() const;

  // Converts the tensor to fp32 into `out` ([numel] fp32, host), checking that its shape is
  // exactly `shape`; a mismatch names the tensor, the file and both shapes.
  absl::Status ReadF32(const std::string& name, absl::Span<const int64_t> shape,
                       float* out) const;
  // Reads rows [row_begin, row_end) of a 2-D tensor (or the whole of a 1-D one when it is
  // sliced as rows) as fp32; used by tensor-parallel ranks to read only their slices.
  absl::Status ReadRowsF32(const std::string& name, int64_t row_begin, int64_t row_end,
                           float* out) const;
  // Reads columns [col_begin, col_end) of every row of a 2-D tensor [rows, cols] as fp32 into
  // `out` ([rows, col_end - col_begin] fp32, host): the input slice of a row-parallel weight
  // ([out_features, in_features] sliced along in_features, e.g. o_proj and down_proj).
  absl::Status ReadColsF32(const std::string& name, int64_t col_begin, int64_t col_end,
                           float* out) const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

// A tensor to write; `data` holds the raw little-endian bytes of `dtype`.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// Conversions used by loaders and writers.
float BF16ToF32(uint16_t v);
uint16_t F32ToBF16(float v);  // round to nearest even
float F16ToF32(uint16_t v);
uint16_t F32ToF16(float v);

}  // namespace specd

#endif  // SPECD_COMMON_IO_SAFETENSORS_H_
