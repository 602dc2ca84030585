"""Stand-ins for OpenRLHF's classes (OpenRLHF needs CUDA and flash-attn to install), after its documented
contract: the Experience fields the KTAE hook reads or writes, micro-batches as
``Experience.concat_experiences`` builds them, and ``RemoteExperienceMaker.compute_advantages_and_returns``
for ``group_norm``. Shared by the adapter tests, the example tests and the Ray workers those start."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

N = 4  # n_samples_per_prompt


@dataclass
class Experience:
    """The fields of openrlhf.trainer.ppo_utils.experience.Experience that the hook reads or writes."""

    sequences: torch.Tensor  # (b, S) prompt + response, right-padded with pad id
    action_mask: torch.Tensor  # (b, A), action j is sequences[:, S - A + j]
    rewards: torch.Tensor  # (b,)
    index: list  # each rollout's position in the rollout batch
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    scores: torch.Tensor | None = None  # (b,) OpenRLHF's binary task score
    info: dict = field(default_factory=dict)


def rollouts(seed: int = 0, prompts: int = 3):
    """Per rollout (position i): prompt + multi-turn response ids and the action mask over S - 1 positions
    (OpenRLHF's vLLM path: ``action_mask[j]`` marks ``sequences[j + 1]``)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(prompts * N):
        prompt = rng.integers(100, 110, size=rng.integers(2, 5))
        response = rng.integers(3, 15, size=rng.integers(1, 9))
        seq = torch.as_tensor(np.concatenate([prompt, response]))
        action = torch.zeros(len(seq) - 1, dtype=torch.bool)
        action[len(prompt) - 1:] = True
        if len(response) > 3:
            action[len(prompt)] = False  # a tool-output token inside the response
        out.append((i, seq, action, float(rng.random() < 0.5)))
    return out


def experiences(rollouts, order, micro: int):
    """Concatenate rollouts in ``order`` into micro-batches as Experience.concat_experiences does."""
    pad = lambda ts, v: torch.nn.utils.rnn.pad_sequence(ts, batch_first=True, padding_value=v)  # noqa: E731
    batches = []
    for k in range(0, len(order), micro):
        part = [rollouts[i] for i in order[k:k + micro]]
        batches.append(Experience(sequences=pad([p[1] for p in part], 0), action_mask=pad([p[2] for p in part], False),
                                  rewards=torch.tensor([p[3] for p in part]), index=[p[0] for p in part]))
    return batches


def group_norm(experiences):
    """OpenRLHF's group_norm with gamma = 1 and no KL: the rollout advantage on every action token."""
    index = torch.tensor([i for e in experiences for i in e.index])
    raw = torch.cat([e.rewards for e in experiences])
    r = torch.empty_like(raw)
    r[index] = raw
    r = r.reshape(-1, N)
    r = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)).reshape(-1)[index]
    start = 0
    for e in experiences:
        b = e.action_mask.shape[0]
        e.advantages = r[start:start + b, None] * e.action_mask.float()
        e.returns = e.advantages.clone()
        start += b
    return experiences


class FakeRemoteExperienceMaker:
    """RemoteExperienceMaker's compute_advantages_and_returns for the group_norm estimator."""

    def __init__(self, estimator: str = "group_norm"):
        algo = types.SimpleNamespace(advantage=types.SimpleNamespace(estimator=estimator))
        self.strategy = types.SimpleNamespace(args=types.SimpleNamespace(algo=algo, rollout=types.SimpleNamespace(
            n_samples_per_prompt=N)))

    def compute_advantages_and_returns(self, experiences):
        return group_norm(experiences)




#: the stand-in package's trainer module: OpenRLHF's name for the experience maker, and what its
#: ``PPOTrainer`` does with it (build one from the strategy).
TRAINER_SOURCE = """from openrlhf_fakes import FakeRemoteExperienceMaker as RemoteExperienceMaker


def build_experience_maker(estimator="group_norm"):
    return RemoteExperienceMaker(estimator)
"""
#: the stand-in CLI module: records its argv and whether Ray was initialised when it ran.
CLI_SOURCE = """import sys
import ray
RUNS = sys.modules["openrlhf"].__dict__.setdefault("RUNS", [])
if __name__ == "__main__":
    RUNS.append((list(sys.argv), ray.is_initialized()))
"""


def write_fake_openrlhf(root: Path) -> Path:
    """A stand-in ``openrlhf`` package under ``root`` (``trainer.ppo_trainer``, ``cli.train_ppo_ray``)."""
    package = root / "openrlhf"
    for sub, name, source in [("trainer", "ppo_trainer.py", TRAINER_SOURCE), ("cli", "train_ppo_ray.py", CLI_SOURCE)]:
        (package / sub).mkdir(parents=True, exist_ok=True)
        (package / sub / "__init__.py").write_text("")
        (package / sub / name).write_text(source)
    (package / "__init__.py").write_text("")
    return root


def use_fake_openrlhf(root: Path, monkeypatch) -> Path:
    """Write the stand-in package and make this process import it (dropping any loaded ``openrlhf``)."""
    write_fake_openrlhf(root)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # import hooks installed by the test go after it
    names = {"openrlhf", "openrlhf.trainer", "openrlhf.trainer.ppo_trainer", "openrlhf.cli", "openrlhf.cli.train_ppo_ray"}
    for name in names | {m for m in sys.modules if m.startswith("openrlhf.")}:
        monkeypatch.setitem(sys.modules, name, None)  # undone after the test: the stand-in leaves no module
        monkeypatch.delitem(sys.modules, name)
    return root


# ------------------------------------------------------------------- what runs inside Ray workers
def worker_state() -> dict:
    """What a Ray worker that builds no trainer (a vLLM engine, say) holds after the setup hook ran."""
    import os

    return {"hooked": any(getattr(f, "owner", None) == "ktae_kernels.integrations.openrlhf" for f in sys.meta_path),
            "trainer_imported": "openrlhf.trainer.ppo_trainer" in sys.modules,
            "openrlhf_imported": "openrlhf" in sys.modules,
            "env": {k: os.environ.get(k) for k in ("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "NCCL_DEBUG",
                                                   "TOKENIZERS_PARALLELISM")}}


class TrainerActor:
    """OpenRLHF's ``PPOTrainer`` actor, reduced to what KTAE touches: it imports the trainer module,
    builds the experience maker and computes one step's advantages."""

    def step(self, seed: int, micro: int) -> dict:
        from openrlhf.trainer import ppo_trainer

        maker = ppo_trainer.build_experience_maker()
        items = rollouts(seed)
        order = list(np.random.default_rng(seed).permutation(len(items)))
        out = maker.compute_advantages_and_returns(experiences(items, order, micro))
        return {"maker": type(maker).__name__, "settings": getattr(type(maker), "ktae_settings", None),
                "advantages": [e.advantages for e in out], "index": [e.index for e in out],
                "info": [e.info for e in out]}
