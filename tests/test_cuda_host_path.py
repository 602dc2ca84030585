"""The cuda backend's host path without a GPU, on the emulator (tests/emulator.py): what a call reads back
(each read is a device sync on a GPU) and launches, counted; the values checked on the device raising the
API's own errors, in the API's order, with ``out`` untouched (or NaN after a replay); the group ids made
dense where the index lives.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import emulated_cuda
from cases import make_batch
from cuda_recorder import Recorder
from ktae_kernels import KTAEConfig, plan as plan_module, token_advantage
from ktae_kernels.backends import cuda, device as device_state
from ktae_kernels.backends.base import BackendSpec
from ktae_kernels.plan import TokenAdvantagePlan
from ktae_kernels.validation import check_rollout_advantage, group_ids, normalise_batch, tensor_group_ids

#: the tensor methods that copy values to the host (on a GPU, each waits for the device).
READS = {"tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__", "cpu", "__array__"}
#: the kernels of a warm call: the scan, the two groups passes, the shared-table pass and the global pass
#: (its blocks exit at once when every group fit its shared table).
KERNELS = ["ktae::scan_kernel", "ktae::groups_kernel", "ktae::group_sums_kernel", "ktae::dynamic_kernel<true>",
           "ktae::dynamic_kernel<false>"]


class Reads(TorchFunctionMode):
    """Counts the reads of tensor values to the host (``READS``; what is done with a copy ``cpu`` made
    and its slices is host work, not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.host: set[int] = set()  # data pointers of copies made by a counted ``cpu``

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        on_host = bool(args) and isinstance(args[0], torch.Tensor) and args[0].untyped_storage().data_ptr() in self.host
        result = func(*args, **(kwargs or {}))
        if name in READS and not on_host:
            self.seen.append(name)
            if name == "cpu":
                self.host.add(result.untyped_storage().data_ptr())
        elif on_host and isinstance(result, torch.Tensor):
            self.host.add(result.untyped_storage().data_ptr())
        return result


class Ops(TorchDispatchMode):
    """The aten ops a call runs besides the cuda kernels (each one a launch on a GPU), views left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def batch_data(shuffle: bool = False):
    """4 groups of 8 rollouts x 48 positions; verl's int64 mask, float32 rewards."""
    responses, mask, rewards, index = make_batch(np.random.default_rng(3), [8] * 4, 48, 60, shuffle=shuffle)
    return responses, mask.long(), rewards.float(), index


def call(ext, responses, mask, rewards, index, rollout_advantage=None, correct=None, out=None):
    """``token_advantage`` as the API runs it for the cuda backend (values checked on the device), launched
    by ``ext`` (the emulator, or a ``Recorder`` of it)."""
    batch = normalise_batch(responses, mask, rewards, index, correct=correct, check_ids=False, defer_values=True)
    given = check_rollout_advantage(rollout_advantage, batch, defer_values=True)
    return cuda.token_advantage(batch, KTAEConfig(), given, out, launcher=ext)


def emulated_plan(emulator, index: torch.Tensor, shape: tuple[int, int]) -> TokenAdvantagePlan:
    """A plan of ``index`` whose backend is the cuda backend on the emulator, registered as the cuda
    backend is (token ids and values checked on the device, capturable)."""
    emulated_cuda.LAUNCHER = emulator
    spec = BackendSpec("emulated_cuda", "emulated_cuda", ("cpu",), lambda _: None, checks_token_ids=True,
                       checks_values=True, capturable=True)
    labels, group = np.unique(index.numpy(), return_inverse=True)
    return TokenAdvantagePlan(shape=shape, device=torch.device("cpu"), config=KTAEConfig(), spec=spec,
                              group=torch.as_tensor(group), group_labels=labels)


def reference(responses, mask, rewards, index, **kwargs):
    return token_advantage(responses, mask, rewards, index, backend="reference", **kwargs)


@pytest.mark.parametrize("index_kind", ["list", "numpy", "uid strings"])
def test_a_warm_call_reads_back_once_and_launches_five_kernels(emulator, index_kind):
    """After a warm-up call of the layout with a host index: one read (the flags, after every launch),
    five kernels, and no sort on the device."""
    responses, mask, rewards, index = batch_data(shuffle=True)
    index = {"list": index.tolist(), "numpy": index.numpy(),
             "uid strings": np.array([f"uid-{i}" for i in index.tolist()], dtype=object)}[index_kind]
    ext = Recorder(emulator)
    call(ext, responses, mask, rewards, index)  # the warm-up: sizes learnt, grid computed
    warm = len(ext.names())
    with Reads() as counted, Ops() as ops:
        got = call(ext, responses, mask, rewards, index)
    assert counted.seen == ["tolist"]
    assert ext.names()[warm:] == KERNELS
    assert not {"sort", "argsort"} & {op.split(".")[0] for op in ops.ops}, ops.ops
    torch.testing.assert_close(got, reference(responses, mask, rewards, index), rtol=0, atol=1e-6)


def test_a_plans_call_reads_back_once(emulator):
    """A plan's call (group ids made dense once): one read, after every launch, and no sort."""
    responses, mask, rewards, index = batch_data()
    plan = emulated_plan(emulator, index, tuple(responses.shape))
    plan(responses, mask, rewards)
    with Reads() as counted, Ops() as ops:
        got = plan(responses, mask, rewards)
    assert counted.seen == ["tolist"]
    assert not {"sort", "argsort"} & {op.split(".")[0] for op in ops.ops}, ops.ops
    torch.testing.assert_close(got, reference(responses, mask, rewards, index), rtol=0, atol=1e-6)


def _bad(name: str, value, responses, mask, rewards, index):
    """The batch with ``name`` made bad: (arguments, keyword arguments)."""
    kwargs = {}
    if name == "rewards":
        rewards = rewards.clone()
        rewards[5] = value
    elif name == "response_mask":
        mask = (mask.double() if isinstance(value, float) else mask).clone()
        mask[2, 7] = value
    elif name == "correct":
        kwargs["correct"] = (rewards > 0).long()
        kwargs["correct"][9] = value
    else:
        kwargs["rollout_advantage"] = torch.zeros(rewards.shape[0], dtype=torch.float64)
        kwargs["rollout_advantage"][4] = value
    return (responses, mask, rewards, index), kwargs


def _host_error(args, kwargs) -> str:
    """The message the API's host checks give for these inputs."""
    with pytest.raises(ValueError) as err:
        batch = normalise_batch(*args, correct=kwargs.get("correct"))
        check_rollout_advantage(kwargs.get("rollout_advantage"), batch)
    return str(err.value)


@pytest.mark.parametrize("name, value", [("rewards", float("nan")), ("rewards", float("-inf")),
                                         ("response_mask", 2), ("response_mask", 0.5), ("response_mask", -1),
                                         ("correct", 3), ("rollout_advantage", float("inf"))])
def test_a_value_checked_on_the_device_raises_the_apis_error_and_leaves_out_untouched(emulator, name, value):
    args, kwargs = _bad(name, value, *batch_data())
    expected = _host_error(args, kwargs)
    out = torch.full(tuple(args[0].shape), 7.0)
    with pytest.raises(ValueError) as err:
        call(emulator, *args, out=out, **kwargs)
    assert str(err.value) == expected
    assert bool((out == 7.0).all()), "a bad input wrote to `out`"


def test_errors_keep_the_apis_order(emulator):
    """The mask is reported before an id out of range, which is reported before a reward."""
    responses, mask, rewards, index = batch_data()
    responses = responses.clone()
    responses[1, 3] = -4
    (_, bad_mask, _, _), _ = _bad("response_mask", 2, responses, mask, rewards, index)
    (_, _, bad_rewards, _), _ = _bad("rewards", float("nan"), responses, mask, rewards, index)
    with pytest.raises(ValueError, match="`response_mask` must be bool or hold only 0 and 1, found 2"):
        call(emulator, responses, bad_mask, rewards, index)
    with pytest.raises(ValueError, match="token ids >= 0 where the mask is 1, found -4"):
        call(emulator, responses, mask, bad_rewards, index)


def test_a_replay_with_a_nan_reward_writes_nan_and_check_raises(emulator, monkeypatch):
    """A captured call checks nothing on the host; its groups pass finds the NaN reward: ``out`` holds
    NaN, and ``check()`` raises the API's error."""
    responses, mask, rewards, index = batch_data()
    mask, rewards = mask.bool(), rewards.double()
    plan = emulated_plan(emulator, index, tuple(responses.shape))
    plan(responses, mask, rewards)
    bad = rewards.clone()
    bad[5] = float("nan")
    out = torch.full(tuple(responses.shape), 7.0)
    with monkeypatch.context() as m:
        m.setattr(plan_module, "capturing", lambda device: True)
        m.setattr(device_state, "capturing", lambda device: True)
        plan(responses, mask, bad, out=out)
    assert bool(out.isnan().all())
    with pytest.raises(ValueError, match="`rewards` must be finite, found nan at row 5"):
        plan.check()


def test_a_device_index_is_grouped_where_it_lives_with_one_read():
    """``tensor_group_ids`` (a GPU tensor index; here on the CPU): one read, the sorted values and run
    starts, and no copy of the index to the host."""
    index = torch.tensor([5, 2, 5, 9, 2, 2])
    with Reads() as counted:
        ids = tensor_group_ids(index, torch.device("cpu"))
    assert counted.seen == ["cpu"] and ids.labels.tolist() == [2, 5, 9] and ids.group.tolist() == [1, 0, 1, 2, 0, 0]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("contiguous", [True, False])
def test_group_ids_of_a_tensor_match_numpys_unique_and_a_stable_sort(dtype, contiguous):
    values = np.repeat(np.array([9, 3, 200, 7]), [3, 1, 4, 2])
    if not contiguous:
        values = np.random.default_rng(0).permutation(values)
    tensor = torch.as_tensor(values, dtype=dtype)
    for index in (tensor, values.astype(tensor.numpy().dtype), values.tolist()):
        ids = group_ids(index, len(values), torch.device("cpu"))
        labels, inverse = np.unique(np.asarray(index), return_inverse=True)
        np.testing.assert_array_equal(ids.labels, labels)
        assert ids.labels.dtype == labels.dtype
        assert ids.group.tolist() == inverse.tolist()
        assert ids.members.tolist() == np.argsort(inverse, kind="stable").tolist()
    host = group_ids(tensor, len(values), torch.device("cpu"))
    on_device = tensor_group_ids(tensor, torch.device("cpu"))  # a GPU tensor's path, here on the CPU
    np.testing.assert_array_equal(on_device.labels, host.labels)
    assert on_device.labels.dtype == host.labels.dtype and torch.equal(on_device.group, host.group)
    assert torch.equal(on_device.members, host.members)

