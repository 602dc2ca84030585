"""The errors and warnings a new user meets, read as they are printed: a transposed batch (named as such,
not as a bad `rewards`), a mask value other than 0 / 1 (its value and where), a NaN reward (its row),
``backend="cuda"`` on a machine without a usable CUDA GPU (what to use instead), a negative ``weight``
(allowed for ablations, with a warning), "auto" running the torch backend because the native kernel is
not built (warned once, with how to build it), and no numpy warning from Triton's interpreter."""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from ktae_kernels import KTAEConfig, available_backends, clear_caches, token_advantage
from ktae_kernels import registry
from ktae_kernels.backends.base import BackendUnavailableError

RESPONSES = torch.tensor([[5, 7, 2], [5, 8, 2]])
REWARDS = torch.tensor([1.0, 0.0])


def test_a_transposed_batch_is_named_not_blamed_on_the_rewards():
    """``[L, B]`` ids with ``B`` rewards: the ids are the problem, and the fix is a transpose."""
    responses = torch.arange(1, 25).reshape(8, 3)  # B = 8 rollouts of L = 3 tokens
    rewards, index = torch.arange(8.0) % 2, torch.arange(8) // 4
    with pytest.raises(ValueError) as raised:
        token_advantage(responses.T, responses.T != 0, rewards, index)
    assert str(raised.value) == ("`responses` must be [B, L], one row per rollout, got shape (3, 8), and `rewards` "
                                 "has 8 values, one per column: the batch looks transposed; pass `responses.T` and "
                                 "`response_mask.T`")
    with pytest.raises(ValueError) as raised:
        token_advantage(responses.T, responses != 0, rewards, index)
    assert str(raised.value).endswith("got (8, 3); one of the two is transposed: both are [B, L]")
    assert token_advantage(responses, responses != 0, rewards, index).shape == (8, 3)


@pytest.mark.parametrize("mask, found", [
    ([[1, 2, 1], [1, 1, 0]], "found 2 at row 0, column 1;"),
    ([[1, 1, 1], [1, 1, 0.5]], "found 0.5 at row 1, column 2;"),
    ([[1, 3, 1], [-1, 1, 0]], "found 3 at row 0, column 1 (2 values are neither 0 nor 1);"),
])
def test_a_mask_value_other_than_0_or_1_is_named_with_its_place(mask, found):
    with pytest.raises(ValueError) as raised:
        token_advantage(RESPONSES, torch.tensor(mask), REWARDS, [0, 0])
    assert str(raised.value) == (f"`response_mask` must be bool or hold only 0 and 1, {found} build it as "
                                 f"`responses != pad_id`")


def test_correct_labels_other_than_0_or_1_name_the_row():
    with pytest.raises(ValueError, match=r"`correct` must be bool or hold only 0 and 1, found 2 at row 1;"):
        token_advantage(RESPONSES, RESPONSES != 0, REWARDS, [0, 0], correct=[1, 2])


@pytest.mark.parametrize("rewards, found", [
    (torch.tensor([1.0, float("nan")]), "found nan at row 1"),
    (torch.tensor([[0.0, 0.0, float("inf")], [1.0, 0.0, 0.0]]), "found inf at row 0"),  # token-level, summed
    (torch.tensor([float("nan"), float("-inf")]), "found nan at row 0 (2 rows are not finite)"),
])
def test_a_non_finite_reward_names_its_row(rewards, found):
    with pytest.raises(ValueError) as raised:
        token_advantage(RESPONSES, RESPONSES != 0, rewards, [0, 0])
    assert str(raised.value) == f"`rewards` must be finite, {found}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a usable CUDA GPU")
