// libFuzzer: a .safetensors file (8-byte header length, JSON header, data) through
// SafetensorsFile::Open, which must refuse anything whose tensors would read outside the file;
// every byte of every accepted tensor is then touched so ASan sees any such read.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "common/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path =
      "/tmp/specd-fuzz-safetensors-" + std::to_string(getpid()) + ".safetensors";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  auto file = specd::SafetensorsFile::Open(path);
  if (file.ok()) {
    unsigned sum = 0;
    for (const auto& [name, view] : (*file)->tensors()) {
      if (view.numel() * static_cast<int64_t>(specd::DTypeSize(view.dtype)) !=
          static_cast<int64_t>(view.nbytes)) {
        __builtin_trap();  // Open() promised sizes match dtype x shape
      }
      for (size_t i = 0; i < view.nbytes; ++i) sum += view.data[i];
    }
    static volatile unsigned sink;
    sink = sum;
  }
  return 0;
}
