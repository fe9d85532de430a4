#include "common/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/io/load_progress.h"
#include "common/logging.h"
#include "nlohmann/json.hpp"

namespace specd {
namespace {

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<DType> ParseDType(const std::string& name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "I32") return DType::kI32;
  if (name == "I64") return DType::kI64;
  if (name == "U8") return DType::kU8;
  if (name == "BOOL") return DType::kBool;
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype \"", name, "\""));
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF16: case DType::kBF16: return 2;
    case DType::kI64: return 8;
    case DType::kU8: case DType::kBool: return 1;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

float BF16ToF32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToBF16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if (std::isnan(v)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; --exp; }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToF16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int32_t exp = static_cast<int32_t>((bits >> 23) & 0xff) - 127 + 15;
  uint32_t mant = bits & 0x7fffffu;
  if (((bits >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    const int shift = 14 - exp;
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return static_cast<uint16_t>(half);
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, map_size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat(path, ": cannot stat"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, ": truncated safetensors file (", size,
                                            " bytes, no header length)"));
  }
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrCat(path, ": mmap failed: ", std::strerror(errno)));
  }
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->map_ = map;
  file->map_size_ = size;
  const uint8_t* base = static_cast<const uint8_t*>(map);

  uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);
  if (header_len > size - 8) {
    return absl::DataLossError(absl::StrCat(path, ": header length ", header_len,
                                            " runs past the end of the file (", size, " bytes)"));
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(reinterpret_cast<const char*>(base + 8),
                                   reinterpret_cast<const char*>(base + 8 + header_len));
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": malformed header JSON: ", e.what()));
  }
  if (!header.is_object()) {
    return absl::DataLossError(absl::StrCat(path, ": header is not a JSON object"));
  }
  const uint8_t* data = base + 8 + header_len;
  const size_t data_size = size - 8 - header_len;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const nlohmann::json& entry = it.value();
    auto bad = [&](const std::string& what) {
      return absl::DataLossError(absl::StrCat(path, ": tensor ", name, ": ", what));
    };
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets")) {
      return bad("header entry lacks dtype, shape or data_offsets");
    }
    if (!entry["dtype"].is_string()) return bad("dtype is not a string");
    absl::StatusOr<DType> dtype = ParseDType(entry["dtype"].get<std::string>());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", name, ": ", dtype.status().message()));
    }
    TensorView view;
    view.name = name;
    view.file = path;
    view.dtype = *dtype;
    if (!entry["shape"].is_array()) return bad("shape is not an array");
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) return bad("shape has a bad dimension");
      view.shape.push_back(d.get<int64_t>());
    }
    const auto& offs = entry["data_offsets"];
    if (!offs.is_array() || offs.size() != 2 || !offs[0].is_number_unsigned() ||
        !offs[1].is_number_unsigned()) {
      return bad("data_offsets is not a pair of offsets");
    }
    const uint64_t begin = offs[0].get<uint64_t>();
    const uint64_t end = offs[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return absl::DataLossError(absl::StrCat(path, ": tensor ", name, ": data [", begin, ", ",
                                              end, ") runs past the end of the data (",
                                              data_size, " bytes; file truncated?)"));
    }
    const uint64_t expected = static_cast<uint64_t>(view.numel()) * DTypeSize(view.dtype);
    if (end - begin != expected) {
      return bad(absl::StrCat("holds ", end - begin, " bytes but ", DTypeName(view.dtype), " ",
                              ShapeString(view.shape), " needs ", expected));
    }
    view.data = data + begin;
    view.nbytes = end - begin;
    ranges.emplace_back(begin, end);
    file->tensors_.emplace(name, std::move(view));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return absl::DataLossError(absl::StrCat(path, ": tensors overlap in the data section"));
    }
  }
  return file;
}

const TensorView* SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::unique_ptr<TensorStore>> TensorStore::OpenFolder(const std::string& dir) {
  namespace fs = std::filesystem;
  auto store = std::make_unique<TensorStore>();
  std::vector<std::string> files;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  std::error_code ec;
  if (fs::exists(index_path, ec)) {
    std::ifstream in(index_path);
    nlohmann::json index;
    try {
      in >> index;
    } catch (const nlohmann::json::exception& e) {
      return absl::DataLossError(
          absl::StrCat(index_path.string(), ": malformed JSON: ", e.what()));
    }
    if (!index.contains("weight_map") || !index["weight_map"].is_object()) {
      return absl::DataLossError(absl::StrCat(index_path.string(), ": no weight_map object"));
    }
    std::set<std::string> shards;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      if (!it.value().is_string()) {
        return absl::DataLossError(absl::StrCat(index_path.string(), ": weight_map entry ",
                                                it.key(), " is not a file name"));
      }
      shards.insert(it.value().get<std::string>());
    }
    for (const auto& s : shards) files.push_back((fs::path(dir) / s).string());
  } else if (fs::exists(fs::path(dir) / "model.safetensors", ec)) {
    files.push_back((fs::path(dir) / "model.safetensors").string());
  } else {
    if (!fs::is_directory(dir, ec)) {
      return absl::NotFoundError(absl::StrCat(dir, ": no such model folder"));
    }
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
    }
    std::sort(files.begin(), files.end());
  }
  if (files.empty()) {
    return absl::NotFoundError(absl::StrCat(dir, ": no *.safetensors files"));
  }
  // The files are mapped, not read: the bytes come in as the backend places the tensors.
  int64_t total_bytes = 0;
  for (const auto& f : files) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(f);
    if (!file.ok()) return file.status();
    SPECD_LOG(INFO) << "mapped " << f << ": " << (*file)->tensors().size() << " tensors, "
                    << HumanBytes(static_cast<int64_t>((*file)->size()));
    total_bytes += static_cast<int64_t>((*file)->size());
    store->files_.push_back(std::move(*file));
  }
  for (const auto& file : store->files_) {
    for (const auto& [name, view] : file->tensors()) {
      if (!store->index_.emplace(name, &view).second) {
        return absl::DataLossError(absl::StrCat(file->path(), ": tensor ", name,
                                                " also appears in ", store->index_[name]->file));
      }
    }
  }
  if (store->files_.size() > 1) {
    SPECD_LOG(INFO) << dir << ": " << store->files_.size() << " files, " << store->index_.size()
                    << " tensors, " << HumanBytes(total_bytes);
  }
  return store;
}

