// The kernels' argument structs and constants: ONE definition, included by the device source
// (ktae_kernels.cu, compiled by NVRTC or, for the tests, by the CPU emulator) and parsed by
// ktae_kernels/backends/cuda/abi.py, which builds the ctypes structs the launches pass from it.
// Plain declarations only (abi.py reads each struct field by field and each `constexpr` integer).
#pragma once

#ifdef __CUDACC_RTC__
// NVRTC has no host headers: the fixed-width integers and NAN, as <cstdint> and <cmath> give them.
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#define NAN __int_as_float(0x7fc00000)
#else
#include <cmath>
#include <cstdint>
#endif

// The few helpers the kernels share with the emulator's host code are callable on both sides.
#ifdef __CUDACC__
#define KTAE_HOST_DEVICE __host__ __device__
#else
#define KTAE_HOST_DEVICE
#endif

namespace ktae {

// What the table passes compute (KernelArgs.mode).
enum Mode : int {
  kAdvantage = 0,  // the advantages (token_advantage)
  kCount = 1,      // distinct token ids of each group -> status (key_token_scores, first)
  kRows = 2,       // each group's rows at row_offset[g], unsorted (key_token_scores, then)
};

// Most masked tokens one group may hold (keeps slot indices and counters in 32 bits; ktae_kernels
// backends/device.py MAX_GROUP_TOKENS).
constexpr int64_t kMaxGroupTokens = int64_t{1} << 30;

// A hash-table slot key no token id can take (ids are < 2^31).
constexpr uint32_t kEmptyKey = 0xFFFFFFFFu;
// Upper bound of threads per block (the kernels' __launch_bounds__).
constexpr int kMaxThreads = 1024;
// The compile-time variants of the kernels (options.KernelVariant, whose defaults these are; runtime.py
// and the emulator's build pass a variant's values as -D macros, each variant its own compile).
#ifndef KTAE_UNROLL
#define KTAE_UNROLL 4
#endif
#ifndef KTAE_MATCH_ANY
#define KTAE_MATCH_ANY 1
#endif
#ifndef KTAE_LOAD_AHEAD
#define KTAE_LOAD_AHEAD 1
#endif
// Tokens each thread loads per step of the scan, the table build and the gather.
constexpr int kUnroll = KTAE_UNROLL;
// Lanes of a warp holding the same id merge into one update (__match_any_sync); 0: a lane its own.
constexpr int kMatchAny = KTAE_MATCH_ANY;
// The next step's mask and ids asked of L2 while this one is inserted; 0: not.
constexpr int kLoadAhead = KTAE_LOAD_AHEAD;

// Most distinct ids a table of `capacity` slots takes before it counts as overflowed (3/4 load).
KTAE_HOST_DEVICE inline constexpr int64_t max_keys(int64_t capacity) { return capacity - capacity / 4; }

// Fewest slots of a table sized by its ids (cuda.MIN_CAPACITY).
constexpr int64_t kMinCapacity = 32;

// Smallest power-of-two table of at least kMinCapacity slots holding n_keys ids (cuda.table_capacity).
KTAE_HOST_DEVICE inline constexpr int64_t table_capacity(int64_t n_keys) {
  int64_t capacity = kMinCapacity;
  while (max_keys(capacity) < n_keys) capacity *= 2;
  return capacity;
}

// Bytes of the per-block header in dynamic shared memory: used + overflow counters, then one
// bitmask word per 32 rollouts of the group's correct rollouts; rounded up to 8 bytes.
KTAE_HOST_DEVICE inline constexpr int64_t header_bytes(int64_t words) { return (8 + 4 * words + 7) / 8 * 8; }

// Dynamic shared memory of a block whose table lives in shared memory: the header, then per slot
// an 8-byte counter word, a 4-byte key and, unless `packed` (one presence word kept in the counter
// word, see ktae_kernels.cu), `words` 4-byte presence words.
KTAE_HOST_DEVICE inline constexpr int64_t shared_table_bytes(int64_t capacity, int64_t words, bool packed = false) {
  return header_bytes(words) + capacity * (packed ? 12 : 12 + 4 * words);
}

// Most masked tokens of a group whose shared table may use the packed layout (16-bit counters).
constexpr int64_t kPackedMaxTokens = 65535;

// Row columns written in kRows mode (the KeyTokenScores integer row fields, in this order).
constexpr int kRowInts = 8;  // group, token, a, b, c, d, f_c, f_w

// Everything a launch reads and writes. All pointers are device pointers (host pointers for the
// CPU emulator); int64 everywhere an index can exceed 2^31 (B * L can).
struct KernelArgs {
  // the batch
  const int64_t* responses;  // [B, L] token ids, read only where mask is set
  const bool* mask;          // [B, L]
  int64_t length;            // L
  const int64_t* members;    // [B] rollout ids ordered by group (stable)
  const int64_t* starts;     // [n_groups + 1] group g's rollouts are members[starts[g] : starts[g + 1]]
  const bool* correct;       // [B] reward > threshold
  const int64_t* group_counts;  // [4, n_groups] rows n_c, n_w, T_c, T_w
  int64_t n_groups;
  // per-table statistics (device.grid_tables order), rows Cohen's h and strength alpha F + beta IG
  const double* table_values;   // [2, table_size]
  int64_t table_size;
  const int64_t* ignore_ids;  // [n_ignore] sorted token ids whose score is 0
  int64_t n_ignore;
  // the launch
  int64_t n_items;             // groups: block i takes groups i, i + gridDim.x, ...
  const int64_t* group_order;  // [n_items] or null: the i-th group taken is group_order[i] (largest first)
  int32_t mode;                // Mode
  // the method's hyper-parameters
  double alpha, beta, k1, bm25_b, top, weight;
  bool use_tf;
  // outputs
  long long* bad_ids;          // [2] least id < 0 under the mask (else 0), largest id > 2^31 - 1 (else 2^31 - 1)
  int64_t* status;             // [n_groups] distinct ids of the group, -1 when its table overflowed
  const int64_t* row_offset;   // [n_groups + 1] where each group's rows start (kRows; the given scores)
  int64_t* row_ints;           // [kRowInts, n_rows] (kRows)
  int64_t n_rows;
  // the table passes (pipeline.py): every choice that depends on the data is made on the
  // device, per group (presence words, slot layout, table size), so nothing is read back before or
  // between the launches; nothing is written when the flags hold a bad input
  const double* base;          // [B] rollout advantage A_i
  float* advantage;            // [B, L]
  bool use_given;              // take each token's score from the given rows (sorted by (group, token),
  const int64_t* given_token;  // [n_rows], fisher="upstream") instead of computing it
  const double* given_score;
  const int64_t* extent;       // [B] last masked position + 1: rollouts are read up to it only
  int64_t shared_bytes;        // dynamic shared memory of a shared-table pass
  int64_t max_capacity;        // most slots of a shared table (a power of two): the host sizes it
                               // by the distinct ids it has seen (cuda.static_plan)
  long long* largest_keys;     // [1] zeroed before: the most distinct ids a completed group held
  long long* shared_need;      // [1] zeroed before: the most dynamic shared memory a completed group's
                               // table takes in its own layout, sized for its distinct ids (group_shared_need)
  long long* left;             // [1] zeroed before: groups the shared pass left to the global pass
  const long long* most_tokens;  // [1] the masked tokens of a group past kMaxGroupTokens (0: none)
  const long long* bad_values;   // [1] non-zero: an input value out of its domain (kFlagBadValues)
  bool nan_on_error;           // after a bad input, write NaN over `advantage` (a replay of a captured
                               // call) instead of nothing
  bool allow_packed;           // the packed slot where a group has one presence word and < 2^16 tokens
  unsigned char* ws_bytes;     // global-memory pass: block b owns [b * ws_slice_bytes, (b + 1) * ws_slice_bytes)
  int64_t ws_slice_bytes;      //   and takes the hash partitions of an overflowing group one after another
  uint16_t* slot_index;        // [B, L] or null: the shared pass's build records each position's slot
                               // there and its gather reads it back (tables of < 2^16 slots)
  int32_t grid_bound;          // table_values holds every table of groups of up to grid_bound rollouts at the
                               // closed-form offset of device.grid_index; bigger groups (or no table_values)
                               // get their statistics computed per slot from
  const double* log_factorial; // log(k!), k < lf_size (>= the largest group + 1)
  int64_t lf_size;
  double log_rtol, log_err, p_one, ln2;  // as StatsArgs
};

// The [B]-sized bookkeeping before the table passes (pipeline.py), on the device: a scan pass (one block per rollout:
// masked tokens, extent, out-of-range ids) and the groups passes (a thread per rollout: correct
// flags, group offsets from the members sorted by group; a thread per group: n_c, n_w, T_c, T_w and
// the rollout advantage A_i).
struct PrepareArgs {
  const int64_t* responses;  // [B, L]
  const bool* mask;          // [B, L]
  int64_t B, L;
  const int64_t* group;      // [B] dense group ids
  const int64_t* members;    // [B] argsort(group, stable)
  int64_t n_groups;
  const double* rewards;     // [B] (a value that is not finite sets bad_values)
  const double* given;       // [B] or null: the caller's rollout advantage A_i (likewise checked)
  const bool* given_correct; // [B] or null: then reward > threshold
  double threshold;
  int baseline;              // kBaseline*
  double eps;
  // outputs
  long long* bad_ids;        // [2] zeroed before: least id < 0, (largest id > 2^31 - 1) - (2^31 - 1)
  long long* most_tokens;    // [1] zeroed before: the masked tokens of a group past kMaxGroupTokens
  long long* bad_values;     // [1] zeroed (or set by the host's device checks) before: see kFlagBadValues
  int64_t* lengths;          // [B] masked tokens
  int64_t* extent;           // [B] last masked position + 1 (0 when none)
  bool* correct;             // [B]
  int64_t* starts;           // [n_groups + 1]
  int64_t* group_counts;     // [4, n_groups] n_c, n_w, T_c, T_w
  double* base;              // [B] A_i (unless kBaselineGiven)
  int64_t* status;           // [n_groups] set to -1 (not done) for the table passes
};

enum Baseline : int { kBaselineGrpo = 0, kBaselineMean = 1, kBaselineNone = 2, kBaselineGiven = 3 };

// Threads a block of the groups passes.
constexpr int kGroupsThreads = 128;

// The flags at the head of the passes' workspace (pipeline.py), zeroed before them and read back by the host after
// the last launch, by index: the least id < 0 under the mask and the excess of the largest past 2^31 - 1
// (bad_ids), the most distinct ids a completed group held, the most dynamic shared memory a completed
// group's table needed (group_shared_need), the groups the shared pass left to the global pass, the masked
// tokens of a group past kMaxGroupTokens, and bad_values (non-zero: rewards or the given rollout advantage
// not finite, found by groups_kernel, or a 0/1 input holding another value, found by the host's device
// checks before the first pass). A bad input (bad_ids, a group past kMaxGroupTokens, bad_values) stops
// every table pass before it writes.
enum Flag : int {
  kFlagLowId = 0, kFlagHighId = 1, kFlagDistinct = 2, kFlagSharedNeed = 3, kFlagLeft = 4, kFlagMostTokens = 5,
  kFlagBadValues = 6, kAdvantageFlags = 7
};

// Dynamic shared memory a shared-table block needs for a group of `words` presence words, the
// `packed` slot or not, holding `n_keys` distinct ids: the header and the table for them
// (table_capacity). The host sizes the next call's shared pass by the largest of a call's groups
// (cuda.static_plan: two blocks per SM when it fits half an SM).
KTAE_HOST_DEVICE inline constexpr int64_t group_shared_need(int64_t words, bool packed, int64_t n_keys) {
  return shared_table_bytes(table_capacity(n_keys), words, packed);
}

// The per-table statistics of a grid (ktae_kernels/backends/device.py, GridTables): for each table
// t, out[:, t] = p_value, F, IG, Cohen's h, strength (alpha F + beta IG), as method.table_statistics.
struct StatsArgs {
  const int32_t* cells;          // [4, size] rows a, b, n_c, n_w
  int64_t size;
  const double* log_factorial;   // log(k!) up to the largest n_c + n_w
  const double* angle;           // asin(sqrt(k / max(n, 1))) at n (n + 1) / 2 + k
  double log_rtol, log_err, p_one, ln2, alpha, beta;  // log1p(1e-14), fisher._LOG_ERR, fisher.P_ONE, log(2)
  double* out;                   // [5, size]
};

// Threads per block of the statistics kernel (one table per thread).
constexpr int kStatsThreads = 128;

// Threads a block of nan_on_error_kernel (grid-stride beyond its blocks; they exit at once unless the
// flags hold a bad input).
constexpr int kNanThreads = 256;

}  // namespace ktae
