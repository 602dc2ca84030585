// KTAE on the GPU: one thread block per group of rollouts.
//
// token_advantage (pipeline.advantage) enqueues, with nothing read back in between:
//   scan         one block per rollout: masked tokens, extent, ids out of range (the flags), kUnroll
//                mask bytes and then the ids under them in flight per thread;
//   groups       correct flags and group offsets (a thread per rollout), then a warp per group:
//                n_c, n_w, T_c, T_w and the rollout advantage A_i;
//   shared pass  one block per group. Build: the block reads its rollouts' tokens once (coalesced,
//                kUnroll loads in flight per thread, the next tile's lines asked of L2 while this one is
//                inserted; a token id is loaded only where the mask is set; the rollouts' metadata
//                staged in the warps' lanes, 32 at a time) and inserts each masked
//                id into an open-addressing hash table in shared memory (linear probing): a key, an
//                occurrence counter pair (f_c, f_w) and one presence bit per rollout (in the same
//                8-byte word for the packed slot of small groups, see Table). Lanes of a warp holding
//                the same id are merged with __match_any_sync, so a frequent token costs one atomic
//                per warp (kMatchAny). Score: per occupied slot (queued in a warp's lanes, 32 scored at once),
//                a = popc(presence & correct rollouts), b = the
//                rest; the table's statistics (strength = alpha F + beta IG, Cohen's h) from the
//                device grid (or computed for groups past it; or the given per-row scores of
//                fisher="upstream"), the per-row BM25 direction and tanh squash, stored in place of
//                the counters. Gather: (A_i + weight * score) * mask for every position.
//   global pass  a few blocks take the groups the shared pass left (a table too small for their
//                distinct ids), in a global-memory slice each, splitting a group's ids into hash
//                partitions until each fits; they exit at once when no group was left.
// kUnroll, kMatchAny and kLoadAhead are compile-time variants (ktae_args.h, options.KernelVariant), each
// computing the same bits.
// key_token_scores runs the same passes twice, in other modes (KernelArgs.mode): kCount (each group's
// distinct ids, into status, nothing scored or written), then kRows (each occupied slot as a row at
// row_offset[g], in slot order: the host sorts them by (group, token)).
//
// The same source builds for the CPU emulator (KTAE_CPU_EMULATION, csrc/emulation/), which runs
// every CUDA thread as a host thread so the tests exercise this code without a GPU.
// Device code only, for NVRTC (ktae_kernels/backends/cuda/runtime.py) and the emulator: no host
// headers. The launches are ktae_kernels/backends/cuda/pipeline.py's.
#include "ktae_args.h"

#ifdef KTAE_CPU_EMULATION
#define KTAE_NOINLINE __attribute__((noinline))
#else
#define KTAE_NOINLINE __noinline__
#define KTAE_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace ktae {
namespace {

constexpr unsigned kFullWarp = 0xFFFFFFFFu;
constexpr uint32_t kNoSlot = 0xFFFFFFFFu;
constexpr double kTfEps = 1e-5;  // method.TF_EPS
constexpr int64_t kMaxTokenId = 2147483647;  // api.MAX_TOKEN_ID

constexpr uint16_t kNoIndex = 0xFFFFu;  // a slot-index entry without a counted id (tables < 2^16 slots)

// Block-wide scalars at the start of dynamic shared memory (see header_bytes).
struct BlockState {
  uint32_t used;      // slots claimed
  uint32_t overflow;  // nonzero once the table holds more than max_keys ids (or is full)
};

// Two slot layouts. Wide: counts = f_c | f_w << 32 and `words` presence words per slot apart.
// Packed (one presence word, fewer than 2^16 tokens in the group; 12 bytes a slot, so that two
// blocks of 8192 slots share an SM): counts = f_c | f_w << 16 | presence << 32, one 8-byte word.
// Either way each slot's 8-byte counts word later holds its score's bits (kAdvantage).
struct Table {
  uint32_t* keys;                // [capacity], kEmptyKey where free
  unsigned long long* counts;    // [capacity], see above
  uint32_t* presence;            // wide: [words][capacity] bit r: rollout r of the group holds the key
  uint32_t capacity;             // power of two
  bool packed;
};

struct GroupCounts {
  int64_t n_c, n_w, T_c, T_w;
};

__device__ __forceinline__ GroupCounts group_counts(const KernelArgs& args, int64_t g) {
  const int64_t n = args.n_groups;
  return GroupCounts{args.group_counts[g], args.group_counts[n + g], args.group_counts[2 * n + g],
                     args.group_counts[3 * n + g]};
}

struct SlotCounts {
  int a, b;
  uint32_t f_c, f_w;
};

__device__ __forceinline__ uint32_t load_volatile(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}

// Home slot: the high half of key * 2^64 / phi (Fibonacci hashing), masked to the table.
__device__ __forceinline__ uint32_t home_slot(uint32_t key, uint32_t capacity) {
  const unsigned long long h = static_cast<unsigned long long>(key) * 0x9E3779B97F4A7C15ull;
  return static_cast<uint32_t>(h >> 32) & (capacity - 1u);
}

// The slot holding `key`, claiming a free one for a new key; kNoSlot when the table is full.
// Keys only ever go from kEmptyKey to an id, so a key seen once stays in its slot.
__device__ uint32_t find_or_insert(const Table& t, uint32_t key, BlockState* state) {
  uint32_t slot = home_slot(key, t.capacity);
  for (uint32_t probe = 0; probe < t.capacity; ++probe) {
    uint32_t seen = load_volatile(t.keys + slot);
    if (seen == kEmptyKey) {
      seen = atomicCAS(t.keys + slot, kEmptyKey, key);
      if (seen == kEmptyKey) {
        if (atomicAdd(&state->used, 1u) + 1u > static_cast<uint32_t>(max_keys(t.capacity))) {
          *reinterpret_cast<volatile uint32_t*>(&state->overflow) = 1u;
        }
        return slot;
      }
    }
    if (seen == key) return slot;
    slot = (slot + 1u) & (t.capacity - 1u);
  }
  *reinterpret_cast<volatile uint32_t*>(&state->overflow) = 1u;
  return kNoSlot;
}

// The slot of a key known to be in the (complete, read-only) table; kNoSlot if it is not.
__device__ __forceinline__ uint32_t find(const Table& t, uint32_t key) {
  uint32_t slot = home_slot(key, t.capacity);
  for (uint32_t probe = 0; probe < t.capacity; ++probe) {
    const uint32_t seen = t.keys[slot];
    if (seen == key) return slot;
    if (seen == kEmptyKey) return kNoSlot;
    slot = (slot + 1u) & (t.capacity - 1u);
  }
  return kNoSlot;
}

// Empties the table: keys, counters and presence words.
__device__ void clear_table(const Table& t, int words) {
  for (uint32_t s = threadIdx.x; s < t.capacity; s += blockDim.x) {
    t.keys[s] = kEmptyKey;
    t.counts[s] = 0ull;
    if (!t.packed) {
      for (int w = 0; w < words; ++w) t.presence[static_cast<size_t>(w) * t.capacity + s] = 0u;
    }
  }
}

// This thread's kUnroll positions start + u * blockDim.x + threadIdx.x of a rollout, every load issued
// before any is used: first the mask bytes, then the ids under them. Positions at or past `end` (the
// rollout's extent, or L) read nothing and are not valid; a token id is read only where the mask is set
// (padding ids are never read: 0). The table passes (load_tile) and the scan load their tiles here.
__device__ __forceinline__ void load_masked_ids(const int64_t* tokens, const bool* mask, int64_t start,
                                                int64_t end, int64_t (&token)[kUnroll], bool (&valid)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t pos = start + static_cast<int64_t>(u) * blockDim.x + threadIdx.x;
    valid[u] = pos < end && mask[pos];
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    token[u] = valid[u] ? tokens[start + static_cast<int64_t>(u) * blockDim.x + threadIdx.x] : 0;
  }
}

