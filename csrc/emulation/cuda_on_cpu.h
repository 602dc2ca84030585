// Just enough of CUDA to run ktae_kernels/backends/cuda/ktae_kernels.cu on the CPU, for tests on machines
// without a GPU.
//
// A launch runs on the calling host thread, block after block; each CUDA thread of a block is a fiber
// (ucontext) that runs until it waits in __syncthreads (a barrier over the block) or a warp collective
// (__ballot_sync, __match_any_sync, __shfl_sync, __syncwarp: an exchange over the warp's 32 threads,
// which therefore must all call it; the kernels use full-warp masks only, anything else aborts), or is
// about to do an atomic (GCC __atomic builtins), so that atomics of different threads interleave. The
// threads are resumed in rounds, in an order shuffled with a fixed seed. run_serial takes the threads
// one after another with no fibers, for kernels whose threads never wait on one another. Dynamic shared
// memory is a per-block buffer filled with garbage so that a missing initialisation shows. This checks
// the kernels' indexing, block and warp logic and the atomics' interleavings; it says nothing about
// CUDA's memory model or performance.
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace ktae_emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

inline thread_local Dim3 thread_idx, block_idx, block_dim, grid_dim;
struct Block;
inline thread_local Block* block = nullptr;

// The running CUDA thread gives the host thread back to its block's scheduler, which resumes another.
inline void yield();

// A reusable barrier over `count` CUDA threads of one block: the last to arrive releases the others,
// which wait by yielding.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void wait();

 private:
  const int count_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

struct Warp {
  Barrier barrier{32};
  uint64_t values[32] = {};
};

// One block's state: its barrier, warps and shared memory, and the scheduler of its CUDA threads, each
// a fiber (ucontext) with a stack of its own on the launching host thread.
struct Block {
  Block(int threads, int64_t shared_bytes)
      : barrier(threads), shared(static_cast<size_t>(shared_bytes) + 16, 0xA5) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
  }
  Barrier barrier;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<unsigned char> shared;
  bool serial = false;  // run_serial: the threads run one after another, so no thread may wait on another
  ucontext_t scheduler{};
  std::vector<ucontext_t> contexts;
  std::vector<char> done;
  std::vector<char> slow;  // this block's slow threads (as a warp the GPU holds back)
  std::function<void()> kernel;
  std::vector<const uint64_t*> waits_on;  // the generation of the barrier a thread waits in (or null) ...
  std::vector<uint64_t> waits_for;         // ... and the value it waits to see change

  bool runnable(int t) const { return !done[t] && (waits_on[t] == nullptr || *waits_on[t] != waits_for[t]); }
};

// A collective in a kernel run by run_serial would wait forever: abort instead.
inline void check_not_serial(const char* what) {
  if (block->serial) {
    std::fprintf(stderr, "cuda_on_cpu: %s in a kernel run by run_serial, which no thread may wait in\n", what);
    std::abort();
  }
}

inline void yield() { swapcontext(&block->contexts[thread_idx.x], &block->scheduler); }

inline void Barrier::wait() {
  const uint64_t generation = generation_;
  if (++arrived_ == count_) {
    arrived_ = 0;
    ++generation_;
    return;
  }
  const unsigned t = thread_idx.x;
  block->waits_on[t] = &generation_;  // not resumed until the last thread arrives
  block->waits_for[t] = generation;
  yield();
  block->waits_on[t] = nullptr;
}

// Before an atomic: let the other threads of the block run first, so that atomics interleave as on a GPU.
inline void interleave() {
  if (block == nullptr || block->serial) return;
  yield();
}

// At each read of blockDim (every stride of a block-wide loop): one time in kPreemptEvery, let the other
// threads run first, as a GPU's warps run ahead of one another inside plain code (a missing
// __syncthreads shows).
constexpr uint32_t kPreemptEvery = 8;
inline const Dim3& preemptible(const Dim3& dim) {
  static thread_local uint32_t state = 0x2545F491u;
  if (block != nullptr && !block->serial) {
    state = state * 1664525u + 1013904223u;
    if ((state >> 16) % kPreemptEvery == 0u) yield();
  }
  return dim;
}

inline unsigned char* dynamic_shared() {
  // 16-byte aligned, as CUDA's dynamic shared memory
  auto address = reinterpret_cast<uintptr_t>(block->shared.data());
  return block->shared.data() + ((16 - address % 16) % 16);
}

