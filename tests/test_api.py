"""Public API: accepted input forms, output contract, and clear errors on bad input."""
import sys

import numpy as np
import pytest
import torch

from ktae_kernels import (BackendUnavailableError, KTAEConfig, available_backends, clear_caches, key_token_scores,
                          token_advantage)
from ktae_kernels.registry import get_backend, resolve


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(0, 30, (8, 10), generator=g)
    mask = torch.ones(8, 10, dtype=torch.bool)
    mask[:, 8:] = False
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    return responses, mask, rewards, index


def test_output_contract(batch):
    responses, mask, rewards, index = batch
    adv = token_advantage(responses, mask, rewards, index)
    assert adv.shape == (8, 10) and adv.dtype == torch.float32 and adv.device == responses.device
    assert torch.all(adv[:, 8:] == 0)
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.float32, torch.float64])
def test_numeric_masks_must_hold_only_zeros_and_ones(batch, dtype):
    """Integer masks take one min / max pass, float ones an exact test; any other value is refused."""
    responses, mask, rewards, index = batch
    want = token_advantage(responses, mask, rewards, index)
    assert torch.equal(token_advantage(responses, mask.to(dtype), rewards, index), want)
    for bad in ([2, -1] if dtype.is_signed else [2]) + ([0.5] if dtype.is_floating_point else []):
        wrong = mask.to(dtype).clone()
        wrong[3, 4] = bad
        with pytest.raises(ValueError, match="`response_mask` must be bool or hold only 0 and 1"):
            token_advantage(responses, wrong, rewards, index)


def test_token_level_rewards_are_summed_per_row_in_float64_bit_for_bit():
    """``float64_row_sums`` goes over blocks of rows on the CPU; each row's sum is the same bits as
    ``t.to(torch.float64).sum(-1)``."""
    from ktae_kernels.validation import ROW_SUM_ROWS, float64_row_sums

    gen = torch.Generator().manual_seed(5)
    for rows, cols in ((ROW_SUM_ROWS * 3 + 7, 97), (5, 3000), (ROW_SUM_ROWS, 1)):
        values = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, cols)  # finite in half
        for t in (values, values.half(), (values * 100).long()):
            assert torch.equal(float64_row_sums(t), t.to(torch.float64).sum(-1))


def test_uid_strings_get_the_group_ids_and_labels_of_np_unique():
    """String uids take a dict, not numpy's object sort: the same labels (Python's string order, empty
    and non-ASCII strings included) and the same dense ids; a mix of types fails."""
    from ktae_kernels.validation import dense_group_ids

    rng = np.random.default_rng(3)
    pool = ["", "a", "B", "b", "ä", "z9", "10", "9", "uid-\u00e9", "uid-e", "\U0001f600"] + [f"u{k}" for k in range(40)]
    uids = np.array(rng.choice(np.array(pool, dtype=object), size=500), dtype=object)
    group, labels = dense_group_ids(uids, 500, torch.device("cpu"))
    want_labels, want_inverse = np.unique(uids, return_inverse=True)
    assert labels.dtype == object and labels.tolist() == want_labels.tolist()
    assert group.dtype == torch.int64 and group.tolist() == want_inverse.tolist()
    with pytest.raises(ValueError, match="of one kind, all ints or all strings, got a mix of int and str"):
        dense_group_ids(np.array(["a", 1, "b"], dtype=object), 3, torch.device("cpu"))


def test_integer_index_gets_the_group_ids_and_labels_of_np_unique():
    """Integer ids get the labels, dtype included, and dense ids of ``np.unique``, for sorted, unsorted,
    repeated, extreme, unsigned and single ids, from numpy arrays and tensors."""
    from ktae_kernels.validation import dense_group_ids

    rng = np.random.default_rng(4)
    cases = [np.repeat(np.arange(9), 16), np.array([7]), np.array([3, 3, 3]), np.array([-2**63, -1, 0, 2**63 - 1]),
             np.array([2, 1, 1, 0]), np.array([0, 1, 1, 0]), np.sort(rng.integers(0, 2**64 - 1, 50, dtype=np.uint64)),
             np.repeat(np.arange(5), 3).astype(np.int8), np.sort(rng.integers(-9, 9, 200)), rng.integers(-9, 9, 200)]
    for values in cases:
        want_labels, want_inverse = np.unique(values, return_inverse=True)
        for index in (values, torch.from_numpy(values) if values.dtype != np.uint64 else values):
            group, labels = dense_group_ids(index, len(values), torch.device("cpu"))
            assert labels.dtype == want_labels.dtype and labels.tolist() == want_labels.tolist()
            assert group.dtype == torch.int64 and group.tolist() == want_inverse.tolist()