// One pass over a rollout (load_masked_ids), then the checks: an id outside [0, 2^31) under the mask is
// left out and recorded in bad_ids (zeroed before the first pass: the least id below 0, and by how much
// the largest exceeds 2^31 - 1), which the host reads after the kernels.
__device__ __forceinline__ void load_tile(const KernelArgs& args, const int64_t* tokens, const bool* mask,
                                          int64_t start, int64_t end, int64_t (&token)[kUnroll],
                                          bool (&valid)[kUnroll]) {
  load_masked_ids(tokens, mask, start, end, token, valid);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {  // after every load: a check's atomic would order the loads after it
    if (token[u] < 0 || token[u] > kMaxTokenId) {
      if (token[u] < 0) {
        atomicMin(args.bad_ids, static_cast<long long>(token[u]));
      } else {
        atomicMax(args.bad_ids + 1, static_cast<long long>(token[u] - kMaxTokenId));
      }
      valid[u] = false;
    }
  }
}

// Which of `parts` hash partitions (a power of two) holds `key`: a hash independent of the slot's,
// so that a group too diverse for its table is counted one partition of its ids at a time.
__device__ __forceinline__ bool in_part(uint32_t key, uint32_t parts, uint32_t part) {
  if (parts == 1u) return true;
  const unsigned long long h = static_cast<unsigned long long>(key) * 0xC2B2AE3D27D4EB4Full;
  return (static_cast<uint32_t>(h >> 40) & (parts - 1u)) == part;
}

// Asks L2 for the line that holds `p`, with no register waiting for it: the load-ahead of the next pass.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef KTAE_CPU_EMULATION
  (void)p;
#else
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// Loads ahead the pass after the one at `start` of a rollout of extent `end`: this rollout's next one
// (`row`: the rollout's offset in [B, L]), or the first pass of the next rollout (`next_row`; -1: none)
// of extent `next_end`. Each thread asks for the lines of its kUnroll positions in `array` (`size` bytes
// a position), so that they are in L2 when the pass loads them.
__device__ __forceinline__ void load_ahead(const void* array, int size, int64_t row, int64_t start, int64_t end,
                                           int64_t next_row, int64_t next_end) {
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  const bool same = start + step < end;
  if (!same && next_row < 0) return;
  const int64_t at = same ? row + start + step : next_row, stop = same ? row + end : next_row + next_end;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t pos = at + static_cast<int64_t>(u) * blockDim.x + threadIdx.x;
    if (pos < stop) prefetch_l2(static_cast<const char*>(array) + pos * size);
  }
}

// The rollout's positions a pass reads: up to its extent (last masked position + 1) when known.
__device__ __forceinline__ int64_t rollout_end(const KernelArgs& args, int64_t rollout) {
  return args.extent ? args.extent[rollout] : args.length;
}

// What a pass over a group needs of each of its rollouts besides the tokens: its id (its row of [B, L]),
// extent, correct flag and rollout advantage (kBase).
struct Rollout {
  int64_t id, end;
  bool correct;
  double base;
};

// A 64-bit shuffle: lane `source`'s value on every lane.
__device__ __forceinline__ int64_t shfl_int64(int64_t value, int source) {
  const uint64_t bits = static_cast<uint64_t>(value);
  const unsigned lo = __shfl_sync(kFullWarp, static_cast<unsigned>(bits), source);
  const unsigned hi = __shfl_sync(kFullWarp, static_cast<unsigned>(bits >> 32), source);
  return static_cast<int64_t>(static_cast<uint64_t>(hi) << 32 | lo);
}

// The group's rollouts `at`, at + 1, ..., at + 31 staged in the lanes of every warp: lane j loads rollout
// at + j's metadata, all lanes at once, so that a group costs two dependent trips (members, then the
// rest) per 32 rollouts instead of two or three per rollout. Every lane of the warp calls it.
template <bool kBase>
__device__ __forceinline__ Rollout stage_rollouts(const KernelArgs& args, int64_t first, int group_size, int at) {
  Rollout m{0, 0, false, 0.0};
  if (const int j = at + static_cast<int>(threadIdx.x & 31u); j < group_size) {
    m.id = args.members[first + j];
    m.end = rollout_end(args, m.id);
    m.correct = args.correct[m.id];
    if (kBase) m.base = args.base[m.id];
  }
  return m;
}

// Rollout r's metadata from the warp's staged ones (stage_rollouts at r & ~31), on every lane. Every lane
// of the warp calls it.
template <bool kBase>
__device__ __forceinline__ Rollout staged_rollout(const Rollout& staged, int r) {
  const int lane = r & 31;
  return Rollout{shfl_int64(staged.id, lane), shfl_int64(staged.end, lane),
                 __shfl_sync(kFullWarp, static_cast<unsigned>(staged.correct), lane) != 0u,
                 kBase ? __shfl_sync(kFullWarp, staged.base, lane) : 0.0};
}

