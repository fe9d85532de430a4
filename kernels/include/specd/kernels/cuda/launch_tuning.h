// How the CUDA kernel library launches its kernels: programmatic dependent launch (PDL) per
// launch site and the shared-memory share of L1 that every launch asks for.
//
// These are properties of the process's launches, not of one op: every launcher of the library
// applies them in LaunchPdl (kernels/cuda/device_utils.cuh). So they are one process-wide
// setting, which the engine sets from its typed configuration when it creates a backend
// (engine/cuda/cuda_tuning.h, which parses the SPECD_* environment once); the kernels never read
// the environment. Programs that launch kernels without a backend (benchmarks, tests) get the
// defaults below unless they call SetLaunchTuning themselves.
//
// Host code only; safe to read from several threads (the ranks of a tensor-parallel group launch
// at once) while one sets it.
#ifndef SPECD_KERNELS_CUDA_LAUNCH_TUNING_H_
#define SPECD_KERNELS_CUDA_LAUNCH_TUNING_H_

#include <atomic>
#include <cstdint>
#include <string_view>

namespace specd {
namespace cuda {

// The launch sites whose PDL can be turned off one by one, by the names SPECD_PDL_OFF lists.
inline constexpr std::string_view kLaunchSiteNames[] = {
    "rmsnorm", "swiglu", "rope", "embedding", "attention", "combine", "allreduce"};
inline constexpr int kNumLaunchSites = sizeof(kLaunchSiteNames) / sizeof(kLaunchSiteNames[0]);

// The index of `site` in kLaunchSiteNames, or -1.
constexpr int LaunchSiteIndex(std::string_view site) {
  for (int i = 0; i < kNumLaunchSites; ++i) {
    if (kLaunchSiteNames[i] == site) return i;
  }
  return -1;
}

struct LaunchTuning {
  // Programmatic dependent launch for the short kernels: a kernel starts its prologue while its
  // predecessor drains. False turns it off everywhere (SPECD_PDL=0).
  bool pdl = true;
  // Sites launched without PDL even when `pdl` is on, bit LaunchSiteIndex(site) each
  // (SPECD_PDL_OFF=attention,combine): an early dependent's resident CTAs can slow the kernel
  // they wait on, and A/B runs find out where.
  uint32_t pdl_off_sites = 0;
  // Percent of L1 every launch asks to be shared memory, or -1 to leave it to the driver
  // (SPECD_SMEM_CARVEOUT). An SM changes its split only when idle, and a kernel launched early
  // by PDL lands on SMs where its predecessor still runs; asking for the largest split
  // everywhere keeps two 80 KB attention CTAs an SM behind RoPE. None of these kernels leans
  // on L1.
  int smem_carveout = 100;

  bool PdlAt(std::string_view site) const {
    const int i = LaunchSiteIndex(site);
    return pdl && (i < 0 || (pdl_off_sites >> i & 1u) == 0);
  }
};

namespace internal {
inline std::atomic<bool> g_launch_pdl{true};
inline std::atomic<uint32_t> g_launch_pdl_off_sites{0};
inline std::atomic<int> g_launch_smem_carveout{100};
}  // namespace internal

// Sets how later launches of this process are made.
inline void SetLaunchTuning(const LaunchTuning& tuning) {
  internal::g_launch_pdl.store(tuning.pdl, std::memory_order_relaxed);
  internal::g_launch_pdl_off_sites.store(tuning.pdl_off_sites, std::memory_order_relaxed);
  internal::g_launch_smem_carveout.store(tuning.smem_carveout, std::memory_order_relaxed);
}

inline LaunchTuning GetLaunchTuning() {
  LaunchTuning t;
  t.pdl = internal::g_launch_pdl.load(std::memory_order_relaxed);
  t.pdl_off_sites = internal::g_launch_pdl_off_sites.load(std::memory_order_relaxed);
  t.smem_carveout = internal::g_launch_smem_carveout.load(std::memory_order_relaxed);
  return t;
}

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_LAUNCH_TUNING_H_
