#include "bench/kernel_trace.h"

#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace specd {
namespace bench {
namespace {

// CUPTI hands records over on its own thread, in buffers it asks for: they go to one list.
std::mutex g_mu;
std::vector<KernelTrace::Kernel>* g_kernels = nullptr;
constexpr size_t kBufferBytes = 8 << 20;

// "void specd::cuda::(anonymous namespace)::RmsNormKernel<8>(specd::cuda::RmsNormParams)" ->
// "RmsNormKernel"; cuBLASLt's kernels keep their own names ("sm90_xmma_gemm_..."), which say
// the tile shape.
std::string ShortName(const char* mangled) {
  if (mangled == nullptr) return "?";
  int status = 0;
  char* full = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && full != nullptr ? full : mangled;
  std::free(full);
  // The one parenthesis that is not an argument list.
  for (const std::string anon = "(anonymous namespace)::";;) {
    const size_t at = name.find(anon);
    if (at == std::string::npos) break;
    name.erase(at, anon.size());
  }
  // Drop the argument list, then template arguments, then return type and namespaces.
  int depth = 0;
  std::string flat;
  for (char ch : name) {
    if (ch == '(' && depth == 0) break;
    if (ch == '<' || ch == '(') ++depth;
    if (depth == 0) flat += ch;
    if ((ch == '>' || ch == ')') && depth > 0) --depth;
  }
  const size_t space = flat.rfind(' ');
  if (space != std::string::npos) flat = flat.substr(space + 1);
  const size_t colon = flat.rfind("::");
  if (colon != std::string::npos) flat = flat.substr(colon + 2);
  return flat.empty() ? name : flat;
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::vector<KernelTrace::Kernel> got;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    got.push_back({ShortName(k->name), k->start, k->end});
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_kernels != nullptr) g_kernels->insert(g_kernels->end(), got.begin(), got.end());
}

absl::Status Check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return absl::OkStatus();
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  return absl::InternalError(absl::StrCat("CUPTI ", what, ": ", text != nullptr ? text : "?"));
}

}  // namespace

absl::Status KernelTrace::Enable() {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_kernels != nullptr) return absl::FailedPreconditionError("KernelTrace: enabled twice");
    g_kernels = new std::vector<Kernel>();
  }
  if (absl::Status s = Check(cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted),
                             "registering buffers");
      !s.ok()) {
    return s;
  }
  // CONCURRENT_KERNEL, not KERNEL: the latter serialises kernels, which would hide the overlap
  // this is meant to show.
  return Check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enabling kernels");
}

uint64_t KernelTrace::Now() {
  uint64_t t = 0;
  cuptiGetTimestamp(&t);
  return t;
}

std::vector<KernelTrace::Kernel> KernelTrace::Window(uint64_t t0, uint64_t t1) {
  cuptiActivityFlushAll(1);
  std::vector<Kernel> out;
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_kernels == nullptr) return out;
  for (const Kernel& k : *g_kernels) {
    if (k.start_ns >= t0 && k.start_ns <= t1) out.push_back(k);
  }
  std::sort(out.begin(), out.end(),
            [](const Kernel& a, const Kernel& b) { return a.start_ns < b.start_ns; });
  return out;
}

void KernelTrace::Summarize(const std::string& label, const std::vector<Kernel>& kernels,
                            std::FILE* out) {
  if (kernels.empty()) {
    std::fprintf(out, "# trace %s: no kernels recorded\n", label.c_str());
    return;
  }
  double sum_us = 0.0, busy_us = 0.0, idle_us = 0.0;
  uint64_t covered_to = kernels[0].start_ns, last_end = 0;
  // Per name: count, summed duration, and summed exclusive time (what the kernel added to the
  // span: the part of it after every kernel before it had ended; a kernel launched early by
  // programmatic dependent launch spends the rest waiting for its predecessor); per (before,
  // after) pair: idle time between them.
  struct PerName {
    int count = 0;
    double dur_us = 0.0, excl_us = 0.0;
  };
  std::map<std::string, PerName> by_name;
  std::map<std::pair<std::string, std::string>, std::pair<int, double>> gaps;
  std::string last_name;
  for (const Kernel& k : kernels) {
    const double d = (k.end_ns - k.start_ns) * 1e-3;
    sum_us += d;
    PerName& n = by_name[k.name];
    ++n.count;
    n.dur_us += d;
    if (k.start_ns > covered_to && last_end != 0) {
      const double gap = (k.start_ns - covered_to) * 1e-3;
      idle_us += gap;
      auto& g = gaps[{last_name, k.name}];
      ++g.first;
      g.second += gap;
    }
    const uint64_t from = std::max(k.start_ns, covered_to);
    if (k.end_ns > from) {
      busy_us += (k.end_ns - from) * 1e-3;
      n.excl_us += (k.end_ns - from) * 1e-3;
    }
    if (k.end_ns > covered_to) {
      covered_to = k.end_ns;
      last_name = k.name;
    }
    last_end = std::max(last_end, k.end_ns);
  }
  const double span_us = (last_end - kernels[0].start_ns) * 1e-3;
  std::fprintf(out,
               "# trace %s: %zu kernels, span %.1f us, busy %.1f us, idle %.1f us "
               "(%.2f us a kernel), kernel sum %.1f us\n",
               label.c_str(), kernels.size(), span_us, busy_us, idle_us,
               idle_us / static_cast<double>(kernels.size()), sum_us);
  std::vector<std::pair<double, std::string>> names;
  for (const auto& [name, v] : by_name) {
    names.push_back({v.excl_us, absl::StrFormat("%s n=%d (%.2f us a launch; duration %.2f)", name,
                                                v.count, v.excl_us / v.count,
                                                v.dur_us / v.count)});
  }
  std::sort(names.rbegin(), names.rend());
  for (const auto& [us, text] : names) {
    std::fprintf(out, "# trace %s kernel %8.1f us exclusive  %s\n", label.c_str(), us,
                 text.c_str());
  }
  std::vector<std::pair<double, std::string>> pairs;
  for (const auto& [p, v] : gaps) {
    pairs.push_back({v.second, absl::StrCat(p.first, " -> ", p.second, " n=", v.first)});
  }
  std::sort(pairs.rbegin(), pairs.rend());
  for (size_t i = 0; i < pairs.size() && i < 12; ++i) {
    std::fprintf(out, "# trace %s idle %8.1f us  %s\n", label.c_str(), pairs[i].first,
                 pairs[i].second.c_str());
  }
}

absl::Status KernelTrace::WriteCsv(const std::vector<Kernel>& kernels, const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return absl::InternalError(absl::StrCat("cannot write ", path));
  std::fprintf(f, "name,start_us,end_us\n");
  const uint64_t base = kernels.empty() ? 0 : kernels[0].start_ns;
  for (const Kernel& k : kernels) {
    std::fprintf(f, "\"%s\",%.3f,%.3f\n", k.name.c_str(), (k.start_ns - base) * 1e-3,
                 (k.end_ns - base) * 1e-3);
  }
  std::fclose(f);
  return absl::OkStatus();
}

}  // namespace bench
}  // namespace specd