// The row ([B, L] offset) and extent of rollout r + 1 of the group, for the load-ahead of its first pass
// (row -1: r is the last): from the staged rollouts, or, at the end of the 32 staged, loaded. Every lane
// of the warp calls it.
__device__ __forceinline__ void next_rollout(const KernelArgs& args, const Rollout& staged, int64_t first,
                                             int group_size, int r, int64_t& row, int64_t& end) {
  row = -1;
  end = 0;
  if ((r + 1) & 31) {
    const Rollout next = staged_rollout<false>(staged, r + 1);
    if (r + 1 < group_size) row = next.id * args.length, end = next.end;
  } else if (r + 1 < group_size) {
    const int64_t next = args.members[first + r + 1];
    row = next * args.length, end = rollout_end(args, next);
  }
}

// The group's correct-rollout mask: bit j of word w set when its rollout 32 w + j (in member order) is
// correct. A warp a word, each lane loading one rollout's flag, all at once: two dependent trips a word,
// not two a rollout in one thread. Every lane of a warp runs the loop.
__device__ __forceinline__ void correct_mask(const KernelArgs& args, int64_t first, int group_size, int words,
                                             uint32_t* correct_bits) {
  for (int w = static_cast<int>(threadIdx.x >> 5); w < words; w += static_cast<int>(blockDim.x >> 5)) {
    const int j = 32 * w + static_cast<int>(threadIdx.x & 31u);
    const unsigned bits = __ballot_sync(kFullWarp, j < group_size && args.correct[args.members[first + j]]);
    if ((threadIdx.x & 31u) == 0u) correct_bits[w] = bits;
  }
}

// Phase 1. Each pass of the inner loop covers blockDim.x * kUnroll positions of one rollout, so a
// warp's lanes always share the rollout and agree on correctness and the presence bit. Every lane
// runs every warp collective (masked positions carry kEmptyKey and are skipped afterwards).
// kRecord: also store each position's slot (kNoIndex where nothing is counted) in args.slot_index,
// so that the gather reads 2 bytes a position instead of the mask and the int64 id, and probes nothing.
template <bool kRecord = false>
__device__ void build_table(const KernelArgs& args, const Table& t, int64_t first, int group_size,
                            BlockState* state, uint32_t parts = 1u, uint32_t part = 0u) {
  const unsigned lane = threadIdx.x & 31u;
  const int64_t length = args.length;
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  Rollout staged{};
  for (int r = 0; r < group_size; ++r) {
    if ((r & 31) == 0) staged = stage_rollouts<false>(args, first, group_size, r);
    const Rollout meta = staged_rollout<false>(staged, r);
    int64_t next_row = -1, next_end = 0;
    if (kLoadAhead) next_rollout(args, staged, first, group_size, r, next_row, next_end);
    const int64_t rollout = meta.id;
    const int64_t* tokens = args.responses + rollout * length;
    const bool* mask = args.mask + rollout * length;
    const bool is_correct = meta.correct;
    const size_t presence_row = static_cast<size_t>(r >> 5) * t.capacity;  // wide layout
    const uint32_t bit = 1u << (r & 31);
    const int64_t end = meta.end;
    uint16_t* record = kRecord ? args.slot_index + rollout * length : nullptr;
    for (int64_t start = 0; start < end; start += step) {
      if (__shfl_sync(kFullWarp, load_volatile(&state->overflow), 0) != 0u) return;
      int64_t token[kUnroll];
      bool valid[kUnroll];
      load_tile(args, tokens, mask, start, end, token, valid);
      if (kLoadAhead) {  // the next pass's mask and ids into L2 while this one is inserted
        load_ahead(args.mask, 1, rollout * length, start, end, next_row, next_end);
        load_ahead(args.responses, 8, rollout * length, start, end, next_row, next_end);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t key = valid[u] && in_part(static_cast<uint32_t>(token[u]), parts, part)
                                 ? static_cast<uint32_t>(token[u]) : kEmptyKey;
        // kMatchAny: the lanes holding the same id, their lowest the leader; else each lane alone
        const unsigned peers = kMatchAny ? __match_any_sync(kFullWarp, key) : 1u << lane;
        const unsigned leader = static_cast<unsigned>(__ffs(peers) - 1);
        uint32_t slot = kNoSlot;
        if (key != kEmptyKey && lane == leader) slot = find_or_insert(t, key, state);
        if (kRecord) {  // every lane of the warp: the slot its leader found
          slot = __shfl_sync(kFullWarp, slot, static_cast<int>(leader));
          const int64_t pos = start + static_cast<int64_t>(u) * blockDim.x + threadIdx.x;
          if (pos < end) record[pos] = key == kEmptyKey || slot == kNoSlot ? kNoIndex : static_cast<uint16_t>(slot);
        }
        if (key == kEmptyKey || lane != leader) continue;
        if (slot == kNoSlot) continue;
        // 32-bit atomics on the half that changes (little-endian): wide, f_c low and f_w high
        // (below 2^31 each); packed, f_c | f_w << 16 (below 2^16 each: no carry) and presence high
        auto* halves = reinterpret_cast<uint32_t*>(t.counts + slot);
        const uint32_t n = static_cast<uint32_t>(__popc(peers));
        if (t.packed) {
          atomicAdd(halves, is_correct ? n : n << 16);
          atomicOr(halves + 1, bit);
        } else {
          atomicAdd(halves + (is_correct ? 0 : 1), n);
          atomicOr(t.presence + presence_row + slot, bit);
        }
      }
    }
  }
}

__device__ SlotCounts slot_counts(const Table& t, uint32_t slot, const uint32_t* correct_bits,
                                  int words) {
  SlotCounts c{0, 0, 0u, 0u};
  const unsigned long long f = t.counts[slot];
  if (t.packed) {
    const uint32_t present = static_cast<uint32_t>(f >> 32);
    c.a = __popc(present & correct_bits[0]);
    c.b = __popc(present & ~correct_bits[0]);
    c.f_c = static_cast<uint32_t>(f & 0xFFFFull);
    c.f_w = static_cast<uint32_t>((f >> 16) & 0xFFFFull);
    return c;
  }
  for (int w = 0; w < words; ++w) {
    const uint32_t present = t.presence[static_cast<size_t>(w) * t.capacity + slot];
    c.a += __popc(present & correct_bits[w]);
    c.b += __popc(present & ~correct_bits[w]);
  }
  c.f_c = static_cast<uint32_t>(f & 0xFFFFFFFFull);
  c.f_w = static_cast<uint32_t>(f >> 32);
  return c;
}

