// Native CPU kernel of ktae_kernels (module ktae_kernels._cpu): C++17, its own threads (workers.h),
// nanobind, no torch at build time.
//
// One work item per group. A thread counts its group's tokens into a compact table reached from
// the token id (a dense map for ids < kDenseIds, a seeded open-addressing hash table above), scores
// every distinct id once from its table's statistics (strength = alpha F + beta IG and Cohen's h), and
// writes the group's [G, L] advantages while its ids are still in cache. Groups are independent and
// each is computed by one thread in a fixed order, so the output is bitwise identical for any number
// of threads.
//
// The statistics come from ktae_kernels/method.py or from statistics.h. method.py passes a grid that
// numbers a group's tables offset[g] + a * stride[g] + b: holding every table of every group (small
// groups, exact mode: looked up at that entry), or only the tables the rows use, listed by their sorted
// entries (fisher="upstream": found by binary search, so memory follows the rows, not the grid).
// Without a grid (big groups, exact mode) each distinct table is computed here once, memoised across
// groups and calls.
//
// Arguments are nanobind ndarrays (DLPack: torch, numpy, ...), checked here for dtype, shape, stride
// and device; the GIL is released while the kernel runs.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "arrays.h"
#include "output_pool.h"
#include "sparse_map.h"
#include "statistics.h"
#include "workers.h"

namespace nb = nanobind;

namespace ktae {
namespace {

constexpr int64_t kMaxTokenId = 2147483647;       // ids are < 2**31
constexpr int64_t kDenseIds = int64_t(1) << 18;  // covers every common vocabulary (Qwen 151,936; Gemma 262,144)
constexpr double kTfEps = 1e-5;                   // method.TF_EPS

// Per (group, token id): presence and occurrences (f_c | f_w << 32). While counting a group of at
// most 64 rollouts, `pres` holds one bit per rollout; otherwise (and after counting) it is a | b << 32.
struct Entry {
  uint64_t pres;
  uint64_t occ;
};

constexpr int64_t kBitsRollouts = 64;
// Groups of up to this many rollouts count presence with 16-bit a, b and a 32-bit last-seen stamp
// packed into the entry's `pres` word (16-byte entries); bigger ones use StampedEntry.
constexpr int64_t kPackedRollouts = 65535;

// How a group counts presence: rollout bits, packed stamps, or wide stamps (see count_group_as).
enum class Presence { kBits, kPacked, kWide };

// An entry while counting a group of more than kPackedRollouts rollouts: presence counts grow when the
// id shows up in a rollout other than the last one it was seen in (kept on the entry's cache line).
struct StampedEntry {
  uint64_t pres;
  uint64_t occ;
  int64_t last;  // 1 + the index in `order` of the last rollout the id was seen in, 0: none yet
};

struct Batch {
  const int64_t* ids;      // [B, L] rows `ids_stride` apart, unit column stride
  int64_t ids_stride;
  const uint8_t* mask;     // [B, L] bool rows `mask_stride` apart
  int64_t mask_stride;
  int64_t B, L, n_groups;
  const int64_t* order;    // rollouts sorted by group
  const int64_t* start;    // [n_groups + 1] group g's rollouts are order[start[g] .. start[g + 1])
  const uint8_t* correct;  // [B]
};

// The method's scalars, as KTAEConfig holds them (bound: the largest double below top).
struct Method {
  double k1, b, alpha, beta, top, bound, weight;
  bool use_tf;
};

// Where a table's statistics come from: a grid that method.py computed (group g's table (a, b) is grid
// entry offset[g] + a * stride[g] + b), or statistics.h where offset is nullptr. strength and h are
// indexed by entry, or, where `entries` lists the entries they hold (sorted), by position in that list.
struct Grid {
  const int64_t* offset = nullptr;   // [n_groups]
  const int64_t* stride = nullptr;   // [n_groups] (n_w + 1)
  const double* strength = nullptr;  // alpha F + beta IG
  const double* h = nullptr;         // Cohen's h
  const int64_t* entries = nullptr;  // [n_entries] strictly increasing, or nullptr: every entry is held
  int64_t n_entries = 0;
};

// What scoring and writing need besides the batch.
struct Params {
  Method method;
  Grid grid;
  const int64_t* ignore;  // sorted ignored ids
  int64_t n_ignore;
  const double* base;     // [B] rollout advantage
};

// A growable array whose contents are undefined until written (see ensure_zeroed).
template <typename T>
struct Buffer {
  std::unique_ptr<T[]> data;
  int64_t capacity = 0;

  T* ensure(int64_t n) {
    if (n > capacity) {
      data.reset(new T[size_t(n)]);
      capacity = n;
    }
    return data.get();
  }

  // The same, all zero when (re)allocated; the caller keeps it zero.
  T* ensure_zeroed(int64_t n) {
    if (n > capacity) {
      data.reset(new T[size_t(n)]());
      capacity = n;
    }
    return data.get();
  }
};

// A thread's map from token id to 1 + the id's entry in the current group (0: not seen yet): a 4-byte
// dense map for ids below kDenseIds, a seeded hash table above. All zero between groups.
struct IdMap {
  std::vector<uint32_t> dense = std::vector<uint32_t>(size_t(kDenseIds));
  SparseMap sparse;

  // The value of any int64 id (0 when it was not counted).
  uint32_t value(int64_t id) const {
    if (static_cast<uint64_t>(id) < static_cast<uint64_t>(kDenseIds)) return dense[size_t(id)];
    if (static_cast<uint64_t>(id) > static_cast<uint64_t>(kMaxTokenId)) return 0;
    return sparse.value_of(uint32_t(id));
  }

  // Empty the map of the group's ids ids[0 .. n).
  void clear(const uint32_t* ids, int64_t n) {
    uint32_t* const map = dense.data();
    uint64_t n_sparse = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (ids[j] < kDenseIds)
        map[ids[j]] = 0;
      else
        ++n_sparse;
    }
    sparse.clear(ids, n, uint32_t(kDenseIds), n_sparse);
  }
};

struct MemoSlot {
  uint64_t key;  // a | b << 16 | f_c << 32 | f_w << 48, or kNoKey
  double score;
};

// A thread's scoring state: the current group's weighted scores by slot ([0]: a zero sentinel, [1 + j]:
// entry j), their memo by (a, b, f_c, f_w) (direct-mapped, see GroupScorer), and the statistics of the
// tables met so far (in front of the shared cache).
struct Scoring {
  std::vector<double> by_slot;
  Buffer<MemoSlot> memo;
  LocalStatistics stats;
  bool unlisted = false;  // a table missing from the grid's `entries` was met (see strength_of)
};

// A thread's state for one group at a time, reused across groups and calls. Counting lists the group's
// distinct ids in `tokens`, in first-seen order: on the compact path as keys of `compact`; on the
// general path as entries reached through `ids`, behind a trash entry at index -1 that positions out
// of the mask update (counting has no branch on the mask). `position` then holds, for every block of
// kWord positions that counting read (one with a position in the mask) and every position of a row's
// tail, the slot of each position: 1 + its entry, 0 out of the mask. Maps and entries are all zero
// between groups.
struct Workspace {
  IdMap ids;
  Buffer<uint64_t> compact;      // the compact path's map, token id -> entry, then score (see count_compact)
  Buffer<uint32_t> tokens;       // the group's ids (and one written ahead)
  int64_t n_ids = 0;             // listed in `tokens`
  Buffer<Entry> entry_buffer;    // [0]: the trash entry, [1 + j]: entry j
  Buffer<StampedEntry> stamped;  // the same while counting a group of more than kPackedRollouts rollouts
  Buffer<uint32_t> position;
  Scoring scoring;