@pytest.mark.parametrize("form", ["tensor", "numpy-int", "uid-strings", "list", "int32"])
def test_index_forms_agree(batch, form):
    responses, mask, rewards, index = batch
    expected = token_advantage(responses, mask, rewards, index)
    labels = {
        "tensor": index,
        "numpy-int": index.numpy() * 7 + 3,
        "uid-strings": np.array([f"uid-{int(i)}" for i in index], dtype=object),
        "list": index.tolist(),
        "int32": index.to(torch.int32),
    }[form]
    torch.testing.assert_close(token_advantage(responses, mask, rewards, labels), expected, rtol=0, atol=0)


def test_group_ids_follow_sorted_labels(batch):
    responses, mask, rewards, _ = batch
    uids = np.array(["b"] * 4 + ["a"] * 4, dtype=object)
    res = key_token_scores(responses, mask, rewards, uids)
    assert list(res.group_labels) == ["a", "b"]
    assert res.n_c.tolist() == [1, 3]  # group "a" holds rollouts 4..7


def test_token_level_rewards_are_summed(batch):
    responses, mask, rewards, index = batch
    tlr = torch.zeros(8, 10)
    tlr[:, 3] = rewards * 0.5
    tlr[:, 5] = rewards * 0.5
    torch.testing.assert_close(token_advantage(responses, mask, tlr, index),
                               token_advantage(responses, mask, rewards, index))


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.float32, torch.uint8])
def test_mask_dtypes(batch, mask_dtype):
    responses, mask, rewards, index = batch
    torch.testing.assert_close(token_advantage(responses, mask.to(mask_dtype), rewards, index),
                               token_advantage(responses, mask, rewards, index))


def test_masked_out_ids_are_never_read(batch):
    responses, mask, rewards, index = batch
    padded = responses.clone()
    padded[~mask] = -100  # e.g. a label pad value under mask 0
    torch.testing.assert_close(token_advantage(padded, mask, rewards, index),
                               token_advantage(responses, mask, rewards, index))


def test_baselines(batch):
    responses, mask, rewards, index = batch
    cfg = KTAEConfig(weight=0.0)
    r = rewards.double().view(2, 4)
    grpo = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(8, 1).float()
    mean = (r - r.mean(1, keepdim=True)).view(8, 1).float()
    torch.testing.assert_close(token_advantage(responses, mask, rewards, index, config=cfg), grpo * mask)
    cfg_mean = KTAEConfig(weight=0.0, baseline="mean")
    torch.testing.assert_close(token_advantage(responses, mask, rewards, index, config=cfg_mean), mean * mask)
    cfg_none = KTAEConfig(weight=0.0, baseline="none")
    torch.testing.assert_close(token_advantage(responses, mask, rewards, index, config=cfg_none),
                               rewards.view(8, 1) * mask)


def test_given_rollout_advantage(batch):
    responses, mask, rewards, index = batch
    given = torch.linspace(-1, 1, 8)
    no_ktae = token_advantage(responses, mask, rewards, index, config=KTAEConfig(weight=0.0), rollout_advantage=given)
    torch.testing.assert_close(no_ktae, given.view(8, 1) * mask)
    full = token_advantage(responses, mask, rewards, index, rollout_advantage=given)
    plain = token_advantage(responses, mask, rewards, index)
    base = token_advantage(responses, mask, rewards, index, config=KTAEConfig(weight=0.0))
    torch.testing.assert_close(full - no_ktae, plain - base, rtol=0, atol=1e-6)


def test_single_rollout_group_follows_verl(batch):
    """verl gives a one-rollout group mean 0 and std 1: A = r / (1 + eps)."""
    responses, mask, rewards, _ = batch
    index = torch.arange(8)
    adv = token_advantage(responses, mask, rewards * 3, index)
    torch.testing.assert_close(adv, (rewards * 3 / (1 + 1e-6)).view(8, 1) * mask)


def test_rewards_with_grad_are_read_as_values(batch):
    responses, mask, rewards, index = batch
    scored = rewards.clone().requires_grad_(True)
    given = torch.linspace(-1, 1, 8, requires_grad=True)
    torch.testing.assert_close(token_advantage(responses, mask, scored, index),
                               token_advantage(responses, mask, rewards, index))
    out = token_advantage(responses, mask, scored, index, rollout_advantage=given)
    assert not out.requires_grad


def test_empty_batch_and_empty_length():
    out = token_advantage(torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0, 5)
    out = token_advantage(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0), torch.ones(3), torch.zeros(3, dtype=torch.long))
    assert out.shape == (3, 0)