// ---------------------------------------------------------------------------- per-table statistics
// The statistics of every table of a grid (ktae_kernels/backends/device.py, GridTables), one thread
// per table: the same formulas, in the same order of operations, as method.table_statistics (exact
// mode). Each log-pmf is -(((lf[k] + lf[n1 - k]) + lf[col - k]) + lf[n2 - col + k]) from the same
// log-factorial table, so the tie test and the p = 1 rule of F classify every table as the CPU does;
// p = exp(lse(kept) - lse(all)), each log-sum-exp shifted by its own maximum (torch's logsumexp), and
// only the order of the two sums differs from torch's reduction. Every product that feeds a sum is
// rounded on its own (__dmul_rn / __dadd_rn: no FMA contraction), as on the CPU.

__device__ __forceinline__ double log_pmf(const double* lf, int k, int n1, int n2, int col) {
  return -(((lf[k] + lf[n1 - k]) + lf[col - k]) + lf[n2 - col + k]);
}

// What the statistics read besides the table: the log-factorial table and scipy's tolerances.
struct FisherConsts {
  const double* log_factorial;
  double log_rtol, log_err, p_one, ln2;
};

__device__ double fisher_pvalue(const FisherConsts& args, int a, int b, int n_c, int n_w) {
  const int n1 = a + b, n2 = n_c + n_w - n1, col = n_c;
  if (n1 == 0 || n2 == 0 || col == 0 || col == n1 + n2) return 1.0;
  const int lo = col - n2 > 0 ? col - n2 : 0;
  const int hi = n1 < col ? n1 : col;
  const double* lf = args.log_factorial;
  const double lp_obs = log_pmf(lf, a, n1, n2, col);
  const double tol = __dadd_rn(args.log_rtol, __dmul_rn(args.log_err, fabs(lp_obs)));
  const double limit = lp_obs + tol;
  double top = lp_obs, top_kept = lp_obs;
  for (int k = lo; k <= hi; ++k) {
    const double lp = log_pmf(lf, k, n1, n2, col);
    top = fmax(top, lp);
    if (lp <= limit) top_kept = fmax(top_kept, lp);
  }
  if (lp_obs >= top - tol) return 1.0;
  double total = 0.0, kept = 0.0;
  for (int k = lo; k <= hi; ++k) {
    const double lp = log_pmf(lf, k, n1, n2, col);
    total += exp(lp - top);
    if (lp <= limit) kept += exp(lp - top_kept);
  }
  return fmin(exp((log(kept) + top_kept) - (log(total) + top)), 1.0);
}

// Binary entropy in bits, 0 log 0 = 0 (method.binary_entropy).
__device__ __forceinline__ double entropy_bits(double p, double ln2) {
  const double q = 1.0 - p;
  const double xp = p == 0.0 ? 0.0 : __dmul_rn(p, log(p));
  const double xq = q == 0.0 ? 0.0 : __dmul_rn(q, log(q));
  return -__dadd_rn(xp, xq) / ln2;
}

// H(Y) - H(Y | X) in bits, clamped at 0 (method.information_gain).
__device__ double information_gain(int a, int b, int n_c, int n_w, double ln2) {
  const double af = a, bf = b, ncf = n_c, nwf = n_w;
  const double cf = ncf - af, df = nwf - bf;
  const double n = fmax(ncf + nwf, 1.0);
  const double present = af + bf, absent = cf + df;
  const double h_y = entropy_bits(ncf / n, ln2);
  const double h_present = present > 0 ? __dmul_rn(present / n, entropy_bits(af / fmax(present, 1.0), ln2)) : 0.0;
  const double h_absent = absent > 0 ? __dmul_rn(absent / n, entropy_bits(cf / fmax(absent, 1.0), ln2)) : 0.0;
  return fmax(__dadd_rn(__dadd_rn(h_y, -h_present), -h_absent), 0.0);
}

// asin(sqrt(k / max(n, 1))), as device.tables_of's angle table (method.cohen_h).
__device__ __forceinline__ double arcsine_angle(int k, int n) {
  return asin(sqrt(static_cast<double>(k) / static_cast<double>(n > 1 ? n : 1)));
}

// F, IG, Cohen's h and strength of one table, as table_statistics_kernel (which see) with the
// angles computed here instead of read from a table.
__device__ KTAE_NOINLINE void table_stats(const FisherConsts& k, double alpha, double beta, int a, int b, int n_c, int n_w,
                            double* h, double* strength) {
  const double p = fisher_pvalue(k, a, b, n_c, n_w);
  const bool informative = n_c > 0 && n_w > 0 && a + b < n_c + n_w;
  const double F = informative && p < k.p_one ? exp(-2.0 * p) : 0.0;
  const double IG = informative ? information_gain(a, b, n_c, n_w, k.ln2) : 0.0;
  *h = arcsine_angle(a, n_c) - arcsine_angle(b, n_w);
  *strength = __dadd_rn(__dmul_rn(alpha, F), __dmul_rn(beta, IG));
}

__device__ __forceinline__ double bm25_tf(uint32_t f, int64_t T, double avg, const KernelArgs& args) {
  if (f == 0u) return 0.0;
  const double q = static_cast<double>(f) / static_cast<double>(T > 1 ? T : 1);
  const double K = args.k1 * (1.0 - args.bm25_b + args.bm25_b * static_cast<double>(T) / fmax(avg, 1e-300));
  return q * (args.k1 + 1.0) / (q + K);
}

__device__ bool is_ignored(const KernelArgs& args, uint32_t token) {
  int64_t lo = 0, hi = args.n_ignore;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (args.ignore_ids[mid] < static_cast<int64_t>(token)) lo = mid + 1; else hi = mid;
  }
  return lo < args.n_ignore && args.ignore_ids[lo] == static_cast<int64_t>(token);
}

