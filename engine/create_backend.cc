// CreateBackend: picks the backend named by BackendOptions::device.
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "engine/backend.h"
#include "engine/cpu/cpu_backend.h"
#include "engine/tp/tp_cpu_backend.h"
#include "engine/warmup.h"
#ifdef SPECD_WITH_CUDA
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_tp_backend.h"
#endif

namespace specd {
namespace {

#ifdef SPECD_WITH_CUDA
// Runs the warm-up of BackendOptions::cuda_warmup on a freshly loaded CUDA backend.
absl::StatusOr<std::unique_ptr<Backend>> WarmedUp(std::unique_ptr<Backend> backend,
                                                  const BackendOptions& options) {
  if (!options.cuda_warmup) return backend;
  absl::StatusOr<WarmUpReport> report =
      WarmUpBackend(*backend, GemmClassWarmUpRows(options.cuda_gemm_invariant_rows));
  if (!report.ok()) return report.status();
  SPECD_LOG(INFO) << options.device << ": warmed up at " << report->rows.size()
                  << " GEMM row classes (up to " << (report->rows.empty() ? 0 : report->rows.back())
                  << " rows) in " << report->seconds << " s";
  return backend;
}
#endif

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& dir,
                                                       const BackendOptions& options) {
  if (options.tensor_parallel < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor_parallel: ", options.tensor_parallel, " must be >= 1"));
  }
  if (options.device == "cpu" && options.tensor_parallel > 1) {
    absl::StatusOr<std::unique_ptr<TensorParallelBackend>> tp = CreateTpCpuBackend(dir, options);
    if (!tp.ok()) return tp.status();
    return std::unique_ptr<Backend>(std::move(*tp));
  }
  if (options.device == "cpu") {
    absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create(dir, options);
    if (!cpu.ok()) return cpu.status();
    return std::unique_ptr<Backend>(std::move(*cpu));
  }
  if (options.device == "cuda" || absl::StartsWith(options.device, "cuda:")) {
    int device = 0;
    if (options.device != "cuda" && !absl::SimpleAtoi(options.device.substr(5), &device)) {
      return absl::InvalidArgumentError(
          absl::StrCat("device \"", options.device, "\": expected cuda:N with N a GPU index"));
    }
#ifdef SPECD_WITH_CUDA
    if (options.tensor_parallel == 1 && options.devices.size() == 1) {
      device = options.devices[0];
    } else if (options.tensor_parallel > 1 || !options.devices.empty()) {
      CudaTpOptions tp;
      tp.devices = options.devices;
      if (tp.devices.empty()) {
        for (int r = 0; r < options.tensor_parallel; ++r) tp.devices.push_back(device + r);
      }
      if (static_cast<int>(tp.devices.size()) != options.tensor_parallel) {
        return absl::InvalidArgumentError(absl::StrCat("devices: lists ", tp.devices.size(),
                                                       " GPUs but tensor_parallel is ",
                                                       options.tensor_parallel));
      }
      tp.custom_allreduce_max_bytes = options.cuda_custom_allreduce_max_bytes;
      absl::StatusOr<std::unique_ptr<CudaTensorParallelBackend>> gpus =
          CudaTensorParallelBackend::Create(dir, options, tp);
      if (!gpus.ok()) return gpus.status();
      return WarmedUp(std::unique_ptr<Backend>(std::move(*gpus)), options);
    }
    absl::StatusOr<std::unique_ptr<CudaBackend>> gpu = CudaBackend::Create(dir, device, options);
    if (!gpu.ok()) return gpu.status();
    return WarmedUp(std::unique_ptr<Backend>(std::move(*gpu)), options);
#else
    return absl::UnimplementedError(
        absl::StrCat("device \"", options.device,
                     "\": this build has no CUDA backend (configure with nvcc "
                     "available, SPECD_CUDA=AUTO or ON)"));
#endif
  }
  return absl::UnimplementedError(
      absl::StrCat("device \"", options.device, "\" is not supported by this build (try \"cpu\")"));
}

}  // namespace specd