  Entry* entries() const { return entry_buffer.data.get() + 1; }

  uint64_t* compact_map() { return compact.ensure_zeroed(kDenseIds); }

  // Room for a group of `positions` positions on the general path: at most that many entries (plus the
  // trash entry), ids (plus one written ahead) and position slots.
  void begin_group(int64_t positions) {
    entry_buffer.ensure_zeroed(positions + 1);
    tokens.ensure(positions + 1);
    position.ensure(positions + 1);
    n_ids = 0;
  }

  // Empty the compact map for the next group.
  void reset_compact() {
    uint64_t* const map = compact.data.get();
    const uint32_t* const t = tokens.data.get();
    for (int64_t j = 0, n = n_ids; j < n; ++j) map[t[j]] = 0;
    n_ids = 0;
  }

  // Empty the id map and zero the entries (the trash entry included) for the next group.
  void reset() {
    ids.clear(tokens.data.get(), n_ids);
    std::memset(static_cast<void*>(entry_buffer.data.get()), 0, size_t(n_ids + 1) * sizeof(Entry));
    n_ids = 0;
  }
};

// Workspaces are reused across calls (their maps are large and all-zero when idle): a kernel thread
// takes one from the pool for the whole call and gives it back. Concurrent calls get distinct ones.
class Pool {
 public:
  std::unique_ptr<Workspace> take() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        std::unique_ptr<Workspace> ws = std::move(idle_.back());
        idle_.pop_back();
        return ws;
      }
    }
    return std::make_unique<Workspace>();
  }
  void give(std::unique_ptr<Workspace> ws) {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(std::move(ws));
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<Workspace>> idle_;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: threads may outlive static destruction
  return *p;
}

struct GroupTotals {
  int64_t n_c = 0, n_w = 0;  // correct / wrong rollouts
  int64_t T_c = 0, T_w = 0;  // masked tokens of correct / wrong rollouts
  bool bad_id = false;       // a masked id outside [0, 2**31)
};

inline uint64_t lo(uint64_t v) { return v & 0xffffffffu; }
inline uint64_t hi(uint64_t v) { return v >> 32; }

// Rollout bits -> a | b << 32. The portable build has no POPCNT instruction; on x86-64 a second
// clone uses it where the processor has it (chosen once, at load time).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
__attribute__((target_clones("popcnt", "default")))
#endif
void bits_to_counts(Entry* entries, int64_t n, uint64_t correct_bits) {
  for (int64_t j = 0; j < n; ++j)
    entries[j].pres = uint64_t(__builtin_popcountll(entries[j].pres & correct_bits)) |
                      (uint64_t(__builtin_popcountll(entries[j].pres & ~correct_bits)) << 32);
}

// Mask bytes are 0 or 1 (bool): eight of them read as one word tell an all-out or all-in block.
constexpr int64_t kWord = 8;
constexpr uint64_t kAllIn = 0x0101010101010101ull;

inline uint64_t mask_word(const uint8_t* m) {
  uint64_t w;
  std::memcpy(&w, m, sizeof w);
  return w;
}

// Positions ahead of the current block whose dense-map slots are prefetched: a group's distinct ids first
// touch scattered cache lines of the 1 MB map, and overlapping those misses is much of the counting
// time. Runs of ids past the dense map are not prefetched: their hash table (8 bytes a slot, load at
// most 1/4: about 128 KB for a group's few thousand ids) stays in L2, and hashing each id twice cost
// more than it saved.
constexpr int64_t kPrefetch = 64;

// One rollout's part of the presence update (see count_group_as).
struct Rollout {
  int64_t k;            // its index in `order`
  uint64_t bit;         // kBits: its presence bit
  uint64_t inc;         // 1 (correct) or 1 << 32 (wrong): f_c | f_w << 32, and a | b << 32 for kWide
  uint64_t stamp;       // kPacked: its position in the group + 1
  uint64_t packed_inc;  // kPacked: a (1 << 32) or b (1 << 48)
};

template <Presence kMode, typename Counted>
inline void update(Counted& e, const Rollout& r) {
  if constexpr (kMode == Presence::kBits) {
    e.pres |= r.bit;
  } else if constexpr (kMode == Presence::kWide) {
    e.pres += (e.last != r.k + 1) ? r.inc : 0;
    e.last = r.k + 1;
  } else {
    const uint64_t w = e.pres;
    e.pres = ((w & ~uint64_t(0xffffffff)) + (lo(w) != r.stamp ? r.packed_inc : 0)) | r.stamp;
  }
  e.occ += r.inc;
}

// cond != 0 ? yes : no, as a conditional move: compilers make a branch of the plain ternary here, and
// the first occurrences of ids (about one token in five) would mispredict it.
template <typename T>
inline T pick(uint32_t cond, T yes, T no) {
#if defined(__GNUC__) && defined(__x86_64__)
  __asm__("test %[c], %[c]\n\tcmovnz %[y], %[n]" : [n] "+r"(no) : [y] "r"(yes), [c] "r"(cond) : "cc");
  return no;
#else
  const T m = T(0) - T(cond != 0);
  return (yes & m) | (no & ~m);
#endif
}

// The OR of a block's ids (as uint64), in vector registers where there are some: the counting loop then
// reads each id again from L1 instead of holding eight in general registers.
inline uint64_t block_or(const int64_t* ids) {
#ifdef __SSE2__
  const __m128i* v = reinterpret_cast<const __m128i*>(ids);
  const __m128i any = _mm_or_si128(_mm_or_si128(_mm_loadu_si128(v), _mm_loadu_si128(v + 1)),
                                   _mm_or_si128(_mm_loadu_si128(v + 2), _mm_loadu_si128(v + 3)));
  return uint64_t(_mm_cvtsi128_si64(any)) | uint64_t(_mm_cvtsi128_si64(_mm_unpackhi_epi64(any, any)));
#else
  uint64_t any = 0;
  for (int64_t j = 0; j < kWord; ++j) any |= static_cast<uint64_t>(ids[j]);
  return any;
#endif
}

// A group's counting state. Each loop below works on a local copy, so that the compiler keeps it in
// registers (stores through the uint32 arrays could otherwise alias its fields), and copies it back.
//
// A token's id reaches its slot (1 + its entry; 0: new) in the dense map or the hash table. A new id gets
// entry n + 1 (all zero: entries are zero between groups), by a conditional move, not a branch: the
// slot is written back every time (the same value for a known id, at an address known from the id
// alone), and the id is written ahead into tokens[n] every time and kept only when new.
template <Presence kMode, typename Counted>
struct Cursor {
  Counted* entries;  // the group's entries, entries[-1]: the trash entry (positions out of the mask)
  uint32_t* tokens;  // the id of each entry
  uint32_t* pos;     // the next position slot to record (see Workspace::position)
  uint32_t* dense;   // the dense map
  SparseMap* sparse;
  SparseMap::View table;
  uint32_t n;        // entries so far
  uint32_t n_dense;  // of which in the dense map (the others are in the hash table)
  int64_t counted;   // masked, in-range tokens of the current rollout
  uint32_t bad;      // a masked id out of range was met
  Rollout r;

