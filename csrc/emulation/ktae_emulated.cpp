// The KTAE kernels built for the CPU emulator (cuda_on_cpu.h): the same device source NVRTC compiles
// (ktae_kernels/backends/cuda/ktae_kernels.cu), launched block by block (fibers on the calling thread)
// through one entry with cuLaunchKernel's arguments, so that the cuda backend's Python launches
// (ktae_kernels/backends/cuda/pipeline.py) drive it unchanged; tensors live on the CPU. A plain shared
// library loaded with ctypes by tests/emulator.py; not part of the installed package.
#define KTAE_CPU_EMULATION
#include "cuda_on_cpu.h"

#include <cstring>

#include "../../ktae_kernels/backends/cuda/ktae_kernels.cu"

namespace {

// The opt-in shared memory per block of an H100 / H200, so host-side sizing matches a real GPU.
constexpr int64_t kEmulatedSharedBytes = 232448;

template <class Args>
const Args& arg(void** params, int i) {
  return *static_cast<const Args*>(params[i]);
}

// Runs kernel `name` (its NVRTC name expression, runtime.py KERNELS) with `params` as cuLaunchKernel
// takes them (a pointer to each argument). False for an unknown name.
bool dispatch(const char* name, void** params, int64_t grid, int block, int64_t smem) {
  using namespace ktae;
  const auto is = [name](const char* expected) { return std::strcmp(name, expected) == 0; };
  const auto run = [&](auto kernel) { ktae_emu::run(kernel, grid, block, smem); return true; };
  // kernels whose threads never wait on one another: every thread in turn on this one
  const auto serial = [&](auto kernel) { ktae_emu::run_serial(kernel, grid, block, smem); return true; };
  if (is("ktae::scan_kernel")) return run([&] { scan_kernel(arg<PrepareArgs>(params, 0)); });
  if (is("ktae::groups_kernel")) return run([&] { groups_kernel(arg<PrepareArgs>(params, 0)); });
  if (is("ktae::group_sums_kernel")) return run([&] { group_sums_kernel(arg<PrepareArgs>(params, 0)); });
  if (is("ktae::dynamic_kernel<true>")) return run([&] { dynamic_kernel<true>(arg<KernelArgs>(params, 0)); });
  if (is("ktae::dynamic_kernel<false>")) return run([&] { dynamic_kernel<false>(arg<KernelArgs>(params, 0)); });
  if (is("ktae::nan_on_error_kernel")) {
    return serial([&] { nan_on_error_kernel(arg<KernelArgs>(params, 0), arg<int64_t>(params, 1)); });
  }
  if (is("ktae::table_statistics_kernel")) return serial([&] { table_statistics_kernel(arg<StatsArgs>(params, 0)); });
  return false;
}

}  // namespace

// 0 after the launch ran to completion; 1 for an unknown kernel or a launch configuration a GPU
// would refuse (threads not a multiple of 32 in [32, kMaxThreads], more than the opt-in shared
// memory, no blocks).
extern "C" int ktae_emulated_launch(const char* name, int64_t grid, int block, int64_t smem, void** params) {
  if (block <= 0 || block % 32 != 0 || block > ktae::kMaxThreads || smem < 0 || smem > kEmulatedSharedBytes ||
      grid <= 0) {
    return 1;
  }
  return dispatch(name, params, grid, block, smem) ? 0 : 1;
}

extern "C" int64_t ktae_emulated_max_shared_bytes() { return kEmulatedSharedBytes; }

// The header's table sizes, for the test that the Python side computes the same (pipeline.py).
extern "C" int64_t ktae_emulated_max_keys(int64_t capacity) { return ktae::max_keys(capacity); }
extern "C" int64_t ktae_emulated_header_bytes(int64_t words) { return ktae::header_bytes(words); }
extern "C" int64_t ktae_emulated_shared_table_bytes(int64_t capacity, int64_t words, bool packed) {
  return ktae::shared_table_bytes(capacity, words, packed);
}
extern "C" int64_t ktae_emulated_group_shared_need(int64_t words, bool packed, int64_t n_keys) {
  return ktae::group_shared_need(words, packed, n_keys);
}
