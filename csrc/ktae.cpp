// Torch bindings of the KTAE group kernels: ktae_kernels._C.
//
// Checks every tensor's dtype, device, layout and shape, then launches one pass of the group kernel
// (ktae_kernels.h). Free of CUDA headers: the caller passes the stream handle and sets the current
// device (ktae_kernels/cuda.py does both), so this file also builds against a CPU-only torch and
// links with the CPU emulator of the kernels for the tests.
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#include "ktae_kernels.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

void check(const Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape,
           const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == dtype, "ktae_kernels._C: `", name, "` must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == device, "ktae_kernels._C: `", name, "` must be on ", device, ", got ",
              t.device());
  TORCH_CHECK(t.sizes() == shape, "ktae_kernels._C: `", name, "` must have shape ", shape, ", got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), "ktae_kernels._C: `", name, "` must be contiguous");
}

const Tensor& required(const OptTensor& t, const char* name, const char* when) {
  TORCH_CHECK(t.has_value(), "ktae_kernels._C: `", name, "` is required ", when);
  return *t;
}

template <class T>
T* ptr(const Tensor& t) {
  return t.numel() ? t.data_ptr<T>() : nullptr;
}

// `responses` on the device the kernels run on (the GPU, or the CPU under the emulator) and [B, L].
void check_responses(const Tensor& responses) {
  const at::DeviceType kind = ktae::runs_on_cpu() ? at::kCPU : at::kCUDA;
  TORCH_CHECK(responses.device().type() == kind, "ktae_kernels._C: tensors must be on ",
              at::DeviceTypeName(kind), ", got ", responses.device());
  TORCH_CHECK(responses.dim() == 2, "ktae_kernels._C: `responses` must be [B, L], got ", responses.sizes());
}

// The scoring constants every table kernel reads: params = [alpha, beta, k1, b, top, weight], use_tf.
void set_scoring(ktae::KernelArgs& args, const std::vector<double>& params, bool use_tf) {
  TORCH_CHECK(params.size() == 6, "ktae_kernels._C: `params` must be [alpha, beta, k1, b, top, weight]");
  args.alpha = params[0];
  args.beta = params[1];
  args.k1 = params[2];
  args.bm25_b = params[3];
  args.top = params[4];
  args.weight = params[5];
  args.use_tf = use_tf;
}