  // An id below kDenseIds, in the mask.
  void dense_id(uint32_t id) {
    const uint32_t found = dense[id];
    tokens[n] = id;
    const uint32_t here = pick(found, found, n + 1);
    dense[id] = here;
    n += found == 0;
    *pos++ = here;
    update<kMode>(entries[int64_t(here) - 1], r);
  }

  // An id in [kDenseIds, 2**31), in the mask; the table has room for it (see make_room).
  void sparse_id(uint32_t id) {
    const uint32_t key = id + 1;
    uint64_t h = table.home(key);
    SparseMap::Slot at = table.slots[h];
    if (__builtin_expect(SparseMap::other_key(at.key, key), 0)) {
      h = SparseMap::probe_index(table.slots, table.mask, key, h);
      at = table.slots[h];
    }
    const uint32_t found = at.value;  // 0 in an empty slot
    tokens[n] = id;
    const uint32_t here = pick(found, found, n + 1);
    table.slots[h] = SparseMap::Slot{key, here};
    n += found == 0;
    *pos++ = here;
    update<kMode>(entries[int64_t(here) - 1], r);
  }

  // Any id, in the mask or not: out of the mask (or out of range, flagged when in the mask) it is
  // counted as id 0 on the trash entry, position slot 0, with no branch on the mask.
  void any_id(int64_t id, uint32_t in_mask) {
    const uint32_t valid = static_cast<uint64_t>(id) <= static_cast<uint64_t>(kMaxTokenId);
    bad |= in_mask & (valid ^ 1);
    const uint32_t keep = in_mask & valid;
    const int64_t counted_id = id & -int64_t(keep);
    counted += keep;
    if (counted_id >= kDenseIds) {
      sparse_id(uint32_t(counted_id));
      return;
    }
    const uint32_t found = dense[counted_id];
    tokens[n] = uint32_t(counted_id);
    const uint32_t fresh = keep & uint32_t(found == 0);
    const uint32_t here = pick(found, found, n + 1) & (0u - keep);
    dense[counted_id] = here | found;  // out of the mask: found, unchanged
    n += fresh;
    n_dense += fresh;
    *pos++ = here;
    update<kMode>(entries[int64_t(here) - 1], r);
  }

  // Keep the hash table's load under 1/4 with `more` new ids to come.
  void make_room(uint64_t more) {
    if (__builtin_expect(sparse->full(n - n_dense, more), 0)) {
      sparse->grow(tokens, n, uint32_t(kDenseIds));
      table = sparse->view();
    }
  }

  // Prefetch the map slots of the block of ids at `ahead`.
  void prefetch(const int64_t* ahead) const {
    if (block_or(ahead) < static_cast<uint64_t>(kDenseIds)) {
      for (int64_t j = 0; j < kWord; ++j) __builtin_prefetch(dense + ahead[j], 1);
    } else {
      for (int64_t j = 0; j < kWord; ++j) __builtin_prefetch(table.slots + table.home(uint32_t(ahead[j]) + 1), 1);
    }
  }
};

// The runs of blocks of one row from position t (the first block qualifies); each returns where its
// run ends. dense_run: blocks all in the mask with every id below kDenseIds (one test of their OR);
// sparse_run: all in the mask with every id in [0, 2**31); mixed_run: blocks partly in the mask.
template <Presence kMode, typename Counted>
int64_t dense_run(const int64_t* ids, const uint8_t* m, int64_t t, int64_t L, Cursor<kMode, Counted>& cursor) {
  Cursor<kMode, Counted> c = cursor;
  const int64_t start = t;
  const uint32_t n_start = c.n;
  for (; t + kWord <= L; t += kWord) {
    const int64_t* const block = ids + t;
    if (mask_word(m + t) != kAllIn || block_or(block) >= static_cast<uint64_t>(kDenseIds)) break;
    if (t + kPrefetch + kWord <= L)
      for (int64_t j = 0; j < kWord; ++j)
        __builtin_prefetch(c.dense + (static_cast<uint64_t>(block[kPrefetch + j]) & (kDenseIds - 1)), 1);
    for (int64_t j = 0; j < kWord; ++j) c.dense_id(uint32_t(block[j]));
  }
  c.n_dense += c.n - n_start;  // every new entry of the run is a dense one
  c.counted += t - start;
  cursor = c;
  return t;
}

template <Presence kMode, typename Counted>
int64_t sparse_run(const int64_t* ids, const uint8_t* m, int64_t t, int64_t L, Cursor<kMode, Counted>& cursor) {
  Cursor<kMode, Counted> c = cursor;
  const int64_t start = t;
  for (; t + kWord <= L; t += kWord) {
    const int64_t* const block = ids + t;
    if (mask_word(m + t) != kAllIn || block_or(block) > static_cast<uint64_t>(kMaxTokenId)) break;
    c.make_room(kWord);
#pragma GCC unroll 8
    for (int64_t j = 0; j < kWord; ++j) {
      const uint32_t id = uint32_t(block[j]);
      if (__builtin_expect(id >= kDenseIds, 1)) {
        c.sparse_id(id);
      } else {
        const uint32_t before = c.n;
        c.dense_id(id);
        c.n_dense += c.n - before;
      }
    }
  }
  c.counted += t - start;
  cursor = c;
  return t;
}

template <Presence kMode, typename Counted>
int64_t mixed_run(const int64_t* ids, const uint8_t* m, int64_t t, int64_t L, Cursor<kMode, Counted>& cursor) {
  Cursor<kMode, Counted> c = cursor;
  for (; t + kWord <= L; t += kWord) {
    const uint64_t w = mask_word(m + t);
    if (w == 0 || w == kAllIn) break;
    c.make_room(kWord);
    if (t + kPrefetch + kWord <= L) c.prefetch(ids + t + kPrefetch);
    for (int64_t j = 0; j < kWord; ++j) c.any_id(ids[t + j], m[t + j] != 0);
  }
  cursor = c;
  return t;
}

// Positions one by one: a block all in the mask with an id out of range, a row's tail.
template <Presence kMode, typename Counted>
void count_positions(const int64_t* ids, const uint8_t* m, int64_t count, Cursor<kMode, Counted>& cursor) {
  Cursor<kMode, Counted> c = cursor;
  c.make_room(uint64_t(count));
  for (int64_t j = 0; j < count; ++j) c.any_id(ids[j], m[j] != 0);
  cursor = c;
}

