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
  TORCH_CHECK(t.defined(), "ktae_kernels._C: `", name, "` must be set");
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
  TORCH_CHECK(responses.defined(), "ktae_kernels._C: `responses` must be set");
  const at::DeviceType kind = ktae::runs_on_cpu() ? at::kCPU : at::kCUDA;
  TORCH_CHECK(responses.device().type() == kind, "ktae_kernels._C: tensors must be on ",
              at::DeviceTypeName(kind), ", got ", responses.device());
  TORCH_CHECK(responses.dim() == 2, "ktae_kernels._C: `responses` must be [B, L], got ", responses.sizes());
}

// The arguments of `launch` (one pass of the rows kernel), in three structs; ktae_kernels.h says
// what each array holds.
// The rollouts and their groups: responses int64 [B, L], mask bool [B, L], members int64 [B] (the
// rollouts sorted by group), starts int64 [n_groups + 1], correct bool [B], group_counts int64
// [4, n_groups]; written: bad_ids int64 [2], status int64 [n_groups]; rows mode: row_offset int64
// [n_groups + 1], row_ints int64 [kRowInts, n_rows].
struct GroupInputs {
  Tensor responses, mask, members, starts, correct, group_counts, bad_ids, status;
  OptTensor row_offset, row_ints;
};

// Where the pass keeps its tables: shared memory (`shared_capacity` slots, `packed` 12-byte slots),
// or, with `shared_table` false, one slice of the global workspace per block (ws_*).
struct TableArgs {
  bool shared_table = true;
  int64_t words = 1;
  int64_t shared_capacity = 0;
  bool packed = false;
  OptTensor ws_keys, ws_counts, ws_presence, ws_offset, ws_capacity;
};

// One launch: kCount or kRows over the groups of `block_group` (int64 [n_items]) on `blocks` blocks
// of `threads` threads with `shared_bytes` of dynamic shared memory, on the CUDA stream `stream`.
struct PassArgs {
  int64_t mode = 0;
  Tensor block_group;
  int64_t blocks = 1;
  bool skip_done = false;
  int64_t threads = 0;
  int64_t shared_bytes = 0;
  int64_t stream = 0;
};

// The arguments of `advantage` (token_advantage, every pass), in three structs.
// The batch and where the results go: responses, mask, group (dense ids), members (sorted by group),
// rewards float64 [B], correct (caller labels, bool [B]) and given (rollout advantage, float64 [B])
// when given; workspace int64 (ktae::advantage_layout, its head the flags) and out float32 [B, L].
struct AdvantageInputs {
  Tensor responses, mask, group, members, rewards;
  OptTensor correct, given;
  int64_t n_groups = 0;
  Tensor workspace, out;
};

// Where the scores come from and the method's scalars: the device grid (table_values float64
// [2, size] for groups of up to grid_bound rollouts) and log_factorial (groups past it), or the
// given rows (row_offset, given_token, given_score: fisher="upstream"); the ignored ids; params =
// [alpha, beta, k1, b, top, weight]; constants = [log_rtol, log_err, p_one, ln2]; the baseline code.
struct Scoring {
  OptTensor table_values;
  int64_t grid_bound = 0;
  OptTensor log_factorial, row_offset, given_token, given_score;
  Tensor ignore_ids;
  std::vector<double> params, constants;
  bool use_tf = true;
  double threshold = 0.0;
  int64_t baseline = 0;
  double eps = 0.0;
};

