"""TRL adapter: ``KTAEGRPOTrainer``, a drop-in ``GRPOTrainer`` whose advantages are KTAE's ``[B, T]``.

It overrides ``_generate_and_score_completions`` (TRL has no advantage hook; its maintainers advise
this override); TRL's per-token losses take ``[B, T]`` advantages. Groups of ``num_generations``
gathered rows may straddle processes: their statistics are merged with ``process_group=WORLD``
("auto" / "torch" backend). Where TRL branches per sequence on the advantage's sign (OPSM's
off-policy mask, VESPO's weight) the rollout's own ``A_i`` is passed. Correct / wrong: the reward
functions named by ``ktae_correct_reward_funcs``; else the one reward function that is not one of TRL's
shaping rewards (``SHAPING_REWARDS``); several candidates without that keyword are an error. The mixin
must come before the ``GRPOTrainer`` class in the bases (checked when the class is created). See
docs/integrations.md.
"""
from __future__ import annotations

import inspect
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
import trl
from torch import Tensor
from trl import GRPOTrainer

from ..api import key_token_scores
from ..config import KTAEConfig
from ..options import ExecutionOptions
from ..metrics import ktae_metrics
from ..registry import DISTRIBUTED_BACKENDS, check_backend_name
from .gathered import grpo_groups, grpo_token_advantages
from .shared import (AdapterSettings, FrameworkMismatchError, Labels, backend_that_runs, check_baseline_unused,
                     check_metrics_mode, check_version, correct_labels, missing_target, rollout_baseline, step_metrics)

__all__ = ["RELIED_ON", "SHAPING_REWARDS", "KTAEGRPOMixin", "KTAEGRPOTrainer", "check_mixin_order",
           "check_subclass_overrides", "grpo_token_advantages", "liger_loss_takes_sequence_advantages"]

#: metrics averaged over tokens: across processes, weighted by each process's token count.
TOKEN_METRICS = ("ktae/score_abs_mean", "ktae/key_token_share")
#: extra key of the ``_generate_and_score_completions`` output: the ``[B]`` rollout advantages ``A_i``.
ROLLOUT_KEY = "ktae_rollout_advantages"
#: supported TRL: >= MIN_VERSION (the ``GRPOTrainer`` contract of 1.x), < BELOW_VERSION.
MIN_VERSION, BELOW_VERSION = "1.0", "2"
#: TRL's own reward functions (``trl.rewards``) that shape a reward without saying whether an answer is
#: correct (a length or repetition penalty, a format reward): they label rollouts only when named in
#: ``ktae_correct_reward_funcs``.
SHAPING_REWARDS = ("soft_overlong_punishment_reward", "repetition_penalty_reward", "think_format_reward")
#: the ``GRPOTrainer`` methods the mixin overrides, and what KTAE expects each to be.
OVERRIDDEN = {"_generate_and_score_completions": "the method that returns a step's rewards, completion ids and "
                                                 "(B,) advantages (KTAE replaces them with (B, T) ones)",
              "_calculate_rewards": "the method that returns the gathered rewards per reward function"}

#: the ``GRPOTrainer`` methods whose own behaviour KTAE relies on: the batch its advantages are computed
#: for, the rewards of exactly those rows, and a loss that takes ``(B, T)`` advantages. A subclass that
#: replaces one (GMPO's loss takes ``(B,)`` advantages; a replay buffer swaps rows after the rewards) is
#: refused unless ``ktae_allow_overrides=True``.
RELIED_ON = ("_generate_and_score_completions", "_calculate_rewards", "compute_loss", "_compute_loss")


def check_trainer_class(trainer_cls: type) -> None:
    """Check TRL's version against the supported range and that ``trainer_cls`` (a ``GRPOTrainer``
    (sub)class, without the mixin) still has the methods KTAE overrides: without them the overrides
    would never run and training would go on without KTAE. Raises ``FrameworkMismatchError``."""
    version = str(trl.__version__)
    check_version("TRL", version, MIN_VERSION, BELOW_VERSION)
    for name, expected in OVERRIDDEN.items():
        if not callable(getattr(trainer_cls, name, None)):
            raise missing_target("TRL", version, f"{trainer_cls.__name__} has no method {name}", expected)