// The score of one (group, token) row: its table's strength (alpha F + beta IG, 0 where the table is
// not informative) and Cohen's h from the per-table arrays, plus the per-row BM25 direction, squashed
// to top * tanh(key / 2) strictly inside (-top, top); 0 where the table is not informative (a group
// with one class, a token in every rollout) and for ignored ids.
__device__ double row_score(const KernelArgs& args, uint32_t token, const SlotCounts& s, const GroupCounts& gc) {
  const bool informative = gc.n_c > 0 && gc.n_w > 0 && static_cast<int64_t>(s.a) + s.b < gc.n_c + gc.n_w;
  if (!informative || is_ignored(args, token)) return 0.0;
  double x, strength;  // Cohen's h, then the direction
  if (const int64_t n = gc.n_c + gc.n_w; args.table_values != nullptr && n <= args.grid_bound) {
    // device.grid_index in closed form
    const int64_t c = gc.n_c;
    const int64_t entry = (n + 3) * (n + 2) * (n + 1) * n / 24 + (n + 2) * c * (c + 1) / 2 -
                          c * (c + 1) * (2 * c + 1) / 6 + s.a * (gc.n_w + 1) + s.b;
    x = args.table_values[entry];
    strength = args.table_values[args.table_size + entry];
  } else {  // a group past the grid: this slot's table, computed here
    const FisherConsts k{args.log_factorial, args.log_rtol, args.log_err, args.p_one, args.ln2};
    table_stats(k, args.alpha, args.beta, s.a, s.b, static_cast<int>(gc.n_c), static_cast<int>(gc.n_w), &x, &strength);
  }
  if (args.use_tf) {
    const double avg = static_cast<double>(gc.T_c + gc.T_w) / 2.0;
    const double tf_c = bm25_tf(s.f_c, gc.T_c, avg, args), tf_w = bm25_tf(s.f_w, gc.T_w, avg, args);
    x += tf_c / (tf_w + kTfEps) - tf_w / (tf_c + kTfEps);
  }
  const double key = strength * x / (args.alpha + args.beta);
  const double bound = nextafter(args.top, 0.0);
  return fmin(fmax(args.top * tanh(key / 2.0), -bound), bound) + 0.0;  // + 0.0: no -0.0 scores
}

// The score of (group g, token) from the given sorted rows (fisher="upstream", or a grid of tables
// too large to compute whole).
__device__ double given_score(const KernelArgs& args, int64_t g, uint32_t token) {
  int64_t lo = args.row_offset[g], hi = args.row_offset[g + 1];
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (args.given_token[mid] < static_cast<int64_t>(token)) lo = mid + 1; else hi = mid;
  }
  return lo < args.row_offset[g + 1] && args.given_token[lo] == static_cast<int64_t>(token)
             ? args.given_score[lo]
             : NAN;
}

// kRows: each occupied slot as a row, at row_offset[g] + first + its place in the order the block's
// threads reach it (`counter`, zero before, counts them); column c of a row at row_ints[c * n_rows].
__device__ void write_rows(const KernelArgs& args, const Table& t, int64_t g, int64_t first,
                           const uint32_t* correct_bits, const GroupCounts& gc, int words, uint32_t* counter) {
  const int64_t n = args.n_rows;
  for (uint32_t slot = threadIdx.x; slot < t.capacity; slot += blockDim.x) {
    const uint32_t token = t.keys[slot];
    if (token == kEmptyKey) continue;
    const SlotCounts s = slot_counts(t, slot, correct_bits, words);
    int64_t* ints = args.row_ints + args.row_offset[g] + first + atomicAdd(counter, 1u);
    ints[0] = g;
    ints[n] = token;
    ints[2 * n] = s.a;
    ints[3 * n] = s.b;
    ints[4 * n] = gc.n_c - s.a;
    ints[5 * n] = gc.n_w - s.b;
    ints[6 * n] = s.f_c;
    ints[7 * n] = s.f_w;
  }
}

// Replaces occupied slot s's counters by the bits of its float64 score.
__device__ __forceinline__ void score_slot(const KernelArgs& args, const Table& t, int64_t g, uint32_t s,
                                           const uint32_t* correct_bits, const GroupCounts& gc, int words) {
  const uint32_t token = t.keys[s];
  const double score = args.use_given ? given_score(args, g, token)
                                      : row_score(args, token, slot_counts(t, s, correct_bits, words), gc);
  t.counts[s] = static_cast<unsigned long long>(__double_as_longlong(score));
}

// The lane of the k-th set bit (from 0) of `bits`; some lane when fewer than k + 1 are set.
__device__ __forceinline__ int nth_set_bit(unsigned bits, int k) {
  int lane = 0;
  for (int step = 16; step > 0; step >>= 1) {
    if (__popc(bits & ((1u << (lane + step)) - 1u)) <= k) lane += step;
  }
  return lane;
}

// Replaces every occupied slot's counters by the bits of its float64 score, over the occupied slots
// only: each warp walks 32 slots at a time and queues their occupied ones in its lanes (lane j takes
// the one of rank j - queued), and scores a full queue at once, so that no lane of a scoring step
// idles on an empty slot (a walk over every slot leaves the lanes of the empty ones, about half at
// the tables' load, idle through each score). Each slot is scored by one thread, which alone reads and
// writes it, so no barrier is needed until the gather reads them. Every lane of a warp runs the walk.
__device__ void score_slots(const KernelArgs& args, const Table& t, int64_t g,
                            const uint32_t* correct_bits, const GroupCounts& gc, int words) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  uint32_t mine = kNoSlot;  // this lane's queued slot, in lanes below `queued`
  int queued = 0;
  for (uint32_t at = threadIdx.x & ~31u;; at += blockDim.x) {
    const bool walking = at < t.capacity;  // the same on every lane; past the walk, the last queue is scored
    const uint32_t s = at + static_cast<uint32_t>(lane);
    const unsigned occupied = __ballot_sync(kFullWarp, walking && s < t.capacity && t.keys[s] != kEmptyKey);
    const int n = __popc(occupied);
    const int rank = (lane - queued) & 31;  // of the occupied slot this lane takes, if there is one
    const uint32_t incoming = __shfl_sync(kFullWarp, s, nth_set_bit(occupied, rank));
    if (lane >= queued && rank < n) mine = incoming;
    if (walking && queued + n < 32) {
      queued += n;
      continue;
    }
    if (walking || lane < queued) score_slot(args, t, g, mine, correct_bits, gc, words);  // one call site
    if (!walking) return;
    queued += n - 32;
    if (lane < queued) mine = incoming;  // the ranks past the full queue
  }
}