bool TensorStore::Has(const std::string& name) const { return index_.count(name) > 0; }

absl::StatusOr<const TensorView*> TensorStore::Get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    std::string where = files_.empty() ? "" : files_.front()->path();
    if (files_.size() > 1) where = absl::StrCat(where, " and ", files_.size() - 1, " more shards");
    return absl::NotFoundError(absl::StrCat("missing tensor ", name, " in ", where));
  }
  return it->second;
}

std::vector<std::string> TensorStore::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, view] : index_) names.push_back(name);
  return names;
}

namespace {

void ConvertToF32(const TensorView& v, int64_t begin, int64_t count, float* out) {
  // An empty range (a tensor-parallel rank's empty share) may come with a null `out`, which
  // memcpy must not see even for zero bytes.
  if (count <= 0) return;
  switch (v.dtype) {
    case DType::kF32:
      std::memcpy(out, v.data + begin * 4, count * 4);
      break;
    case DType::kBF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, v.data + (begin + i) * 2, 2);
        out[i] = BF16ToF32(h);
      }
      break;
    case DType::kF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, v.data + (begin + i) * 2, 2);
        out[i] = F16ToF32(h);
      }
      break;
    default:
      break;
  }
}

absl::Status CheckFloat(const TensorView& v) {
  if (v.dtype != DType::kF32 && v.dtype != DType::kF16 && v.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(v.file, ": tensor ", v.name, ": dtype ",
                                                   DTypeName(v.dtype),
                                                   " is not a floating-point type"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status TensorStore::ReadF32(const std::string& name, absl::Span<const int64_t> shape,
                                  float* out) const {
  absl::StatusOr<const TensorView*> v = Get(name);
  if (!v.ok()) return v.status();
  const TensorView& view = **v;
  if (absl::Span<const int64_t>(view.shape) != shape) {
    return absl::InvalidArgumentError(absl::StrCat(view.file, ": tensor ", name, " has shape ",
                                                   ShapeString(view.shape), ", expected ",
                                                   ShapeString(shape)));
  }
  if (absl::Status s = CheckFloat(view); !s.ok()) return s;
  ConvertToF32(view, 0, view.numel(), out);
  return absl::OkStatus();
}

absl::Status TensorStore::ReadRowsF32(const std::string& name, int64_t row_begin,
                                      int64_t row_end, float* out) const {
  absl::StatusOr<const TensorView*> v = Get(name);
  if (!v.ok()) return v.status();
  const TensorView& view = **v;
  if (absl::Status s = CheckFloat(view); !s.ok()) return s;
  if (view.shape.empty() || row_begin < 0 || row_end > view.shape[0] || row_begin > row_end) {
    return absl::InvalidArgumentError(absl::StrCat(view.file, ": tensor ", name, " of shape ",
                                                   ShapeString(view.shape), " has no rows [",
                                                   row_begin, ", ", row_end, ")"));
  }
  const int64_t row = view.numel() / std::max<int64_t>(view.shape[0], 1);
  ConvertToF32(view, row_begin * row, (row_end - row_begin) * row, out);
  return absl::OkStatus();
}

absl::Status TensorStore::ReadColsF32(const std::string& name, int64_t col_begin,
                                      int64_t col_end, float* out) const {
  absl::StatusOr<const TensorView*> v = Get(name);
  if (!v.ok()) return v.status();
  const TensorView& view = **v;
  if (absl::Status s = CheckFloat(view); !s.ok()) return s;
  if (view.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(view.file, ": tensor ", name, " of shape ",
                                                   ShapeString(view.shape),
                                                   " is not 2-D, so it has no column slices"));
  }
  const int64_t rows = view.shape[0], cols = view.shape[1];
  if (col_begin < 0 || col_end > cols || col_begin > col_end) {
    return absl::InvalidArgumentError(absl::StrCat(view.file, ": tensor ", name, " of shape ",
                                                   ShapeString(view.shape), " has no columns [",
                                                   col_begin, ", ", col_end, ")"));
  }
  const int64_t width = col_end - col_begin;
  for (int64_t r = 0; r < rows && width > 0; ++r) {
    ConvertToF32(view, r * cols + col_begin, width, out + r * width);
  }
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (static_cast<uint64_t>(numel) * DTypeSize(t.dtype) != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat("WriteSafetensors: tensor ", t.name, " has ",
                                                     t.data.size(), " bytes for shape ",
                                                     ShapeString(t.shape)));
    }
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');  // keeps the data 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write"));
  const uint64_t len = text.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(text.data(), text.size());
  for (const auto& t : tensors) {
    out.write(reinterpret_cast<const char*>(t.data.data()), t.data.size());
  }
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace specd