// Count one group's masked tokens into `ws`. Presence: kBits, one bit per rollout (<= 64 rollouts);
// kPacked, `pres` = last-seen rollout + 1 (low 32 bits) | a << 32 | b << 48, growing a or b when an id
// shows up in a rollout other than the last one it was seen in; kWide, the same with the stamp in a
// third word (24-byte entries). A row is read in blocks of kWord positions: a block out of the mask is
// skipped (a response's padding); the others go through the runs above, a row's tail through
// count_positions. Every block read records kWord position slots, which write_group reads back in step.
template <Presence kMode>
GroupTotals count_group_as(const Batch& in, int64_t g, Workspace& ws) {
  constexpr bool kBits = kMode == Presence::kBits, kWide = kMode == Presence::kWide;
  using Counted = std::conditional_t<kWide, StampedEntry, Entry>;
  GroupTotals tot;
  const int64_t first = in.start[g], last = in.start[g + 1], L = in.L;
  const int64_t positions = (last - first) * L;
  ws.begin_group(positions);
  Counted* entries;
  if constexpr (kWide)
    entries = ws.stamped.ensure_zeroed(positions + 1) + 1;
  else
    entries = ws.entries();
  Cursor<kMode, Counted> c{entries, ws.tokens.data.get(), ws.position.data.get(), ws.ids.dense.data(), &ws.ids.sparse,
                           ws.ids.sparse.view(), 0, 0, 0, 0, Rollout{}};
  uint64_t correct_bits = 0;
  for (int64_t k = first; k < last; ++k) {
    const int64_t i = in.order[k], local = k - first;
    const int64_t* const ids = in.ids + i * in.ids_stride;
    const uint8_t* const m = in.mask + i * in.mask_stride;
    const bool is_c = in.correct[i] != 0;
    c.r = Rollout{k, kBits ? uint64_t(1) << local : 0, is_c ? uint64_t(1) : (uint64_t(1) << 32), uint64_t(local + 1),
                  is_c ? uint64_t(1) << 32 : uint64_t(1) << 48};
    if (kBits && is_c) correct_bits |= c.r.bit;
    c.counted = 0;
    int64_t t = 0;
    while (t + kWord <= L) {
      const uint64_t w = mask_word(m + t);
      if (w == 0) {
        t += kWord;
      } else if (w != kAllIn) {
        t = mixed_run(ids, m, t, L, c);
      } else {
        const uint64_t any = block_or(ids + t);
        if (any < static_cast<uint64_t>(kDenseIds)) {
          t = dense_run(ids, m, t, L, c);
        } else if (any <= static_cast<uint64_t>(kMaxTokenId)) {
          t = sparse_run(ids, m, t, L, c);
        } else {
          count_positions(ids + t, m + t, kWord, c);
          t += kWord;
        }
      }
    }
    count_positions(ids + t, m + t, L - t, c);
    (is_c ? tot.T_c : tot.T_w) += c.counted;
    (is_c ? tot.n_c : tot.n_w) += 1;
  }
  const int64_t n = c.n;
  ws.n_ids = n;
  tot.bad_id = c.bad != 0;
  Entry* out = ws.entries();
  if constexpr (kBits) {
    bits_to_counts(out, n, correct_bits);
  } else if constexpr (kWide) {
    for (int64_t j = 0; j < n; ++j) out[j] = Entry{entries[j].pres, entries[j].occ};
    std::memset(static_cast<void*>(entries - 1), 0, size_t(n + 1) * sizeof(Counted));  // zero for the next group
  } else {
    for (int64_t j = 0; j < n; ++j) out[j].pres = ((out[j].pres >> 32) & 0xffff) | (out[j].pres >> 48) << 32;
  }
  return tot;
}

GroupTotals count_group(const Batch& in, int64_t g, Workspace& ws) {
  const int64_t size = in.start[g + 1] - in.start[g];
  if (size <= kBitsRollouts) return count_group_as<Presence::kBits>(in, g, ws);
  if (size <= kPackedRollouts) return count_group_as<Presence::kPacked>(in, g, ws);
  return count_group_as<Presence::kWide>(in, g, ws);
}

// BM25 saturated frequencies of one side (correct or wrong rollouts) of a group, as method.bm25_tf with
// K = method.bm25_norm: the same operations on the same operands, so the same doubles. K is computed once
// per group, and the frequency of each small count the first time a row needs it (a score's divisions
// are most of what a memo miss costs, besides its tanh; computing all of them up front cost a batch of
// many small groups more than it saved).
class Bm25Side {
 public:
  static constexpr uint64_t kCached = 64;

  Bm25Side(int64_t T, double avg, const Method& m)
      : T_(double(std::max<int64_t>(T, 1))),
        K_(m.k1 * ((1.0 - m.b) + (m.b * double(T)) / std::max(avg, 1e-300))),
        k1_plus_1_(m.k1 + 1.0) {
    cached_[0] = 0.0;
    std::fill(cached_ + 1, cached_ + kCached, kNotYet);
  }

  double operator()(uint64_t f) {
    if (f >= kCached) return compute(f);
    if (cached_[f] == kNotYet) cached_[f] = compute(f);
    return cached_[f];
  }

 private:
  double compute(uint64_t f) const {
    const double q = double(f) / T_;
    return (q * k1_plus_1_) / (q + K_);
  }

  static constexpr double kNotYet = -1.0;  // a frequency is >= 0

  double T_, K_, k1_plus_1_;
  double cached_[kCached];
};

// A group's BM25 frequencies, correct and wrong side.
struct Bm25 {
  Bm25Side c, w;
};

// strength (alpha F + beta IG) and Cohen's h of one table.
struct Strength {
  double strength, h;
};

// The score of one (group, token) row, as method.score_rows.
inline double score_of(Strength s, uint64_t f_c, uint64_t f_w, Bm25& tf, const Method& m) {
  double x = s.h;
  if (m.use_tf) {
    const double tf_c = tf.c(f_c), tf_w = tf.w(f_w);
    x = x + (tf_c / (tf_w + kTfEps) - tf_w / (tf_c + kTfEps));
  }
  const double key = (s.strength * x) / (m.alpha + m.beta);
  return std::min(m.bound, std::max(-m.bound, m.top * std::tanh(key / 2.0))) + 0.0;  // + 0.0: no -0.0 scores
}

// The statistics of grid entry `entry` from a grid that lists its entries: found by binary search. An
// entry not listed (only a caller's bug: method.distinct_tables lists every row's table) reads nothing
// past the arrays: it flags the workspace, so that advantage raises, and gives strength and h 0.
inline Strength listed_strength(const Grid& grid, int64_t entry, Workspace& ws) {
  const int64_t* const end = grid.entries + grid.n_entries;
  const int64_t* const at = std::lower_bound(grid.entries, end, entry);
  if (at == end || *at != entry) {
    ws.scoring.unlisted = true;
    return {0.0, 0.0};
  }
  const int64_t k = at - grid.entries;
  return {grid.strength[k], grid.h[k]};
}

// The statistics of table (a, b) of group g with totals `tot`: from the grid, or from the caches.
inline Strength strength_of(int64_t g, int64_t a, int64_t b, const GroupTotals& tot, const Params& p,
                            Workspace& ws) {
  const Grid& grid = p.grid;
  if (grid.offset != nullptr) {
    const int64_t entry = grid.offset[g] + a * grid.stride[g] + b;
    if (grid.entries != nullptr) return listed_strength(grid, entry, ws);
    return {grid.strength[entry], grid.h[entry]};
  }
  const TableStats s = ws.scoring.stats.get(Table{a, b, tot.n_c, tot.n_w});
  return {p.method.alpha * s.F + p.method.beta * s.IG, s.h};
}

// The zero rule of method.informative_rows: a row is scored only where its table is informative (a
// mixed group, a token missing from some rollout). (Ignored ids are zeroed by score_group.)
inline bool informative(int64_t a, int64_t b, const GroupTotals& tot) {
  return tot.n_c > 0 && tot.n_w > 0 && a + b < tot.n_c + tot.n_w;
}