// (A_i + weight * score) * mask, rounded once to float32 (no FMA, as the float64 reference). With
// hash partitions, the positions of partition `part`'s ids; positions without a masked id are
// written once, with partition 0.
template <bool kFromIndex = false>
__device__ void gather_advantage(const KernelArgs& args, const Table& t, int64_t first, int group_size,
                                 uint32_t parts = 1u, uint32_t part = 0u) {
  const int64_t length = args.length;
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  Rollout staged{};
  for (int r = 0; r < group_size; ++r) {
    if ((r & 31) == 0) staged = stage_rollouts<true>(args, first, group_size, r);
    const Rollout meta = staged_rollout<true>(staged, r);
    const int64_t rollout = meta.id;
    const int64_t* tokens = args.responses + rollout * length;
    const bool* mask = args.mask + rollout * length;
    float* out = args.advantage + rollout * length;
    const double base = meta.base;
    const int64_t end = meta.end;
    if (kFromIndex) {  // the slots the build recorded: no mask, no ids, no probing
      const uint16_t* index = args.slot_index + rollout * length;
      int64_t next_row = -1, next_end = 0;
      if (kLoadAhead) next_rollout(args, staged, first, group_size, r, next_row, next_end);
      for (int64_t start = 0; start < end; start += step) {
        if (kLoadAhead) load_ahead(args.slot_index, 2, rollout * length, start, end, next_row, next_end);
        uint16_t slot[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t pos = start + static_cast<int64_t>(u) * blockDim.x + threadIdx.x;
          slot[u] = pos < end ? index[pos] : kNoIndex;
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t pos = start + static_cast<int64_t>(u) * blockDim.x + threadIdx.x;
          if (pos >= end) continue;
          out[pos] = slot[u] == kNoIndex ? 0.0f : __double2float_rn(__dadd_rn(base, __dmul_rn(args.weight,
                         __longlong_as_double(static_cast<long long>(t.counts[slot[u]])))));
        }
      }
    }
    for (int64_t start = 0; !kFromIndex && start < end; start += step) {
      int64_t token[kUnroll];
      bool valid[kUnroll];
      load_tile(args, tokens, mask, start, end, token, valid);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t pos = start + static_cast<int64_t>(u) * blockDim.x + threadIdx.x;
        if (pos >= end) continue;
        if (!valid[u]) {
          if (part == 0u) out[pos] = 0.0f;
          continue;
        }
        const uint32_t key = static_cast<uint32_t>(token[u]);
        if (!in_part(key, parts, part)) continue;
        const uint32_t slot = find(t, key);
        const double score = slot == kNoSlot ? NAN : __longlong_as_double(static_cast<long long>(t.counts[slot]));
        out[pos] = __double2float_rn(__dadd_rn(base, __dmul_rn(args.weight, score)));
      }
    }
    if (part == 0u) {  // past the last masked position: zeros, nothing read
      for (int64_t pos = end + threadIdx.x; pos < length; pos += blockDim.x) out[pos] = 0.0f;
    }
  }
}

// A bad input stops every table pass before it writes (the host raises; `out` stays as it was, or,
// for a replay of a captured call, holds NaN): an id out of range, a group past kMaxGroupTokens, or an
// input value out of its domain (kFlagBadValues).
__device__ __forceinline__ bool bad_input(const KernelArgs& args) {
  const auto* flags = reinterpret_cast<const volatile long long*>(args.bad_ids);
  return flags[0] != 0 || flags[1] != 0 || *reinterpret_cast<const volatile long long*>(args.most_tokens) != 0 ||
         *reinterpret_cast<const volatile long long*>(args.bad_values) != 0;
}

// One group of the static-bound pipeline (pipeline.advantage), every choice made here: the
// group's own presence words and slot layout, a table sized by its masked tokens (so only that much
// is cleared), in the shared pass at most max_capacity slots (the host's size for the distinct ids
// it has seen), up to what the block's shared memory (or global slice) holds. The shared pass gives
// up on a group that overflows (status -1, nothing written); the global pass redoes it, splitting
// its ids into 2, 4, ... hash partitions until each fits its slice, a partition's positions written
// after its table is complete. Nothing at all is written after a bad input (bad_input).
template <bool kSharedTable>
__device__ void process_dynamic(const KernelArgs& args, unsigned char* smem, int64_t g) {
  auto* state = reinterpret_cast<BlockState*>(smem);
  if (bad_input(args)) return;
  if (!kSharedTable && args.status[g] >= 0) return;
  const int64_t first = args.starts[g];
  const int group_size = static_cast<int>(args.starts[g + 1] - first);
  const GroupCounts gc = group_counts(args, g);
  const int words = group_size > 32 ? (group_size + 31) / 32 : 1;
  const int64_t tokens = gc.T_c + gc.T_w;
  const bool packed = args.allow_packed && words == 1 && tokens <= kPackedMaxTokens;
  const int64_t slot_bytes = packed ? 12 : 12 + 4 * static_cast<int64_t>(words);
  uint32_t* correct_bits;
  unsigned char* table;
  int64_t room;
  if (kSharedTable) {
    correct_bits = reinterpret_cast<uint32_t*>(smem + sizeof(BlockState));
    table = smem + header_bytes(words);
    room = args.shared_bytes - header_bytes(words);
  } else {  // the block's slice: the correct-rollout mask, then the table
    unsigned char* slice = args.ws_bytes + static_cast<int64_t>(blockIdx.x) * args.ws_slice_bytes;
    const int64_t mask_bytes = (4 * static_cast<int64_t>(words) + 7) / 8 * 8;
    correct_bits = reinterpret_cast<uint32_t*>(slice);
    table = slice + mask_bytes;
    room = args.ws_slice_bytes - mask_bytes;
  }
  int64_t capacity = table_capacity(tokens);
  if (kSharedTable && capacity > args.max_capacity) capacity = args.max_capacity;  // distinct ids seen
  while (capacity > 2 && capacity * slot_bytes > room) capacity /= 2;
  const int64_t least = kSharedTable && args.max_capacity > kMinCapacity ? kMinCapacity : 2;
  if (capacity < least || capacity * slot_bytes > room) {  // no room: the global pass takes it
    if (threadIdx.x == 0) {
      args.status[g] = -1;
      atomicAdd(reinterpret_cast<unsigned long long*>(args.left), 1ull);
    }
    return;
  }
  auto* counts = reinterpret_cast<unsigned long long*>(table);
  auto* keys = reinterpret_cast<uint32_t*>(counts + capacity);
  const Table t{keys, counts, packed ? nullptr : keys + capacity, static_cast<uint32_t>(capacity), packed};

  correct_mask(args, first, group_size, words, correct_bits);
  const uint32_t most_parts = kSharedTable ? 1u : (1u << 24);
  // the shared pass records each position's slot when the table's slots fit 16 bits
  const bool from_index = kSharedTable && args.slot_index != nullptr && capacity < kNoIndex;
  for (uint32_t parts = 1u;; parts *= 2u) {
    bool overflowed = false;
    int64_t n_keys = 0;
    for (uint32_t part = 0u; part < parts && !overflowed; ++part) {
      clear_table(t, words);
      if (threadIdx.x == 0) *state = BlockState{0u, 0u};
      __syncthreads();
      if (from_index) {
        build_table<true>(args, t, first, group_size, state);
      } else {
        build_table(args, t, first, group_size, state, parts, part);
      }
      __syncthreads();
      overflowed = state->overflow != 0u;
      const uint32_t used = state->used;
      n_keys += used;
      __syncthreads();  // every thread has read the state before it is reset
      if (overflowed) break;
      if (args.mode == kRows) {  // this partition's rows, after the earlier ones' (overflow is 0: the counter)
        write_rows(args, t, g, n_keys - used, correct_bits, gc, words, &state->overflow);
        __syncthreads();
      }
      if (args.mode != kAdvantage) continue;  // kCount, kRows: nothing scored or gathered
      score_slots(args, t, g, correct_bits, gc, words);
      __syncthreads();
      if (from_index) {
        gather_advantage<true>(args, t, first, group_size);
      } else {
        gather_advantage(args, t, first, group_size, parts, part);
      }
      __syncthreads();  // the table is cleared for the next partition
    }
    if (!overflowed || parts >= most_parts) {
      if (threadIdx.x == 0) {
        args.status[g] = overflowed ? -1 : n_keys;
        if (overflowed) atomicAdd(reinterpret_cast<unsigned long long*>(args.left), 1ull);
        if (!overflowed) {
          atomicMax(args.largest_keys, static_cast<long long>(n_keys));
          atomicMax(args.shared_need, static_cast<long long>(group_shared_need(words, packed, n_keys)));
        }
      }
      return;
    }
  }
}


