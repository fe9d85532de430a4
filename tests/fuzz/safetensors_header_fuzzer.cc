// libFuzzer: a .safetensors file (8-byte header length, JSON header, data) through
// SafetensorsFile::Open, which must refuse anything whose tensors would read outside the file;
// every byte of every accepted tensor is then touched so ASan sees any such read.
//
// The input goes into one in-memory file (memfd) made once and opened through
// /proc/self/fd/N, so Open() still opens, stats and maps a real file per input but no input
// creates, writes or truncates one on disk (which on a loaded machine cost more than the
// parsing).
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/io/safetensors.h"

namespace {

// The memfd's path; the process exits when it cannot be made (nothing would be fuzzed).
const std::string& InputPath() {
  static const std::string* path = [] {
    const int fd = memfd_create("specd-fuzz-safetensors", MFD_CLOEXEC);
    if (fd < 0) __builtin_trap();
    return new std::string("/proc/self/fd/" + std::to_string(fd));
  }();
  return *path;
}

int InputFd() {
  static const int fd = std::stoi(InputPath().substr(InputPath().rfind('/') + 1));
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  InputPath();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = InputFd();
  if (ftruncate(fd, 0) != 0) __builtin_trap();
  for (size_t done = 0; done < size;) {
    const ssize_t n = pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (n <= 0) __builtin_trap();
    done += static_cast<size_t>(n);
  }
  auto file = specd::SafetensorsFile::Open(InputPath());
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
