"""Rollouts: sample G responses per prompt (transformers ``generate`` or vLLM) and pack them as tensors."""
from __future__ import annotations

import importlib
import os
import tempfile
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Rollouts:
    """A packed batch of N rollouts.

    prompts: int64 ``[N, P]`` left-padded prompt ids; prompt_mask: bool ``[N, P]``.
    responses: int64 ``[N, L]`` right-padded response ids (eos included when generated);
    response_mask: bool ``[N, L]``. group: int64 ``[N]`` prompt (group) id of each rollout.
    """

    prompts: Tensor
    prompt_mask: Tensor
    responses: Tensor
    response_mask: Tensor
    group: Tensor

    @property
    def input_ids(self) -> Tensor:
        """int64 ``[N, P + L]``: prompt then response."""
        return torch.cat([self.prompts, self.responses], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """int64 ``[N, P + L]``."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1).long()

    def rows(self, index: Tensor) -> "Rollouts":
        """The rollouts at ``index`` (int64 ``[n]``)."""
        return Rollouts(self.prompts[index], self.prompt_mask[index], self.responses[index],
                        self.response_mask[index], self.group[index])


def pack(prompts: list[list[int]], responses: list[list[int]], group: list[int], pad_id: int,
         device: str | torch.device) -> Rollouts:
    """Left-pad the prompts and right-pad the responses (each at least one column wide)."""
    if not (len(prompts) == len(responses) == len(group)):
        raise ValueError(f"pack needs one prompt, response and group id per rollout, got "
                         f"{len(prompts)}, {len(responses)}, {len(group)}")
    prompt_ids, prompt_mask = _pad(prompts, pad_id, left=True)
    response_ids, response_mask = _pad(responses, pad_id, left=False)
    return Rollouts(prompt_ids.to(device), prompt_mask.to(device), response_ids.to(device),
                    response_mask.to(device), torch.tensor(group, dtype=torch.int64, device=device))


def _pad(seqs: list[list[int]], pad_id: int, *, left: bool) -> tuple[Tensor, Tensor]:
    width = max(1, max((len(s) for s in seqs), default=0))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s, dtype=torch.int64)
        mask[i, cols] = True
    return ids, mask


def trim_at_eos(ids: list[int], eos_id: int) -> list[int]:
    """The response up to and including its first eos (all of it when there is none)."""
    return ids[: ids.index(eos_id) + 1] if eos_id in ids else ids


class HFRollout:
    """Sampling with ``model.generate`` (the default engine; CPU or GPU)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, temperature: float,
                 top_p: float) -> None:
        self.pad_id, self.eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p

    def sync(self, policy: PreTrainedModel) -> None:
        """Nothing to do: generation uses the live policy."""

    @torch.no_grad()
    def generate(self, policy: PreTrainedModel, prompts: list[list[int]], n: int,
                 greedy: bool = False) -> list[list[int]]:
        """``n`` responses per prompt (rollout ``i * n + j`` answers prompt ``i``), each trimmed at eos."""
        device = next(policy.parameters()).device
        ids, mask = _pad(prompts, self.pad_id, left=True)
        ids, mask = ids.repeat_interleave(n, 0).to(device), mask.repeat_interleave(n, 0).long().to(device)
        config = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else self.temperature,
            top_p=None if greedy else self.top_p, top_k=None, max_new_tokens=self.max_new_tokens,
            pad_token_id=self.pad_id, eos_token_id=self.eos_id,
        )
        was_training = policy.training
        policy.eval()
        out = policy.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        policy.train(was_training)
        return [trim_at_eos(row, self.eos_id) for row in out[:, ids.shape[1]:].tolist()]


class VLLMRollout:
    """Sampling with vLLM in this process (GPU); the policy's weights are loaded into it after each update.

    vLLM is imported lazily; the engine reads the model from a directory (the policy is saved to a
    temporary one first). Weight sync uses ``LLM.apply_model(... load_weights ...)``, available in
    recent vLLM releases; set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so the engine shares this process.
    """

    def __init__(self, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
                 temperature: float, top_p: float, seed: int, gpu_memory_utilization: float = 0.3) -> None:
        try:
            vllm = importlib.import_module("vllm")
        except ImportError as err:
            raise RuntimeError(f"--rollout vllm needs vLLM ({err}); install it with `pip install -e \".[vllm]\"` "
                               "on a CUDA machine, or use the default --rollout hf") from None
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._dir = tempfile.TemporaryDirectory(prefix="ktae-vllm-")
        policy.save_pretrained(self._dir.name)
        tokenizer.save_pretrained(self._dir.name)
        self.llm = vllm.LLM(model=self._dir.name, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                            dtype=str(policy.dtype).removeprefix("torch."), enable_prefix_caching=False)
        self._sampling = vllm.SamplingParams
        self.eos_id = tokenizer.eos_token_id
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p

    def sync(self, policy: PreTrainedModel) -> None:
        """Copy the policy's current weights into the vLLM engine."""
        weights = [(name, p.detach()) for name, p in policy.state_dict().items()]
        self.llm.apply_model(lambda model: model.load_weights(weights))

    def generate(self, policy: PreTrainedModel, prompts: list[list[int]], n: int,
                 greedy: bool = False) -> list[list[int]]:
        """As ``HFRollout.generate`` (``policy`` is unused: call ``sync`` after each update)."""
        params = self._sampling(n=n, temperature=0.0 if greedy else self.temperature,
                                top_p=1.0 if greedy else self.top_p, max_tokens=self.max_new_tokens)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [trim_at_eos(list(c.token_ids), self.eos_id) for o in outputs for c in o.outputs]