// Each lane publishes a 64-bit value; every lane gets all 32 back.
inline void exchange(unsigned mask, uint64_t value, uint64_t (&out)[32]) {
  if (mask != 0xFFFFFFFFu) {
    std::fprintf(stderr, "cuda_on_cpu: warp collectives must use the full mask, got %08x\n", mask);
    std::abort();
  }
  check_not_serial("a warp collective");
  Warp& warp = *block->warps[thread_idx.x / 32];
  warp.values[thread_idx.x % 32] = value;
  warp.barrier.wait();
  std::memcpy(out, warp.values, sizeof(out));
  warp.barrier.wait();
}

// Bytes of a CUDA thread's stack (the kernels keep a few small arrays; a host thread's default is 8 MB).
constexpr size_t kStackBytes = 256 * 1024;

// The stacks of a host thread's fibers, kept across launches (allocated, never touched until used).
inline std::vector<std::unique_ptr<char[]>>& stacks(int threads) {
  static thread_local std::vector<std::unique_ptr<char[]>> pool;
  while (static_cast<int>(pool.size()) < threads) pool.emplace_back(new char[kStackBytes]);
  return pool;
}

inline void fiber_main() {
  block->kernel();
  block->done[thread_idx.x] = 1;
}  // returns to the scheduler (uc_link)

// One thread in kSlowShare of a block is slow: resumed in one round in kSlowResume (the others in one
// in two), so that it lags far behind, as a thread the host or the GPU holds back.
constexpr uint32_t kSlowShare = 8;
constexpr uint32_t kSlowResume = 32;

// Runs `kernel` over `blocks` blocks of `threads` CUDA threads, one block after another, on the calling
// host thread: each CUDA thread a fiber that runs until it waits in a barrier or warp collective, is
// about to do an atomic, or reads blockDim and is preempted (preemptible). In each round every thread
// that can run is resumed or not at random (the slow ones seldom), in a shuffled order (a fixed seed: a
// launch runs the same way every time), so that some threads run far ahead of others as on a GPU.
// Shared memory is refilled with garbage before each block. A block whose unfinished threads all wait
// is deadlocked (a thread skipped a barrier or a warp collective): abort.
template <class Kernel>
void run(Kernel kernel, int64_t blocks, int threads, int64_t shared_bytes) {
  Block state(threads, shared_bytes);
  state.kernel = kernel;
  state.contexts.resize(threads);
  state.done.resize(threads);
  state.slow.resize(threads);
  state.waits_on.assign(threads, nullptr);
  state.waits_for.resize(threads);
  auto& stack = stacks(threads);
  block = &state;
  block_dim = Dim3{static_cast<unsigned>(threads), 1, 1};
  grid_dim = Dim3{static_cast<unsigned>(blocks), 1, 1};
  std::vector<int> order;
  order.reserve(threads);
  uint32_t seed = 0x9E3779B9u;
  for (int64_t b = 0; b < blocks; ++b) {
    block_idx = Dim3{static_cast<unsigned>(b), 0, 0};
    std::memset(state.shared.data(), 0xA5, state.shared.size());
    for (int t = 0; t < threads; ++t) {
      ucontext_t& context = state.contexts[t];
      getcontext(&context);
      context.uc_stack.ss_sp = stack[t].get();
      context.uc_stack.ss_size = kStackBytes;
      context.uc_link = &state.scheduler;
      makecontext(&context, fiber_main, 0);
      state.done[t] = 0;
      seed = seed * 1664525u + 1013904223u;
      state.slow[t] = (seed >> 16) % kSlowShare == 0u;
    }
    for (int alive = threads; alive > 0;) {
      order.clear();
      for (int t = 0; t < threads; ++t) {
        if (state.runnable(t)) order.push_back(t);
      }
      if (order.empty()) {
        std::fprintf(stderr, "cuda_on_cpu: deadlock in block %lld: %d threads wait for the others\n",
                     static_cast<long long>(b), alive);
        std::abort();
      }
      for (size_t i = order.size() - 1; i > 0; --i) {
        seed = seed * 1664525u + 1013904223u;
        std::swap(order[i], order[(seed >> 8) % static_cast<uint32_t>(i + 1)]);
      }
      for (const int t : order) {
        seed = seed * 1664525u + 1013904223u;
        if ((seed >> 16) % (state.slow[t] ? kSlowResume : 2u) != 0u) continue;
        thread_idx = Dim3{static_cast<unsigned>(t), 0, 0};
        swapcontext(&state.scheduler, &state.contexts[t]);
        if (state.done[t]) --alive;
      }
    }
  }
  block = nullptr;
}

