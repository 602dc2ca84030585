// Native CPU kernel of ktae_kernels (module ktae_kernels._cpu): C++17, OpenMP, nanobind, no torch at build time.
//
// One OpenMP task per group. A thread counts its group's tokens into a compact table reached from
// the token id (a dense map for ids < kDenseIds, a seeded open-addressing hash table above), scores
// every distinct id once from its table's statistics (strength = alpha F + beta IG and Cohen's h), and
// writes the group's [G, L] advantages while its ids are still in cache. Groups are independent and
// each is computed by one thread in a fixed order, so the output is bitwise identical for any number
// of threads.
//
// The statistics come either from a grid that ktae_kernels/method.py computed (looked up at
// offset[g] + a * stride[g] + b; small groups) or from statistics.h (big groups: each distinct table
// computed here once, memoised across groups and calls).
//
// Arguments are nanobind ndarrays (DLPack: torch, numpy, ...), checked here for dtype, shape, stride
// and device; the GIL is released while the kernel runs.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __linux__
#include <sys/mman.h>
#endif

#include "arrays.h"
#include "sparse_map.h"
#include "statistics.h"

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
  int64_t last;
};

struct Batch {
  const int64_t* ids;      // [B, L] rows `ids_stride` apart, unit column stride
  int64_t ids_stride;
  const uint8_t* mask;     // [B, L] bool rows `mask_stride` apart
  int64_t mask_stride;
  int64_t L;
  const int64_t* order;    // rollouts sorted by group
  const int64_t* start;    // [n_groups + 1] group g's rollouts are order[start[g] .. start[g + 1])
  const uint8_t* correct;  // [B]
};

// Where a table's statistics come from: the precomputed grid (offset != nullptr) or statistics.h.
struct Params {
  const int64_t* offset;    // [n_groups] grid offset, or nullptr: statistics computed here
  const int64_t* stride;    // [n_groups] grid stride (n_w + 1)
  const double* strength;   // [grid] alpha F + beta IG
  const double* h;          // [grid] Cohen's h
  const int64_t* ignore;    // sorted ignored ids
  int64_t n_ignore;
  const double* base;       // [B] rollout advantage
  double k1, b, alpha, beta, top, bound, weight;
  bool use_tf;
};

// A growable array whose contents are undefined until written.
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
};

// A thread's counting table: token id -> 1 + index of the id's entry in the current group (0: not
// seen yet), in a 4-byte dense map for small ids and a seeded hash table above; the group's entries,
// token ids and weighted scores are compact arrays in first-seen order. Both maps are empty between
// groups. `stats` memoises table statistics on this thread (in front of the shared cache).
struct Workspace {
  std::vector<uint32_t> slot;
  SparseMap sparse;
  Buffer<Entry> entries;
  Buffer<StampedEntry> stamped;  // groups of more than kBitsRollouts rollouts, while counting
  Buffer<int64_t> tokens;
  Buffer<uint32_t> position;  // the slot of each masked position of the group, in order
  int64_t n_entries = 0;
  std::vector<double> scores;  // by slot: [0] a zero sentinel, [1 + j] entry j's weighted score
  std::vector<double> memo;  // score by (a, b, f_c, f_w) for small counts, NaN when not computed yet
  LocalStatistics stats;

  Workspace() : slot(kDenseIds, 0) {}

  // Room for a group of `positions` positions: at most that many entries, plus one spare that
  // counting writes ahead into.
  void begin_group(int64_t positions) {
    entries.ensure(positions + 1);
    tokens.ensure(positions + 1);
    position.ensure(positions + 1);  // + 1: write_group may read one past the last masked position
    n_entries = 0;
  }

  uint32_t& slot_of(int64_t id) { return id < kDenseIds ? slot[size_t(id)] : sparse.at(uint32_t(id)); }

  // Bring the map entry of a coming id into cache (any int64: out-of-range ids touch a valid line).
  void prefetch(int64_t id) const {
    if (static_cast<uint64_t>(id) < static_cast<uint64_t>(kDenseIds))
      __builtin_prefetch(slot.data() + id, 1);
    else
      sparse.prefetch(uint32_t(id));
  }