def check_mixin_order(cls: type) -> None:
    """Raise TypeError when ``cls`` lists ``KTAEGRPOMixin`` after a ``GRPOTrainer`` class in its method
    resolution order: ``GRPOTrainer``'s methods would run instead of KTAE's and training would be plain
    GRPO. The message gives the order that works. Classes without ``GRPOTrainer`` are not checked."""
    mro = cls.__mro__
    if GRPOTrainer not in mro or mro.index(KTAEGRPOMixin) < mro.index(GRPOTrainer):
        return
    names = [base.__name__ for base in cls.__bases__]
    first = [n for n, base in zip(names, cls.__bases__) if issubclass(base, KTAEGRPOMixin)]
    works = first + [n for n in names if n not in first]
    raise TypeError(f"class {cls.__name__}({', '.join(names)}): KTAEGRPOMixin comes after GRPOTrainer in the method "
                    f"resolution order, so GRPOTrainer's methods would run instead of KTAE's and training would be "
                    f"plain GRPO; list it first: class {cls.__name__}({', '.join(works)})")


def check_subclass_overrides(cls: type) -> None:
    """Raise TypeError when a class before ``GRPOTrainer`` in ``cls``'s method resolution order that is not
    built on ``KTAEGRPOMixin`` (the user's ``GRPOTrainer`` subclass under the mixin, or a trainer listed
    before ``KTAEGRPOTrainer`` in the bases, whose methods then run before KTAE's) defines one of
    ``RELIED_ON``, naming the class and the method."""
    mro = cls.__mro__
    foreign = [klass for klass in mro[:mro.index(GRPOTrainer)] if not issubclass(klass, KTAEGRPOMixin)]
    found = [(klass.__name__, name) for klass in foreign for name in RELIED_ON if name in vars(klass)]
    if found:
        owner, name = found[0]
        raise TypeError(
            f"{cls.__name__}: {owner}.{name} replaces GRPOTrainer's {name}, which KTAE relies on ({RELIED_ON}): its "
            f"(B, T) advantages are for the rows and rewards GRPOTrainer's own methods produce, and its loss must take "
            f"per-token advantages (a loss written for (B,) advantages, like GMPO's, or a replay buffer that swaps "
            f"rows, trains on wrong numbers without an error). Once you have checked that {owner}.{name} works with "
            f"KTAE's advantages, pass ktae_allow_overrides=True")


def liger_loss_takes_sequence_advantages(trainer_cls: type = GRPOTrainer) -> bool:
    """Whether this TRL's ``use_liger_kernel=True`` routes the loss through Liger's fused GRPO loss
    (TRL 1.x before 1.16), which takes ``(B,)`` advantages only."""
    return any(hasattr(trainer_cls, name) for name in ("compute_liger_loss", "_compute_liger_loss"))


