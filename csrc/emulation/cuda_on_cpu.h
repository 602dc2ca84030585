// Just enough of CUDA to run ktae_kernels/backends/cuda/ktae_kernels.cu on the CPU, for tests on machines
// without a GPU.
//
// Every CUDA thread of a block is a host thread (run_serial: one host thread takes them in turn, for
// kernels whose threads never wait on one another); __syncthreads is a barrier over the block and each
// warp collective (__ballot_sync, __match_any_sync, __shfl_sync) is an exchange over the warp's 32
// threads, which therefore must all call it (the kernels use full-warp masks only; anything else
// aborts); __syncwarp is such an exchange too. Atomics are GCC __atomic builtins. Dynamic shared memory is a per-block buffer filled
// with garbage so that a missing initialisation shows. This checks the kernels' indexing, block and
// warp logic under real interleavings; it says nothing about CUDA's memory model or performance.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ktae_emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

// A reusable barrier for a fixed number of threads. A thread left waiting for a minute means a
// kernel bug (some thread skipped a __syncthreads or a warp collective): abort instead of hanging.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return generation_ != generation; })) {
      std::fprintf(stderr, "cuda_on_cpu: a barrier waited 60 s for %d threads (deadlock)\n", count_);
      std::abort();
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  const int count_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

struct Warp {
  Barrier barrier{32};
  uint64_t values[32] = {};
};

struct Block {
  Block(int threads, int64_t shared_bytes)
      : barrier(threads), shared(static_cast<size_t>(shared_bytes) + 16, 0xA5) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
  }
  Barrier barrier;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<unsigned char> shared;
  bool serial = false;  // run_serial: one host thread runs every thread, so no thread may wait on another
};

// A collective in a kernel run by run_serial would wait forever: abort instead.
inline void check_not_serial(const char* what);

inline thread_local Dim3 thread_idx, block_idx, block_dim, grid_dim;
inline thread_local Block* block = nullptr;

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

// Runs `kernel` over `blocks` blocks of `threads` host threads, one block after another; the same
// threads serve every block, and shared memory is refilled with garbage before each.
template <class Kernel>
void run(Kernel kernel, int64_t blocks, int threads, int64_t shared_bytes) {
  Block state(threads, shared_bytes);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      thread_idx = Dim3{static_cast<unsigned>(t), 0, 0};
      block_dim = Dim3{static_cast<unsigned>(threads), 1, 1};
      grid_dim = Dim3{static_cast<unsigned>(blocks), 1, 1};
      block = &state;
      for (int64_t b = 0; b < blocks; ++b) {
        block_idx = Dim3{static_cast<unsigned>(b), 0, 0};
        if (t == 0) std::memset(state.shared.data(), 0xA5, state.shared.size());
        state.barrier.wait();
        kernel();
        state.barrier.wait();
      }
    });
  }
  for (auto& th : pool) th.join();
}

// Runs a kernel whose threads never wait on one another (no __syncthreads, no warp collective: it
// aborts on one) as `run` does, but every thread of every block in turn on the calling thread: the same
// writes, without a barrier's cost per block (the statistics grid is thousands of blocks).
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

inline void check_not_serial(const char* what) {
  if (block->serial) {
    std::fprintf(stderr, "cuda_on_cpu: %s in a kernel run by run_serial, which no thread may wait in\n", what);
    std::abort();
  }
}

}  // namespace ktae_emu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define threadIdx ktae_emu::thread_idx
#define blockIdx ktae_emu::block_idx
#define blockDim ktae_emu::block_dim
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
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;  // the old value, as CUDA returns it
}
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}
inline long long atomicMin(long long* address, long long value) {
  long long seen = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (value < seen && !__atomic_compare_exchange_n(address, &seen, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return seen;
}
inline long long atomicMax(long long* address, long long value) {
  long long seen = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (value > seen && !__atomic_compare_exchange_n(address, &seen, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return seen;
}
inline unsigned atomicOr(unsigned* address, unsigned value) {
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
