// Per-table statistics of the 2x2 table [[a, b], [n_c - a, n_w - b]] for big groups, computed here once
// per distinct table and memoised (a cache per kernel thread in front of one shared, sharded cache),
// formula for formula as ktae_kernels/fisher.py (_pvalue_grid, fisher_weight) and ktae_kernels/method.py
// (information_gain, cohen_h, table_statistics) compute them in float64:
//   p:  scipy's two-sided Fisher test in log space (log-factorials from lgamma, log-sum-exp over the
//       support, relative tolerance 1e-14 plus a float64 rounding margin, min(p, 1));
//   F = exp(-2 p), 0 where p >= 1 - 1e-12 or the table is not informative; IG in bits; Cohen's h.
// The statistics do not depend on the configuration (strength = alpha F + beta IG is formed by the
// caller), so the caches are keyed by the table alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace ktae {

struct Table {
  int64_t a, b, n_c, n_w;
};

struct TableStats {
  double F, IG, h;
};

constexpr double kScipyRtol = 1e-14;                       // fisher.SCIPY_RTOL
constexpr double kPOne = 1.0 - 1e-12;                      // fisher.P_ONE
constexpr double kLogErr = 16 * 2.220446049250313e-16;     // fisher._LOG_ERR
constexpr double kLog2 = 0.6931471805599453;               // math.log(2.0)
constexpr int64_t kLogFactorials = int64_t(1) << 16;       // tabulated log(k!), k < this

// log(k!) as torch.lgamma(k + 1.0) computes it (glibc's lgamma), tabulated once for small k.
inline double log_factorial(int64_t k) {
  static const std::vector<double>* table = [] {
    auto* t = new std::vector<double>(size_t(kLogFactorials));
    for (int64_t j = 0; j < kLogFactorials; ++j) (*t)[size_t(j)] = std::lgamma(double(j) + 1.0);
    return t;
  }();
  return k < kLogFactorials ? (*table)[size_t(k)] : std::lgamma(double(k) + 1.0);
}

// Tabulate the log-factorials before the kernel threads start (the static initialisation is
// thread-safe anyway; this keeps its cost out of one group's time).
inline void ensure_log_factorials() { log_factorial(0); }

// log-sum-exp of lp[0..n) over the entries where keep[j], as torch.logsumexp (max subtracted).
inline double log_sum_exp(const double* lp, const bool* keep, int64_t n) {
  double top = -INFINITY;
  for (int64_t j = 0; j < n; ++j)
    if (keep[j]) top = std::max(top, lp[j]);
  const double shift = std::isinf(top) ? 0.0 : top;
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j)
    if (keep[j]) sum += std::exp(lp[j] - shift);
  return std::log(sum) + shift;
}

// Two-sided Fisher p-value of the table, as fisher._pvalue_grid.
inline double fisher_pvalue(const Table& t) {
  const int64_t c = t.n_c - t.a, d = t.n_w - t.b;
  const int64_t n1 = t.a + t.b, n2 = c + d, col = t.a + c;
  if (n1 == 0 || n2 == 0 || col == 0 || col == n1 + n2) return 1.0;
  const int64_t lo = std::max<int64_t>(col - n2, 0), hi = std::min(n1, col), width = hi - lo + 1;
  auto lp_at = [&](int64_t k) {
    return -(log_factorial(k) + log_factorial(n1 - k) + log_factorial(col - k) + log_factorial(n2 - col + k));
  };
  thread_local std::vector<double> lp;
  thread_local std::unique_ptr<bool[]> keep, all;
  thread_local int64_t capacity = 0;
  if (width > capacity) {
    capacity = std::max(width, 2 * capacity);
    keep.reset(new bool[size_t(capacity)]);
    all.reset(new bool[size_t(capacity)]);
    std::fill(all.get(), all.get() + capacity, true);
  }
  lp.resize(size_t(width));
  double top = -INFINITY;
  for (int64_t j = 0; j < width; ++j) top = std::max(top, lp[size_t(j)] = lp_at(lo + j));
  const double lp_obs = lp_at(t.a);
  const double tol = std::log1p(kScipyRtol) + kLogErr * std::abs(lp_obs);
  if (lp_obs >= top - tol) return 1.0;
  const double limit = lp_obs + tol;
  for (int64_t j = 0; j < width; ++j) keep[j] = lp[size_t(j)] <= limit;
  const double p = std::exp(log_sum_exp(lp.data(), keep.get(), width) - log_sum_exp(lp.data(), all.get(), width));
  return std::min(p, 1.0);
}

// Binary entropy in bits with 0 log 0 = 0, as method.binary_entropy.
inline double binary_entropy(double p) {
  const double q = 1.0 - p;
  const double xlogx = (p == 0.0 ? 0.0 : p * std::log(p)) + (q == 0.0 ? 0.0 : q * std::log(q));
  return -xlogx / kLog2;
}

