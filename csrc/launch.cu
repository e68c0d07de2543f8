// Host side of the GEMM kernels (skinny, panel): variant choice, grid planning, launch (with programmatic dependent
// launch), and the build/device probes. Plain CUDA runtime; no torch.
#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "env.h"
#include "exl3_kernels.h"
#include "panel.cuh"
#include "skinny.cuh"

// setup.py passes the target list as a token, e.g. sm_90a__sm_121a (a quoted string would not survive the shell).
#define EXL3_STR2(x) #x
#define EXL3_STR(x) EXL3_STR2(x)
#ifdef VLLM_EXL3_ARCHS
#define EXL3_ARCHS_STRING EXL3_STR(VLLM_EXL3_ARCHS)
#else
#define EXL3_ARCHS_STRING "unknown"
#endif

namespace exl3 {
namespace {

constexpr int kMinUnitsPerBlock = 16;  // two k-tiles per warp: below this a block is all prologue
constexpr int kDirectWaves = 4;       // >= this many waves of whole column groups: no split-K

struct DeviceCache {
  std::mutex mu;
  std::unordered_map<long long, int> blocks_per_sm;  // (device, kernel) -> occupancy, after raising its smem limit
  int sms[64] = {0};
};
DeviceCache& cache() {
  static DeviceCache c;
  return c;
}

int current_device() {
  int dev = 0;
  cudaGetDevice(&dev);
  return dev;
}

int sm_count(int dev) {
  DeviceCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  if (dev >= 0 && dev < 64 && c.sms[dev] == 0) cudaDeviceGetAttribute(&c.sms[dev], cudaDevAttrMultiProcessorCount, dev);
  return dev >= 0 && dev < 64 ? c.sms[dev] : 1;
}

// Raises the kernel's dynamic shared memory limit (once per device) and returns its occupancy.
int prepare_kernel(const GemmKernel& k, int dev) {
  DeviceCache& c = cache();
  const long long key = (static_cast<long long>(dev) << 48) ^ reinterpret_cast<long long>(k.fn);
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.blocks_per_sm.find(key);
  if (it != c.blocks_per_sm.end()) return it->second;
  int blocks = 0;
  if (cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k.fn, kGemmThreads, k.smem) != cudaSuccess)
    blocks = 0;
  c.blocks_per_sm.emplace(key, blocks);
  return blocks;
}

// mt: 8-row groups per row chunk (skinny: 1 or 2; the panel kernel has one size).
GemmKernel pick(const GemmArgs& a, bool panel, int mt, bool dup) {
  if (panel) return panel_kernel_for(a.w.codebook, a.w.bits2);
  return a.w.codebook == kCbMul1 ? skinny_kernel_mul1(a.w.bits2, mt, dup) : skinny_kernel_3inst_mcg(a.w.bits2, mt, dup);
}

// The grouped skinny kernels (duplicated-activation codewords only).
GemmKernel pick_group(const GemmArgs& a, int mt) {
  return a.w.codebook == kCbMul1 ? skinny_group_kernel_mul1(a.w.bits2, mt)
                                 : skinny_group_kernel_3inst_mcg(a.w.bits2, mt);
}

// plan_gemm's grid and split-K choice for the kernels `pick(mt)` gives (mt: 8-row groups per row chunk).
template <typename Pick>
GemmPlan plan_with(const GemmArgs& a, int force_split, bool panel, bool dup, const Pick& pick_mt) {
  GemmPlan p{};
  p.panel = panel;
  p.dup = dup;
  p.rows_per_chunk = panel ? kPanelRows : a.rows <= 8 ? 8 : 16;
  p.row_chunks = (a.rows + p.rows_per_chunk - 1) / p.rows_per_chunk;
  const long long items = static_cast<long long>(p.row_chunks) * a.groups;
  const long long units = items * a.kb_count * kTilesPerHad;
  const int dev = current_device();
  // Prepare both row-chunk variants now: a later call with another row count may come during CUDA-graph capture,
  // where attribute changes are best avoided.
  if (!panel) {
    const GemmKernel other = pick_mt(p.rows_per_chunk == 8 ? 2 : 1);
    if (other.fn) prepare_kernel(other, dev);
  }
  const GemmKernel k = pick_mt(p.rows_per_chunk / 8);
  const int per_sm = k.fn ? prepare_kernel(k, dev) : 0;
  const long long slots = static_cast<long long>(per_sm > 0 ? per_sm : 1) * sm_count(dev);
  p.split_k = force_split >= 0 ? force_split != 0 : items < kDirectWaves * slots;
  if (p.split_k) {
    long long grid = slots;
    const int env_grid = env::skinny_grid();  // bench: override the block count
    if (env_grid > 0) grid = env_grid;
    grid = std::min(grid, std::max(1LL, units / kMinUnitsPerBlock));
    p.grid = static_cast<int>(std::max(1LL, grid));
    const long long kta = static_cast<long long>(a.kb_count) * kTilesPerHad;
    for (long long rg = 0; rg < items; ++rg)
      p.max_slots = std::max(p.max_slots, block_of_unit((rg + 1) * kta - 1, units, p.grid) -
                                              block_of_unit(rg * kta, units, p.grid) + 1);
    p.partial_bytes = static_cast<size_t>(items) * p.max_slots * p.rows_per_chunk * kHadBlock * sizeof(float);
    p.counter_bytes = (static_cast<size_t>(items) * sizeof(int) + 15) / 16 * 16;
  } else {
    p.grid = static_cast<int>(items);  // one block per (row chunk, column group), whole k range
  }
  return p;
}

}  // namespace