// One pass of the rows kernel over the groups in `block_group` (see ktae_kernels.h for each
// argument): kCount, or kRows. Optional tensors are needed only by some modes / table kinds.
void launch(int64_t mode, bool shared_table, const Tensor& responses, const Tensor& mask,
            const Tensor& members, const Tensor& starts, const Tensor& correct,
            const Tensor& group_counts, const Tensor& block_group, int64_t blocks, bool skip_done,
            int64_t words, int64_t shared_capacity, bool packed,
            const OptTensor& ws_keys, const OptTensor& ws_counts, const OptTensor& ws_presence,
            const OptTensor& ws_offset, const OptTensor& ws_capacity, const Tensor& bad_ids, const Tensor& status,
            const OptTensor& row_offset, const OptTensor& row_ints, int64_t threads, int64_t shared_bytes,
            int64_t stream) {
  TORCH_CHECK(mode == ktae::kCount || mode == ktae::kRows,
              "ktae_kernels._C: `mode` must be 0 (count) or 1 (rows), got ", mode);
  check_responses(responses);
  const at::Device device = responses.device();
  const int64_t B = responses.size(0), L = responses.size(1);
  const int64_t n_groups = starts.numel() - 1;
  const int64_t n_items = block_group.numel();
  TORCH_CHECK(n_groups >= 0, "ktae_kernels._C: `starts` must hold n_groups + 1 offsets");
  check(responses, "responses", at::kLong, {B, L}, device);
  check(mask, "mask", at::kBool, {B, L}, device);
  check(members, "members", at::kLong, {B}, device);
  check(starts, "starts", at::kLong, {n_groups + 1}, device);
  check(correct, "correct", at::kBool, {B}, device);
  check(group_counts, "group_counts", at::kLong, {4, n_groups}, device);
  check(block_group, "block_group", at::kLong, {n_items}, device);
  check(status, "status", at::kLong, {n_groups}, device);
  check(bad_ids, "bad_ids", at::kLong, {2}, device);
  TORCH_CHECK(blocks >= 1 && blocks <= std::max<int64_t>(n_items, 1) && blocks <= std::numeric_limits<int32_t>::max(),
              "ktae_kernels._C: `blocks` must be in [1, len(block_group)], got ", blocks);
  TORCH_CHECK(words >= 1, "ktae_kernels._C: `words` must be >= 1, got ", words);
  TORCH_CHECK(threads >= 32 && threads <= ktae::kMaxThreads && threads % 32 == 0,
              "ktae_kernels._C: `threads` must be a multiple of 32 in [32, ", ktae::kMaxThreads, "], got ", threads);

  ktae::KernelArgs args{};
  args.responses = ptr<int64_t>(responses);
  args.mask = ptr<bool>(mask);
  args.length = L;
  args.members = ptr<int64_t>(members);
  args.starts = ptr<int64_t>(starts);
  args.correct = ptr<bool>(correct);
  args.group_counts = ptr<int64_t>(group_counts);
  args.n_groups = n_groups;
  args.block_group = ptr<int64_t>(block_group);
  args.n_items = n_items;
  args.skip_done = skip_done;
  args.words = static_cast<int32_t>(words);
  args.status = ptr<int64_t>(status);
  args.bad_ids = reinterpret_cast<long long*>(ptr<int64_t>(bad_ids));

  if (shared_table) {
    TORCH_CHECK(shared_capacity >= 2 && (shared_capacity & (shared_capacity - 1)) == 0,
                "ktae_kernels._C: `shared_capacity` must be a power of two >= 2, got ", shared_capacity);
    TORCH_CHECK(!packed || words == 1, "ktae_kernels._C: `packed` tables need `words` == 1");
    TORCH_CHECK(shared_bytes >= ktae::shared_table_bytes(shared_capacity, words, packed),
                "ktae_kernels._C: `shared_bytes` is too small for the shared table");
    args.shared_capacity = shared_capacity;
    args.packed = packed;
  } else {
    const char* when = "for a global-memory table";
    const Tensor& keys = required(ws_keys, "ws_keys", when);
    const int64_t slots = keys.numel();
    check(keys, "ws_keys", at::kInt, {slots}, device);
    if (mode != ktae::kCount) {  // counting reads and writes keys only
      check(required(ws_counts, "ws_counts", when), "ws_counts", at::kLong, {slots}, device);
      check(required(ws_presence, "ws_presence", when), "ws_presence", at::kInt, {slots * words}, device);
    }
    check(required(ws_offset, "ws_offset", when), "ws_offset", at::kLong, {n_items}, device);
    check(required(ws_capacity, "ws_capacity", when), "ws_capacity", at::kLong, {n_items}, device);
    TORCH_CHECK(shared_bytes >= ktae::header_bytes(words), "ktae_kernels._C: `shared_bytes` is too small");
    args.ws_keys = reinterpret_cast<uint32_t*>(ptr<int32_t>(keys));
    if (mode != ktae::kCount) {
      args.ws_counts = reinterpret_cast<unsigned long long*>(ptr<int64_t>(*ws_counts));
      args.ws_presence = reinterpret_cast<uint32_t*>(ptr<int32_t>(*ws_presence));
    }
    args.ws_offset = ptr<int64_t>(*ws_offset);
    args.ws_capacity = ptr<int64_t>(*ws_capacity);
  }

  if (mode == ktae::kRows) {
    const char* when = "in rows mode";
    const int64_t n_rows = required(row_ints, "row_ints", when).size(-1);
    check(required(row_offset, "row_offset", when), "row_offset", at::kLong, {n_groups + 1}, device);
    check(*row_ints, "row_ints", at::kLong, {ktae::kRowInts, n_rows}, device);
    args.row_offset = ptr<int64_t>(*row_offset);
    args.row_ints = ptr<int64_t>(*row_ints);
    args.n_rows = n_rows;
  }

  if (n_items == 0) return;
  const int err = ktae::launch_group_kernel(args, static_cast<ktae::Mode>(mode), shared_table, blocks,
                                            static_cast<int>(threads), shared_bytes,
                                            reinterpret_cast<void*>(static_cast<intptr_t>(stream)));
  TORCH_CHECK(err == 0, "ktae_kernels._C: kernel launch failed: ", ktae::error_string(err));
}