  void reset() {
    for (int64_t j = 0; j < n_entries; ++j)
      if (tokens.data[j] < kDenseIds) slot[size_t(tokens.data[j])] = 0;
    sparse.clear();
    n_entries = 0;
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

// Mask bytes are 0 or 1 (bool): eight of them read as one word tell an all-out or all-in stretch.
constexpr int64_t kWord = 8;
constexpr uint64_t kAllIn = 0x0101010101010101ull;

inline uint64_t mask_word(const uint8_t* m) {
  uint64_t w;
  std::memcpy(&w, m, sizeof w);
  return w;
}

// Positions ahead of the current one whose map entry is prefetched: a group's distinct ids first
// touch scattered cache lines of the maps, and overlapping those misses is most of the counting time.
// (Prefetching the counting entry too, through a second look-up, measured slower.)
constexpr int64_t kPrefetch = 64;

// Count one group's masked tokens into `ws`. Presence: kBits, one bit per rollout (<= 64 rollouts);
// kPacked, `pres` = last-seen rollout + 1 (low 32 bits) | a << 32 | b << 48, growing a or b when an id
// shows up in a rollout other than the last one it was seen in; kWide, the same in a 24-byte entry.
// A new id's entry is written ahead into the spare entry for every token and kept only when the id
// is new: no branch on the (frequent, unpredictable) first occurrences.
template <Presence kMode>
GroupTotals count_group_as(const Batch& in, int64_t g, Workspace& ws) {
  constexpr bool kBits = kMode == Presence::kBits, kWide = kMode == Presence::kWide;
  using Counted = std::conditional_t<kWide, StampedEntry, Entry>;
  GroupTotals tot;
  uint64_t correct_bits = 0;
  const int64_t positions = (in.start[g + 1] - in.start[g]) * in.L;
  ws.begin_group(positions);
  Counted* entries;
  if constexpr (kWide)
    entries = ws.stamped.ensure(positions + 1);
  else
    entries = ws.entries.data.get();
  int64_t* tokens = ws.tokens.data.get();
  uint32_t* position = ws.position.data.get();
  int64_t n_entries = 0;
  for (int64_t k = in.start[g]; k < in.start[g + 1]; ++k) {
    const int64_t i = in.order[k], local = k - in.start[g];
    const int64_t* ids = in.ids + i * in.ids_stride;
    const uint8_t* m = in.mask + i * in.mask_stride;
    const bool is_c = in.correct[i] != 0;
    const uint64_t inc = is_c ? uint64_t(1) : (uint64_t(1) << 32);
    const uint64_t bit = kBits ? uint64_t(1) << local : 0;
    const uint64_t stamp = uint64_t(local + 1), packed_inc = is_c ? uint64_t(1) << 32 : uint64_t(1) << 48;
    if (kBits && is_c) correct_bits |= bit;
    int64_t n = 0;
    for (int64_t t = 0; t < in.L; ++t) {
      if ((t & (kWord - 1)) == 0 && t + kWord <= in.L && mask_word(m + t) == 0) {
        t += kWord - 1;  // eight positions out of the mask (a response's padding)
        continue;
      }
      if (t + kPrefetch < in.L) ws.prefetch(ids[t + kPrefetch]);
      if (!m[t]) continue;
      const int64_t id = ids[t];
      if (static_cast<uint64_t>(id) > static_cast<uint64_t>(kMaxTokenId)) {
        tot.bad_id = true;
        continue;
      }
      ++n;
      uint32_t& s = ws.slot_of(id);
      const uint32_t found = s;
      if constexpr (kWide)
        entries[n_entries] = Counted{0, 0, -1};
      else
        entries[n_entries] = Counted{0, 0};
      tokens[n_entries] = id;
      const uint32_t fresh = found == 0;
      const uint32_t here = found + fresh * uint32_t(n_entries + 1);  // arithmetic, not a branch
      n_entries += fresh;
      s = here;
      *position++ = here;
      Counted& e = entries[here - 1];
      if constexpr (kBits) {
        e.pres |= bit;
      } else if constexpr (kWide) {
        e.pres += (e.last != k) ? inc : 0;
        e.last = k;
      } else {
        const uint64_t w = e.pres;
        e.pres = ((w & ~uint64_t(0xffffffff)) + (lo(w) != stamp ? packed_inc : 0)) | stamp;
      }
      e.occ += inc;
    }
    (is_c ? tot.T_c : tot.T_w) += n;
    (is_c ? tot.n_c : tot.n_w) += 1;
  }
  ws.n_entries = n_entries;
  Entry* out = ws.entries.data.get();
  if constexpr (kBits) {
    bits_to_counts(entries, n_entries, correct_bits);
  } else if constexpr (kWide) {
    for (int64_t j = 0; j < n_entries; ++j) out[j] = Entry{entries[j].pres, entries[j].occ};
  } else {
    for (int64_t j = 0; j < n_entries; ++j) out[j].pres = ((out[j].pres >> 32) & 0xffff) | (out[j].pres >> 48) << 32;
  }
  return tot;
}

GroupTotals count_group(const Batch& in, int64_t g, Workspace& ws) {
  const int64_t size = in.start[g + 1] - in.start[g];
  if (size <= kBitsRollouts) return count_group_as<Presence::kBits>(in, g, ws);
  if (size <= kPackedRollouts) return count_group_as<Presence::kPacked>(in, g, ws);
  return count_group_as<Presence::kWide>(in, g, ws);
}

// BM25 saturated frequency, as method.bm25_tf / method.bm25_norm.
inline double bm25_tf(uint64_t f, int64_t T, double avg, const Params& p) {
  if (f == 0) return 0.0;
  const double q = double(f) / double(std::max<int64_t>(T, 1));
  const double K = p.k1 * ((1.0 - p.b) + (p.b * double(T)) / std::max(avg, 1e-300));
  return (q * (p.k1 + 1.0)) / (q + K);
}

// strength (alpha F + beta IG) and Cohen's h of one table.
struct Strength {
  double strength, h;
};

// The score of one (group, token) row, as method.score_rows.
inline double score_of(Strength s, uint64_t occ, const GroupTotals& tot, double avg, const Params& p) {
  double x = s.h;
  if (p.use_tf) {
    const double tf_c = bm25_tf(lo(occ), tot.T_c, avg, p), tf_w = bm25_tf(hi(occ), tot.T_w, avg, p);
    x = x + (tf_c / (tf_w + kTfEps) - tf_w / (tf_c + kTfEps));
  }
  const double key = (s.strength * x) / (p.alpha + p.beta);
  return std::min(p.bound, std::max(-p.bound, p.top * std::tanh(key / 2.0)));
}

// The statistics of table (a, b) of group g with totals `tot`: from the grid, or from the caches.
inline Strength strength_of(int64_t g, int64_t a, int64_t b, const GroupTotals& tot, const Params& p,
                            Workspace& ws) {
  if (p.offset != nullptr) {
    const int64_t entry = p.offset[g] + a * p.stride[g] + b;
    return {p.strength[entry], p.h[entry]};
  }
  const TableStats s = ws.stats.get(Table{a, b, tot.n_c, tot.n_w});
  return {p.alpha * s.F + p.beta * s.IG, s.h};
}

// The zero rules, as method.informative_rows and method.ignored_rows: a row is scored only where its
// table is informative (a mixed group, a token missing from some rollout) and its id is not ignored.
inline bool scorable(int64_t a, int64_t b, const GroupTotals& tot, int64_t token, const Params& p) {
  const bool informative = tot.n_c > 0 && tot.n_w > 0 && a + b < tot.n_c + tot.n_w;
  return informative && !(p.n_ignore && std::binary_search(p.ignore, p.ignore + p.n_ignore, token));
}

// Most ids of a group are rare, and the score depends only on (a, b, f_c, f_w): scores of ids seen at
// most kMemoCount times per class are memoised per group (when the group's grid is small).
constexpr uint64_t kMemoCount = 4;
constexpr int64_t kMemoLimit = int64_t(1) << 16;

// weight * score of every distinct id of group g, into ws.scores, as method.score_rows.
void score_group(int64_t g, const GroupTotals& tot, const Params& p, Workspace& ws) {
  const double avg = double(tot.T_c + tot.T_w) / 2.0;
  const int64_t stride = tot.n_w + 1;
  const int64_t memo_size = (tot.n_c + 1) * stride * int64_t(kMemoCount * kMemoCount);
  const bool memo = memo_size <= kMemoLimit;
  if (memo) ws.memo.assign(size_t(memo_size), std::nan(""));
  ws.scores.resize(size_t(ws.n_entries) + 1);
  ws.scores[0] = 0.0;
  for (int64_t j = 0; j < ws.n_entries; ++j) {
    const Entry& e = ws.entries.data[j];
    const int64_t a = int64_t(lo(e.pres)), b = int64_t(hi(e.pres));
    double score;
    if (memo && lo(e.occ) < kMemoCount && hi(e.occ) < kMemoCount) {
      const int64_t table = a * stride + b;
      double& cached = ws.memo[size_t((table * int64_t(kMemoCount) + int64_t(lo(e.occ))) * int64_t(kMemoCount) + int64_t(hi(e.occ)))];
      if (std::isnan(cached)) cached = score_of(strength_of(g, a, b, tot, p, ws), e.occ, tot, avg, p);
      score = cached;
    } else {
      score = score_of(strength_of(g, a, b, tot, p, ws), e.occ, tot, avg, p);
    }
    if (!scorable(a, b, tot, ws.tokens.data[j], p)) score = 0.0;
    ws.scores[size_t(j) + 1] = score * p.weight;
  }
}

// float32(scores[slot] + base) where keep is 1, +0.0f where it is 0, without a branch (a masked-out
// position reads slot 0, the zero sentinel, and its value's bits are cleared).
inline float select_value(const double* scores, const uint32_t* slot, double base, uint32_t keep) {
  const float value = static_cast<float>(scores[*slot & (0u - keep)] + base);
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits &= 0u - keep;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// out[i, t] = float32(weight * score + base[i]) under the mask, 0 elsewhere, for group g's rollouts
// (the masked positions' slots were recorded in order while counting: no second read of the ids).
// Eight positions at a time: a stretch all out of the mask (a response's padding) is zeroed at
// once, one all in is written without a test, a mixed one without a branch per position.
void write_group(const Batch& in, int64_t g, const Params& p, Workspace& ws, float* out) {
  const double* scores = ws.scores.data();
  const uint32_t* slot = ws.position.data.get();
  const int64_t L = in.L;
  for (int64_t k = in.start[g]; k < in.start[g + 1]; ++k) {
    const int64_t i = in.order[k];
    const uint8_t* m = in.mask + i * in.mask_stride;
    const double base = p.base[i];
    float* o = out + i * L;
    int64_t t = 0;
    for (; t + kWord <= L; t += kWord) {
      const uint64_t w = mask_word(m + t);
      if (w == 0) {
        std::memset(o + t, 0, kWord * sizeof(float));
      } else if (w == kAllIn) {
        for (int64_t j = 0; j < kWord; ++j) o[t + j] = static_cast<float>(scores[slot[j]] + base);
        slot += kWord;
      } else {
        for (int64_t j = 0; j < kWord; ++j) {
          const uint32_t keep = m[t + j] != 0;
          o[t + j] = select_value(scores, slot, base, keep);
          slot += keep;
        }
      }
    }
    for (; t < L; ++t) {
      const uint32_t keep = m[t] != 0;
      o[t] = select_value(scores, slot, base, keep);
      slot += keep;
    }
  }
}

// Rows of group g sorted by token id: token, a, b, f_c, f_w written from `row` into cols[5][capacity].
int64_t emit_rows(Workspace& ws, int64_t row, int64_t* cols, int64_t capacity) {
  const int64_t* tokens = ws.tokens.data.get();
  std::vector<uint32_t> by_token(size_t(ws.n_entries));
  for (size_t j = 0; j < by_token.size(); ++j) by_token[j] = uint32_t(j);
  std::sort(by_token.begin(), by_token.end(), [&](uint32_t x, uint32_t y) { return tokens[x] < tokens[y]; });
  for (uint32_t j : by_token) {
    const Entry& e = ws.entries.data[j];
    cols[row] = tokens[j];
    cols[capacity + row] = int64_t(lo(e.pres));
    cols[2 * capacity + row] = int64_t(hi(e.pres));
    cols[3 * capacity + row] = int64_t(lo(e.occ));
    cols[4 * capacity + row] = int64_t(hi(e.occ));
    ++row;
  }
  return int64_t(by_token.size());
}

int clamp_threads(int n) { return n < 1 ? 1 : n; }

// fn(g, workspace) -> whether group g held an out-of-range id, for every group, on `threads` OpenMP
// threads (dynamic schedule), each with a workspace from the pool. Returns whether any group did.
template <typename Fn>
bool for_each_group(int64_t n_groups, int threads, Fn fn) {
  int bad = 0;
#pragma omp parallel num_threads(clamp_threads(threads)) reduction(| : bad) if (threads > 1)
  {
    std::unique_ptr<Workspace> owned = pool().take();
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < n_groups; ++g) bad |= fn(g, *owned) ? 1 : 0;
    pool().give(std::move(owned));
  }
  return bad != 0;
}

// The batch's arrays, checked: ids int64 and mask bool [B, L] with unit column stride, order int64
// [B], start int64 [n_groups + 1], correct bool [B].
Batch batch_of(const char* fn, const Array& ids, const Array& mask, const Array& order, const Array& start,
               const Array& correct) {
  const Check check{fn};
  check.matrix("ids", ids, kInt64);
  const int64_t B = int64_t(ids.shape(0)), L = int64_t(ids.shape(1));
  check.matrix("mask", mask, kBool, B, L);
  check.vector("order", order, kInt64, B);
  check.vector("start", start, kInt64);
  check.vector("correct", correct, kBool, B);
  if (start.shape(0) < 1) check.fail("start", "at least one entry ([n_groups + 1])", start);
  return Batch{static_cast<const int64_t*>(ids.data()), row_stride(ids), static_cast<const uint8_t*>(mask.data()),
               row_stride(mask), L, static_cast<const int64_t*>(order.data()),
               static_cast<const int64_t*>(start.data()), static_cast<const uint8_t*>(correct.data())};
}

// `start` checked against B: non-decreasing, from 0 to B.
void check_start(const char* fn, const Array& start, int64_t B) {
  const int64_t* s = static_cast<const int64_t*>(start.data());
  const int64_t n = int64_t(start.shape(0)) - 1;
  bool ok = s[0] == 0 && s[n] == B;
  for (int64_t g = 0; ok && g < n; ++g) ok = s[g + 1] >= s[g];
  if (!ok) throw nb::value_error((std::string(fn) + ": `start` must rise from 0 to B = " + std::to_string(B)).c_str());
}

// advantage(...) -> True when every masked id was in range (else the output is incomplete).
bool advantage(const Array& ids, const Array& mask, const Array& order, const Array& start, const Array& correct,
               const Array& base, const Array& ignore, const Array& out, const Array* offset, const Array* stride,
               const Array* strength, const Array* h, double k1, double b, double alpha, double beta, double top,
               double bound, double weight, bool use_tf, int threads) {
  const char* fn = "_cpu.advantage";
  const Check check{fn};
  const Batch in = batch_of(fn, ids, mask, order, start, correct);
  const int64_t B = int64_t(ids.shape(0)), n_groups = int64_t(start.shape(0)) - 1;
  check.vector("base", base, kFloat64, B);
  check.vector("ignore", ignore, kInt64);
  check.contiguous_matrix("out", out, kFloat32, B, in.L);
  check_start(fn, start, B);
  Params p{nullptr, nullptr, nullptr, nullptr, static_cast<const int64_t*>(ignore.data()), int64_t(ignore.shape(0)),
           static_cast<const double*>(base.data()), k1, b, alpha, beta, top, bound, weight, use_tf};
  const bool grid = offset != nullptr || stride != nullptr || strength != nullptr || h != nullptr;
  if (grid) {
    if (!(offset && stride && strength && h))
      throw nb::value_error("_cpu.advantage: pass all of `offset`, `stride`, `strength`, `h` (a grid) or none");
    check.vector("offset", *offset, kInt64, n_groups);
    check.vector("stride", *stride, kInt64, n_groups);
    check.vector("strength", *strength, kFloat64);
    check.vector("h", *h, kFloat64, int64_t(strength->shape(0)));
    p.offset = static_cast<const int64_t*>(offset->data());
    p.stride = static_cast<const int64_t*>(stride->data());
    p.strength = static_cast<const double*>(strength->data());
    p.h = static_cast<const double*>(h->data());
  } else {
    ensure_log_factorials();
  }
  float* result = static_cast<float*>(out.data());
  bool bad;
  {
    nb::gil_scoped_release release;
    bad = for_each_group(n_groups, threads, [&](int64_t g, Workspace& ws) {
      const GroupTotals tot = count_group(in, g, ws);
      if (!tot.bad_id) {  // an out-of-range id was never counted: do not look it up
        score_group(g, tot, p, ws);
        write_group(in, g, p, ws, result);
      }
      ws.reset();
      return tot.bad_id;
    });
  }
  return !bad;
}

// rows(...): group g's rows, sorted by token, go to row_offset[g] .. of cols (int64 [5, capacity]:
// token, a, b, f_c, f_w); totals (int64 [3, n_groups]: n_rows, T_c, T_w) are written.
// -> True when every masked id was in range.
bool rows(const Array& ids, const Array& mask, const Array& order, const Array& start, const Array& correct,
          const Array& row_offset, const Array& cols, const Array& totals, int threads) {
  const char* fn = "_cpu.rows";
  const Check check{fn};
  const Batch in = batch_of(fn, ids, mask, order, start, correct);
  const int64_t n_groups = int64_t(start.shape(0)) - 1;
  check_start(fn, start, int64_t(ids.shape(0)));
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

// advise_huge(out): ask Linux to back a fresh output buffer with transparent huge pages, so the first
// write faults in 2 MB pages instead of 4 KB ones (a no-op elsewhere). Returns whether it was taken.
bool advise_huge(const Array& out) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  const uintptr_t address = reinterpret_cast<uintptr_t>(out.data());
  const uintptr_t start = (address + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (address + uintptr_t(out.nbytes())) & ~(kHuge - 1);
  return end > start && madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE) == 0;
#else
  (void)out;
  return false;
#endif
}

bool openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace ktae

NB_MODULE(_cpu, m) {
  using namespace nb::literals;
  m.doc() = "ktae_kernels native CPU kernel (see ktae_kernels/cpu.py)";
  m.def(
      "advantage",
      [](const ktae::Array& ids, const ktae::Array& mask, const ktae::Array& order, const ktae::Array& start,
         const ktae::Array& correct, const ktae::Array& base, const ktae::Array& ignore, const ktae::Array& out,
         std::optional<ktae::Array> offset, std::optional<ktae::Array> stride, std::optional<ktae::Array> strength,
         std::optional<ktae::Array> h, double k1, double b, double alpha, double beta, double top, double bound,
         double weight, bool use_tf, int threads) {
        auto ptr = [](const std::optional<ktae::Array>& a) { return a ? &*a : nullptr; };
        return ktae::advantage(ids, mask, order, start, correct, base, ignore, out, ptr(offset), ptr(stride),
                               ptr(strength), ptr(h), k1, b, alpha, beta, top, bound, weight, use_tf, threads);
      },
      "ids"_a, "mask"_a, "order"_a, "start"_a, "correct"_a, "base"_a, "ignore"_a, "out"_a, nb::kw_only(),
      "offset"_a = nb::none(), "stride"_a = nb::none(), "strength"_a = nb::none(), "h"_a = nb::none(), "k1"_a,
      "b"_a, "alpha"_a, "beta"_a, "top"_a, "bound"_a, "weight"_a, "use_tf"_a, "threads"_a,
      "Fused count, score and write of the float32 [B, L] advantages into `out`; False when a masked id "
      "was out of range. With a grid (offset, stride, strength, h) the statistics are looked up there, "
      "else computed here once per distinct table and memoised.");
  m.def("rows", &ktae::rows, "ids"_a, "mask"_a, "order"_a, "start"_a, "correct"_a, "row_offset"_a, "cols"_a,
        "totals"_a, nb::kw_only(), "threads"_a,
        "Per-group (token, a, b, f_c, f_w) rows sorted by token into cols [5, capacity], and n_rows, T_c, T_w "
        "into totals [3, n_groups]; False when a masked id was out of range.");
  m.def("table_statistics", &ktae::table_statistics, "tables"_a, "out"_a,
        "(p, F, IG, h) float64 [4, T] of the tables (a, b, n_c, n_w) int64 [4, T], as the kernel computes them.");
  m.def("statistics_cache_size", &ktae::shared_cache_size, "Tables held in the shared statistics cache.");
  m.def("clear_statistics_cache", &ktae::clear_shared_cache, "Empty the shared statistics cache.");
  m.def("advise_huge", &ktae::advise_huge, "out"_a, "Hint huge pages for a fresh output buffer (Linux).");
  m.def("openmp", &ktae::openmp, "Whether the module was built with OpenMP.");
}