def test_backend_cuda_without_a_cuda_gpu_says_what_runs_here():
    """Moving the tensors with ``.to('cuda')`` would fail here too: the message says the machine cannot run
    the backend, why, and which backends run on these tensors."""
    with pytest.raises(BackendUnavailableError) as raised:
        token_advantage(RESPONSES, RESPONSES != 0, REWARDS, [0, 0], backend="cuda")
    message = str(raised.value)
    assert message.startswith("backend 'cuda' runs on 'cuda' tensors, and cannot run on this machine: ")
    assert "no CUDA GPU" in message or "no usable CUDA GPU" in message
    assert f"use backend='auto' (here it runs {registry.resolve('auto', 'cpu').name!r})" in message
    assert str(available_backends("cpu")) in message and ".to(" not in message


def test_a_negative_weight_is_allowed_with_a_warning():
    """A negative weight reverses the key-token term: an ablation, allowed (the kernels compute it exactly)
    but never silent."""
    with pytest.warns(UserWarning, match=r"KTAEConfig.weight=-1 is negative: the key-token term is reversed"):
        config = KTAEConfig(weight=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KTAEConfig(weight=0.0)
        KTAEConfig(weight=0.5)
    flipped = token_advantage(RESPONSES, RESPONSES != 0, REWARDS, [0, 0], config=config, rollout_advantage=[0.0, 0.0])
    plain = token_advantage(RESPONSES, RESPONSES != 0, REWARDS, [0, 0], rollout_advantage=[0.0, 0.0])
    torch.testing.assert_close(flipped, -plain, rtol=0, atol=0)


def test_auto_without_the_native_kernel_warns_once_how_to_build_it():
    """Where the native kernel is not built, "auto" runs the torch backend: the first call warns (at the
    caller's line) with the reason and how to build the kernel; later calls are quiet."""
    from ktae_kernels.backends import cpu

    reason = f"the native CPU kernel ktae_kernels._cpu is not built (stub); {cpu.BUILD_HINT}"
    stub = dataclasses.replace(registry.backend_spec("cpu"), unavailable=lambda kind: reason)
    real = registry.register_backend(stub)
    clear_caches()  # "auto" warns once per process: forget earlier warnings
    try:
        _warns_once_how_to_build(reason)
    finally:
        registry.register_backend(real)


def _warns_once_how_to_build(reason: str) -> None:
    with pytest.warns(RuntimeWarning) as caught:
        token_advantage(RESPONSES, RESPONSES != 0, REWARDS, [0, 0])
    (warning,) = caught
    assert str(warning.message) == (f"backend='auto' runs the slower 'torch' backend on cpu tensors: backend 'cpu' "
                                    f"is unavailable: {reason}")
    assert "pip install" in reason and warning.filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        token_advantage(RESPONSES, RESPONSES != 0, REWARDS, [0, 0])
        token_advantage(RESPONSES, RESPONSES != 0, REWARDS, [0, 0], backend="torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs on the CPU only without a GPU")
def test_triton_interpreter_leaks_no_numpy_warning(device):
    """Under ``TRITON_INTERPRET=1`` every lane runs in numpy, masked-off ones too: their 0 / 0 ("invalid
    value encountered in divide") must not reach the caller, whose numpy error state stays as it was."""
    pytest.importorskip("triton")
    from ktae_kernels import key_token_scores
    from ktae_kernels.__main__ import demo_batch

    batch = [t.to(device) for t in demo_batch()]
    before = np.geterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adv = token_advantage(*batch, backend="triton")
        key_token_scores(*batch, backend="triton")
    torch.testing.assert_close(adv, token_advantage(*batch, backend="reference"), rtol=0, atol=1e-6)
    assert np.geterr() == before


def test_ragged_responses_are_named_with_the_fix():
    """Rows of different lengths (a list of per-rollout id lists) must be padded: numpy's own message
    ("inhomogeneous shape") does not say which argument or what to do."""
    with pytest.raises(ValueError) as raised:
        token_advantage([[5, 7], [5]], [[1, 1], [1]], [1.0, 0.0], [0, 0])
    assert str(raised.value) == ("`responses` must be a rectangular array (every row of one length), got a ragged "
                                 "nested list; pad the rows to one length (and set `response_mask` to 0 on the "
                                 "padding)")
