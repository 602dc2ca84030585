// Native CPU kernel of ktae_kernels (module ktae_kernels._cpu): C++17, OpenMP, no torch at build time.
//
// One OpenMP task per group. A thread counts its group's tokens into a compact table reached from
// the token id (a dense map for ids < kDenseIds, a hash map above), scores every distinct id once from the per-table
// statistics that ktae_kernels/method.py computed (strength = alpha F + beta IG and Cohen's h, looked
// up at offset[g] + a * stride[g] + b), and writes the group's [G, L] advantages while its ids are
// still in cache. Groups are independent and each is computed by one thread in a fixed order, so the
// output is bitwise identical for any number of threads.
//
// The Python side (ktae_kernels/cpu.py) passes raw addresses of tensors it validated and keeps alive;
// the GIL is released while the kernel runs.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace {

constexpr int64_t kMaxTokenId = 2147483647;  // ids are < 2**31
constexpr int64_t kDenseIds = int64_t(1) << 18;  // covers every common vocabulary (Qwen 151,936; Gemma 262,144)
constexpr double kTfEps = 1e-5;                   // method.TF_EPS

// Per (group, token id): presence and occurrences (f_c | f_w << 32). While counting a group of at
// most 64 rollouts, `pres` holds one bit per rollout; otherwise (and after counting) it is a | b << 32.
struct Entry {
  uint64_t pres;
  uint64_t occ;
};

constexpr int64_t kBitsRollouts = 64;

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

struct Params {
  const int64_t* offset;    // [n_groups] grid offset
  const int64_t* stride;    // [n_groups] grid stride (n_w + 1)
  const double* strength;   // [grid] alpha F + beta IG
  const double* h;          // [grid] Cohen's h
  const int64_t* ignore;    // sorted ignored ids
  int64_t n_ignore;
  const double* base;       // [B] rollout advantage
  double k1, b, alpha_beta, top, bound, weight;
  int use_tf;
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
// seen yet), in a 4-byte dense map for small ids and a hash map above; the group's entries, token
// ids and weighted scores are compact arrays in first-seen order. `slot` is all-zero between groups.
struct Workspace {
  std::vector<uint32_t> slot;
  std::unordered_map<int64_t, uint32_t> sparse;
  Buffer<Entry> entries;
  Buffer<int64_t> last;       // groups of more than kBitsRollouts rollouts: the last rollout of each entry
  Buffer<int64_t> tokens;
  Buffer<uint32_t> position;  // the slot of each masked position of the group, in order
  int64_t n_entries = 0;
  std::vector<double> scores;
  std::vector<double> memo;  // score by (a, b, f_c, f_w) for small counts, NaN when not computed yet

  Workspace() : slot(kDenseIds, 0) {}