// The launch shape: the shared pass's bytes and slot cap, the global pass's blocks and workspace
// bytes, whether the shared pass records each position's slot, threads per block, the stream;
// nan_on_error: a bad input writes NaN over `out` (a captured call's replay) instead of nothing.
struct AdvantageLaunch {
  bool nan_on_error = false;
  int64_t shared_bytes = 0;
  int64_t max_capacity = 2;
  bool allow_packed = true;
  int64_t fallback_blocks = 0;
  int64_t fallback_bytes = 0;
  bool slot_index = false;
  int64_t threads = 0;
  int64_t stream = 0;
};

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
void launch(const PassArgs& pass, const GroupInputs& in, const TableArgs& table) {
  TORCH_CHECK(pass.mode == ktae::kCount || pass.mode == ktae::kRows,
              "ktae_kernels._C: `mode` must be 0 (count) or 1 (rows), got ", pass.mode);
  check_responses(in.responses);
  const at::Device device = in.responses.device();
  const int64_t B = in.responses.size(0), L = in.responses.size(1);
  const int64_t n_groups = in.starts.numel() - 1;
  const int64_t n_items = pass.block_group.numel();
  TORCH_CHECK(n_groups >= 0, "ktae_kernels._C: `starts` must hold n_groups + 1 offsets");
  check(in.responses, "responses", at::kLong, {B, L}, device);
  check(in.mask, "mask", at::kBool, {B, L}, device);
  check(in.members, "members", at::kLong, {B}, device);
  check(in.starts, "starts", at::kLong, {n_groups + 1}, device);
  check(in.correct, "correct", at::kBool, {B}, device);
  check(in.group_counts, "group_counts", at::kLong, {4, n_groups}, device);
  check(pass.block_group, "block_group", at::kLong, {n_items}, device);
  check(in.status, "status", at::kLong, {n_groups}, device);
  check(in.bad_ids, "bad_ids", at::kLong, {2}, device);
  TORCH_CHECK(pass.blocks >= 1 && pass.blocks <= std::max<int64_t>(n_items, 1) && pass.blocks <= std::numeric_limits<int32_t>::max(),
              "ktae_kernels._C: `blocks` must be in [1, len(block_group)], got ", pass.blocks);
  TORCH_CHECK(table.words >= 1, "ktae_kernels._C: `words` must be >= 1, got ", table.words);
  TORCH_CHECK(pass.threads >= 32 && pass.threads <= ktae::kMaxThreads && pass.threads % 32 == 0,
              "ktae_kernels._C: `threads` must be a multiple of 32 in [32, ", ktae::kMaxThreads, "], got ", pass.threads);

  ktae::KernelArgs args{};
  args.responses = ptr<int64_t>(in.responses);
  args.mask = ptr<bool>(in.mask);
  args.length = L;
  args.members = ptr<int64_t>(in.members);
  args.starts = ptr<int64_t>(in.starts);
  args.correct = ptr<bool>(in.correct);
  args.group_counts = ptr<int64_t>(in.group_counts);
  args.n_groups = n_groups;
  args.block_group = ptr<int64_t>(pass.block_group);
  args.n_items = n_items;
  args.skip_done = pass.skip_done;
  args.words = static_cast<int32_t>(table.words);
  args.status = ptr<int64_t>(in.status);
  args.bad_ids = reinterpret_cast<long long*>(ptr<int64_t>(in.bad_ids));

  if (table.shared_table) {
    TORCH_CHECK(table.shared_capacity >= 2 && (table.shared_capacity & (table.shared_capacity - 1)) == 0,
                "ktae_kernels._C: `shared_capacity` must be a power of two >= 2, got ", table.shared_capacity);
    TORCH_CHECK(!table.packed || table.words == 1, "ktae_kernels._C: `packed` tables need `words` == 1");
    TORCH_CHECK(pass.shared_bytes >= ktae::shared_table_bytes(table.shared_capacity, table.words, table.packed),
                "ktae_kernels._C: `shared_bytes` is too small for the shared table");
    args.shared_capacity = table.shared_capacity;
    args.packed = table.packed;
  } else {
    const char* when = "for a global-memory table";
    const Tensor& keys = required(table.ws_keys, "ws_keys", when);
    const int64_t slots = keys.numel();
    check(keys, "ws_keys", at::kInt, {slots}, device);
    if (pass.mode != ktae::kCount) {  // counting reads and writes keys only
      check(required(table.ws_counts, "ws_counts", when), "ws_counts", at::kLong, {slots}, device);
      check(required(table.ws_presence, "ws_presence", when), "ws_presence", at::kInt, {slots * table.words}, device);
    }
    check(required(table.ws_offset, "ws_offset", when), "ws_offset", at::kLong, {n_items}, device);
    check(required(table.ws_capacity, "ws_capacity", when), "ws_capacity", at::kLong, {n_items}, device);
    TORCH_CHECK(pass.shared_bytes >= ktae::header_bytes(table.words), "ktae_kernels._C: `shared_bytes` is too small");
    args.ws_keys = reinterpret_cast<uint32_t*>(ptr<int32_t>(keys));
    if (pass.mode != ktae::kCount) {
      args.ws_counts = reinterpret_cast<unsigned long long*>(ptr<int64_t>(*table.ws_counts));
      args.ws_presence = reinterpret_cast<uint32_t*>(ptr<int32_t>(*table.ws_presence));
    }
    args.ws_offset = ptr<int64_t>(*table.ws_offset);
    args.ws_capacity = ptr<int64_t>(*table.ws_capacity);
  }

  if (pass.mode == ktae::kRows) {
    const char* when = "in rows mode";
    const int64_t n_rows = required(in.row_ints, "row_ints", when).size(-1);
    check(required(in.row_offset, "row_offset", when), "row_offset", at::kLong, {n_groups + 1}, device);
    check(*in.row_ints, "row_ints", at::kLong, {ktae::kRowInts, n_rows}, device);
    args.row_offset = ptr<int64_t>(*in.row_offset);
    args.row_ints = ptr<int64_t>(*in.row_ints);
    args.n_rows = n_rows;
  }

  if (n_items == 0) return;
  const int err = ktae::launch_group_kernel(args, static_cast<ktae::Mode>(pass.mode), table.shared_table, pass.blocks,
                                            static_cast<int>(pass.threads), pass.shared_bytes,
                                            reinterpret_cast<void*>(static_cast<intptr_t>(pass.stream)));
  TORCH_CHECK(err == 0, "ktae_kernels._C: kernel launch failed: ", ktae::error_string(err));
}