@pytest.mark.parametrize("mutate, argument", [
    (lambda r, m, w, i: (r.float(), m, w, i), "responses"),
    (lambda r, m, w, i: (r[0], m, w, i), "responses"),
    (lambda r, m, w, i: (torch.where(m, -r - 1, r), m, w, i), "responses"),
    (lambda r, m, w, i: (r + 2**31, m, w, i), "responses"),
    (lambda r, m, w, i: (r, m[:, :5], w, i), "response_mask"),
    (lambda r, m, w, i: (r, m.float() * 0.5, w, i), "response_mask"),
    (lambda r, m, w, i: (r, m.long() * 2, w, i), "response_mask"),
    (lambda r, m, w, i: (r, m, w[:5], i), "rewards"),
    (lambda r, m, w, i: (r, m, torch.where(w > 0, float("nan"), w), i), "rewards"),
    (lambda r, m, w, i: (r, m, w + float("inf"), i), "rewards"),
    (lambda r, m, w, i: (r, m, w, i[:5]), "index"),
    (lambda r, m, w, i: (r, m, w, i.float() + 0.5), "index"),
    (lambda r, m, w, i: (r, m, w, "uid"), "index"),
    (lambda r, m, w, i: ([[1, 2]], m, w, i), "responses"),
])
def test_bad_input_names_the_argument(batch, mutate, argument):
    with pytest.raises(ValueError, match=argument):
        token_advantage(*mutate(*batch))


def test_bad_config_and_rollout_advantage(batch):
    with pytest.raises(ValueError, match="config"):
        token_advantage(*batch, config={"alpha": 1.0})
    with pytest.raises(ValueError, match="rollout_advantage"):
        token_advantage(*batch, rollout_advantage=torch.zeros(3))
    with pytest.raises(ValueError, match="rollout_advantage"):
        token_advantage(*batch, rollout_advantage=torch.full((8,), float("nan")))


def test_backend_registry_errors(batch):
    with pytest.raises(ValueError, match="backend"):
        token_advantage(*batch, backend="numpy")
    assert "torch" in available_backends("cpu") and "reference" in available_backends("cpu")
    with pytest.raises((ValueError, BackendUnavailableError), match="cuda"):
        token_advantage(*batch, backend="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a usable CUDA GPU")
def test_no_backend_is_available_for_cuda_tensors_without_a_gpu():
    """What ``available_backends`` lists must run: without a CUDA GPU not even torch runs CUDA tensors."""
    assert available_backends("cuda") == () and available_backends(torch.device("cuda", 0)) == ()
    with pytest.raises(BackendUnavailableError, match=r"^backend 'torch' is unavailable: .*CUDA"):
        resolve("torch", "cuda")
    with pytest.raises(BackendUnavailableError, match=r"^no backend can run on device type 'cuda' here: .*CUDA"):
        resolve("auto", "cuda")


def test_with_a_gpu_reference_and_torch_run_cuda_tensors(monkeypatch):
    from ktae_kernels.registry import backend_spec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backend_spec("torch").unavailable("cuda") is None and backend_spec("reference").unavailable("cuda") is None


@pytest.mark.parametrize("device", [None, 5, "tpu", "cuda:x"])
def test_a_bad_device_is_named(device):
    message = rf"^`device` must be a torch.device or a device string such as 'cpu' or 'cuda:0', got {device!r}$"
    for call in (available_backends, lambda d: resolve("auto", d)):
        with pytest.raises(ValueError, match=message):
            call(device)


def test_auto_on_cpu_prefers_the_native_kernel(monkeypatch):
    import ktae_kernels.backends.cpu as cpu

    expected = "ktae_kernels.backends.cpu" if cpu.unavailable_reason() is None else "ktae_kernels.backends.torch"
    assert get_backend("auto", "cpu").__name__ == expected
    monkeypatch.setattr(cpu, "unavailable_reason", lambda: "not built")
    assert get_backend("auto", "cpu").__name__ == "ktae_kernels.backends.torch"


def test_auto_on_cuda_picks_the_fastest_gpu_kernel_there(monkeypatch):
    """With CUDA faked available: "auto" takes cuda when its extension is built, else triton (warning
    once that cuda is missing), else torch: the order of their paper-batch times on an H200."""
    import types

    import ktae_kernels.registry as registry
    from ktae_kernels.backends import cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    clear_caches()  # "auto" warns once per process: forget earlier warnings
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))  # importable
    monkeypatch.setattr(cuda, "unavailable_reason", lambda: None)
    assert resolve("auto", "cuda").name == "cuda"
    monkeypatch.setattr(cuda, "unavailable_reason", lambda: "not built")
    with pytest.warns(RuntimeWarning, match="runs the slower 'triton' backend on cuda tensors: backend 'cuda' "
                                            "is unavailable: not built"):
        assert resolve("auto", "cuda").name == "triton"
    monkeypatch.setitem(sys.modules, "triton", None)  # not installed
    assert resolve("auto", "cuda").name == "torch"