  // Room for a group of `positions` positions: at most that many entries, plus one spare that
  // counting writes ahead into.
  void begin_group(int64_t positions) {
    entries.ensure(positions + 1);
    last.ensure(positions + 1);
    tokens.ensure(positions + 1);
    position.ensure(positions);
    n_entries = 0;
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
  int64_t n_c = 0;           // correct rollouts
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

// Count one group's masked tokens into `ws`: presence as rollout bits (kBits) or with last-seen stamps.
// A new id's entry is written ahead into the spare entry for every token and kept only when the id
// is new: no branch on the (frequent, unpredictable) first occurrences.
template <bool kBits>
GroupTotals count_group_as(const Batch& in, int64_t g, Workspace& ws) {
  GroupTotals tot;
  uint64_t correct_bits = 0;
  ws.begin_group((in.start[g + 1] - in.start[g]) * in.L);
  Entry* entries = ws.entries.data.get();
  int64_t* tokens = ws.tokens.data.get();
  int64_t* last = ws.last.data.get();
  uint32_t* position = ws.position.data.get();
  int64_t n_entries = 0;
  for (int64_t k = in.start[g]; k < in.start[g + 1]; ++k) {
    const int64_t i = in.order[k], local = k - in.start[g];
    const int64_t* ids = in.ids + i * in.ids_stride;
    const uint8_t* m = in.mask + i * in.mask_stride;
    const bool is_c = in.correct[i] != 0;
    const uint64_t inc = is_c ? uint64_t(1) : (uint64_t(1) << 32);
    const uint64_t bit = kBits ? uint64_t(1) << local : 0;
    if (kBits && is_c) correct_bits |= bit;
    int64_t n = 0;
    for (int64_t t = 0; t < in.L; ++t) {
      if (!m[t]) continue;
      const int64_t id = ids[t];
      if (static_cast<uint64_t>(id) > static_cast<uint64_t>(kMaxTokenId)) {
        tot.bad_id = true;
        continue;
      }
      ++n;
      uint32_t& s = id < kDenseIds ? ws.slot[size_t(id)] : ws.sparse[id];
      const uint32_t found = s;
      entries[n_entries] = Entry{0, 0};
      tokens[n_entries] = id;
      if (!kBits) last[n_entries] = -1;
      const bool fresh = found == 0;
      const uint32_t here = fresh ? uint32_t(n_entries + 1) : found;
      n_entries += fresh ? 1 : 0;
      s = here;
      *position++ = here;
      Entry& e = entries[here - 1];
      if (kBits) {
        e.pres |= bit;
      } else {
        int64_t& seen = last[here - 1];
        e.pres += (seen != k) ? inc : 0;
        seen = k;
      }
      e.occ += inc;
    }
    (is_c ? tot.T_c : tot.T_w) += n;
    tot.n_c += is_c ? 1 : 0;
  }
  ws.n_entries = n_entries;
  if (kBits) bits_to_counts(entries, n_entries, correct_bits);
  return tot;
}

GroupTotals count_group(const Batch& in, int64_t g, Workspace& ws) {
  return in.start[g + 1] - in.start[g] <= kBitsRollouts ? count_group_as<true>(in, g, ws)
                                                        : count_group_as<false>(in, g, ws);
}

// BM25 saturated frequency, as method.bm25_tf / method.bm25_norm.
inline double bm25_tf(uint64_t f, int64_t T, double avg, const Params& p) {
  if (f == 0) return 0.0;
  const double q = double(f) / double(std::max<int64_t>(T, 1));
  const double K = p.k1 * ((1.0 - p.b) + (p.b * double(T)) / std::max(avg, 1e-300));
  return (q * (p.k1 + 1.0)) / (q + K);
}

// The score of one (group, token) row, as method.score_rows.
inline double score_of(int64_t entry, uint64_t occ, const GroupTotals& tot, double avg, const Params& p) {
  double x = p.h[entry];
  if (p.use_tf) {
    const double tf_c = bm25_tf(lo(occ), tot.T_c, avg, p), tf_w = bm25_tf(hi(occ), tot.T_w, avg, p);
    x = x + (tf_c / (tf_w + kTfEps) - tf_w / (tf_c + kTfEps));
  }
  const double key = (p.strength[entry] * x) / p.alpha_beta;
  return std::min(p.bound, std::max(-p.bound, p.top * std::tanh(key / 2.0)));
}

// Most ids of a group are rare, and the score depends only on (a, b, f_c, f_w): scores of ids seen at
// most kMemoCount times per class are memoised per group (when the group's grid is small).
constexpr uint64_t kMemoCount = 4;
constexpr int64_t kMemoLimit = int64_t(1) << 16;

// weight * score of every distinct id of group g, into ws.scores, as method.score_rows.
void score_group(int64_t g, const GroupTotals& tot, const Params& p, Workspace& ws) {
  const double avg = double(tot.T_c + tot.T_w) / 2.0;
  const int64_t offset = p.offset[g], stride = p.stride[g];
  const int64_t memo_size = (tot.n_c + 1) * stride * int64_t(kMemoCount * kMemoCount);
  const bool memo = memo_size <= kMemoLimit;
  if (memo) ws.memo.assign(size_t(memo_size), std::nan(""));
  ws.scores.resize(size_t(ws.n_entries));
  for (int64_t j = 0; j < ws.n_entries; ++j) {
    const Entry& e = ws.entries.data[j];
    const int64_t table = int64_t(lo(e.pres)) * stride + int64_t(hi(e.pres));
    double score;
    if (memo && lo(e.occ) < kMemoCount && hi(e.occ) < kMemoCount) {
      double& cached = ws.memo[size_t((table * int64_t(kMemoCount) + int64_t(lo(e.occ))) * int64_t(kMemoCount) + int64_t(hi(e.occ)))];
      if (std::isnan(cached)) cached = score_of(offset + table, e.occ, tot, avg, p);
      score = cached;
    } else {
      score = score_of(offset + table, e.occ, tot, avg, p);
    }
    if (p.n_ignore && std::binary_search(p.ignore, p.ignore + p.n_ignore, ws.tokens.data[j])) score = 0.0;
    ws.scores[size_t(j)] = score * p.weight;
  }
}

// out[i, t] = float32(weight * score + base[i]) under the mask, 0 elsewhere, for group g's rollouts
// (the masked positions' slots were recorded in order while counting: no second read of the ids).
void write_group(const Batch& in, int64_t g, const Params& p, Workspace& ws, float* out) {
  const double* scores = ws.scores.data() - 1;  // indexed by slot (1 + entry index)
  const uint32_t* slot = ws.position.data.get();
  for (int64_t k = in.start[g]; k < in.start[g + 1]; ++k) {
    const int64_t i = in.order[k];
    const uint8_t* m = in.mask + i * in.mask_stride;
    const double base = p.base[i];
    float* o = out + i * in.L;
    for (int64_t t = 0; t < in.L; ++t)
      o[t] = m[t] ? static_cast<float>(scores[*slot++] + base) : 0.0f;
  }
}

// Rows of group g sorted by token id: token, a, b, f_c, f_w written from `row`.
int64_t emit_rows(Workspace& ws, int64_t row, int64_t* const cols[5]) {
  const int64_t* tokens = ws.tokens.data.get();
  std::vector<uint32_t> by_token(size_t(ws.n_entries));
  for (size_t j = 0; j < by_token.size(); ++j) by_token[j] = uint32_t(j);
  std::sort(by_token.begin(), by_token.end(), [&](uint32_t x, uint32_t y) { return tokens[x] < tokens[y]; });
  for (uint32_t j : by_token) {
    const Entry& e = ws.entries.data[j];
    cols[0][row] = tokens[j];
    cols[1][row] = int64_t(lo(e.pres));
    cols[2][row] = int64_t(hi(e.pres));
    cols[3][row] = int64_t(lo(e.occ));
    cols[4][row] = int64_t(hi(e.occ));
    ++row;
  }
  return int64_t(by_token.size());
}

template <typename T>
T* ptr(unsigned long long address) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

int clamp_threads(int n) { return n < 1 ? 1 : n; }

// fn(g, workspace) -> whether group g held an out-of-range id, for every group, on `threads` OpenMP
// threads (dynamic schedule), each with a workspace from the pool. Returns whether any group did.
template <typename Fn>
bool for_each_group(long long n_groups, int threads, Fn fn) {
  int bad = 0;
#pragma omp parallel num_threads(clamp_threads(threads)) reduction(| : bad)
  {
    std::unique_ptr<Workspace> owned = pool().take();
#pragma omp for schedule(dynamic, 1)
    for (long long g = 0; g < n_groups; ++g) bad |= fn(int64_t(g), *owned) ? 1 : 0;
    pool().give(std::move(owned));
  }
  return bad != 0;
}

// advantage(ids, ids_stride, mask, mask_stride, L, order, start, n_groups, correct, offset, stride,
//           strength, h, ignore, n_ignore, base, k1, b, alpha_beta, top, bound, weight, use_tf, out, threads)
// -> True when every masked id was in range (else the output is incomplete).
PyObject* advantage(PyObject*, PyObject* args) {
  unsigned long long ids, mask, order, start, correct, offset, stride, strength, h, ignore, base, out;
  long long ids_stride, mask_stride, L, n_groups, n_ignore;
  double k1, b, alpha_beta, top, bound, weight;
  int use_tf, threads;
  if (!PyArg_ParseTuple(args, "KLKLLKKLKKKKKKLKddddddpKi", &ids, &ids_stride, &mask, &mask_stride, &L, &order,
                        &start, &n_groups, &correct, &offset, &stride, &strength, &h, &ignore, &n_ignore, &base,
                        &k1, &b, &alpha_beta, &top, &bound, &weight, &use_tf, &out, &threads))
    return nullptr;
  const Batch in{ptr<const int64_t>(ids), ids_stride, ptr<const uint8_t>(mask), mask_stride, L,
                 ptr<const int64_t>(order), ptr<const int64_t>(start), ptr<const uint8_t>(correct)};
  const Params p{ptr<const int64_t>(offset), ptr<const int64_t>(stride), ptr<const double>(strength),
                 ptr<const double>(h), ptr<const int64_t>(ignore), n_ignore, ptr<const double>(base),
                 k1, b, alpha_beta, top, bound, weight, use_tf};
  float* result = ptr<float>(out);
  bool bad;
  Py_BEGIN_ALLOW_THREADS
  bad = for_each_group(n_groups, threads, [&](int64_t g, Workspace& ws) {
    const GroupTotals tot = count_group(in, g, ws);
    if (!tot.bad_id) {  // an out-of-range id was never counted: do not look it up
      score_group(g, tot, p, ws);
      write_group(in, g, p, ws, result);
    }
    ws.reset();
    return tot.bad_id;
  });
  Py_END_ALLOW_THREADS
  return PyBool_FromLong(!bad);
}

// rows(ids, ids_stride, mask, mask_stride, L, order, start, n_groups, correct, row_offset,
//      token, a, b, f_c, f_w, n_rows, T_c, T_w, threads)
// Group g's rows, sorted by token, go to row_offset[g] ..; n_rows[g], T_c[g], T_w[g] are written.
// -> True when every masked id was in range.
PyObject* rows(PyObject*, PyObject* args) {
  unsigned long long ids, mask, order, start, correct, row_offset, token, a, b, f_c, f_w, n_rows, T_c, T_w;
  long long ids_stride, mask_stride, L, n_groups;
  int threads;
  if (!PyArg_ParseTuple(args, "KLKLLKKLKKKKKKKKKKi", &ids, &ids_stride, &mask, &mask_stride, &L, &order, &start,
                        &n_groups, &correct, &row_offset, &token, &a, &b, &f_c, &f_w, &n_rows, &T_c, &T_w, &threads))
    return nullptr;
  const Batch in{ptr<const int64_t>(ids), ids_stride, ptr<const uint8_t>(mask), mask_stride, L,
                 ptr<const int64_t>(order), ptr<const int64_t>(start), ptr<const uint8_t>(correct)};
  int64_t* const cols[5] = {ptr<int64_t>(token), ptr<int64_t>(a), ptr<int64_t>(b), ptr<int64_t>(f_c), ptr<int64_t>(f_w)};
  const int64_t* offsets = ptr<const int64_t>(row_offset);
  int64_t *counts = ptr<int64_t>(n_rows), *tc = ptr<int64_t>(T_c), *tw = ptr<int64_t>(T_w);
  bool bad;
  Py_BEGIN_ALLOW_THREADS
  bad = for_each_group(n_groups, threads, [&](int64_t g, Workspace& ws) {
    const GroupTotals tot = count_group(in, g, ws);
    counts[g] = emit_rows(ws, offsets[g], cols);
    tc[g] = tot.T_c;
    tw[g] = tot.T_w;
    ws.reset();
    return tot.bad_id;
  });
  Py_END_ALLOW_THREADS
  return PyBool_FromLong(!bad);
}

// floor(ids, ids_stride, mask, mask_stride, B, L, out, threads): out[i, t] = mask ? float(id) : 0, the
// least any implementation must do (read the ids and the mask once, write float32 once); the
// benchmark's memory floor.
PyObject* floor_pass(PyObject*, PyObject* args) {
  unsigned long long ids, mask, out;
  long long ids_stride, mask_stride, B, L;
  int threads;
  if (!PyArg_ParseTuple(args, "KLKLLLKi", &ids, &ids_stride, &mask, &mask_stride, &B, &L, &out, &threads))
    return nullptr;
  const int64_t* id = ptr<const int64_t>(ids);
  const uint8_t* m = ptr<const uint8_t>(mask);
  float* o = ptr<float>(out);
  Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
  for (long long i = 0; i < B; ++i)
    for (long long t = 0; t < L; ++t)
      o[i * L + t] = m[i * mask_stride + t] ? static_cast<float>(id[i * ids_stride + t]) : 0.0f;
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// advise_huge(address, bytes): ask Linux to back a fresh output buffer with transparent huge pages,
// so the first write faults in 2 MB pages instead of 4 KB ones (a no-op elsewhere). Returns whether
// the hint was taken.
PyObject* advise_huge(PyObject*, PyObject* args) {
  unsigned long long address, bytes;
  if (!PyArg_ParseTuple(args, "KK", &address, &bytes)) return nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  const uintptr_t start = (uintptr_t(address) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (uintptr_t(address) + uintptr_t(bytes)) & ~(kHuge - 1);
  if (end > start && madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE) == 0) Py_RETURN_TRUE;
#else
  (void)address;
  (void)bytes;
#endif
  Py_RETURN_FALSE;
}

PyObject* openmp(PyObject*, PyObject*) {
#ifdef _OPENMP
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyMethodDef kMethods[] = {
    {"advantage", advantage, METH_VARARGS, "Fused count, score and write of the [B, L] advantages."},
    {"rows", rows, METH_VARARGS, "Per-group (token, a, b, f_c, f_w) rows sorted by token, and T_c, T_w."},
    {"floor", floor_pass, METH_VARARGS, "The memory floor: read ids and mask once, write float32 once."},
    {"advise_huge", advise_huge, METH_VARARGS, "Hint huge pages for a fresh output buffer (Linux)."},
    {"openmp", openmp, METH_NOARGS, "Whether the module was built with OpenMP."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cpu", "ktae_kernels native CPU kernel (see ktae_kernels/cpu.py)",
                       -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__cpu() { return PyModule_Create(&kModule); }