// The advantage passes: blocks take the groups blockIdx.x, blockIdx.x + gridDim.x, ... of
// group_order when given (the groups with the most masked tokens first), else of the dense ids. The
// global pass (after a shared pass) exits at once when the shared pass left no group.
template <bool kSharedTable>
__global__ void __launch_bounds__(kMaxThreads) dynamic_kernel(const KernelArgs args) {
  KTAE_DYNAMIC_SHARED(smem);
  if (!kSharedTable && args.shared_bytes > 0 && *reinterpret_cast<const volatile long long*>(args.left) == 0) return;
  for (int64_t i = blockIdx.x; i < args.n_items; i += gridDim.x) {
    process_dynamic<kSharedTable>(args, smem, args.group_order != nullptr ? args.group_order[i] : i);
    __syncthreads();
  }
}

// After the table passes of a captured call's replay (nan_on_error): NaN over all `positions` of
// `advantage` when the flags hold a bad input (the passes wrote nothing: `out` must not keep the
// previous replay's values); its blocks exit at once otherwise.
__global__ void nan_on_error_kernel(const KernelArgs args, int64_t positions) {
  if (!bad_input(args)) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < positions; i += stride) {
    args.advantage[i] = NAN;
  }
}

// The sum of a warp's 64-bit integers, on every lane.
__device__ __forceinline__ long long warp_sum(long long value) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(kFullWarp, value, offset);
  return value;
}

// The largest of a warp's 64-bit integers, on every lane.
__device__ __forceinline__ long long warp_max(long long value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const long long other = __shfl_xor_sync(kFullWarp, value, offset);
    value = other > value ? other : value;
  }
  return value;
}

// Scan pass, one block per rollout: masked tokens, extent (last masked position + 1) and the ids out
// of [0, 2^31) under the mask (bad_ids). Each step, a thread loads its kUnroll mask bytes, then the ids
// under them (load_masked_ids: 2 dependent DRAM trips a step, not 2 a position), and checks them after
// the last load. Four block-wide accumulators in dynamic shared memory.
__global__ void __launch_bounds__(kMaxThreads) scan_kernel(const PrepareArgs args) {
  KTAE_DYNAMIC_SHARED(smem);
  auto* count = reinterpret_cast<unsigned long long*>(smem);
  auto* acc = reinterpret_cast<long long*>(smem);  // [1] extent, [2] least id, [3] excess of the largest
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  for (int64_t r = blockIdx.x; r < args.B; r += gridDim.x) {
    if (threadIdx.x == 0) {
      *count = 0ull;
      acc[1] = acc[2] = acc[3] = 0;
    }
    __syncthreads();
    const bool* mask = args.mask + r * args.L;
    const int64_t* tokens = args.responses + r * args.L;
    unsigned long long mine = 0ull;
    long long last = 0, low = 0, high = 0;
    for (int64_t start = 0; start < args.L; start += step) {
      bool masked[kUnroll];
      int64_t id[kUnroll];
      load_masked_ids(tokens, mask, start, args.L, id, masked);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (!masked[u]) continue;
        ++mine;
        last = start + static_cast<int64_t>(u) * blockDim.x + threadIdx.x + 1;
        if (id[u] < 0 || id[u] > kMaxTokenId) {
          low = id[u] < low ? id[u] : low;
          high = id[u] > high ? id[u] : high;
        }
      }
    }
    // a warp's totals first, then one shared atomic per warp: every thread of the block updates the
    // same two words, and atomics on one shared address serialise. Every lane gets here (blockDim is
    // a multiple of 32).
    mine = static_cast<unsigned long long>(warp_sum(static_cast<long long>(mine)));
    last = warp_max(last);
    if ((threadIdx.x & 31) == 0 && mine) {
      atomicAdd(count, mine);
      atomicMax(acc + 1, last);
    }
    if (low < 0) atomicMin(acc + 2, low);  // bad ids only: rare
    if (high > kMaxTokenId) atomicMax(acc + 3, high - kMaxTokenId);
    __syncthreads();
    if (threadIdx.x == 0) {
      args.lengths[r] = static_cast<int64_t>(*count);
      args.extent[r] = acc[1];
      if (acc[2] < 0) atomicMin(args.bad_ids, acc[2]);
      if (acc[3] > 0) atomicMax(args.bad_ids + 1, acc[3]);
    }
    __syncthreads();
  }
}