// A row's score depends only on (a, b, f_c, f_w) within a group, and a group's rows share few of them
// (most ids are rare): scores are memoised per group in a direct-mapped table of about one slot per
// kMemoEntries rows (a collision only recomputes). Rows with a count past 16 bits are not memoised.
constexpr uint64_t kNoKey = ~uint64_t(0);
constexpr int64_t kMemoEntries = 4;
constexpr int kMemoMinBits = 8, kMemoMaxBits = 13;

inline int memo_bits(int64_t n_rows) {
  int bits = kMemoMinBits;
  while (bits < kMemoMaxBits && (int64_t(1) << bits) * kMemoEntries < n_rows) ++bits;
  return bits;
}

// weight * score of group g's rows, as method.score_rows, memoised (see above).
class GroupScorer {
 public:
  GroupScorer(int64_t g, const GroupTotals& tot, const Params& p, Workspace& ws, int64_t n_rows)
      : g_(g), tot_(tot), p_(p), ws_(ws), tf_{side(tot.T_c), side(tot.T_w)}, bits_(memo_bits(n_rows)),
        memo_(ws.scoring.memo.ensure(int64_t(1) << bits_)) {
    std::fill(memo_, memo_ + (int64_t(1) << bits_), MemoSlot{kNoKey, 0.0});
  }

  double operator()(uint64_t a, uint64_t b, uint64_t f_c, uint64_t f_w) {
    if ((a | b) >= 0x10000 || f_c >= 0xffff || f_w >= 0xffff) return compute(a, b, f_c, f_w);
    const uint64_t key = a | b << 16 | f_c << 32 | f_w << 48;
    MemoSlot& slot = memo_[(key * 0x9e3779b97f4a7c15ull) >> (64 - bits_)];
    if (slot.key != key) slot = MemoSlot{key, compute(a, b, f_c, f_w)};
    return slot.score;
  }

 private:
  Bm25Side side(int64_t T) const { return Bm25Side(T, double(tot_.T_c + tot_.T_w) / 2.0, p_.method); }

  double compute(uint64_t a, uint64_t b, uint64_t f_c, uint64_t f_w) {
    const int64_t ia = int64_t(a), ib = int64_t(b);
    const double score =
        informative(ia, ib, tot_) ? score_of(strength_of(g_, ia, ib, tot_, p_, ws_), f_c, f_w, tf_, p_.method) : 0.0;
    return score * p_.method.weight;
  }

  int64_t g_;
  const GroupTotals& tot_;
  const Params& p_;
  Workspace& ws_;
  Bm25 tf_;
  int bits_;
  MemoSlot* memo_;
};

// weight * score of every distinct id of group g, into ws.scoring.by_slot, as method.score_rows.
void score_group(int64_t g, const GroupTotals& tot, const Params& p, Workspace& ws) {
  const int64_t n = ws.n_ids;
  GroupScorer score(g, tot, p, ws, n);
  ws.scoring.by_slot.resize(size_t(n) + 1);
  double* const scores = ws.scoring.by_slot.data();
  scores[0] = 0.0;
  const Entry* const entries = ws.entries();
  for (int64_t j = 0; j < n; ++j) {
    const Entry e = entries[j];
    scores[j + 1] = score(lo(e.pres), hi(e.pres), lo(e.occ), hi(e.occ));
  }
  // method.ignored_rows: an ignored id scores 0 (looked up once per ignored id, not per row)
  for (int64_t k = 0; k < p.n_ignore; ++k) {
    const uint32_t s = ws.ids.value(p.ignore[k]);
    if (s != 0) scores[s] = 0.0 * p.method.weight;
  }
}

