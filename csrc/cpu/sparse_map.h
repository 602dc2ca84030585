// SparseMap: token id (< 2**31) -> uint32 value (1 + the id's entry in the current group, 0: absent), an
// open-addressing (linear probing) hash table for the ids past the kernel's dense map.
//
// The hash is multiply-shift with a random odd multiplier drawn per table (a universal family, see
// home()): ids chosen to collide under one table's hash do not collide under another's, so there is no
// hash-flooding worst case. The load stays at most 1/4 (the counting loop calls grow() before a block of
// ids could pass it), so a look-up almost always ends at the id's home slot: the counting loop reads that
// slot inline (key match: found; empty: a new id; anything else, told by one test: probe_index()) and
// writes it back as one 8-byte store, exactly as it reads and writes the dense map.
//
// The table holds no list of its own: the group's entries (their ids, in first-seen order) are the
// list. grow() re-inserts them, clear() removes them newest first (removing the newest key of a linear
// probing table leaves every older key's probe path intact) or zeroes the table when that is cheaper.
// The table only grows; it is empty between groups.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>

namespace ktae {

class SparseMap {
 public:
  // key = id + 1 (0 marks an empty slot); value = 1 + entry index.
  struct Slot {
    uint32_t key, value;
  };

  SparseMap() {
    std::seed_seq seq{entropy(), uint64_t(reinterpret_cast<uintptr_t>(this)),
                      uint64_t(std::chrono::steady_clock::now().time_since_epoch().count())};
    std::mt19937_64 rng(seq);
    multiplier_ = rng() | 1;
    allocate(kInitialBits);
  }

  // What the counting loop needs, to hold in registers: the slots, the hash multiplier and the mask.
  struct View {
    Slot* slots;
    uint64_t multiplier, mask;

    uint64_t home(uint32_t key) const { return ((uint64_t(key) * multiplier) >> 32) & mask; }
  };

  View view() const { return View{slots_.get(), multiplier_, mask_}; }
  uint64_t capacity() const { return mask_ + 1; }

  // The home slot of a key: bits 32 .. 32 + log2(capacity) of multiplier * key (mod 2**64), that is the
  // top bits of a product modulo 2**(32 + log2(capacity)): Dietzfelbinger's multiply-shift with a
  // random odd multiplier (universal: two keys collide with probability at most 2 / capacity over the
  // multiplier), with a shift that does not depend on the table's size.
  uint64_t home(uint32_t key) const { return view().home(key); }

  // Whether a slot holding `held` holds a key other than `key` (neither `key` nor empty), as one test:
  // the product of two 32-bit numbers is 0 only when one is. Written as two compares, compilers emit two
  // branches, and the first (`held == key`) mispredicts on every new id (about one token in five).
  static bool other_key(uint32_t held, uint32_t key) { return uint64_t(held) * uint64_t(held ^ key) != 0; }

  // The index of `key`'s slot after its home slot `i` held another key: where the key is, or the
  // empty slot where it goes.
  static uint64_t probe_index(const Slot* slots, uint64_t mask, uint32_t key, uint64_t i) {
    for (i = (i + 1) & mask;; i = (i + 1) & mask)
      if (!other_key(slots[i].key, key)) return i;
  }

  // Whether `count` keys plus `more` new ones would pass the table's load of 1/4.
  bool full(uint64_t count, uint64_t more) const { return 4 * (count + more) > capacity(); }

  // The slot of `key` after its home slot held another key: where the key is, or the empty slot where
  // it goes.
  Slot* probe(uint32_t key, uint64_t i) const { return slots_.get() + probe_index(slots_.get(), mask_, key, i); }

  // The slot of `key` (where it is, or where it would go).
  Slot* find(uint32_t key) const {
    const uint64_t i = home(key);
    Slot* s = slots_.get() + i;
    return other_key(s->key, key) ? probe(key, i) : s;
  }

  // The value of id, 0 when absent.
  uint32_t value_of(uint32_t id) const { return find(id + 1)->value; }

  // Double the table and re-insert the ids of ids[0 .. n) that are >= first (value j + 1 for ids[j]).
  void grow(const uint32_t* ids, int64_t n, uint32_t first) {
    allocate(bits_ + 1);
    for (int64_t j = 0; j < n; ++j)
      if (ids[j] >= first) *find(ids[j] + 1) = Slot{ids[j] + 1, uint32_t(j + 1)};
  }

  // Empty the table, which holds `count` keys: the ids of ids[0 .. n) that are >= first.
  void clear(const uint32_t* ids, int64_t n, uint32_t first, uint64_t count) {
    if (count == 0) return;
    if (32 * count >= capacity()) {  // a memset runs at tens of bytes a cycle, a removal hashes and misses
      std::memset(static_cast<void*>(slots_.get()), 0, capacity() * sizeof(Slot));
      return;
    }
    for (int64_t j = n - 1; j >= 0; --j)
      if (ids[j] >= first) *find(ids[j] + 1) = Slot{0, 0};
  }

 private:
  static constexpr int kInitialBits = 12;

  static uint64_t entropy() {
    try {
      std::random_device device;
      return (uint64_t(device()) << 32) ^ device();
    } catch (...) {
      return 0x9e3779b97f4a7c15ull;
    }
  }

  void allocate(int bits) {
    bits_ = bits;
    mask_ = (uint64_t(1) << bits) - 1;
    slots_.reset(new Slot[capacity()]());
  }

  std::unique_ptr<Slot[]> slots_;
  uint64_t mask_ = 0, multiplier_ = 1;
  int bits_ = 0;
};

}  // namespace ktae