// Whether a double is finite: its exponent bits are not all ones (NaN and +-inf).
__device__ __forceinline__ bool is_finite(double x) {
  return (__double_as_longlong(x) & 0x7ff0000000000000LL) != 0x7ff0000000000000LL;
}

// Groups pass, in two launches over the whole device (the per-group work is a chain of dependent
// loads, so it wants many threads, not one block). First, per rollout: correct flags, the group
// offsets from the members sorted by group, and bad_values when a reward (or given A_i) is not finite.
__global__ void groups_kernel(const PrepareArgs args) {
  const int64_t B = args.B, n = args.n_groups;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = tid; i < B; i += stride) {
    const int64_t r = args.members[i];
    const int64_t g = args.group[r];
    const double reward = args.rewards[r];
    args.correct[r] = args.given_correct ? args.given_correct[r] : reward > args.threshold;
    if (!is_finite(reward) || (args.given != nullptr && !is_finite(args.given[r]))) *args.bad_values = 1;
    const int64_t before = i == 0 ? -1 : args.group[args.members[i - 1]];
    for (int64_t h = before + 1; h <= g; ++h) args.starts[h] = i;
    if (i == B - 1) {
      for (int64_t h = g + 1; h <= n; ++h) args.starts[h] = B;
    }
  }
  if (B == 0) {
    for (int64_t h = tid; h <= n; h += stride) args.starts[h] = 0;
  }
}

// `sum` plus the first `count` lanes' `value`, in lane order, on every lane (so that a float sum
// rounds as a loop over the members in order does): the warp's values pass through its 32 slots of
// shared memory (`staged`), each lane adding all of them.
__device__ __forceinline__ double ordered_add(double sum, double value, int count, double* staged) {
  staged[threadIdx.x & 31u] = value;
  __syncwarp();
  for (int j = 0; j < count; ++j) sum = __dadd_rn(sum, staged[j]);
  __syncwarp();  // every lane has read the slots before the next values are staged
  return sum;
}

// Then a warp per group: n_c, n_w, T_c, T_w and the baseline of method.rollout_advantage. The lanes
// load 32 members at a time; the float sums run in member order (= index order, as torch's index_add_
// on the CPU), every product rounded on its own. A group past kMaxGroupTokens masked tokens is flagged.
__global__ void group_sums_kernel(const PrepareArgs args) {
  KTAE_DYNAMIC_SHARED(smem);  // 32 doubles a warp (ordered_add)
  double* staged = reinterpret_cast<double*>(smem) + (threadIdx.x & ~31u);
  const int64_t n = args.n_groups;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t g = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; g < n; g += warps) {
    const int64_t first = args.starts[g], end = args.starts[g + 1], size = end - first;
    long long n_c = 0, T_c = 0, T = 0;
    double sum = 0.0;
    for (int64_t at = first; at < end; at += 32) {
      double reward = 0.0;
      if (at + lane < end) {
        const int64_t r = args.members[at + lane];
        const bool c = args.correct[r];
        n_c += c;
        T += args.lengths[r];
        T_c += c ? args.lengths[r] : 0;
        reward = args.rewards[r];
      }
      sum = ordered_add(sum, reward, static_cast<int>(end - at < 32 ? end - at : 32), staged);
    }
    n_c = warp_sum(n_c);
    T_c = warp_sum(T_c);
    T = warp_sum(T);
    if (lane == 0) {
      args.status[g] = -1;
      args.group_counts[g] = n_c;
      args.group_counts[n + g] = size - n_c;
      args.group_counts[2 * n + g] = T_c;
      args.group_counts[3 * n + g] = T - T_c;
      if (T > kMaxGroupTokens) atomicMax(args.most_tokens, T);
    }
    if (args.baseline == kBaselineGiven) continue;
    const double mean = size > 1 ? sum / static_cast<double>(size) : 0.0;
    double squares = 0.0;
    for (int64_t at = first; at < end; at += 32) {
      const double centred = at + lane < end ? args.rewards[args.members[at + lane]] - mean : 0.0;
      squares = ordered_add(squares, __dmul_rn(centred, centred), static_cast<int>(end - at < 32 ? end - at : 32),
                            staged);
    }
    const double var = squares / static_cast<double>(size > 2 ? size - 1 : 1);
    const double std = size > 1 ? sqrt(var) : 1.0;
    for (int64_t i = first + lane; i < end; i += 32) {
      const int64_t r = args.members[i];
      const double centred = args.rewards[r] - mean;
      args.base[r] = args.baseline == kBaselineNone ? args.rewards[r]
                     : args.baseline == kBaselineMean ? centred
                                                      : centred / (std + args.eps);
    }
  }
}

__global__ void table_statistics_kernel(const StatsArgs args) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= args.size) return;
  const int a = args.cells[t], b = args.cells[args.size + t];
  const int n_c = args.cells[2 * args.size + t], n_w = args.cells[3 * args.size + t];
  const FisherConsts k{args.log_factorial, args.log_rtol, args.log_err, args.p_one, args.ln2};
  const double p = fisher_pvalue(k, a, b, n_c, n_w);
  const bool informative = n_c > 0 && n_w > 0 && a + b < n_c + n_w;
  const double F = informative && p < args.p_one ? exp(-2.0 * p) : 0.0;
  const double IG = informative ? information_gain(a, b, n_c, n_w, args.ln2) : 0.0;
  const int64_t tri_c = static_cast<int64_t>(n_c) * (n_c + 1) / 2, tri_w = static_cast<int64_t>(n_w) * (n_w + 1) / 2;
  double* out = args.out;
  out[t] = p;
  out[args.size + t] = F;
  out[2 * args.size + t] = IG;
  out[3 * args.size + t] = args.angle[tri_c + a] - args.angle[tri_w + b];
  out[4 * args.size + t] = __dadd_rn(__dmul_rn(args.alpha, F), __dmul_rn(args.beta, IG));
}

}  // namespace

}  // namespace ktae
