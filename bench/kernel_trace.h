// A kernel timeline for benchmarks, from CUPTI's activity records: when each kernel of a window
// of host time ran on the device, graph replays included. ncu times each kernel alone, with its
// own launch overhead, so its per-kernel sum neither adds up to a step's wall time nor shows the
// idle time between kernels or the overlap that programmatic dependent launch gives; this does.
// There is no Nsight Systems on the GPU hosts, and CUPTI ships with the CUDA toolkit.
//
//   KernelTrace trace;
//   trace.Enable();            // before the steps (CUPTI then records every kernel)
//   uint64_t t0 = KernelTrace::Now();  ... a synchronised step ...  uint64_t t1 = KernelTrace::Now();
//   std::vector<KernelTrace::Kernel> ks = trace.Window(t0, t1);  // that step's kernels
//   KernelTrace::Summarize("decode", ks, stdout);
#ifndef SPECD_BENCH_KERNEL_TRACE_H_
#define SPECD_BENCH_KERNEL_TRACE_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace specd {
namespace bench {

class KernelTrace {
 public:
  struct Kernel {
    std::string name;  // demangled, without arguments or template parameters
    uint64_t start_ns = 0, end_ns = 0;  // CUPTI's clock (Now())
  };

  // Starts recording every kernel the process runs from now on. Once a process.
  absl::Status Enable();
  // CUPTI's timestamp, the clock of Kernel::start_ns and end_ns.
  static uint64_t Now();
  // The kernels that started in [t0, t1], by start time. Flushes CUPTI's buffers first.
  std::vector<Kernel> Window(uint64_t t0, uint64_t t1);
  // Prints, each line prefixed with "# trace <label>": the span from the first kernel's start to
  // the last one's end, the time some kernel ran (the union of their intervals), the idle time
  // in between, the sum of kernel durations (above the busy time where launches overlap); then
  // per kernel name the count and its exclusive time (what it added to the span, beyond the
  // kernels before it: durations include the wait of a kernel launched early), and the idle time
  // by the pair of kernels around it (the largest first).
  static void Summarize(const std::string& label, const std::vector<Kernel>& kernels,
                        std::FILE* out);
  // One line a kernel (name, start and end in µs from the first start) to `path`.
  static absl::Status WriteCsv(const std::vector<Kernel>& kernels, const std::string& path);
};

}  // namespace bench
}  // namespace specd

#endif  // SPECD_BENCH_KERNEL_TRACE_H_
