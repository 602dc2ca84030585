"""Real OpenRLHF (``pip install --no-deps openrlhf``) driven on a CPU, as its trainer actor runs it: the
CLI's own parser and checks (``parse_args``), vLLM-style responses turned into Experiences by its
``SamplesGenerator`` (``rollout_samples``), and ``RemoteExperienceMaker.make_experience_batch`` (split,
KL, length penalties, advantages). The model forward passes (policy, reference, reward model) are the only
stand-ins: ``ForwardGroup`` computes deterministic log-probs and rewards from the tokens.

Importing this module imports OpenRLHF (with flash_attn, deepspeed and vllm stubbed): Ray workers
that must not import OpenRLHF import ``openrlhf_stubs`` instead.
"""
from __future__ import annotations

import contextlib
import copy
import runpy
import sys
import types
from typing import Any, Callable, Iterator

import numpy as np
import torch

import openrlhf_stubs

openrlhf_stubs.import_openrlhf()

import openrlhf.utils  # noqa: E402
import ray  # noqa: E402
from openrlhf.trainer import ppo_trainer  # noqa: E402
from openrlhf.trainer.ppo_trainer import BasePPOTrainer  # noqa: E402
from openrlhf.trainer.ppo_utils import experience_maker  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402

CLI = "openrlhf.cli.train_ppo_ray"
N = 4  # rollouts per prompt
#: token 7 in a response makes it correct (the reward model's and reward function's rule).
ANSWER = 7
#: flags every test run passes: one actor GPU, 3 prompts x 4 rollouts in micro-batches of 5, and a
#: context window (``--data.max_len``) that cuts the longest rollouts.
FLAGS = ["--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--rollout.n_samples_per_prompt", str(N),
         "--rollout.batch_size", "3", "--rollout.micro_batch_size", "5", "--data.max_len", "18"]
#: DAPO's overlong penalty: responses longer than 10 - 4 tokens lose up to 1.
OVERLONG = ["--rollout.max_new_tokens", "10", "--reward.overlong_buffer_len", "4"]
#: dynamic batching: micro-batches balanced by sequence length, at most 40 tokens each.
DYNAMIC = ["--train.dynamic_batch_enable", "--rollout.max_tokens_per_gpu", "40", "--vllm.num_engines", "1"]
PAD = 0


class Parsed(Exception):
    """Raised where ``train_ppo_ray`` starts training, carrying the args its parser and checks built."""


def parse_args(flags: list[str]) -> Any:
    """OpenRLHF's args as ``python -m openrlhf.cli.train_ppo_ray <flags>`` builds them: its own parser,
    ``hierarchize`` and checks (the module run as ``__main__``), stopped where ``train(args)`` asks for
    the DeepSpeed strategy (``ray.is_initialized`` answers True so that no Ray starts)."""
    saved = openrlhf.utils.get_strategy, ray.is_initialized, sys.argv

    def stop(args: Any) -> None:
        raise Parsed(args)

    openrlhf.utils.get_strategy, ray.is_initialized, sys.argv = stop, (lambda: True), [CLI, *flags]
    try:
        with openrlhf_stubs.stubbed():
            runpy.run_module(CLI, run_name="__main__")
    except Parsed as parsed:
        return parsed.args[0]
    finally:
        openrlhf.utils.get_strategy, ray.is_initialized, sys.argv = saved
    raise AssertionError(f"{CLI} returned without calling train(args)")