def test_rocm_has_no_gpu_kernels(monkeypatch):
    from ktae_kernels.registry import backend_spec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert all("ROCm" in backend_spec(name).unavailable("cuda") for name in ("triton", "cuda"))
    assert get_backend("auto", "cuda").__name__ == "ktae_kernels.backends.torch"


BACKENDS_HERE = [b for b in ("reference", "torch", "cpu") if b in available_backends("cpu")]


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_out_is_written_and_returned(batch, backend):
    expected = token_advantage(*batch, backend=backend)
    out = torch.full((8, 10), float("nan"))
    result = token_advantage(*batch, backend=backend, out=out)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [
    torch.zeros(8, 9), torch.zeros(8, 10, dtype=torch.float64), torch.zeros(10, 8).t(), torch.zeros(8, 20)[:, ::2],
    np.zeros((8, 10), dtype=np.float32),
])
def test_bad_out_is_rejected_by_name(batch, bad):
    with pytest.raises(ValueError, match="`out`"):
        token_advantage(*batch, out=bad)


OUT_BACKENDS = BACKENDS_HERE + (["triton"] if "triton" in available_backends("cpu") else [])  # triton: interpreted


def _inputs_inside_out(batch, name):
    """``out`` ([8, 10] float32, filled with 7.0 but for the bytes of ``name``) and the call's inputs by name,
    ``name`` holding its values in a view of ``out``'s memory."""
    responses, mask, rewards, index = batch
    out = torch.full((8, 10), 7.0)
    inside = {"responses": out.view(torch.int32), "response_mask": out.view(torch.bool)[:, :10],
              "rewards": out[:, 0], "rollout_advantage": out[0, :8], "correct": out.view(torch.bool)[0, :8]}[name]
    values = dict(responses=responses, response_mask=mask, rewards=rewards, rollout_advantage=torch.ones(8),
                  correct=rewards > 0)
    inside.copy_(values[name])
    return out, {**values, name: inside}, index