// The whole token_advantage with static-bound sizing (ktae::launch_advantage): the bookkeeping, a
// shared-table pass and, with fallback_blocks > 0, a global-memory pass, nothing read back. The
// workspace (int64, ktae::advantage_layout) is written; its first entries are the flags
// (ktae::kAdvantageFlags). The scores come from table_values (the device grid) and log_factorial
// (groups past it), or from the given rows (row_offset, given_token, given_score: fisher="upstream").
void advantage(const Tensor& responses, const Tensor& mask, const Tensor& group, const Tensor& members,
               const Tensor& rewards, const OptTensor& correct, const OptTensor& given,
               const OptTensor& table_values, int64_t grid_bound, const OptTensor& log_factorial,
               const OptTensor& row_offset, const OptTensor& given_token, const OptTensor& given_score,
               const Tensor& ignore_ids, const Tensor& workspace, const Tensor& out, int64_t n_groups,
               const std::vector<double>& params, bool use_tf, double threshold, int64_t baseline, double eps,
               const std::vector<double>& constants, int64_t shared_bytes, int64_t max_capacity,
               bool allow_packed, int64_t fallback_blocks, int64_t fallback_bytes, bool slot_index,
               int64_t threads, int64_t stream) {
  check_responses(responses);
  const at::Device device = responses.device();
  const int64_t B = responses.size(0), L = responses.size(1);
  TORCH_CHECK(n_groups >= 0, "ktae_kernels._C: `n_groups` must be >= 0");
  check(responses, "responses", at::kLong, {B, L}, device);
  check(mask, "mask", at::kBool, {B, L}, device);
  check(group, "group", at::kLong, {B}, device);
  check(members, "members", at::kLong, {B}, device);
  check(rewards, "rewards", at::kDouble, {B}, device);
  check(ignore_ids, "ignore_ids", at::kLong, {ignore_ids.numel()}, device);
  check(out, "out", at::kFloat, {B, L}, device);
  if (correct.has_value()) check(*correct, "correct", at::kBool, {B}, device);
  if (given.has_value()) check(*given, "given", at::kDouble, {B}, device);
  TORCH_CHECK(baseline >= ktae::kBaselineGrpo && baseline <= ktae::kBaselineGiven,
              "ktae_kernels._C: `baseline` must be 0 (grpo), 1 (mean), 2 (none) or 3 (given), got ", baseline);
  TORCH_CHECK((baseline == ktae::kBaselineGiven) == given.has_value(),
              "ktae_kernels._C: `given` goes with baseline 3 (given), and only with it");
  TORCH_CHECK(constants.size() == 4, "ktae_kernels._C: `constants` must be [log_rtol, log_err, p_one, ln2]");
  TORCH_CHECK(threads >= 32 && threads <= ktae::kMaxThreads && threads % 32 == 0,
              "ktae_kernels._C: `threads` must be a multiple of 32 in [32, ", ktae::kMaxThreads, "], got ", threads);
  TORCH_CHECK(max_capacity >= 2 && (max_capacity & (max_capacity - 1)) == 0,
              "ktae_kernels._C: `max_capacity` must be a power of two >= 2, got ", max_capacity);
  TORCH_CHECK(shared_bytes >= 0 && fallback_blocks >= 0 && fallback_bytes >= 0,
              "ktae_kernels._C: `shared_bytes`, `fallback_blocks` and `fallback_bytes` must be >= 0");
  TORCH_CHECK(shared_bytes > 0 || fallback_blocks > 0 || n_groups == 0,
              "ktae_kernels._C: no pass would take the groups (shared_bytes and fallback_blocks are 0)");
  TORCH_CHECK(fallback_blocks == 0 || fallback_bytes / fallback_blocks >= 64,
              "ktae_kernels._C: `fallback_bytes` gives each of the `fallback_blocks` less than 64 bytes");
  const ktae::AdvantageLayout layout = ktae::advantage_layout(B, n_groups, fallback_bytes, slot_index ? B * L : 0);
  check(workspace, "workspace", at::kLong, {workspace.numel()}, device);
  TORCH_CHECK(workspace.numel() >= layout.total, "ktae_kernels._C: `workspace` must hold ", layout.total,
              " int64, got ", workspace.numel());
  int64_t lf_size = 0;
  if (log_factorial.has_value()) {
    check(*log_factorial, "log_factorial", at::kDouble, {log_factorial->numel()}, device);
    lf_size = log_factorial->numel();
  }
  // the largest group has at most B - n_groups + 1 rollouts; its statistics need log(k!) up to there
  const int64_t largest = n_groups > 0 ? B - n_groups + 1 : 0;
  int64_t table_size = 0;
  if (table_values.has_value()) {
    TORCH_CHECK(table_values->dim() == 2, "ktae_kernels._C: `table_values` must be [2, size], got ", table_values->sizes());
    check(*table_values, "table_values", at::kDouble, {2, table_values->size(1)}, device);
    table_size = table_values->size(1);
    // every table of a group of up to grid_bound rollouts: C(grid_bound + 4, 4) entries
    const int64_t b = grid_bound;
    TORCH_CHECK(b >= 0 && table_size >= (b + 4) * (b + 3) / 2 * (b + 2) / 3 * (b + 1) / 4,
                "ktae_kernels._C: `table_values` is too small for `grid_bound` ", grid_bound);
  }
  TORCH_CHECK(given_token.has_value() == given_score.has_value() && given_token.has_value() == row_offset.has_value(),
              "ktae_kernels._C: `row_offset`, `given_token` and `given_score` go together");
  if (given_token.has_value()) {
    const int64_t n_rows = given_token->numel();
    check(*given_token, "given_token", at::kLong, {n_rows}, device);
    check(*given_score, "given_score", at::kDouble, {n_rows}, device);
    check(*row_offset, "row_offset", at::kLong, {n_groups + 1}, device);
  } else if (!table_values.has_value() || largest > grid_bound) {
    TORCH_CHECK(lf_size > largest, "ktae_kernels._C: `log_factorial` must hold log(k!) up to B - n_groups + 1 = ",
                largest, " (groups past the grid), got ", lf_size, " entries");
  }

  int64_t* ws = workspace.data_ptr<int64_t>();
  ktae::PrepareArgs prep{};
  prep.responses = ptr<int64_t>(responses);
  prep.mask = ptr<bool>(mask);
  prep.B = B;
  prep.L = L;
  prep.group = ptr<int64_t>(group);
  prep.members = ptr<int64_t>(members);
  prep.n_groups = n_groups;
  prep.rewards = ptr<double>(rewards);
  prep.given_correct = correct.has_value() ? ptr<bool>(*correct) : nullptr;
  prep.threshold = threshold;
  prep.baseline = static_cast<int>(baseline);
  prep.eps = eps;
  prep.bad_ids = reinterpret_cast<long long*>(ws);
  prep.most_tokens = prep.bad_ids + 5;
  prep.lengths = ws + layout.lengths;
  prep.extent = ws + layout.extent;
  prep.correct = reinterpret_cast<bool*>(ws + layout.correct);
  prep.starts = ws + layout.starts;
  prep.group_counts = ws + layout.group_counts;
  prep.base = given.has_value() ? nullptr : reinterpret_cast<double*>(ws + layout.base);
  prep.status = ws + layout.status;

  ktae::KernelArgs args{};
  args.responses = prep.responses;
  args.mask = prep.mask;
  args.length = L;
  args.members = prep.members;
  args.starts = prep.starts;
  args.correct = prep.correct;
  args.group_counts = prep.group_counts;
  args.n_groups = n_groups;
  args.table_values = table_values.has_value() ? ptr<double>(*table_values) : nullptr;
  args.table_size = table_size;
  args.grid_bound = static_cast<int32_t>(std::min<int64_t>(grid_bound, std::numeric_limits<int32_t>::max()));
  args.log_factorial = lf_size ? ptr<double>(*log_factorial) : nullptr;
  args.lf_size = lf_size;
  args.log_rtol = constants[0];
  args.log_err = constants[1];
  args.p_one = constants[2];
  args.ln2 = constants[3];
  args.ignore_ids = ptr<int64_t>(ignore_ids);
  args.n_ignore = ignore_ids.numel();
  args.n_items = n_groups;
  args.words = 1;
  set_scoring(args, params, use_tf);
  args.bad_ids = prep.bad_ids;
  args.status = ws + layout.status;
  args.base = given.has_value() ? ptr<double>(*given) : prep.base;
  args.advantage = ptr<float>(out);
  if (given_token.has_value()) {
    args.use_given = true;
    args.row_offset = ptr<int64_t>(*row_offset);
    args.given_token = ptr<int64_t>(*given_token);
    args.given_score = ptr<double>(*given_score);
    args.n_rows = given_token->numel();
  }
  args.extent = prep.extent;
  args.shared_bytes = shared_bytes;
  args.max_capacity = max_capacity;
  args.largest_keys = prep.bad_ids + 2;
  args.shared_need = prep.bad_ids + 3;
  args.left = prep.bad_ids + 4;
  args.most_tokens = prep.most_tokens;
  args.allow_packed = allow_packed;
  args.ws_bytes = reinterpret_cast<unsigned char*>(ws + layout.tables);
  args.ws_slice_bytes = fallback_blocks ? fallback_bytes / fallback_blocks / 8 * 8 : 0;
  args.slot_index = slot_index ? reinterpret_cast<uint16_t*>(ws + layout.slot_index) : nullptr;
  const int err = ktae::launch_advantage(prep, args, static_cast<int>(threads), fallback_blocks,
                                         reinterpret_cast<void*>(static_cast<intptr_t>(stream)));
  TORCH_CHECK(err == 0, "ktae_kernels._C: kernel launch failed: ", ktae::error_string(err));
}

