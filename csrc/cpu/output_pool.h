// OutputPool: the memory of the fresh float32 outputs the CPU backend returns, kept mapped between calls.
//
// A new output's pages cost Linux a fault and a zeroing each (far less in huge pages; more when a VM's
// host must back them again), while the kernel overwrites every position anyway: on a big batch the
// faults take about as long as the kernel itself (docs/benchmarks.md). The backend therefore hands out
// outputs as tensors over blocks of this pool: torch calls the block's deleter once the last reference
// to the tensor's storage is gone (views, numpy arrays and DLPack exports included), and the block comes
// back here, mapped and warm, for the next output that fits it. At most kKeep returned blocks are kept;
// older ones are freed.
//
// A new block is 2 MB aligned, advised to transparent huge pages (Linux) and mapped before the kernel
// writes it: one touch per 4 KB page, in one contiguous slice per thread (faults taken inside the
// kernel's group loop, scattered over the threads' groups, cost several times as much).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <mutex>

#include "workers.h"
#include <new>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace ktae {

class OutputPool {
 public:
  struct Block {
    void* data;
    size_t bytes;
  };

  // Free blocks kept for reuse (a trainer holds one output while it computes the next).
  static constexpr size_t kKeep = 2;

  // A block of at least `bytes` (> 0) bytes: the smallest returned block that holds them and is at most
  // twice their size (the most recently returned of equal ones: the warmest), else a new one mapped
  // on `threads` threads. Owned by the caller until give().
  Block* take(size_t bytes, int threads) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if ((*it)->bytes >= bytes && (*it)->bytes / 2 <= bytes && (best == free_.end() || (*it)->bytes <= (*best)->bytes))
          best = it;
      if (best != free_.end()) {
        Block* block = *best;
        free_.erase(best);
        return block;
      }
    }
    return allocate(bytes, threads);
  }

  // Return a block (its last user is gone); frees the oldest returned blocks past kKeep.
  void give(Block* block) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(block);
    while (free_.size() > kKeep) {
      release(free_.front());
      free_.pop_front();
    }
  }

  // Free every returned block; returns the bytes given back.
  size_t clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t bytes = 0;
    for (Block* block : free_) {
      bytes += block->bytes;
      release(block);
    }
    free_.clear();
    return bytes;
  }

  // Returned blocks held, and their bytes.
  std::pair<size_t, size_t> held() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t bytes = 0;
    for (const Block* block : free_) bytes += block->bytes;
    return {free_.size(), bytes};
  }

 private:
  static constexpr size_t kHuge = size_t(1) << 21;
  static constexpr size_t kPage = 4096;

  static Block* allocate(size_t bytes, int threads) {
    const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
    void* data = std::aligned_alloc(kHuge, size);
    if (data == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(data, size, MADV_HUGEPAGE);
#endif
    char* const bytes_of = static_cast<char*>(data);
    for_each_item(
        int64_t(size / kHuge), threads, [] { return 0; },
        [&](int64_t chunk, int) {
          for (size_t at = size_t(chunk) * kHuge, end = at + kHuge; at < end; at += kPage) bytes_of[at] = 0;
        },
        [](int) {});
    return new Block{data, size};
  }

  static void release(Block* block) {
    std::free(block->data);
    delete block;
  }

  std::mutex mutex_;
  std::deque<Block*> free_;  // oldest first
};

inline OutputPool& output_pool() {
  static OutputPool* pool = new OutputPool();  // never destroyed: tensors may outlive static destruction
  return *pool;
}

}  // namespace ktae