// The whole token_advantage with static-bound sizing (ktae::launch_advantage): the bookkeeping, a
// shared-table pass and, with fallback_blocks > 0, a global-memory pass, nothing read back. The
// workspace (int64, ktae::advantage_layout) is written; its first entries are the flags
// (ktae::kAdvantageFlags). The scores come from table_values (the device grid) and log_factorial
// (groups past it), or from the given rows (row_offset, given_token, given_score: fisher="upstream").
void advantage(const AdvantageInputs& in, const Scoring& scoring, const AdvantageLaunch& shape) {
  check_responses(in.responses);
  const at::Device device = in.responses.device();
  const int64_t B = in.responses.size(0), L = in.responses.size(1);
  TORCH_CHECK(in.n_groups >= 0, "ktae_kernels._C: `n_groups` must be >= 0");
  check(in.responses, "responses", at::kLong, {B, L}, device);
  check(in.mask, "mask", at::kBool, {B, L}, device);
  check(in.group, "group", at::kLong, {B}, device);
  check(in.members, "members", at::kLong, {B}, device);
  check(in.rewards, "rewards", at::kDouble, {B}, device);
  check(scoring.ignore_ids, "ignore_ids", at::kLong, {scoring.ignore_ids.numel()}, device);
  check(in.out, "out", at::kFloat, {B, L}, device);
  if (in.correct.has_value()) check(*in.correct, "correct", at::kBool, {B}, device);
  if (in.given.has_value()) check(*in.given, "given", at::kDouble, {B}, device);
  TORCH_CHECK(scoring.baseline >= ktae::kBaselineGrpo && scoring.baseline <= ktae::kBaselineGiven,
              "ktae_kernels._C: `baseline` must be 0 (grpo), 1 (mean), 2 (none) or 3 (given), got ", scoring.baseline);
  TORCH_CHECK((scoring.baseline == ktae::kBaselineGiven) == in.given.has_value(),
              "ktae_kernels._C: `given` goes with baseline 3 (given), and only with it");
  TORCH_CHECK(scoring.constants.size() == 4, "ktae_kernels._C: `constants` must be [log_rtol, log_err, p_one, ln2]");
  TORCH_CHECK(shape.threads >= 32 && shape.threads <= ktae::kMaxThreads && shape.threads % 32 == 0,
              "ktae_kernels._C: `threads` must be a multiple of 32 in [32, ", ktae::kMaxThreads, "], got ", shape.threads);
  TORCH_CHECK(shape.max_capacity >= 2 && (shape.max_capacity & (shape.max_capacity - 1)) == 0,
              "ktae_kernels._C: `max_capacity` must be a power of two >= 2, got ", shape.max_capacity);
  TORCH_CHECK(shape.shared_bytes >= 0 && shape.fallback_blocks >= 0 && shape.fallback_bytes >= 0,
              "ktae_kernels._C: `shared_bytes`, `fallback_blocks` and `fallback_bytes` must be >= 0");
  TORCH_CHECK(shape.shared_bytes > 0 || shape.fallback_blocks > 0 || in.n_groups == 0,
              "ktae_kernels._C: no pass would take the groups (shared_bytes and fallback_blocks are 0)");
  TORCH_CHECK(shape.fallback_blocks == 0 || shape.fallback_bytes / shape.fallback_blocks >= 64,
              "ktae_kernels._C: `fallback_bytes` gives each of the `fallback_blocks` less than 64 bytes");
  const ktae::AdvantageLayout layout = ktae::advantage_layout(B, in.n_groups, shape.fallback_bytes, shape.slot_index ? B * L : 0);
  check(in.workspace, "workspace", at::kLong, {in.workspace.numel()}, device);
  TORCH_CHECK(in.workspace.numel() >= layout.total, "ktae_kernels._C: `workspace` must hold ", layout.total,
              " int64, got ", in.workspace.numel());
  int64_t lf_size = 0;
  if (scoring.log_factorial.has_value()) {
    check(*scoring.log_factorial, "log_factorial", at::kDouble, {scoring.log_factorial->numel()}, device);
    lf_size = scoring.log_factorial->numel();
  }
  // the largest group has at most B - n_groups + 1 rollouts; its statistics need log(k!) up to there
  const int64_t largest = in.n_groups > 0 ? B - in.n_groups + 1 : 0;
  int64_t table_size = 0;
  if (scoring.table_values.has_value()) {
    TORCH_CHECK(scoring.table_values->dim() == 2, "ktae_kernels._C: `table_values` must be [2, size], got ", scoring.table_values->sizes());
    check(*scoring.table_values, "table_values", at::kDouble, {2, scoring.table_values->size(1)}, device);
    table_size = scoring.table_values->size(1);
    // every table of a group of up to grid_bound rollouts: C(grid_bound + 4, 4) entries
    const int64_t b = scoring.grid_bound;
    TORCH_CHECK(b >= 0 && table_size >= (b + 4) * (b + 3) / 2 * (b + 2) / 3 * (b + 1) / 4,
                "ktae_kernels._C: `table_values` is too small for `grid_bound` ", scoring.grid_bound);
  }
  TORCH_CHECK(scoring.given_token.has_value() == scoring.given_score.has_value() && scoring.given_token.has_value() == scoring.row_offset.has_value(),
              "ktae_kernels._C: `row_offset`, `given_token` and `given_score` go together");
  if (scoring.given_token.has_value()) {
    const int64_t n_rows = scoring.given_token->numel();
    check(*scoring.given_token, "given_token", at::kLong, {n_rows}, device);
    check(*scoring.given_score, "given_score", at::kDouble, {n_rows}, device);
    check(*scoring.row_offset, "row_offset", at::kLong, {in.n_groups + 1}, device);
  } else if (!scoring.table_values.has_value() || largest > scoring.grid_bound) {
    TORCH_CHECK(lf_size > largest, "ktae_kernels._C: `log_factorial` must hold log(k!) up to B - n_groups + 1 = ",
                largest, " (groups past the grid), got ", lf_size, " entries");
  }

  int64_t* ws = in.workspace.data_ptr<int64_t>();
  ktae::PrepareArgs prep{};
  prep.responses = ptr<int64_t>(in.responses);
  prep.mask = ptr<bool>(in.mask);
  prep.B = B;
  prep.L = L;
  prep.group = ptr<int64_t>(in.group);
  prep.members = ptr<int64_t>(in.members);
  prep.n_groups = in.n_groups;
  prep.rewards = ptr<double>(in.rewards);
  prep.given_correct = in.correct.has_value() ? ptr<bool>(*in.correct) : nullptr;
  prep.threshold = scoring.threshold;
  prep.baseline = static_cast<int>(scoring.baseline);
  prep.eps = scoring.eps;
  prep.bad_ids = reinterpret_cast<long long*>(ws);
  prep.most_tokens = prep.bad_ids + 5;
  prep.lengths = ws + layout.lengths;
  prep.extent = ws + layout.extent;
  prep.correct = reinterpret_cast<bool*>(ws + layout.correct);
  prep.starts = ws + layout.starts;
  prep.group_counts = ws + layout.group_counts;
  prep.base = in.given.has_value() ? nullptr : reinterpret_cast<double*>(ws + layout.base);
  prep.status = ws + layout.status;

  ktae::KernelArgs args{};
  args.responses = prep.responses;
  args.mask = prep.mask;
  args.length = L;
  args.members = prep.members;
  args.starts = prep.starts;
  args.correct = prep.correct;
  args.group_counts = prep.group_counts;
  args.n_groups = in.n_groups;
  args.table_values = scoring.table_values.has_value() ? ptr<double>(*scoring.table_values) : nullptr;
  args.table_size = table_size;
  args.grid_bound = static_cast<int32_t>(std::min<int64_t>(scoring.grid_bound, std::numeric_limits<int32_t>::max()));
  args.log_factorial = lf_size ? ptr<double>(*scoring.log_factorial) : nullptr;
  args.lf_size = lf_size;
  args.log_rtol = scoring.constants[0];
  args.log_err = scoring.constants[1];
  args.p_one = scoring.constants[2];
  args.ln2 = scoring.constants[3];
  args.ignore_ids = ptr<int64_t>(scoring.ignore_ids);
  args.n_ignore = scoring.ignore_ids.numel();
  args.n_items = in.n_groups;
  args.words = 1;
  set_scoring(args, scoring.params, scoring.use_tf);
  args.bad_ids = prep.bad_ids;
  args.status = ws + layout.status;
  args.base = in.given.has_value() ? ptr<double>(*in.given) : prep.base;
  args.advantage = ptr<float>(in.out);
  if (scoring.given_token.has_value()) {
    args.use_given = true;
    args.row_offset = ptr<int64_t>(*scoring.row_offset);
    args.given_token = ptr<int64_t>(*scoring.given_token);
    args.given_score = ptr<double>(*scoring.given_score);
    args.n_rows = scoring.given_token->numel();
  }
  args.extent = prep.extent;
  args.shared_bytes = shape.shared_bytes;
  args.max_capacity = shape.max_capacity;
  args.largest_keys = prep.bad_ids + 2;
  args.shared_need = prep.bad_ids + 3;
  args.left = prep.bad_ids + 4;
  args.most_tokens = prep.most_tokens;
  args.nan_on_error = shape.nan_on_error;
  args.allow_packed = shape.allow_packed;
  args.ws_bytes = reinterpret_cast<unsigned char*>(ws + layout.tables);
  args.ws_slice_bytes = shape.fallback_blocks ? shape.fallback_bytes / shape.fallback_blocks / 8 * 8 : 0;
  args.slot_index = shape.slot_index ? reinterpret_cast<uint16_t*>(ws + layout.slot_index) : nullptr;
  const int err = ktae::launch_advantage(prep, args, static_cast<int>(shape.threads), shape.fallback_blocks,
                                         reinterpret_cast<void*>(static_cast<intptr_t>(shape.stream)));
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

// A struct of arguments as a Python class: default-constructed, its fields set by name (a misspelt
// field raises AttributeError).
template <class T>
pybind11::class_<T> bind_struct(pybind11::module_& m, const char* name, const char* doc) {
  return pybind11::class_<T>(m, name, doc).def(pybind11::init<>());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "KTAE group kernels (csrc/): one thread block per group of rollouts.";
  bind_struct<GroupInputs>(m, "GroupInputs", "The rollouts and groups a rows-kernel pass reads (csrc/ktae.cpp).")
      .def_readwrite("responses", &GroupInputs::responses).def_readwrite("mask", &GroupInputs::mask)
      .def_readwrite("members", &GroupInputs::members).def_readwrite("starts", &GroupInputs::starts)
      .def_readwrite("correct", &GroupInputs::correct).def_readwrite("group_counts", &GroupInputs::group_counts)
      .def_readwrite("bad_ids", &GroupInputs::bad_ids).def_readwrite("status", &GroupInputs::status)
      .def_readwrite("row_offset", &GroupInputs::row_offset).def_readwrite("row_ints", &GroupInputs::row_ints);
  bind_struct<TableArgs>(m, "TableArgs", "Where a rows-kernel pass keeps its tables (csrc/ktae.cpp).")
      .def_readwrite("shared_table", &TableArgs::shared_table).def_readwrite("words", &TableArgs::words)
      .def_readwrite("shared_capacity", &TableArgs::shared_capacity).def_readwrite("packed", &TableArgs::packed)
      .def_readwrite("ws_keys", &TableArgs::ws_keys).def_readwrite("ws_counts", &TableArgs::ws_counts)
      .def_readwrite("ws_presence", &TableArgs::ws_presence).def_readwrite("ws_offset", &TableArgs::ws_offset)
      .def_readwrite("ws_capacity", &TableArgs::ws_capacity);
  bind_struct<PassArgs>(m, "PassArgs", "One launch of the rows kernel (csrc/ktae.cpp).")
      .def_readwrite("mode", &PassArgs::mode).def_readwrite("block_group", &PassArgs::block_group)
      .def_readwrite("blocks", &PassArgs::blocks).def_readwrite("skip_done", &PassArgs::skip_done)
      .def_readwrite("threads", &PassArgs::threads).def_readwrite("shared_bytes", &PassArgs::shared_bytes)
      .def_readwrite("stream", &PassArgs::stream);
  bind_struct<AdvantageInputs>(m, "AdvantageInputs", "The batch and outputs of `advantage` (csrc/ktae.cpp).")
      .def_readwrite("responses", &AdvantageInputs::responses).def_readwrite("mask", &AdvantageInputs::mask)
      .def_readwrite("group", &AdvantageInputs::group).def_readwrite("members", &AdvantageInputs::members)
      .def_readwrite("rewards", &AdvantageInputs::rewards).def_readwrite("correct", &AdvantageInputs::correct)
      .def_readwrite("given", &AdvantageInputs::given).def_readwrite("n_groups", &AdvantageInputs::n_groups)
      .def_readwrite("workspace", &AdvantageInputs::workspace).def_readwrite("out", &AdvantageInputs::out);
  bind_struct<Scoring>(m, "Scoring", "Where `advantage`'s scores come from, and the method's scalars.")
      .def_readwrite("table_values", &Scoring::table_values).def_readwrite("grid_bound", &Scoring::grid_bound)
      .def_readwrite("log_factorial", &Scoring::log_factorial).def_readwrite("row_offset", &Scoring::row_offset)
      .def_readwrite("given_token", &Scoring::given_token).def_readwrite("given_score", &Scoring::given_score)
      .def_readwrite("ignore_ids", &Scoring::ignore_ids).def_readwrite("params", &Scoring::params)
      .def_readwrite("constants", &Scoring::constants).def_readwrite("use_tf", &Scoring::use_tf)
      .def_readwrite("threshold", &Scoring::threshold).def_readwrite("baseline", &Scoring::baseline)
      .def_readwrite("eps", &Scoring::eps);
  bind_struct<AdvantageLaunch>(m, "AdvantageLaunch", "The launch shape of `advantage` (csrc/ktae.cpp).")
      .def_readwrite("shared_bytes", &AdvantageLaunch::shared_bytes)
      .def_readwrite("max_capacity", &AdvantageLaunch::max_capacity)
      .def_readwrite("allow_packed", &AdvantageLaunch::allow_packed)
      .def_readwrite("fallback_blocks", &AdvantageLaunch::fallback_blocks)
      .def_readwrite("fallback_bytes", &AdvantageLaunch::fallback_bytes)
      .def_readwrite("slot_index", &AdvantageLaunch::slot_index).def_readwrite("threads", &AdvantageLaunch::threads)
      .def_readwrite("stream", &AdvantageLaunch::stream).def_readwrite("nan_on_error", &AdvantageLaunch::nan_on_error);
  m.def("launch", &launch, "One pass of the rows kernel (see csrc/ktae_kernels.h).", py::arg("pass"),
        py::arg("inputs"), py::arg("table"));
  m.def("table_statistics", &table_statistics, "Per-table statistics of a grid (see csrc/ktae_kernels.h).",
        py::arg("cells"), py::arg("log_factorial"), py::arg("angle"), py::arg("constants"), py::arg("out"),
        py::arg("stream"));
  m.def("advantage", &advantage, "token_advantage with static-bound sizing (see ktae::launch_advantage).",
        py::arg("inputs"), py::arg("scoring"), py::arg("shape"));
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
  m.def("clear_caches", &ktae::clear_launch_state,
        "Forget the shared memory limits the launchers set per kernel and device (they are set again).");
}