int64_t advantage_workspace_size(int64_t B, int64_t n_groups, int64_t fallback_bytes, int64_t index_positions) {
  return ktae::advantage_layout(B, n_groups, fallback_bytes, index_positions).total;
}

// The per-table statistics of a grid (see ktae::StatsArgs): `constants` = [log1p(1e-14), LOG_ERR,
// P_ONE, log(2), alpha, beta]; `out` float64 [5, size] is written on `stream`.
void table_statistics(const Tensor& cells, const Tensor& log_factorial, const Tensor& angle,
                      const std::vector<double>& constants, const Tensor& out, int64_t stream) {
  const at::DeviceType kind = ktae::runs_on_cpu() ? at::kCPU : at::kCUDA;
  TORCH_CHECK(cells.device().type() == kind, "ktae_kernels._C: `cells` must be on ", at::DeviceTypeName(kind),
              ", got ", cells.device());
  TORCH_CHECK(cells.dim() == 2 && cells.size(0) == 4, "ktae_kernels._C: `cells` must be [4, size], got ", cells.sizes());
  const at::Device device = cells.device();
  const int64_t size = cells.size(1);
  check(cells, "cells", at::kInt, {4, size}, device);
  check(log_factorial, "log_factorial", at::kDouble, {log_factorial.numel()}, device);
  check(angle, "angle", at::kDouble, {angle.numel()}, device);
  check(out, "out", at::kDouble, {5, size}, device);
  TORCH_CHECK(constants.size() == 6,
              "ktae_kernels._C: `constants` must be [log_rtol, log_err, p_one, ln2, alpha, beta], got ",
              constants.size(), " values");
  ktae::StatsArgs args{};
  args.cells = ptr<int32_t>(cells);
  args.size = size;
  args.log_factorial = ptr<double>(log_factorial);
  args.angle = ptr<double>(angle);
  args.log_rtol = constants[0];
  args.log_err = constants[1];
  args.p_one = constants[2];
  args.ln2 = constants[3];
  args.alpha = constants[4];
  args.beta = constants[5];
  args.out = ptr<double>(out);
  const int err = ktae::launch_table_statistics(args, reinterpret_cast<void*>(static_cast<intptr_t>(stream)));
  TORCH_CHECK(err == 0, "ktae_kernels._C: statistics kernel launch failed: ", ktae::error_string(err));
}

