// SparseMap: token id (< 2**31) -> uint32 slot, an open-addressing (linear probing) hash table for the
// ids past the kernel's dense map. The hash is multiply-add-shift with a random multiplier and
// addend drawn per table (a universal family): ids chosen to collide under one table's hash do not
// collide under another's, so there is no hash-flooding worst case. The table only grows; clear()
// empties it in time proportional to what the group inserted.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

namespace ktae {

class SparseMap {
 public:
  SparseMap() {
    std::seed_seq seq{entropy(), uint64_t(reinterpret_cast<uintptr_t>(this)),
                      uint64_t(std::chrono::steady_clock::now().time_since_epoch().count())};
    std::mt19937_64 rng(seq);
    multiplier_ = rng() | 1;
    addend_ = rng();
    rebuild(kInitialBits);
  }

  // The value of `id`, inserted as 0 when absent; valid until the next call.
  uint32_t& at(uint32_t id) {
    if (4 * (used_.size() + 1) > capacity()) rebuild(bits_ + 1);  // load <= 1/4: short probes
    const uint32_t key = id + 1;  // 0 marks an empty slot
    for (uint64_t i = index(key);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == key) return s.value;
      if (s.key == 0) {
        s.key = key;
        s.value = 0;
        used_.push_back(uint32_t(i));
        return s.value;
      }
    }
  }

  // Bring the first slot `id` probes into cache.
  void prefetch(uint32_t id) const { __builtin_prefetch(slots_.get() + index(id + 1), 1); }

  void clear() {
    for (uint32_t i : used_) slots_[i] = Slot{0, 0};
    used_.clear();
  }

 private:
  struct Slot {
    uint32_t key, value;
  };
  static constexpr int kInitialBits = 12;

  static uint64_t entropy() {
    try {
      std::random_device device;
      return (uint64_t(device()) << 32) ^ device();
    } catch (...) {
      return 0x9e3779b97f4a7c15ull;
    }
  }

  uint64_t capacity() const { return mask_ + 1; }
  uint64_t index(uint32_t key) const { return (uint64_t(key) * multiplier_ + addend_) >> (64 - bits_); }

  // Re-insert every entry into a table of 2**bits slots.
  void rebuild(int bits) {
    std::vector<Slot> old;
    for (uint32_t i : used_) old.push_back(slots_[i]);
    bits_ = bits;
    mask_ = (uint64_t(1) << bits) - 1;
    slots_.reset(new Slot[capacity()]());
    used_.clear();
    for (const Slot& s : old) at(s.key - 1) = s.value;
  }

  std::unique_ptr<Slot[]> slots_;
  std::vector<uint32_t> used_;  // occupied slots, in insertion order
  uint64_t mask_ = 0, multiplier_ = 1, addend_ = 0;
  int bits_ = 0;
};

}  // namespace ktae