class KTAEGRPOMixin:
    """Turns a ``GRPOTrainer`` (sub)class into a KTAE one: ``class T(KTAEGRPOMixin, MyGRPOTrainer)``.

    The mixin must come first (``class T(MyGRPOTrainer, KTAEGRPOMixin)`` raises TypeError when the class
    is created). Keywords: ``ktae_config`` (``KTAEConfig()`` when None), ``ktae_backend`` ("auto" or a
    registered backend name; "auto" or "torch" with several processes), ``ktae_use_trl_advantage`` (a
    bool; True: ``A_i`` is TRL's own advantage, following its ``scale_rewards`` and
    ``multi_objective_aggregation``, and a ``ktae_config`` baseline or eps other than the default is
    refused; False: ``ktae_config.baseline`` on the weighted reward), ``ktae_metrics`` ("advantages", "scores" or "off"),
    ``ktae_correct_reward_funcs`` (names of the reward functions that define correctness, e.g.
    ``["accuracy"]``, or the functions themselves: a rollout is correct when their weighted sum is >
    ``ktae_config.correct_threshold``; None: the only reward function, or the only one that is not in
    ``SHAPING_REWARDS``; ValueError at construction when that leaves several or none, for a name several
    functions share, or a labelling function of reward weight 0; ValueError at a step where they all
    returned None for a rollout another function scored), ``ktae_options`` (``ExecutionOptions``: how the
    kernels run; ``ExecutionOptions()`` when None; a dict is refused) and ``ktae_allow_overrides``
    (False: a ``GRPOTrainer`` subclass under the mixin, or before it in the bases, that replaces one of
    ``RELIED_ON`` raises TypeError at construction; True: run it, once you have checked it takes KTAE's ``(B, T)`` advantages).
    ``ktae_rewards_per_func``: the last step's gathered ``[N, n_funcs]`` rewards (None before it).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_mixin_order(cls)

    def __init__(self, *args: Any, ktae_config: KTAEConfig | None = None, ktae_backend: str = "auto",
                 ktae_use_trl_advantage: bool = True, ktae_metrics: str = "advantages",
                 ktae_correct_reward_funcs: Sequence[Any] | None = None, ktae_options: ExecutionOptions | None = None,
                 ktae_allow_overrides: bool = False, **kwargs: Any) -> None:
        check_trainer_class(type(self).__mro__[type(self).__mro__.index(KTAEGRPOMixin) + 1])
        if not isinstance(ktae_allow_overrides, bool):
            raise ValueError(f"`ktae_allow_overrides` must be True or False, got {ktae_allow_overrides!r}")
        if not ktae_allow_overrides:
            check_subclass_overrides(type(self))
        training_args = inspect.signature(GRPOTrainer.__init__).bind_partial(self, *args, **kwargs).arguments.get("args")
        if (training_args is not None and getattr(training_args, "use_liger_kernel", False)
                and liger_loss_takes_sequence_advantages(type(self))):
            raise ValueError("KTAEGRPOTrainer: `args.use_liger_kernel=True` is not supported with this TRL version: "
                             "its Liger GRPO loss takes per-sequence (B,) advantages, KTAE's are per token (B, T). "
                             "Upgrade to TRL >= 1.16 or set use_liger_kernel=False")
        if ktae_config is not None and not isinstance(ktae_config, KTAEConfig):
            raise ValueError(f"`ktae_config` must be a KTAEConfig or None, got {type(ktae_config).__name__}")
        if ktae_options is not None and not isinstance(ktae_options, ExecutionOptions):
            raise ValueError(f"`ktae_options` must be an ExecutionOptions or None, got {type(ktae_options).__name__}; "
                             f"build one with ExecutionOptions(threads=...)")
        if not isinstance(ktae_use_trl_advantage, bool):
            raise ValueError(f"`ktae_use_trl_advantage` must be True or False, got {ktae_use_trl_advantage!r}")
        if ktae_use_trl_advantage and ktae_config is not None:
            check_baseline_unused(ktae_config, "`ktae_config`", "with ktae_use_trl_advantage=True the rollout advantage "
                                  "is TRL's own (its scale_rewards decides the scaling); pass "
                                  "ktae_use_trl_advantage=False to use KTAEConfig.baseline and eps")
        if isinstance(ktae_correct_reward_funcs, str) or callable(ktae_correct_reward_funcs):
            ktae_correct_reward_funcs = [ktae_correct_reward_funcs]
        check_backend_name(ktae_backend, "`ktae_backend`")
        check_metrics_mode(ktae_metrics, "`ktae_metrics`")
        self.ktae_settings = AdapterSettings(KTAEConfig() if ktae_config is None else ktae_config, ktae_backend,
                                             ktae_metrics, options=ExecutionOptions() if ktae_options is None else ktae_options)
        self.ktae_use_trl_advantage = ktae_use_trl_advantage
        self.ktae_rewards_per_func: Tensor | None = None
        self._ktae_sequence_advantages: Tensor | None = None
        super().__init__(*args, **kwargs)
        if self.accelerator.num_processes > 1 and ktae_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"`ktae_backend` must be 'auto' or 'torch' with several processes (groups split across "
                             f"them are merged on the torch path), got {ktae_backend!r}")
        self.ktae_correct_columns = self._ktae_reward_columns(ktae_correct_reward_funcs)

    @property
    def ktae_config(self) -> KTAEConfig:
        """The method's settings (``ktae_settings.config``)."""
        return self.ktae_settings.config

    def _ktae_reward_columns(self, names: Sequence[Any] | None) -> list[int]:
        """Columns of ``rewards_per_func`` that label rollouts: the named (or given) reward functions;
        without names, the only one, or the only one that is not a TRL shaping reward. ValueError for a
        name that is not a reward function's or is shared by several, for none or several candidates,
        and for a labelling function whose reward weight is 0."""
        available = list(self.reward_func_names)
        if names is None:
            columns = self._ktae_only_task_reward(available)
        else:
            columns = [self._ktae_reward_column(name, available) for name in names]
            if not columns:
                raise ValueError(f"`ktae_correct_reward_funcs` must name reward functions of this trainer, one of "
                                 f"{available}; got []")
        zero = [available[c] for c in columns if float(self.reward_weights[c]) == 0.0]
        if zero:
            raise ValueError(f"the reward functions {zero} that label rollouts correct or wrong have reward weight 0, "
                             f"so their weighted sum is 0 and every rollout would be wrong: give them a nonzero "
                             f"weight in `reward_weights`, or name other functions in `ktae_correct_reward_funcs`")
        return columns

    def _ktae_reward_column(self, entry: Any, available: list[str]) -> int:
        """The column of one ``ktae_correct_reward_funcs`` entry: a reward function's name, or the function
        itself (one of ``reward_funcs``; needed where two share a name)."""
        if not isinstance(entry, str):
            found = [i for i, func in enumerate(self.reward_funcs) if func is entry]
            if not found:
                raise ValueError(f"`ktae_correct_reward_funcs` must hold names of this trainer's reward functions "
                                 f"({available}) or the functions themselves; got {entry!r}")
            return found[0]
        if entry not in available:
            raise ValueError(f"`ktae_correct_reward_funcs` must name reward functions of this trainer, one of "
                             f"{available}; got {entry!r}")
        shared = [i for i, n in enumerate(available) if n == entry]
        if len(shared) > 1:
            raise ValueError(f"`ktae_correct_reward_funcs` names {entry!r}, the name TRL gives to the reward functions "
                             f"at positions {shared} of `reward_funcs` (a functools.partial takes the name of the "
                             f"function it wraps): pass the function that says whether an answer is correct itself, "
                             f"e.g. ktae_correct_reward_funcs=[reward_funcs[{shared[-1]}]], or give the functions "
                             f"distinct names")
        return shared[0]

    @staticmethod
    def _ktae_only_task_reward(available: list[str]) -> list[int]:
        """The one reward function, or the one that is not a TRL shaping reward; else ValueError."""
        task = [i for i, n in enumerate(available) if n not in SHAPING_REWARDS]
        if len(available) == 1 or len(task) == 1:
            return task or [0]
        shaping = [n for n in available if n in SHAPING_REWARDS]
        first = task[0] if task else 0
        example = first if available.count(available[first]) > 1 else available[first]
        raise ValueError(f"KTAE splits each group into correct and wrong rollouts, and cannot tell which of the reward "
                         f"functions {available} say whether an answer is correct"
                         + (f" (TRL's shaping rewards {shaping} never do)" if shaping else "")
                         + f": name them in `ktae_correct_reward_funcs`, e.g. ktae_correct_reward_funcs=[{example!r}] "
                         f"(a rollout is correct when their weighted sum is > KTAEConfig.correct_threshold). Labels "
                         f"from the sum of every reward would let a format or length reward turn a correct answer "
                         f"wrong or a wrong one correct")

    # ----------------------------------------------------------------------------- advantages
    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Tensor:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # type: ignore[misc]
        self.ktae_rewards_per_func = rewards_per_func  # gathered over processes
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        started = time.perf_counter()
        base = self._ktae_rollout_advantages(output)
        advantages = self.ktae_advantages(output, rollout_advantage=base)
        output[ROLLOUT_KEY] = base.to(advantages.device, torch.float32)
        self._ktae_log(output, advantages, base, started)
        output["advantages"] = advantages
        return output

    def ktae_advantages(self, output: dict[str, Any], rollout_advantage: Tensor | None = None) -> Tensor:
        """``[B, T]`` advantages for one ``_generate_and_score_completions`` output; ``A_i`` is
        ``rollout_advantage`` when given, else as ``ktae_use_trl_advantage`` says."""
        if rollout_advantage is None and self.ktae_use_trl_advantage:
            rollout_advantage = output["advantages"]
        several = self.accelerator.num_processes > 1
        return grpo_token_advantages(
            output["completion_ids"], self._ktae_mask(output), self.ktae_rewards_per_func, self.reward_weights,
            rollout_advantage, process_index=self.accelerator.process_index,
            num_generations=self._ktae_num_generations(), config=self.ktae_config,
            backend=self.ktae_settings.backend, process_group=dist.group.WORLD if several else None,
            correct=self.ktae_labels().correct, options=self.ktae_settings.options,
        )

    def ktae_labels(self) -> Labels:
        """Correct / wrong flags of the gathered rows and their source (see the class docstring)."""
        rewards, _, unscorable = grpo_groups(self.ktae_rewards_per_func, self.reward_weights,
                                             num_generations=self._ktae_num_generations())
        columns = self.ktae_correct_columns
        values = self.ktae_rewards_per_func[:, columns]
        name = "+".join(self.reward_func_names[c] for c in columns)
        ungraded = (values.isnan().all(dim=1) & ~unscorable).nonzero().flatten().tolist()  # unscorable: no group
        if ungraded:
            raise ValueError(f"the reward functions that label rollouts ({name}) returned None for the gathered rows "
                             f"{ungraded[:8]}{' ...' if len(ungraded) > 8 else ''} of this step, so KTAE cannot say "
                             f"whether those answers are correct: return 0.0 for a wrong answer, or name in "
                             f"`ktae_correct_reward_funcs` every function that grades some rollouts (their weighted "
                             f"sum labels each row)")
        task = (values * self.reward_weights.to(values.device)[columns]).nansum(dim=1)
        return correct_labels(rewards, self.ktae_config.correct_threshold, [(name, task)])

    def _ktae_mask(self, output: dict[str, Any]) -> Tensor:
        mask = output["completion_mask"]
        return mask * output["tool_mask"] if output.get("tool_mask") is not None else mask

    def _ktae_num_generations(self) -> int:
        return self.num_generations if self.model.training else self.num_generations_eval

    def _ktae_own_rows(self, batch_size: int) -> slice:
        start = self.accelerator.process_index * batch_size
        return slice(start, start + batch_size)

    def _ktae_rollout_advantages(self, output: dict[str, Any]) -> Tensor:
        """float64 ``[B]`` ``A_i`` of this process's rows (TRL's, or ``ktae_config.baseline`` over the
        gathered groups exactly as ``grpo_token_advantages`` forms them)."""
        if self.ktae_use_trl_advantage:
            return output["advantages"].detach().to(torch.float64)
        rewards, group, _ = grpo_groups(self.ktae_rewards_per_func, self.reward_weights,
                                        num_generations=self._ktae_num_generations())
        return rollout_baseline(rewards, group, self.ktae_config)[self._ktae_own_rows(output["completion_ids"].shape[0])]

    # ------------------------------------------------------------------------------- logging
    def _ktae_log(self, output: dict[str, Any], advantages: Tensor, base: Tensor, started: float) -> None:
        """The completions table's ``advantage`` column: each completion's mean KTAE advantage (gathered
        over processes); the ``ktae/*`` metrics of this process's rows into TRL's ``_metrics``."""
        mode = "train" if self.model.training else "eval"
        mask = self._ktae_mask(output)
        mean = (advantages * mask).sum(1) / mask.sum(1).clamp(min=1)
        gathered = self.accelerator.gather(mean.float()) if self.accelerator.num_processes > 1 else mean
        column = self._logs["advantages"]
        n = min(len(gathered), len(column))
        for i, value in enumerate(gathered[len(gathered) - n:].tolist()):
            column[len(column) - n + i] = value
        rewards, group, unscorable = grpo_groups(self.ktae_rewards_per_func, self.reward_weights,
                                                 num_generations=self._ktae_num_generations())
        own = self._ktae_own_rows(advantages.shape[0])
        labels = self.ktae_labels()
        local = Labels(labels.correct[own], labels.source)
        scored = mask.bool() & ~unscorable[own, None].to(mask.device)
        scores = lambda: key_token_scores(output["completion_ids"], scored, rewards[own], group[own],  # noqa: E731
                                          config=self.ktae_config, backend=self.ktae_settings.backend,
                                          correct=local.correct, options=self.ktae_settings.options)
        ran = backend_that_runs(self.ktae_settings.backend, advantages.device,
                                distributed=self.accelerator.num_processes > 1)
        values = step_metrics(self.ktae_settings, local, started, backend=ran, scores=scores, advantages=advantages,
                              mask=scored, rollout_advantage=base, group=group[own])
        if values and self.accelerator.num_processes > 1:
            values = self._ktae_across_processes(values, scored.sum(), group, labels.correct)
        for name, value in values.items():
            self._metrics[mode][name].append(value)

    def _ktae_across_processes(self, values: dict[str, float], tokens: Tensor, group: Tensor,
                               correct: Tensor) -> dict[str, float]:
        """This step's metrics over every process's rows: token-weighted means of the token metrics, the
        mixed-group share of the gathered groups, the slowest process's time, the mean of the rest
        (``distinct_tokens_per_group``: of each process's groups)."""
        names = sorted(values)
        row = torch.tensor([[values[n] for n in names] + [float(tokens)]], dtype=torch.float64,
                           device=self.accelerator.device)
        every = self.accelerator.gather(row).reshape(-1, len(names) + 1).cpu()
        weights = every[:, -1]
        merged = {}
        for i, name in enumerate(names):
            column = every[:, i]
            if name in TOKEN_METRICS:
                merged[name] = float((column * weights).sum() / weights.sum().clamp(min=1))
            else:
                merged[name] = float(column.max() if name == "ktae/time_ms" else column.mean())
        none = torch.zeros(group.shape[0], 0)
        merged["ktae/mixed_group_share"] = ktae_metrics(
            advantages=none, mask=none, rollout_advantage=torch.zeros(group.shape[0]), group=group.cpu(),
            correct=correct.cpu(), weight=0.0)["ktae/mixed_group_share"]
        return merged

    # ------------------------------------------------------------------- sequence-level branches
    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        if ROLLOUT_KEY not in inputs:  # the batch did not come through KTAE's _generate_and_score_completions
            raise FrameworkMismatchError(
                f"TRL {trl.__version__}: {type(self).__name__} computed a loss on a batch that KTAE's "
                f"_generate_and_score_completions did not make, so its advantages are not KTAE's. Every override of "
                f"_generate_and_score_completions must call super(); a TRL that builds batches another way is not "
                f"supported")
        self._ktae_sequence_advantages = inputs[ROLLOUT_KEY]
        try:
            return super()._compute_loss(model, inputs)  # type: ignore[misc]
        finally:
            self._ktae_sequence_advantages = None

    def ktae_per_sequence(self, advantages: Tensor) -> Tensor:
        """``[B, 1]`` rollout advantages in place of ``[B, T]`` token ones, where TRL branches per sequence."""
        seq = self._ktae_sequence_advantages
        if seq is None or advantages.dim() != 2 or advantages.shape[1] == 1:
            return advantages
        return seq.to(advantages.device, advantages.dtype).reshape(-1, 1)

    def get_off_policy_mask(self, advantages: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return super().get_off_policy_mask(self.ktae_per_sequence(advantages), *args, **kwargs)  # type: ignore[misc]

    def get_gamma_weights(self, advantages: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return super().get_gamma_weights(self.ktae_per_sequence(advantages), *args, **kwargs)  # type: ignore[misc]


class KTAEGRPOTrainer(KTAEGRPOMixin, GRPOTrainer):
    """``GRPOTrainer`` with KTAE token-level advantages (see ``KTAEGRPOMixin`` for the keywords)."""