GemmPlan plan_gemm(const GemmArgs& a, int force_split, int force_dup, bool panel) {
  // Duplicated-activation codewords unless told otherwise (VLLM_EXL3_SKINNY_DUP=0 or force_dup = 0); the panel
  // kernel always rounds Ŵ pairs.
  const bool dup = !panel && (force_dup >= 0 ? force_dup != 0 : env::skinny_dup());
  return plan_with(a, force_split, panel, dup, [&](int mt) { return pick(a, panel, mt, dup); });
}

GemmPlan plan_gemm_group(const GemmArgs& a, int force_split) {
  return plan_with(a, force_split, false, true, [&](int mt) { return pick_group(a, mt); });
}

bool gemm_group_fits_device(int codebook, int bits2, int rows) {
  GemmArgs a{};
  a.w.codebook = codebook;
  a.w.bits2 = bits2;
  const GemmKernel k = pick_group(a, rows <= 8 ? 1 : 2);
  return k.fn && prepare_kernel(k, current_device()) > 0;
}

namespace {
// One GEMM launch over the plan's stream-K units: the kernel's (GemmArgs, units[, shard table]) parameters.
cudaError_t launch_units(const GemmKernel& k, const GemmArgs& a, const GemmPlan& p, GemmShards* shards, bool pdl,
                         cudaStream_t stream) {
  if (!k.fn) return cudaErrorInvalidValue;
  if (prepare_kernel(k, current_device()) <= 0) return cudaErrorInvalidConfiguration;
  const long long units = static_cast<long long>(p.row_chunks) * a.groups * a.kb_count * kTilesPerHad;
  if (units <= 0) return cudaSuccess;
  if (units >= (1LL << 31)) return cudaErrorInvalidValue;
  int units32 = static_cast<int>(units);
  GemmArgs args = a;
  args.kta_div = make_fast_div(a.kb_count * kTilesPerHad);
  args.groups_div = make_fast_div(a.groups);
  void* kargs[] = {&args, &units32, shards};
  return launch_kernel(k.fn, dim3(p.grid), dim3(kGemmThreads), k.smem, pdl, stream, kargs);
}
}  // namespace

cudaError_t launch_gemm_group(const GemmArgs& a, const GemmShards& shards, const GemmPlan& p, bool pdl,
                              cudaStream_t stream) {
  if (p.panel || !p.dup || a.kb0 != 0 || a.g0 != 0) return cudaErrorInvalidValue;
  GemmShards sh = shards;
  return launch_units(pick_group(a, p.rows_per_chunk / 8), a, p, &sh, pdl, stream);
}

bool gemm_fits_device(int codebook, int bits2, int rows, bool panel) {
  GemmArgs a{};
  a.w.codebook = codebook;
  a.w.bits2 = bits2;
  const GemmKernel k = pick(a, panel, rows <= 8 ? 1 : 2, !panel && env::skinny_dup());
  return k.fn && prepare_kernel(k, current_device()) > 0;
}

cudaError_t launch_gemm(const GemmArgs& a, const GemmPlan& p, bool pdl, cudaStream_t stream) {
  return launch_units(pick(a, p.panel, p.rows_per_chunk / 8, p.dup), a, p, nullptr, pdl, stream);
}

const char* built_archs() {
  static const std::string names = [] {
    std::string s = EXL3_ARCHS_STRING;
    for (size_t i; (i = s.find("__")) != std::string::npos;) s.replace(i, 2, " ");
    return s;
  }();
  return names.c_str();
}

cudaError_t probe_device_support() {
  // Any kernel of the library: fails with cudaErrorNoKernelImageForDevice (or InvalidDeviceFunction) when the
  // binary holds no code this device can run.
  const GemmKernel k = skinny_kernel_mul1(8, 1, true);
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, k.fn);
}

}  // namespace exl3