@pytest.mark.parametrize("backend", OUT_BACKENDS)
@pytest.mark.parametrize("name", ["responses", "response_mask", "rewards", "rollout_advantage", "correct"])
def test_out_overlapping_an_input_is_refused_before_it_is_written(batch, backend, name):
    """An ``out`` sharing memory with an input would overwrite the input while it is read (the cpu backend
    returned wrong values, torch raised numpy's error): refused by name, ``out`` untouched."""
    out, inputs, index = _inputs_inside_out(batch, name)
    before = out.clone()
    with pytest.raises(ValueError) as raised:
        token_advantage(inputs.pop("responses"), inputs.pop("response_mask"), inputs.pop("rewards"), index,
                        backend=backend, out=out, **inputs)
    assert str(raised.value) == (f"`out` must not overlap `{name}` in memory (the result would overwrite it while "
                                 f"it is read); pass a separate buffer, e.g. torch.empty(responses.shape, "
                                 f"dtype=torch.float32, device=responses.device)")
    assert torch.equal(out.view(torch.int32), before.view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_out_beside_inputs_in_one_buffer_is_taken_and_overlapping_is_not(batch, backend):
    """Inputs and ``out`` as views of one float32 buffer (and a numpy array sharing ``out``'s memory): a
    byte of overlap is refused (a reversed numpy view too), ``out`` right after the last input is taken."""
    responses, mask, rewards, index = batch
    want = token_advantage(responses, mask, rewards, index, rollout_advantage=torch.ones(8), backend=backend)
    buffer = torch.zeros(80 + 8 + 8 + 80)
    buffer[:80].view(8, 10).copy_(mask)
    buffer[80:88].copy_(rewards)
    buffer[88:96].fill_(1.0)
    inputs = dict(response_mask=buffer[:80].view(8, 10), rewards=buffer[80:88], rollout_advantage=buffer[88:96])
    for start, name in ((79, "response_mask"), (81, "rewards"), (95, "rollout_advantage")):
        with pytest.raises(ValueError, match=rf"^`out` must not overlap `{name}` in memory"):
            token_advantage(responses, index=index, backend=backend, out=buffer[start:start + 80].view(8, 10),
                            **inputs)
    out = buffer[96:].view(8, 10)
    assert token_advantage(responses, index=index, backend=backend, out=out, **inputs) is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    host = np.zeros((8, 10), dtype=np.float32)
    host[:, 0] = rewards.numpy()
    with pytest.raises(ValueError, match=r"^`out` must not overlap `rewards` in memory"):
        token_advantage(responses, mask, host[::-1, 0], index, backend=backend, out=torch.from_numpy(host))


def test_out_device_is_checked(batch):
    with pytest.raises(ValueError, match="`out`"):
        token_advantage(*batch, out=torch.zeros(8, 10, device="meta"))


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_correct_labels_split_apart_from_rewards(batch, backend):
    responses, mask, rewards, index = batch
    shaped = rewards - 0.3  # e.g. a KL penalty: two correct rollouts would fall below the threshold
    labels = rewards > 0
    by_label = token_advantage(responses, mask, shaped, index, correct=labels, backend=backend)
    from_rewards = key_token_scores(responses, mask, rewards, index, backend=backend)
    from_labels = key_token_scores(responses, mask, shaped, index, correct=labels.int(), backend=backend)
    assert torch.equal(from_labels.a, from_rewards.a) and torch.equal(from_labels.score, from_rewards.score)
    # the scores follow the labels, the baseline follows the shaped rewards
    base_only = token_advantage(responses, mask, shaped, index, config=KTAEConfig(weight=0.0), backend=backend)
    expected = token_advantage(responses, mask, rewards, index, rollout_advantage=base_only[:, 0].double(),
                               backend=backend)
    torch.testing.assert_close(by_label, expected, rtol=0, atol=1e-6)


def test_bad_correct_is_rejected_by_name(batch):
    with pytest.raises(ValueError, match="`correct`"):
        token_advantage(*batch, correct=torch.ones(7, dtype=torch.bool))
    with pytest.raises(ValueError, match="`correct`"):
        token_advantage(*batch, correct=torch.full((8,), 0.5))


def test_object_arrays_and_ints_past_int64_are_taken_as_the_numbers_they_hold():
    """verl's non-tensor columns are object arrays: one of plain numbers is read as numpy reads a list of
    them; a list of group ids past int64 groups as those ints (numpy alone makes it float64)."""
    responses = [[5, 7], [5, 8], [6, 7], [6, 9]]
    args = (responses, [[1, 1]] * 4, [1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1])
    expected = token_advantage(*args, correct=[True, False, True, False], backend="torch")
    as_objects = [np.array(a, dtype=object) for a in args]
    got = token_advantage(*as_objects, correct=np.array([np.bool_(True), False, True, False], dtype=object),
                          backend="torch")
    assert torch.equal(got, expected)
    big = token_advantage(*args[:3], [2**63, 2**63, 5, 5], correct=[True, False, True, False], backend="torch")
    assert torch.equal(big, token_advantage(*args[:3], [1, 1, 0, 0], correct=[True, False, True, False],
                                            backend="torch"))


@pytest.mark.parametrize("mistake, error, message", [
    (dict(responses=torch.tensor([[5.0, 7.0], [5.0, 8.0]])), ValueError, r"`responses`.*`responses\.long\(\)`"),
    (dict(rewards=[1.0, None]), ValueError, r"`rewards` must hold numbers, found None"),
    (dict(rewards=np.array([1.0, "x"], dtype=object)), ValueError, r"`rewards` must hold numbers, found 'x' \(str\)"),
    (dict(responses=[[5, 2**64], [5, 8]]), ValueError,
     r"^`responses` must hold integers that one 64-bit type holds \(int64 or uint64\), found 5 and 18446744073709551616$"),
    (dict(responses=[[-1, 2**63], [5, 8]]), ValueError, r"found -1 and 9223372036854775808$"),
    (dict(responses=[[5, 2**63], [5, 8]]), ValueError, r"`responses` token ids must be < 2\*\*31, found 9223372036854775808"),
    (dict(index=torch.zeros(2, dtype=torch.int64, device="meta")), ValueError, r"`index` is a meta tensor"),
    (dict(index=torch.tensor([0.0, 0.0])), ValueError, r"`index`.*`index\.long\(\)`"),
    (dict(response_mask=torch.tensor([[2, 1], [1, 1]])), ValueError, r"`response_mask`.*responses != pad_id"),
    (dict(backend="cuda"), BackendUnavailableError, r"backend 'cuda' runs on 'cuda' tensors.*backend='auto'"),
])
def test_mistakes_raise_errors_that_name_the_argument_and_the_fix(mistake, error, message):
    args = dict(responses=torch.tensor([[5, 7], [5, 8]]), response_mask=torch.ones(2, 2, dtype=torch.bool),
                rewards=torch.tensor([1.0, 0.0]), index=[0, 0])
    args.update(mistake)
    backend = args.pop("backend", "auto")
    with pytest.raises(error, match=message):
        token_advantage(args["responses"], args["response_mask"], args["rewards"], args["index"], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("layout", ["reversed", "big-endian", "record-field"])
def test_numpy_arrays_of_any_layout_are_taken(batch, backend, layout):
    """numpy arrays torch cannot wrap as they are (negative strides: ``a[::-1]``; big-endian dtypes, e.g.
    read from a file; a field of a record array, whose strides are no multiple of its item size) are
    copied: the result is that of native contiguous arrays."""
    responses, mask, rewards, index = (t.numpy() for t in batch)
    given, correct = np.linspace(-1.0, 1.0, 8), rewards > 0
    want = token_advantage(responses, mask, rewards, index, rollout_advantage=given, correct=correct, backend=backend)

    def arranged(array):
        if layout == "reversed":  # the same values, each axis stored backwards
            return np.flip(np.ascontiguousarray(np.flip(array)))
        if layout == "record-field":  # beside a one-byte field: strides of itemsize + 1 bytes
            records = np.zeros(array.shape, dtype=[("value", array.dtype), ("flag", np.uint8)])
            records["value"] = array
            return records["value"]
        return array.astype(array.dtype.newbyteorder(">"))

    arrays = [arranged(a) for a in (responses, mask.astype(np.float32), rewards, given, correct.astype(np.int64))]
    assert all(np.array_equal(a, b) for a, b in zip(arrays, (responses, mask, rewards, given, correct)))
    got = token_advantage(*arrays[:3], index, rollout_advantage=arrays[3], correct=arrays[4], backend=backend)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_lists_of_empty_rows_are_a_batch_of_no_token(backend):
    """``responses=[[], [], []]``: three rollouts of no token (numpy makes the empty list float64; there is
    no float id in it), as an int64 ``[3, 0]`` tensor would be."""
    got = token_advantage([[], [], []], [[], [], []], [1.0, 0.0, 1.0], [0, 0, 1], backend=backend)
    assert got.shape == (3, 0) and got.dtype == torch.float32
    scores = key_token_scores([[], [], []], [[], [], []], [1.0, 0.0, 1.0], [0, 0, 1], backend=backend)
    assert len(scores) == 0 and scores.n_c.tolist() == [1, 1] and scores.n_w.tolist() == [1, 0]


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_uint64_ids_from_2_63_on_are_reported_with_their_value(backend):
    """A uint64 id of 2**63 was cast to int64 and reported as the negative id -2**63; padding under mask 0
    may hold anything."""
    responses = np.array([[5, 7], [5, 2**63 + 4]], dtype=np.uint64)
    mask = np.ones((2, 2), dtype=bool)
    for ids in (responses, torch.from_numpy(responses)):
        with pytest.raises(ValueError, match=r"^`responses` token ids must be < 2\*\*31, found 9223372036854775812$"):
            token_advantage(ids, mask, [1.0, 0.0], [0, 0], backend=backend)
    mask[1, 1] = False
    want = token_advantage(np.array([[5, 7], [5, 0]]), mask, [1.0, 0.0], [0, 0], backend=backend)
    assert torch.equal(token_advantage(responses, mask, [1.0, 0.0], [0, 0], backend=backend), want)


@pytest.mark.parametrize("given", [[True, False], torch.tensor([True, False]), np.array([True, False])])
def test_a_bool_rollout_advantage_is_refused(given):
    """``A_i`` is a real number: bool flags (perhaps meant as ``correct``) were taken as 1.0 / 0.0."""
    responses = torch.tensor([[5, 7], [5, 8]])
    with pytest.raises(ValueError, match=r"^`rollout_advantage` must be real with shape \[B\] = \[2\], got "
                                         r"torch.bool \(2,\)$"):
        token_advantage(responses, responses != 0, [1.0, 0.0], [0, 0], rollout_advantage=given)


def test_public_examples_run():
    """The docstring examples of the public functions are true."""
    import doctest

    import ktae_kernels.api as api
    import ktae_kernels.config as config
    import ktae_kernels.fisher as fisher
    import ktae_kernels.plan as plan

    for module, examples in ((api, 4), (fisher, 2), (config, 2), (plan, 4)):
        failures, tried = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert tried >= examples and failures == 0, module.__name__


@pytest.mark.parametrize("config", [KTAEConfig(), KTAEConfig(weight=0.3, ignore_token_ids=(3,))], ids=["default", "weight"])
def test_scores_give_the_advantages_bitwise(config):
    """``KeyTokenScores.token_advantage`` (the lookup path for rows scored by other rows' tables) gives
    exactly ``token_advantage`` on the rows the scores were counted from, with string uids too."""
    from cases import random_cases

    for _, responses, mask, rewards, index in random_cases(seed=3, small=True):
        uids = np.array([f"uid-{int(i)}" for i in index], dtype=object)
        base = torch.randn(responses.shape[0], dtype=torch.float64)
        want = token_advantage(responses, mask, rewards, uids, config=config, rollout_advantage=base, backend="torch")
        kts = key_token_scores(responses, mask, rewards, uids, config=config, backend="torch")
        got = kts.token_advantage(responses, mask, uids, base, config.weight)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        unknown = kts.token_scores(responses, np.array(["other"] * responses.shape[0], dtype=object))
        assert not unknown.any()


def test_scores_lookup_takes_any_int64_id():
    """Ids past every row's token (up to int64's largest) score 0, with no overflow of the (group, token) key."""
    responses = torch.tensor([[1, 2], [3, 4], [1, 5], [6, 7]])
    kts = key_token_scores(responses, torch.ones_like(responses, dtype=torch.bool), [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1],
                           backend="torch")
    big = 2**63 - 1
    got = kts.token_scores(torch.tensor([[1, big], [big, 7]]), [0, 1])
    want = kts.token_scores(torch.tensor([[1, 0], [0, 7]]), [0, 1])
    assert torch.equal(got, want) and got[0, 0] != 0 and got[1, 1] != 0 and got[0, 1] == got[1, 0] == 0


@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_no_negative_zero_scores(backend):
    """A scorable table with zero strength and a negative direction gives +0.0, never -0.0 (which
    would print as -0.000)."""
    from cases import random_cases

    for _, responses, mask, rewards, index in random_cases(seed=2, small=True):
        score = key_token_scores(responses, mask, rewards, index, backend=backend).score
        zero = score == 0
        assert not torch.signbit(score[zero]).any()


@pytest.fixture
def scores(batch):
    return key_token_scores(*batch, backend="torch")


def test_scores_methods_take_lists_and_numpy_as_the_api_does(batch, scores):
    responses, mask, rewards, index = batch
    base = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64)
    want = scores.token_advantage(responses, mask, index, base, 0.5)
    got = scores.token_advantage(responses.tolist(), mask.numpy(), index.tolist(), base.tolist(), np.float32(0.5))
    assert torch.equal(got, want) and got.dtype == torch.float32
    assert torch.equal(scores.token_scores(responses.numpy(), index.numpy()), scores.token_scores(responses, index))


@pytest.mark.parametrize("call, message", [
    (lambda s, r, m, i: s.token_scores(r, i[:1]), r"^`index` must be 1-D of length B = 8, got shape \(1,\)$"),
    (lambda s, r, m, i: s.token_scores(r[0], i), r"^`responses` must be 2-D \[B, L\], got shape \(10,\)$"),
    (lambda s, r, m, i: s.token_scores(r.float(), i), r"^`responses` must hold integer token ids, got dtype "
                                                      r"torch.float32; convert with `responses.long\(\)`$"),
    (lambda s, r, m, i: s.token_scores([[1, 2], [3]], i), r"^`responses` must be a rectangular"),
    (lambda s, r, m, i: s.token_scores(r, "uid"), r"^`index` must be a tensor, numpy array or list"),
    (lambda s, r, m, i: s.token_advantage(r, m[:, :5], i, torch.zeros(8)),
     r"^`response_mask` must have the shape of `responses` \(8, 10\), got \(8, 5\)$"),
    (lambda s, r, m, i: s.token_advantage(r, m.T, i, torch.zeros(8)),
     r"^`response_mask` must have the shape of `responses` \(8, 10\), got \(10, 8\); one of the two is transposed"),
    (lambda s, r, m, i: s.token_advantage(r, m.long() * 2, i, torch.zeros(8)),
     r"^`response_mask` must be bool or hold only 0 and 1, found 2 at row 0, column 0 \(\d+ values are neither"),
    (lambda s, r, m, i: s.token_advantage(r, m, i, torch.zeros(1)),
     r"^`rollout_advantage` must be real with shape \[B\] = \[8\], got torch.float32 \(1,\)$"),
    (lambda s, r, m, i: s.token_advantage(r, m, i, torch.tensor([0.0] * 6 + [float("inf"), float("nan")])),
     r"^`rollout_advantage` must be finite, found inf at row 6 \(2 rows are not finite\)$"),
    (lambda s, r, m, i: s.token_advantage(r, m, i, torch.zeros(8), weight="1"),
     r"^`weight` must be a finite number, got '1'$"),
])
def test_scores_methods_name_the_bad_argument(batch, scores, call, message):
    responses, mask, rewards, index = batch
    with pytest.raises(ValueError, match=message):
        call(scores, responses, mask, index)


@pytest.mark.parametrize("index, got", [
    ([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], "float64 values"),
    (np.array([np.nan] * 8, dtype=object), "float values"),
    ([True] * 8, "bool values"),
])
def test_scores_methods_take_the_index_the_api_takes(batch, scores, index, got):
    """``token_scores`` looks rows up by the labels ``token_advantage`` groups by (one check of both):
    float labels (an integral 1.0 found group 1, NaN nothing) are refused as the API refuses them."""
    responses, mask, _, _ = batch
    message = rf"^`index` must hold group ids of one kind, all ints or all strings, got {got}"
    with pytest.raises(ValueError, match=message):
        scores.token_scores(responses, index)
    with pytest.raises(ValueError, match=message):
        scores.token_advantage(responses, mask, index, torch.zeros(8))


def test_key_rows_and_lookup_check_the_group_and_top_k(scores):
    rows = scores.key_rows(1)
    assert scores.key_rows(1, top_k=2) == rows[:2] and scores.key_rows(1, top_k=0) == []
    valid = r"a dense group id, an int in \[0, 2\) \(group_labels\[g\] is your label of group g\)"
    with pytest.raises(ValueError, match=rf"^`top_k` must be None or an int >= 0, got -1$"):
        scores.key_rows(0, top_k=-1)
    with pytest.raises(ValueError, match=rf"^`top_k` must be None or an int >= 0, got True$"):
        scores.key_rows(0, top_k=True)
    with pytest.raises(ValueError, match=rf"^`group` must be {valid}, got 7$"):
        scores.key_rows(7)
    with pytest.raises(ValueError, match=rf"^`group` must be {valid}, got '0'$"):
        scores.lookup("0", 7)
    with pytest.raises(ValueError, match=r"^`scored_only` must be a bool, got 1$"):
        scores.key_rows(0, scored_only=1)
    with pytest.raises(ValueError, match=r"^`token` must be an int token id, got 7.0$"):
        scores.lookup(0, 7.0)
    token = int(scores.token[rows[0]])
    assert scores.lookup(np.int64(1), token)["token"] == token
    with pytest.raises(KeyError, match=r"no row for group 1, token 99"):
        scores.lookup(1, 99)


def test_a_label_given_for_a_dense_group_id_is_named():
    responses = torch.tensor([[5, 7], [5, 8]])
    scores = key_token_scores(responses, responses != 0, [1.0, 0.0], ["uid-a", "uid-a"])
    with pytest.raises(ValueError, match=r"got 'uid-a'; 'uid-a' is your label of group 0$"):
        scores.key_rows("uid-a")


@pytest.mark.parametrize("index, got", [
    ([0.0, 0.0, 1.0, 1.0], "float64 values"),
    (np.array([0.0, 0.0, 1.0, 1.0]), "float64 values"),
    (np.array([0.0, 0.0, 1.0, 1.0], dtype=np.float32), "float32 values"),
    ([True, True, False, False], "bool values"),
    ([0, "a", 0, "a"], "a mix of int and str"),
    (np.array([0, "a", 0, "a"], dtype=object), "a mix of int and str"),
    (np.array(["a", None, "a", None], dtype=object), "a mix of NoneType and str"),
    (np.array([0.0, 0.0, 1.0, 1.0], dtype=object), "float values"),
    ([[0], [0], [1], [1, 2]], "a ragged nested list"),
])
def test_index_holds_ints_or_strings_in_every_form(index, got):
    """A float index is refused as a list or numpy array as it is as a tensor, and labels of two kinds (which
    numpy would turn into strings) are refused rather than grouped by their text."""
    responses = torch.tensor([[5, 7], [5, 8], [1, 2], [3, 4]])
    with pytest.raises(ValueError, match=rf"^`index` must hold group ids of one kind, all ints or all strings, "
                                         rf"got {got}"):
        token_advantage(responses, responses != 0, [1.0, 0.0, 1.0, 0.0], index)


@pytest.mark.parametrize("index", [[], np.array([])])
def test_an_empty_batch_takes_an_empty_list_index(index):
    """numpy makes ``[]`` a float64 array; an empty batch has no float id to refuse."""
    responses = torch.zeros(0, 3, dtype=torch.int64)
    assert token_advantage(responses, responses != 0, torch.zeros(0), index).shape == (0, 3)


@pytest.mark.parametrize("index", [[0, 0, 1, 1], np.array([7, 7, 2, 2], dtype=np.uint8), ["a", "a", "b", "b"],
                                   np.array(["a", "a", "b", "b"], dtype=object), np.array([0, 0, 1, 1], dtype=object),
                                   (np.int64(3), np.int64(3), 4, 4)])
def test_index_forms_that_are_taken(index):
    responses = torch.tensor([[5, 7], [5, 8], [1, 2], [3, 4]])
    want = token_advantage(responses, responses != 0, [1.0, 0.0, 1.0, 0.0], torch.tensor([0, 0, 1, 1]))
    assert torch.equal(token_advantage(responses, responses != 0, [1.0, 0.0, 1.0, 0.0], index), want)
