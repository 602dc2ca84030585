// The KTAE kernels built for the CPU emulator (cuda_on_cpu.h): the same ktae_kernels.cu, launched
// block by block on host threads. Linked with ktae.cpp into a test-only extension whose tensors
// live on the CPU (see tests/test_cuda_emulation.py). Not part of the installed package.
#define KTAE_CPU_EMULATION
#include "cuda_on_cpu.h"

#include "../ktae_kernels.cu"

namespace ktae {
namespace {

// The opt-in shared memory per block of an H100 / H200, so host-side sizing matches a real GPU.
constexpr int64_t kEmulatedSharedBytes = 232448;
constexpr int kBadLaunch = 1;

template <int kMode>
void run_mode(const KernelArgs& args, bool shared_table, int64_t n_blocks, int threads, int64_t shared_bytes) {
  if (shared_table) {
    ktae_emu::run([&] { group_kernel<kMode, true>(args); }, n_blocks, threads, shared_bytes);
  } else {
    ktae_emu::run([&] { group_kernel<kMode, false>(args); }, n_blocks, threads, shared_bytes);
  }
}

}  // namespace

int launch_group_kernel(const KernelArgs& args, Mode mode, bool shared_table, int64_t n_blocks,
                        int threads, int64_t shared_bytes, void* /*stream*/) {
  if (threads <= 0 || threads % 32 != 0 || threads > kMaxThreads || shared_bytes < 0 ||
      shared_bytes > kEmulatedSharedBytes || n_blocks <= 0) {
    return kBadLaunch;
  }
  switch (mode) {
    case kCount: run_mode<kCount>(args, shared_table, n_blocks, threads, shared_bytes); return 0;
    case kRows: run_mode<kRows>(args, shared_table, n_blocks, threads, shared_bytes); return 0;
  }
  return kBadLaunch;
}

int launch_advantage(const PrepareArgs& prepare, const KernelArgs& kernel, int threads, int64_t fallback_blocks,
                     void* /*stream*/) {
  if (threads <= 0 || threads % 32 != 0 || threads > kMaxThreads || kernel.shared_bytes < 0 ||
      kernel.shared_bytes > kEmulatedSharedBytes || fallback_blocks < 0) {
    return kBadLaunch;
  }
  for (int64_t i = 0; i < kAdvantageFlags; ++i) prepare.bad_ids[i] = 0;
  if (prepare.B > 0) ktae_emu::run([&] { scan_kernel(prepare); }, prepare.B, threads, 32);
  ktae_emu::run([&] { groups_kernel(prepare); }, groups_blocks(prepare.B + 1), kGroupsThreads, 0);
  if (prepare.n_groups > 0) {
    ktae_emu::run([&] { group_sums_kernel(prepare); }, groups_blocks(32 * prepare.n_groups), kGroupsThreads,
                  kGroupsThreads * sizeof(double));
  }
  if (kernel.n_items == 0) return 0;
  if (kernel.shared_bytes > 0) {
    ktae_emu::run([&] { dynamic_kernel<true>(kernel); }, kernel.n_items, threads, kernel.shared_bytes);
  }
  if (fallback_blocks > 0) {
    ktae_emu::run([&] { dynamic_kernel<false>(kernel); }, fallback_blocks, threads, 16);
  }
  if (kernel.nan_on_error) {
    ktae_emu::run([&] { nan_on_error_kernel(kernel, prepare.B * prepare.L); }, nan_blocks(prepare.B * prepare.L),
                  kNanThreads, 0);
  }
  return 0;
}

int launch_table_statistics(const StatsArgs& args, void* /*stream*/) {
  if (args.size == 0) return 0;
  const int64_t blocks = (args.size + kStatsThreads - 1) / kStatsThreads;
  ktae_emu::run([&] { table_statistics_kernel(args); }, blocks, kStatsThreads, 0);
  return 0;
}

const char* error_string(int code) {
  return code == 0 ? "no error" : "invalid launch configuration (CPU emulator)";
}

int64_t max_shared_bytes(int /*device*/) { return kEmulatedSharedBytes; }

void clear_launch_state() {}  // the emulator's launchers record nothing

}  // namespace ktae