// float32(score + base) where keep is 1, +0.0f where it is 0, without a branch (a masked-out position
// reads a score that is then cleared: slot 0, the zero sentinel, or the compact map's entry of id 0).
inline float masked_value(double score, double base, uint32_t keep) {
  const float value = static_cast<float>(score + base);
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits &= 0u - keep;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// out[i, t] = float32(weight * score + base[i]) under the mask, 0 elsewhere, for group g's rollouts,
// from the slots counting recorded (no second read of the ids), block by block as counting read them:
// a block out of the mask is zeroed at once, one all in is written without a test, a mixed one
// without a branch.
void write_group(const Batch& in, int64_t g, const Params& p, Workspace& ws, float* out) {
  const double* const scores = ws.scoring.by_slot.data();
  const uint32_t* pos = ws.position.data.get();
  const int64_t L = in.L;
  const uint8_t* const all_masks = in.mask;
  const int64_t mask_stride = in.mask_stride;
  for (int64_t k = in.start[g]; k < in.start[g + 1]; ++k) {
    const int64_t i = in.order[k];
    const uint8_t* const m = all_masks + i * mask_stride;
    const double base = p.base[i];
    float* const o = out + i * L;
    int64_t t = 0;
    for (; t + kWord <= L; t += kWord) {
      const uint64_t w = mask_word(m + t);
      if (w == 0) {
        std::memset(o + t, 0, kWord * sizeof(float));
        continue;
      }
      if (w == kAllIn) {
        for (int64_t j = 0; j < kWord; ++j) o[t + j] = static_cast<float>(scores[pos[j]] + base);
      } else {
        for (int64_t j = 0; j < kWord; ++j) o[t + j] = masked_value(scores[pos[j]], base, m[t + j] != 0);
      }
      pos += kWord;
    }
    for (; t < L; ++t) o[t] = masked_value(scores[*pos++], base, m[t] != 0);
  }
}

// The compact path: a group of at most kCompactRollouts rollouts whose counts fit beside its presence
// bits in 64 bits, all of whose masked ids are below kDenseIds (the usual GRPO batch), counts straight
// into a map from token id to an 8-byte entry, presence bits | f_c << G | f_w << (G + width): a token
// costs a load and two stores (its entry, and its id written ahead into the first-seen list) instead
// of the general path's five (map slot, id, position slot and a 16-byte entry). Scoring then
// overwrites each entry with its id's weighted score (a double's bits), and the write reads the ids
// again to gather them. A masked id at or past kDenseIds (or out of range) sends the group back to the
// general path, which counts it from the start.
constexpr int64_t kCompactRollouts = 32;

// Where an entry's fields lie for a group of G rollouts: presence bits [0, G), f_c [G, G + width),
// f_w [G + width, 64).
struct CompactLayout {
  int shift_c, shift_w;
  uint64_t count_mask;

  // The layout of a group of G rollouts of L positions, if its counts (at most G * L) fit.
  static std::optional<CompactLayout> of(int64_t G, int64_t L) {
    if (G > kCompactRollouts) return std::nullopt;
    const int width = int(64 - G) / 2;
    if (G * L >= (int64_t(1) << width)) return std::nullopt;
    return CompactLayout{int(G), int(G) + width, (uint64_t(1) << width) - 1};
  }
};

inline double as_double(uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

inline uint64_t bits_of(double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, sizeof bits);
  return bits;
}

// A group's counting state on the compact path (a local copy in each loop, kept in registers).
struct CompactCursor {
  uint64_t* map;     // token id -> entry (Workspace::compact)
  uint32_t* tokens;  // the group's ids in first-seen order (and one written ahead)
  uint32_t n;        // ids so far
  int64_t counted;   // masked tokens of the current rollout
  uint64_t bit;      // the current rollout's presence bit
  uint64_t inc;      // 1 << shift_c (correct rollout) or 1 << shift_w (wrong)

  // An id below kDenseIds, in the mask.
  void dense_id(uint32_t id) {
    const uint64_t e = map[id];
    tokens[n] = id;
    n += e == 0;
    map[id] = (e | bit) + inc;
  }

  // Any id, in the mask (keep = 1) or not, counted as id 0 with no presence or occurrence when out of
  // it. False, with nothing counted, for a masked id the compact path does not take.
  bool any_id(int64_t id, uint32_t keep) {
    const uint64_t on = 0 - uint64_t(keep);
    const uint64_t counted_id = static_cast<uint64_t>(id) & on;
    if (counted_id >= static_cast<uint64_t>(kDenseIds)) return false;
    const uint64_t e = map[counted_id];
    tokens[n] = uint32_t(counted_id);
    n += keep & uint32_t(e == 0);
    map[counted_id] = (e | (bit & on)) + (inc & on);
    counted += keep;
    return true;
  }
};

// Count group g on the compact path into ws.compact (ids in ws.tokens, their number in ws.n_ids);
// false, with the map cleared, when a masked id is at or past kDenseIds or out of range.
bool count_compact(const Batch& in, int64_t g, const CompactLayout& layout, Workspace& ws, GroupTotals& tot,
                   uint64_t& correct_bits) {
  const int64_t first = in.start[g], last = in.start[g + 1], L = in.L;
  CompactCursor c{ws.compact_map(), ws.tokens.ensure((last - first) * L + 1), 0, 0, 0, 0};
  correct_bits = 0;
  bool ok = true;
  for (int64_t k = first; ok && k < last; ++k) {
    const int64_t i = in.order[k];
    const int64_t* const ids = in.ids + i * in.ids_stride;
    const uint8_t* const m = in.mask + i * in.mask_stride;
    const bool is_c = in.correct[i] != 0;
    c.bit = uint64_t(1) << (k - first);
    c.inc = uint64_t(1) << (is_c ? layout.shift_c : layout.shift_w);
    if (is_c) correct_bits |= c.bit;
    c.counted = 0;
    int64_t t = 0;
    for (; ok && t + kWord <= L; t += kWord) {
      const uint64_t w = mask_word(m + t);
      if (w == 0) continue;
      const int64_t* const block = ids + t;
      if (w == kAllIn && block_or(block) < static_cast<uint64_t>(kDenseIds)) {
        if (t + kPrefetch + kWord <= L)
          for (int64_t j = 0; j < kWord; ++j)
            __builtin_prefetch(c.map + (static_cast<uint64_t>(block[kPrefetch + j]) & (kDenseIds - 1)), 1);
        for (int64_t j = 0; j < kWord; ++j) c.dense_id(uint32_t(block[j]));
        c.counted += kWord;
      } else {
        for (int64_t j = 0; ok && j < kWord; ++j) ok = c.any_id(block[j], m[t + j] != 0);
      }
    }
    for (; ok && t < L; ++t) ok = c.any_id(ids[t], m[t] != 0);
    (is_c ? tot.T_c : tot.T_w) += c.counted;
    (is_c ? tot.n_c : tot.n_w) += 1;
  }
  ws.n_ids = c.n;
  if (!ok) ws.reset_compact();
  return ok;
}

// Entries ahead of the current one whose map slots scoring prefetches (the first-seen order scatters them).
constexpr int64_t kScorePrefetch = 16;

// Each counted id's entry in ws.compact becomes its weighted score (as method.score_rows; an ignored id
// scores 0). Cloned like bits_to_counts, for its popcounts.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
__attribute__((target_clones("popcnt", "default")))
#endif
void score_compact(int64_t g, const GroupTotals& tot, const CompactLayout& layout, uint64_t correct_bits,
                   const Params& p, Workspace& ws) {
  uint64_t* const map = ws.compact.data.get();
  const uint32_t* const tokens = ws.tokens.data.get();
  const int64_t n = ws.n_ids;
  const uint64_t presence = (uint64_t(1) << layout.shift_c) - 1;
  // method.ignored_rows: a counted ignored id loses its presence bits, which no counted id lacks
  for (int64_t k = 0; k < p.n_ignore; ++k) {
    const int64_t id = p.ignore[k];
    if (id >= 0 && id < kDenseIds) map[id] &= ~presence;
  }
  GroupScorer score(g, tot, p, ws, n);
  for (int64_t j = 0; j < n; ++j) {
    __builtin_prefetch(map + tokens[std::min(j + kScorePrefetch, n - 1)], 1);
    const uint64_t e = map[tokens[j]];
    const uint64_t pres = e & presence;
    const double s = pres == 0 ? 0.0 * p.method.weight
                               : score(uint64_t(__builtin_popcountll(pres & correct_bits)),
                                       uint64_t(__builtin_popcountll(pres & ~correct_bits)),
                                       (e >> layout.shift_c) & layout.count_mask, e >> layout.shift_w);
    map[tokens[j]] = bits_of(s);
  }
}

// out[i, t] for group g's rollouts as write_group writes them, gathering each position's score from
// ws.compact by its id.
void write_compact(const Batch& in, int64_t g, const Params& p, const Workspace& ws, float* out) {
  const uint64_t* const map = ws.compact.data.get();
  const int64_t L = in.L;
  for (int64_t k = in.start[g]; k < in.start[g + 1]; ++k) {
    const int64_t i = in.order[k];
    const int64_t* const ids = in.ids + i * in.ids_stride;
    const uint8_t* const m = in.mask + i * in.mask_stride;
    const double base = p.base[i];
    float* const o = out + i * L;
    auto masked = [&](int64_t t) {
      const uint32_t keep = m[t] != 0;
      return masked_value(as_double(map[static_cast<uint64_t>(ids[t]) & (0 - uint64_t(keep))]), base, keep);
    };
    int64_t t = 0;
    for (; t + kWord <= L; t += kWord) {
      const uint64_t w = mask_word(m + t);
      if (w == 0) {
        std::memset(o + t, 0, kWord * sizeof(float));
      } else if (w == kAllIn) {
        for (int64_t j = 0; j < kWord; ++j) o[t + j] = static_cast<float>(as_double(map[ids[t + j]]) + base);
      } else {
        for (int64_t j = 0; j < kWord; ++j) o[t + j] = masked(t + j);
      }
    }
    for (; t < L; ++t) o[t] = masked(t);
  }
}

// Group g through the compact path: counted, scored and written; false (nothing written, the
// workspace clean) when the group does not take it.
bool advantage_compact(const Batch& in, int64_t g, const Params& p, Workspace& ws, float* out) {
  const std::optional<CompactLayout> layout = CompactLayout::of(in.start[g + 1] - in.start[g], in.L);
  if (!layout) return false;
  GroupTotals tot;
  uint64_t correct_bits;
  if (!count_compact(in, g, *layout, ws, tot, correct_bits)) return false;
  score_compact(g, tot, *layout, correct_bits, p, ws);
  write_compact(in, g, p, ws, out);
  ws.reset_compact();
  return true;
}

// Rows of group g sorted by token id: token, a, b, f_c, f_w written from `row` into cols[5][capacity].
int64_t emit_rows(Workspace& ws, int64_t row, int64_t* cols, int64_t capacity) {
  const uint32_t* tokens = ws.tokens.data.get();
  const Entry* entries = ws.entries();
  std::vector<uint32_t> by_token(size_t(ws.n_ids));
  for (size_t j = 0; j < by_token.size(); ++j) by_token[j] = uint32_t(j);
  std::sort(by_token.begin(), by_token.end(), [&](uint32_t x, uint32_t y) { return tokens[x] < tokens[y]; });
  for (uint32_t j : by_token) {
    const Entry& e = entries[j];
    cols[row] = tokens[j];
    cols[capacity + row] = int64_t(lo(e.pres));
    cols[2 * capacity + row] = int64_t(hi(e.pres));
    cols[3 * capacity + row] = int64_t(lo(e.occ));
    cols[4 * capacity + row] = int64_t(hi(e.occ));
    ++row;
  }
  return int64_t(by_token.size());
}

// fn(g, workspace) -> whether group g held an out-of-range id, for every group, on up to `threads`
// threads (workers.h: each group on one thread, claimed in turn), each with a workspace from the pool.
// Returns whether any group did.
template <typename Fn>
bool for_each_group(int64_t n_groups, int threads, Fn fn) {
  std::atomic<bool> bad{false};
  for_each_item(
      n_groups, threads, [] { return pool().take(); },
      [&](int64_t g, std::unique_ptr<Workspace>& ws) {
        if (fn(g, *ws)) bad.store(true, std::memory_order_relaxed);
      },
      [](std::unique_ptr<Workspace>& ws) { pool().give(std::move(ws)); });
  return bad.load(std::memory_order_relaxed);
}

// The batch's arrays as Python passes them: ids, mask, order, start, correct.
using BatchArrays = std::tuple<Array, Array, Array, Array, Array>;
// A grid's arrays (see Grid): offset, stride, strength, h over every entry, or the same over the listed
// entries followed by `entries`.
using FullGridArrays = std::tuple<Array, Array, Array, Array>;
using ListedGridArrays = std::tuple<Array, Array, Array, Array, Array>;
using GridArrays = std::variant<FullGridArrays, ListedGridArrays>;

// `start` (int64 [n_groups + 1], checked) rises from 0 to B.
void check_start(const Check& check, const Array& start, int64_t B) {
  const int64_t* s = static_cast<const int64_t*>(start.data());
  const int64_t n = extent(start, 0) - 1;
  bool ok = s[0] == 0 && s[n] == B;
  for (int64_t g = 0; ok && g < n; ++g) ok = s[g + 1] >= s[g];
  if (!ok)
    throw nb::value_error((std::string(check.fn) + ": `start` must rise from 0 to B = " + std::to_string(B)).c_str());
}

// The batch's arrays, checked: ids int64 and mask bool [B, L] with unit column stride, order int64
// [B], start int64 [n_groups + 1] rising from 0 to B, correct bool [B].
Batch batch_of(const Check& check, const BatchArrays& arrays) {
  const auto& [ids, mask, order, start, correct] = arrays;
  check.matrix("ids", ids, kInt64);
  const int64_t B = extent(ids, 0), L = extent(ids, 1);
  check.matrix("mask", mask, kBool, B, L);
  check.vector("order", order, kInt64, B);
  check.vector("start", start, kInt64);
  check.vector("correct", correct, kBool, B);
  if (start.shape(0) < 1) check.fail("start", "at least one entry ([n_groups + 1])", start);
  check_start(check, start, B);
  return Batch{static_cast<const int64_t*>(ids.data()), row_stride(ids), static_cast<const uint8_t*>(mask.data()),
               row_stride(mask), B, L, extent(start, 0) - 1, static_cast<const int64_t*>(order.data()),
               static_cast<const int64_t*>(start.data()), static_cast<const uint8_t*>(correct.data())};
}

// A grid's offset, stride, strength and h, checked for n_groups groups.
Grid lookup_of(const Check& check, const Array& offset, const Array& stride, const Array& strength, const Array& h,
               int64_t n_groups) {
  check.vector("offset", offset, kInt64, n_groups);
  check.vector("stride", stride, kInt64, n_groups);
  check.vector("strength", strength, kFloat64);
  check.vector("h", h, kFloat64, extent(strength, 0));
  return Grid{static_cast<const int64_t*>(offset.data()), static_cast<const int64_t*>(stride.data()),
              static_cast<const double*>(strength.data()), static_cast<const double*>(h.data())};
}

// A grid's arrays, checked for n_groups groups: listed entries are int64 [len(strength)], strictly increasing.
Grid grid_of(const Check& check, const GridArrays& arrays, int64_t n_groups) {
  if (const auto* full = std::get_if<FullGridArrays>(&arrays)) {
    const auto& [offset, stride, strength, h] = *full;
    return lookup_of(check, offset, stride, strength, h, n_groups);
  }
  const auto& [offset, stride, strength, h, entries] = std::get<ListedGridArrays>(arrays);
  Grid grid = lookup_of(check, offset, stride, strength, h, n_groups);
  check.vector("entries", entries, kInt64, extent(strength, 0));
  grid.entries = static_cast<const int64_t*>(entries.data());
  grid.n_entries = extent(entries, 0);
  if (std::adjacent_find(grid.entries, grid.entries + grid.n_entries, std::greater_equal<int64_t>()) !=
      grid.entries + grid.n_entries)
    throw nb::value_error((std::string(check.fn) + ": `entries` must be strictly increasing").c_str());
  return grid;
}

// advantage(...) -> True when every masked id was in range (else the output is incomplete); raises
// RuntimeError when a row's table is missing from a listed grid's entries.
bool advantage(const BatchArrays& batch, const Array& base, const Array& ignore, const Array& out,
               const Method& method, const std::optional<GridArrays>& grid, int threads) {
  const Check check{"_cpu.advantage"};
  const Batch in = batch_of(check, batch);
  check.vector("base", base, kFloat64, in.B);
  check.vector("ignore", ignore, kInt64);
  check.contiguous_matrix("out", out, kFloat32, in.B, in.L);
  const Params p{method, grid ? grid_of(check, *grid, in.n_groups) : Grid{}, static_cast<const int64_t*>(ignore.data()),
                 extent(ignore, 0), static_cast<const double*>(base.data())};
  if (!grid) ensure_log_factorials();
  float* result = static_cast<float*>(out.data());
  std::atomic<bool> unlisted{false};
  bool bad;
  {
    nb::gil_scoped_release release;
    bad = for_each_group(in.n_groups, threads, [&](int64_t g, Workspace& ws) {
      bool bad_id = false;
      if (!advantage_compact(in, g, p, ws, result)) {
        const GroupTotals tot = count_group(in, g, ws);
        bad_id = tot.bad_id;
        if (!bad_id) {  // an out-of-range id was never counted: do not look it up
          score_group(g, tot, p, ws);
          write_group(in, g, p, ws, result);
        }
        ws.reset();
      }
      if (std::exchange(ws.scoring.unlisted, false)) unlisted.store(true, std::memory_order_relaxed);
      return bad_id;
    });
  }
  if (unlisted.load(std::memory_order_relaxed))
    throw std::runtime_error(std::string(check.fn) + ": a row's table is not among the grid's `entries`");
  return !bad;
}

// rows(...): group g's rows, sorted by token, go to row_offset[g] .. of cols (int64 [5, capacity]:
// token, a, b, f_c, f_w); totals (int64 [3, n_groups]: n_rows, T_c, T_w) are written.
// -> True when every masked id was in range.
bool rows(const BatchArrays& batch, const Array& row_offset, const Array& cols, const Array& totals, int threads) {
  const Check check{"_cpu.rows"};
  const Batch in = batch_of(check, batch);
  const int64_t n_groups = in.n_groups;
  check.vector("row_offset", row_offset, kInt64, n_groups);
  check.contiguous_matrix("cols", cols, kInt64, 5);
  check.contiguous_matrix("totals", totals, kInt64, 3, n_groups);
  const int64_t capacity = int64_t(cols.shape(1));
  const int64_t* offsets = static_cast<const int64_t*>(row_offset.data());
  int64_t* out = static_cast<int64_t*>(cols.data());
  int64_t* tot_out = static_cast<int64_t*>(totals.data());
  bool bad;
  {
    nb::gil_scoped_release release;
    bad = for_each_group(n_groups, threads, [&](int64_t g, Workspace& ws) {
      const GroupTotals tot = count_group(in, g, ws);
      tot_out[g] = emit_rows(ws, offsets[g], out, capacity);
      tot_out[n_groups + g] = tot.T_c;
      tot_out[2 * n_groups + g] = tot.T_w;
      ws.reset();
      return tot.bad_id;
    });
  }
  return !bad;
}

// table_statistics(tables int64 [4, T] (a, b, n_c, n_w), out float64 [4, T] (p, F, IG, h)): the
// statistics this module computes for big groups, for tests against method.table_statistics.
void table_statistics(const Array& tables, const Array& out) {
  const Check check{"_cpu.table_statistics"};
  check.contiguous_matrix("tables", tables, kInt64, 4);
  const int64_t T = int64_t(tables.shape(1));
  check.contiguous_matrix("out", out, kFloat64, 4, T);
  const int64_t* t = static_cast<const int64_t*>(tables.data());
  double* o = static_cast<double*>(out.data());
  for (int64_t j = 0; j < T; ++j) {
    const Table x{t[j], t[T + j], t[2 * T + j], t[3 * T + j]};
    if (x.a < 0 || x.b < 0 || x.a > x.n_c || x.b > x.n_w)
      throw nb::value_error("_cpu.table_statistics: `tables` must hold 0 <= a <= n_c and 0 <= b <= n_w");
  }
  for (int64_t j = 0; j < T; ++j) {
    const Table x{t[j], t[T + j], t[2 * T + j], t[3 * T + j]};
    const double p = fisher_pvalue(x);
    const TableStats s = statistics_of(x, p);
    o[j] = p;
    o[T + j] = s.F;
    o[2 * T + j] = s.IG;
    o[3 * T + j] = s.h;
  }
}

// new_output(rows, cols, threads): a float32 [rows, cols] torch tensor over a block of the output pool
// (output_pool.h); the block returns to the pool when torch frees the tensor's storage.
using Output = nb::ndarray<nb::pytorch, float, nb::ndim<2>, nb::c_contig>;

Output new_output(int64_t rows, int64_t cols, int threads) {
  if (rows <= 0 || cols <= 0)
    throw nb::value_error(("_cpu.new_output: `rows` and `cols` must be positive, got " + std::to_string(rows) +
                           " and " + std::to_string(cols)).c_str());
  OutputPool::Block* block;
  {
    nb::gil_scoped_release unlocked;
    block = output_pool().take(size_t(rows) * size_t(cols) * sizeof(float), threads);
  }
  nb::capsule owner(block, [](void* b) noexcept { output_pool().give(static_cast<OutputPool::Block*>(b)); });
  return Output(block->data, {size_t(rows), size_t(cols)}, owner);
}

}  // namespace
}  // namespace ktae