// F, IG and h of a table whose p-value is p, as method.table_statistics (exact mode).
inline TableStats statistics_of(const Table& t, double p) {
  const double a = double(t.a), b = double(t.b), n_c = double(t.n_c), n_w = double(t.n_w);
  const double c = n_c - a, d = n_w - b;
  const double h = std::asin(std::sqrt(a / double(std::max<int64_t>(t.n_c, 1)))) -
                   std::asin(std::sqrt(b / double(std::max<int64_t>(t.n_w, 1))));
  const bool informative = t.n_c > 0 && t.n_w > 0 && t.a + t.b < t.n_c + t.n_w;
  if (!informative) return {0.0, 0.0, h};
  const double n = std::max(n_c + n_w, 1.0), present = a + b, absent = c + d;
  const double h_y = binary_entropy(n_c / n);
  const double h_present = present > 0 ? present / n * binary_entropy(a / std::max(present, 1.0)) : 0.0;
  const double h_absent = absent > 0 ? absent / n * binary_entropy(c / std::max(absent, 1.0)) : 0.0;
  const double IG = std::max(h_y - h_present - h_absent, 0.0);
  const double F = p >= kPOne ? 0.0 : std::exp(-2.0 * p);
  return {F, IG, h};
}

inline TableStats compute_statistics(const Table& t) { return statistics_of(t, fisher_pvalue(t)); }

// Tables whose counts all fit 16 bits are cached under one 64-bit key.
constexpr int64_t kKeyLimit = int64_t(1) << 16;

inline bool cacheable(const Table& t) { return t.n_c < kKeyLimit && t.n_w < kKeyLimit; }

inline uint64_t key_of(const Table& t) {
  return uint64_t(t.a) | uint64_t(t.b) << 16 | uint64_t(t.n_c) << 32 | uint64_t(t.n_w) << 48;
}

// The shared cache: kShards maps, each behind its own mutex, each emptied when it reaches kShardLimit
// tables (about 1M tables, 40 MB, in all). `generation` changes when it is cleared.
class SharedStatistics {
 public:
  static constexpr int kShards = 64;
  static constexpr size_t kShardLimit = size_t(1) << 14;

  TableStats get(const Table& t) {
    const uint64_t key = key_of(t);
    Shard& shard = shards_[(key * 0x9e3779b97f4a7c15ull) >> 58];
    {
      std::lock_guard<std::mutex> lock(shard.mutex);
      auto it = shard.map.find(key);
      if (it != shard.map.end()) return it->second;
    }
    const TableStats s = compute_statistics(t);  // outside the lock; a race computes the same value twice
    std::lock_guard<std::mutex> lock(shard.mutex);
    if (shard.map.size() >= kShardLimit) shard.map.clear();
    shard.map.emplace(key, s);
    return s;
  }

  size_t size() {
    size_t n = 0;
    for (Shard& shard : shards_) {
      std::lock_guard<std::mutex> lock(shard.mutex);
      n += shard.map.size();
    }
    return n;
  }

  void clear() {
    for (Shard& shard : shards_) {
      std::lock_guard<std::mutex> lock(shard.mutex);
      shard.map.clear();
    }
    generation.fetch_add(1);
  }

  std::atomic<uint64_t> generation{0};

 private:
  struct Shard {
    std::mutex mutex;
    std::unordered_map<uint64_t, TableStats> map;
  };
  Shard shards_[kShards];
};

inline SharedStatistics& shared_statistics() {
  static SharedStatistics* s = new SharedStatistics();  // never destroyed: threads may outlive it
  return *s;
}

inline size_t shared_cache_size() { return shared_statistics().size(); }
inline void clear_shared_cache() { shared_statistics().clear(); }

// One kernel thread's cache in front of the shared one (no lock on a hit); emptied when it reaches
// kLimit tables or the shared cache was cleared.
class LocalStatistics {
 public:
  static constexpr size_t kLimit = size_t(1) << 16;

  TableStats get(const Table& t) {
    if (!cacheable(t)) return compute_statistics(t);
    SharedStatistics& shared = shared_statistics();
    const uint64_t generation = shared.generation.load(std::memory_order_relaxed);
    if (generation != generation_ || map_.size() >= kLimit) {
      map_.clear();
      generation_ = generation;
    }
    const uint64_t key = key_of(t);
    auto it = map_.find(key);
    if (it != map_.end()) return it->second;
    const TableStats s = shared.get(t);
    map_.emplace(key, s);
    return s;
  }

 private:
  std::unordered_map<uint64_t, TableStats> map_;
  uint64_t generation_ = 0;
};

}  // namespace ktae
