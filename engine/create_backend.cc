// CreateBackend: picks the backend named by BackendOptions::device.
#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#include "engine/cpu_backend.h"

namespace specd {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& dir,
                                                      const BackendOptions& options) {
  if (options.device == "cpu") {
    absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create(dir, options);
    if (!cpu.ok()) return cpu.status();
    return std::unique_ptr<Backend>(std::move(*cpu));
  }
  return absl::UnimplementedError(
      absl::StrCat("device \"", options.device, "\" is not supported by this build (try \"cpu\")"));
}

}  // namespace specd