NB_MODULE(_cpu, m) {
  using namespace nb::literals;
  m.doc() = "ktae_kernels native CPU kernel (see ktae_kernels/backends/cpu.py)";
  nb::class_<ktae::Method>(m, "Method", "The method's scalars (`bound`: the largest float64 below `top`).")
      .def(nb::init<double, double, double, double, double, double, double, bool>(), nb::kw_only(), "k1"_a, "b"_a,
           "alpha"_a, "beta"_a, "top"_a, "bound"_a, "weight"_a, "use_tf"_a);
  m.def("advantage", &ktae::advantage, "batch"_a, "base"_a, "ignore"_a, "out"_a, "method"_a, nb::kw_only(),
        "grid"_a = nb::none(), "threads"_a,
        "Fused count, score and write of the float32 [B, L] advantages of `batch` (ids, mask, order, start, "
        "correct) into `out`; False when a masked id was out of range. With a `grid` (offset, stride, strength, h) "
        "the statistics are looked up there by entry; with (offset, stride, strength, h, entries) strength and h "
        "hold the sorted grid `entries` only, found by binary search (RuntimeError for a row's table not listed). "
        "Without a grid they are computed here once per distinct table and memoised.");
  m.def("rows", &ktae::rows, "batch"_a, "row_offset"_a, "cols"_a, "totals"_a, nb::kw_only(), "threads"_a,
        "Per-group (token, a, b, f_c, f_w) rows sorted by token into cols [5, capacity], and n_rows, T_c, T_w "
        "into totals [3, n_groups]; False when a masked id was out of range.");
  m.def("table_statistics", &ktae::table_statistics, "tables"_a, "out"_a,
        "(p, F, IG, h) float64 [4, T] of the tables (a, b, n_c, n_w) int64 [4, T], as the kernel computes them.");
  m.def("statistics_cache_size", &ktae::shared_cache_size, "Tables held in the shared statistics cache.");
  m.def("clear_statistics_cache", &ktae::clear_shared_cache, "Empty the shared statistics cache.");
  m.def("new_output", &ktae::new_output, "rows"_a, "cols"_a, nb::kw_only(), "threads"_a,
        "A float32 [rows, cols] tensor over a block of the output pool (mapped on `threads` threads when new); "
        "the block returns to the pool when torch frees the tensor.");
  m.def("output_pool_held", []() { return ktae::output_pool().held(); },
        "(blocks, bytes) of returned outputs the pool keeps for reuse.");
  m.def("clear_output_pool", []() { return ktae::output_pool().clear(); },
        "Free the returned outputs the pool keeps; returns the bytes freed.");
  m.def(
      "set_worker_mode",
      [](const std::string& mode) {
        using Mode = ktae::Workers::Mode;
        if (mode != "normal" && mode != "held" && mode != "together")
          throw nb::value_error(("_cpu.set_worker_mode: `mode` must be 'normal', 'held' or 'together', got '" + mode +
                                 "'").c_str());
        ktae::workers().set_mode(mode == "held" ? Mode::kHeld : mode == "together" ? Mode::kTogether : Mode::kNormal);
      },
      "mode"_a,
      "Test seam for the kernel's worker threads: 'held' (woken workers wait, as threads the operating system does not "
      "schedule: calls run on their own thread), 'together' (a call claims no group before every worker it woke has "
      "joined, from any core), 'normal' (as shipped).");
  m.def("worker_items", []() { return ktae::workers().worker_items(); },
        "Test seam: groups (and output-mapping chunks) that worker threads, not calling threads, have run.");
}