# --------------------------------------------------------------------------------------- rollouts
def responses(seed: int = 0, prompts: int = 3, *, scored: bool = True) -> list[dict]:
    """vLLM engine outputs as ``SamplesGenerator`` receives them, ``N`` per prompt in prompt order: the
    observation tokens (prompt, then one or two turns with tool output between: ``action_ranges``), a
    response made correct by token ``ANSWER``, ``finish_reason == "length"`` as ``truncated``. With
    ``scored`` the reward function's ``reward`` / ``scores`` / ``extra_logs["acc"]`` (1 when correct), else
    none of them (the reward-model path)."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(prompts):
        prompt = [100 + p, *rng.integers(101, 110, size=rng.integers(2, 5)).tolist()]
        for _ in range(N):
            correct = bool(rng.random() < 0.5)
            turns = [rng.integers(3, 15, size=rng.integers(1, 9)).tolist() for _ in range(rng.integers(1, 3))]
            turns = [[t if t != ANSWER else 3 for t in turn] for turn in turns]
            if correct:
                turns[-1][-1] = ANSWER
            tokens, ranges = list(prompt), []
            for k, turn in enumerate(turns):
                if k:
                    tokens += [200, 201]  # a tool's output: observed, not an action
                ranges.append((len(tokens), len(tokens) + len(turn)))
                tokens += turn
            item = {"observation_tokens": tokens, "action_ranges": ranges, "rollout_log_probs": None,
                    "prompt": f"prompt {p}", "label": "7", "truncated": sum(map(len, turns)) >= 10}
            if scored:
                item.update(reward=float(correct), scores=float(correct), extra_logs={"acc": float(correct)})
            out.append(item)
    return out


def rollout_samples(args: Any, items: list[dict]) -> list[Any]:
    """One Experience per response, as OpenRLHF's ``SamplesGenerator`` makes them (truncated to
    ``--data.max_len``)."""
    generator = SamplesGenerator(types.SimpleNamespace(args=args), None, None, None, [])
    return [generator._process_response_into_experience(item, max_len=args.data.max_len) for item in items]


# ----------------------------------------------------------------------------- model forward passes
class ForwardGroup:
    """Stands in for a ``RayActorGroup`` of one model: ``forward`` on each micro-batch, all on one actor
    (the result is a list per actor, as OpenRLHF's groups return). ``fn`` gets the batch's tensors."""

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn

    def async_run_method_batch(self, method_name: str, **batches: list) -> list[list[torch.Tensor]]:
        assert method_name == "forward", method_name
        n = len(batches["sequences"])
        return [[self.fn(**{k: v[i] for k, v in batches.items()}) for i in range(n)]]


def log_probs(offset: int) -> Callable[..., torch.Tensor]:
    """A policy's action log-probs ``[b, S - 1]``: a fixed function of the next tokens."""
    def forward(sequences: torch.Tensor, **other: Any) -> torch.Tensor:
        return -((sequences[:, 1:] * 7 + offset) % 13).float() / 13 - 0.05
    return forward


def reward_model(sequences: torch.Tensor, attention_mask: torch.Tensor, **other: Any) -> torch.Tensor:
    """The reward model: 1 for a sequence holding ``ANSWER``, else 0 (``[b]``)."""
    return ((sequences == ANSWER) & (attention_mask > 0)).any(1).float()


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """``ray.get`` / ``ray.put`` of the experience maker's module as the identity, so that it runs with
    ``ForwardGroup`` s and no Ray (inside a Ray actor as well)."""
    real = experience_maker.ray
    experience_maker.ray = types.SimpleNamespace(get=lambda refs: refs, put=lambda value: value)
    try:
        yield
    finally:
        experience_maker.ray = real


def build_maker(args: Any, maker_class: type | None = None) -> Any:
    """``maker_class`` (OpenRLHF's ``RemoteExperienceMaker`` when None) built as ``BasePPOTrainer`` builds
    it, with forward groups for the policy, the reference (KL on) and the reward model (no remote reward)."""
    cls = maker_class or experience_maker.RemoteExperienceMaker
    return cls(*model_groups(args), _kl_controller(args), types.SimpleNamespace(args=args),
               types.SimpleNamespace(pad_token_id=PAD))


def model_groups(args: Any) -> tuple[Any, Any, Any, Any]:
    """(actor, critic, reward model, reference) groups of a run with ``args``."""
    reference = ForwardGroup(log_probs(3)) if args.algo.kl.init_coef > 0 else None
    reward = None if args.reward.remote_url else ForwardGroup(reward_model)
    return ForwardGroup(log_probs(0)), None, reward, reference


def _kl_controller(args: Any) -> Any:
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    return FixedKLController(args.algo.kl.init_coef)


def make_experiences(maker: Any, samples: list[Any]) -> list[Any]:
    """``maker.make_experience_batch`` on copies of ``samples`` (split, forward passes, KL, length
    penalties, advantages)."""
    with local_ray():
        return maker.make_experience_batch(copy.deepcopy(samples))


# ------------------------------------------------------------------------------- in a Ray actor
class TrainerActor(BasePPOTrainer):
    """OpenRLHF's ``BasePPOTrainer`` as a Ray actor: its own ``__init__`` builds the experience maker
    (KTAE's where the setup hook patched the trainer module); ``step`` runs one batch of rollouts through
    it."""

    def __init__(self, flags: list[str]):
        args = parse_args(flags)
        actor, critic, reward, reference = model_groups(args)
        super().__init__(types.SimpleNamespace(args=args), actor, critic, reward, reference, None,
                         types.SimpleNamespace(pad_token_id=PAD))

    def step(self, seed: int) -> dict:
        samples = rollout_samples(self.args, responses(seed))
        out = make_experiences(self.experience_maker, samples)
        from ktae_kernels.integrations.openrlhf import installed_version

        return {"maker": type(self.experience_maker).__name__, "version": installed_version(),
                "settings": getattr(type(self.experience_maker), "ktae_settings", None),
                "advantages": [e.advantages for e in out], "index": [e.index for e in out],
                "info": [e.info for e in out]}
