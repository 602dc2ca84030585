"""TrainConfig: every knob of the trainer, and the GRPO / DAPO presets that fill the unset ones."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ktae_kernels import KTAEConfig

from .loss import LOSS_AGGS

ADVANTAGES = ("grpo", "ktae")
DTYPES = ("float32", "bfloat16", "float16")
#: supervised warm-up of the random tiny model (greedy accuracy about 0.4-0.6 on 2-digit addition).
TINY_WARMUP_STEPS = 300
ROLLOUTS = ("hf", "vllm")

#: Preset values for the fields left at None. GRPO: symmetric clip, per-sequence loss mean, optional
#: KL (off by default; --kl-coef turns it on). DAPO: clip-higher, token-mean loss, dynamic sampling
#: (drop all-correct / all-wrong groups) and the soft overlong penalty.
PRESETS: dict[str, dict[str, object]] = {
    "grpo": dict(eps_low=0.2, eps_high=0.2, loss_agg="seq-mean-token-mean", kl_coef=0.0,
                 dynamic_sampling=False, overlong_buffer=0),
    "dapo": dict(eps_low=0.2, eps_high=0.28, loss_agg="token-mean", kl_coef=0.0,
                 dynamic_sampling=True, overlong_buffer=-1),  # -1: a third of --max-new-tokens
}


@dataclass(frozen=True)
class TrainConfig:
    """See ``python -m training.train --help`` for each field; None fields come from the preset."""

    adv: str = "ktae"
    preset: str = "grpo"
    name: str | None = None
    out_dir: str | None = None
    seed: int = 0
    model: str = "tiny"
    device: str | None = None
    dtype: str = "float32"
    threads: int | None = None
    rollout: str = "hf"
    task: str = "addition"
    digits: int = 2
    steps: int = 200
    prompts_per_step: int = 8
    group_size: int = 16
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 3e-4
    mini_batches: int = 2
    ppo_epochs: int = 1
    max_grad_norm: float = 1.0
    norm_adv_by_std: bool = True
    eps_low: float | None = None
    eps_high: float | None = None
    loss_agg: str | None = None
    kl_coef: float | None = None
    dynamic_sampling: bool | None = None
    max_gen_batches: int = 3
    overlong_buffer: int | None = None
    overlong_factor: float = 1.0
    ktae_backend: str = "auto"
    ktae_weight: float = 1.0
    ktae_alpha: float = 1.0
    ktae_beta: float = 1.0
    ktae_top: float = 1.0
    ktae_fisher: str = "exact"
    ktae_ignore_ids: tuple[int, ...] = field(default=())
    warmup_steps: int | None = None
    warmup_lr: float = 3e-3
    warmup_batch: int = 64
    eval_every: int = 10
    eval_size: int = 200
    report_every: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        _check_choice("adv", self.adv, ADVANTAGES)
        _check_choice("preset", self.preset, tuple(PRESETS))
        _check_choice("rollout", self.rollout, ROLLOUTS)
        _check_choice("dtype", self.dtype, DTYPES)
        if self.loss_agg is not None:
            _check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        for name in ("steps", "prompts_per_step", "max_new_tokens", "mini_batches", "ppo_epochs", "max_gen_batches",
                     "eval_every", "warmup_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_size", "warmup_steps"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.report_every < 0:
            raise ValueError(f"TrainConfig.report_every must be >= 0 (0: no reports), got {self.report_every}")
        if self.group_size < 2:
            raise ValueError("TrainConfig.group_size must be >= 2 (GRPO compares the rollouts of a prompt), "
                             f"got {self.group_size}")

    def resolved(self) -> "TrainConfig":
        """A copy with every None field taken from the preset, and the run name set."""
        values = {k: v for k, v in PRESETS[self.preset].items() if getattr(self, k) is None}
        if self.warmup_steps is None:
            values["warmup_steps"] = TINY_WARMUP_STEPS if self.model == "tiny" else 0
        if self.threads is None and self.model == "tiny":
            values["threads"] = 1  # fastest for a 0.1M-parameter model; more threads thrash on a busy CPU
        if values.get("overlong_buffer") == -1:
            values["overlong_buffer"] = max(1, self.max_new_tokens // 3)
        if self.name is None:
            values["name"] = f"{self.preset}-{self.adv}-s{self.seed}"
        return dataclasses.replace(self, **values)

    def ktae_config(self) -> KTAEConfig:
        """The KTAEConfig of this run (the rollout advantage is passed in, so no baseline is used)."""
        return KTAEConfig(alpha=self.ktae_alpha, beta=self.ktae_beta, top=self.ktae_top, weight=self.ktae_weight,
                          fisher=self.ktae_fisher, ignore_token_ids=self.ktae_ignore_ids)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"TrainConfig.{name} must be one of {choices}, got {value!r}")