// Runs a kernel whose threads never wait on one another (no __syncthreads, no warp collective: it
// aborts on one) as `run` does, but every thread of every block in turn, without fibers: the same
// writes, for much less (the statistics grid is thousands of blocks).
template <class Kernel>
void run_serial(Kernel kernel, int64_t blocks, int threads, int64_t shared_bytes) {
  Block state(threads, shared_bytes);
  state.serial = true;
  block = &state;
  block_dim = Dim3{static_cast<unsigned>(threads), 1, 1};
  grid_dim = Dim3{static_cast<unsigned>(blocks), 1, 1};
  for (int64_t b = 0; b < blocks; ++b) {
    block_idx = Dim3{static_cast<unsigned>(b), 0, 0};
    std::memset(state.shared.data(), 0xA5, state.shared.size());
    for (int t = 0; t < threads; ++t) {
      thread_idx = Dim3{static_cast<unsigned>(t), 0, 0};
      kernel();
    }
  }
  block = nullptr;
}

}  // namespace ktae_emu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define threadIdx ktae_emu::thread_idx
#define blockIdx ktae_emu::block_idx
#define blockDim ktae_emu::preemptible(ktae_emu::block_dim)
#define gridDim ktae_emu::grid_dim
#define KTAE_DYNAMIC_SHARED(name) unsigned char* name = ktae_emu::dynamic_shared()

inline void __syncthreads() {
  ktae_emu::check_not_serial("__syncthreads");
  ktae_emu::block->barrier.wait();
}
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) {
  uint64_t all[32];
  ktae_emu::exchange(mask, 0, all);
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  uint64_t all[32];
  ktae_emu::exchange(mask, predicate != 0, all);
  unsigned bits = 0;
  for (int i = 0; i < 32; ++i) bits |= static_cast<unsigned>(all[i] != 0) << i;
  return bits;
}

inline unsigned __match_any_sync(unsigned mask, unsigned value) {
  uint64_t all[32];
  ktae_emu::exchange(mask, value, all);
  unsigned bits = 0;
  for (int i = 0; i < 32; ++i) bits |= static_cast<unsigned>(all[i] == value) << i;
  return bits;
}

inline unsigned __shfl_sync(unsigned mask, unsigned value, int source) {
  uint64_t all[32];
  ktae_emu::exchange(mask, value, all);
  return static_cast<unsigned>(all[source & 31]);
}

inline double __shfl_sync(unsigned mask, double value, int source) {
  uint64_t all[32], bits;
  std::memcpy(&bits, &value, sizeof(bits));
  ktae_emu::exchange(mask, bits, all);
  std::memcpy(&value, &all[source & 31], sizeof(value));
  return value;
}

inline long long __shfl_xor_sync(unsigned mask, long long value, int lane_mask) {
  uint64_t all[32];
  ktae_emu::exchange(mask, static_cast<uint64_t>(value), all);
  return static_cast<long long>(all[(ktae_emu::thread_idx.x % 32) ^ static_cast<unsigned>(lane_mask & 31)]);
}

inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }

inline unsigned atomicCAS(unsigned* address, unsigned compare, unsigned value) {
  ktae_emu::interleave();
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;  // the old value, as CUDA returns it
}
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  ktae_emu::interleave();
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  ktae_emu::interleave();
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}
inline long long atomicMin(long long* address, long long value) {
  ktae_emu::interleave();
  long long seen = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (value < seen && !__atomic_compare_exchange_n(address, &seen, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return seen;
}
inline long long atomicMax(long long* address, long long value) {
  ktae_emu::interleave();
  long long seen = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (value > seen && !__atomic_compare_exchange_n(address, &seen, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return seen;
}
inline unsigned atomicOr(unsigned* address, unsigned value) {
  ktae_emu::interleave();
  return __atomic_fetch_or(address, value, __ATOMIC_SEQ_CST);
}

inline long long __double_as_longlong(double x) {
  long long bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}
inline double __longlong_as_double(long long bits) {
  double x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}
inline double __dadd_rn(double x, double y) { return x + y; }
inline double __dmul_rn(double x, double y) { return x * y; }
inline float __double2float_rn(double x) { return static_cast<float>(x); }