int64_t max_shared_bytes(int64_t device) {
  const int64_t bytes = ktae::max_shared_bytes(static_cast<int>(device));
  TORCH_CHECK(bytes > 0, "ktae_kernels._C: cannot read the shared memory size of device ", device);
  return bytes;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "KTAE group kernels (csrc/): one thread block per group of rollouts.";
  m.def("launch", &launch, "One pass of the rows kernel (see csrc/ktae_kernels.h).", py::arg("mode"),
        py::arg("shared_table"), py::arg("responses"), py::arg("mask"), py::arg("members"),
        py::arg("starts"), py::arg("correct"), py::arg("group_counts"), py::arg("block_group"), py::arg("blocks"),
        py::arg("skip_done"), py::arg("words"), py::arg("shared_capacity"), py::arg("packed"),
        py::arg("ws_keys"), py::arg("ws_counts"), py::arg("ws_presence"), py::arg("ws_offset"),
        py::arg("ws_capacity"), py::arg("bad_ids"), py::arg("status"), py::arg("row_offset"), py::arg("row_ints"),
        py::arg("threads"), py::arg("shared_bytes"), py::arg("stream"));
  m.def("table_statistics", &table_statistics, "Per-table statistics of a grid (see csrc/ktae_kernels.h).",
        py::arg("cells"), py::arg("log_factorial"), py::arg("angle"), py::arg("constants"), py::arg("out"),
        py::arg("stream"));
  m.def("advantage", &advantage, "token_advantage with static-bound sizing (see ktae::launch_advantage).",
        py::arg("responses"), py::arg("mask"), py::arg("group"), py::arg("members"), py::arg("rewards"),
        py::arg("correct"), py::arg("given"), py::arg("table_values"), py::arg("grid_bound"),
        py::arg("log_factorial"), py::arg("row_offset"), py::arg("given_token"), py::arg("given_score"),
        py::arg("ignore_ids"), py::arg("workspace"), py::arg("out"),
        py::arg("n_groups"), py::arg("params"), py::arg("use_tf"), py::arg("threshold"), py::arg("baseline"),
        py::arg("eps"), py::arg("constants"), py::arg("shared_bytes"), py::arg("max_capacity"),
        py::arg("allow_packed"), py::arg("fallback_blocks"), py::arg("fallback_bytes"), py::arg("slot_index"),
        py::arg("threads"), py::arg("stream"));
  m.def("advantage_workspace_size", &advantage_workspace_size, py::arg("B"), py::arg("n_groups"),
        py::arg("fallback_bytes"), py::arg("index_positions") = 0);
  m.attr("MIN_CAPACITY") = ktae::kMinCapacity;
  m.attr("GROUPS_THREADS") = ktae::kGroupsThreads;
  m.def("max_shared_bytes", &max_shared_bytes, "Opt-in dynamic shared memory per block of a device.",
        py::arg("device"));
  m.def("shared_table_bytes", &ktae::shared_table_bytes, py::arg("capacity"), py::arg("words"),
        py::arg("packed") = false);
  m.attr("PACKED_MAX_TOKENS") = ktae::kPackedMaxTokens;
  m.def("header_bytes", &ktae::header_bytes, py::arg("words"));
  m.def("group_shared_need", &ktae::group_shared_need, py::arg("words"), py::arg("packed"), py::arg("n_keys"));
  m.def("max_keys", &ktae::max_keys, py::arg("capacity"));
  m.attr("MAX_THREADS") = ktae::kMaxThreads;
  m.attr("UNROLL") = ktae::kUnroll;
  m.attr("RUNS_ON_CPU") = ktae::runs_on_cpu();
}
