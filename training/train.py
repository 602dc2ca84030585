"""``python -m training.train``: GRPO / DAPO on a verifiable toy task, with plain or KTAE advantages.

One step: sample G rollouts for each of P prompts, score them with the exact-match verifier, compute
advantages (``--adv grpo``: the group z-score broadcast to every token; ``--adv ktae``: the same
rollout advantage plus ``ktae_kernels.token_advantage``'s key-token score per token), then update
the policy with the clipped token-level policy-gradient loss.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ktae_kernels import token_advantage
from ktae_kernels.registry import backend_names

from .config import ADVANTAGES, DTYPES, PRESETS, ROLLOUTS, TrainConfig
from .logs import plot_run, write_csv, write_json, write_step_report
from .loss import LOSS_AGGS, grpo_advantage, overlong_penalty, policy_loss, token_logprobs
from .model import load_policy
from .rollout import HFRollout, Rollouts, VLLMRollout, pack
from .tasks import TASKS, AdditionTask, Problem
from .tokenizer import decode_answers, encode_prompt
from .warmup import sft_warmup

RUNS_DIR = Path(__file__).resolve().parent / "runs"
Engine = HFRollout | VLLMRollout


@dataclass
class Scored:
    """The rollouts a step trains on, with float64 ``rewards [N]`` and bool ``correct [N]``; ``metrics``
    (reward, acc, resp_len over every rollout sampled this step, groups_kept, gen_batches)."""

    rollouts: Rollouts | None
    rewards: Tensor
    correct: Tensor
    metrics: dict


@dataclass
class RunResult:
    """history: one dict per CSV row; last: the final step's rollouts, rewards, correct, advantages."""

    config: TrainConfig
    history: list[dict]
    warmup_losses: list[float]
    out_dir: Path
    policy: PreTrainedModel
    last: dict


def train(config: TrainConfig) -> RunResult:
    """Run the whole recipe (warm-up, RL steps, evals) and write the log, summary and plot (and, with
    ``report_every``, a key-token HTML report every that many steps)."""
    cfg = config.resolved()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(cfg.out_dir) if cfg.out_dir else RUNS_DIR / cfg.name
    out_dir.mkdir(parents=True, exist_ok=True)

    policy, tokenizer = load_policy(cfg.model, device, getattr(torch, cfg.dtype))
    task = TASKS[cfg.task](digits=cfg.digits, eval_size=cfg.eval_size)
    engine = make_engine(cfg, policy, tokenizer)  # first: a missing vLLM fails before any work
    # a bar from the first warm-up step on: the warm-up is a good part of a short run
    with tqdm(total=cfg.warmup_steps, desc=f"{cfg.name} warm-up (SFT)", file=sys.stderr,
              disable=not cfg.progress or not cfg.warmup_steps) as warm:
        warmup_losses = sft_warmup(policy, tokenizer, task, steps=cfg.warmup_steps, lr=cfg.warmup_lr,
                                   batch=cfg.warmup_batch, rng=rng, on_step=lambda loss: _advance(warm, loss))
    engine.sync(policy)
    ref = copy.deepcopy(policy).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)

    history = [{"step": 0, "eval_acc": evaluate(engine, policy, tokenizer, task)}]
    last: dict = {}
    bar = tqdm(range(1, cfg.steps + 1), desc=cfg.name, disable=not cfg.progress, file=sys.stderr)
    for step in bar:
        row, step_tensors = rl_step(cfg, engine, policy, ref, optimizer, tokenizer, task, rng)
        last = step_tensors or last
        row["step"] = step
        if step % cfg.eval_every == 0 or step == cfg.steps:
            row["eval_acc"] = evaluate(engine, policy, tokenizer, task)
        history.append(row)
        if cfg.report_every and step % cfg.report_every == 0 and step_tensors:
            write_step_report(out_dir / f"report-step{step:04d}.html", step_tensors, tokenizer, cfg.ktae_config(),
                              f"KTAE key tokens, {cfg.name}, step {step}", backend=cfg.ktae_backend)
        bar.set_postfix(progress_fields(cfg, row, history))

    write_csv(history, out_dir / "log.csv")
    write_json(summarise(cfg, history, warmup_losses), out_dir / "summary.json")
    plot_run(history, out_dir / "reward.png", f"{cfg.preset.upper()} + {cfg.adv} advantages, seed {cfg.seed}")
    return RunResult(cfg, history, warmup_losses, out_dir, policy, last)


def _advance(bar: tqdm, loss: float) -> None:
    """One warm-up step done: move the bar and show the step's loss."""
    bar.update()
    bar.set_postfix(loss=f"{loss:.3f}")


def progress_fields(cfg: TrainConfig, row: dict, history: list[dict]) -> dict[str, str]:
    """The RL bar's fields: ``acc`` (share of this step's sampled rollouts that are correct), the
    mean shaped reward ``reward`` only where the reward is shaped (DAPO's overlong penalty; without
    shaping it is ``acc`` again), the last greedy ``eval_acc``, and the KTAE milliseconds."""
    fields = {"acc": f"{row['acc']:.2f}"}
    if cfg.overlong_buffer:
        fields["reward"] = f"{row['reward']:.3f}"
    fields["eval_acc"] = f"{next(r['eval_acc'] for r in reversed(history) if 'eval_acc' in r):.2f}"
    fields["ktae_ms"] = f"{1e3 * row['ktae_s']:.1f}"
    return fields


def rl_step(cfg: TrainConfig, engine: Engine, policy: PreTrainedModel, ref: PreTrainedModel | None,
            optimizer: torch.optim.Optimizer, tokenizer: PreTrainedTokenizerBase, task: AdditionTask,
            rng: random.Random) -> tuple[dict, dict]:
    """One RL step: collect, advantages, update. Returns the log row and the step's tensors."""
    start = time.perf_counter()
    batch = collect(cfg, engine, policy, tokenizer, task, rng)
    gen_s = time.perf_counter() - start
    row = dict(batch.metrics, gen_s=gen_s, ktae_s=0.0, update_s=0.0)
    if batch.rollouts is None:  # dynamic sampling kept no group: nothing to learn from this step
        row.update(step_s=gen_s, ktae_share=0.0)
        return row, {}
    advantages, row["ktae_s"] = compute_advantages(cfg, batch)
    start_update = time.perf_counter()
    row.update(update_policy(cfg, policy, ref, optimizer, batch.rollouts, advantages))
    engine.sync(policy)
    row["update_s"] = time.perf_counter() - start_update
    row["step_s"] = time.perf_counter() - start
    row["ktae_share"] = row["ktae_s"] / row["step_s"]
    last = dict(rollouts=batch.rollouts, rewards=batch.rewards, correct=batch.correct, advantages=advantages)
    return row, last


def collect(cfg: TrainConfig, engine: Engine, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
            task: AdditionTask, rng: random.Random) -> Scored:
    """Sample and score G rollouts for each of P prompts.

    With dynamic sampling (DAPO), groups whose rollouts are all correct or all wrong are dropped and
    new prompts are sampled (at most ``max_gen_batches`` generation rounds) until P groups are kept.
    """
    G, P = cfg.group_size, cfg.prompts_per_step
    kept: dict[str, list] = {"prompts": [], "responses": [], "group": [], "rewards": [], "correct": []}
    seen_rewards, seen_correct, seen_len = [], [], []
    rounds = cfg.max_gen_batches if cfg.dynamic_sampling else 1
    for gen_batch in range(1, rounds + 1):
        problems = task.sample(rng, P)
        prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
        responses = engine.generate(policy, prompts, G)
        rewards, correct = score(cfg, tokenizer, task, [p for p in problems for _ in range(G)], responses)
        seen_rewards += rewards.tolist()
        seen_correct += correct.tolist()
        seen_len += [len(r) for r in responses]
        for i in range(P):
            rows = range(i * G, (i + 1) * G)
            mixed = 0 < int(correct[i * G:(i + 1) * G].sum()) < G
            if len(kept["prompts"]) == P * G or (cfg.dynamic_sampling and not mixed):
                continue
            group_id = len(kept["prompts"]) // G
            kept["prompts"] += [prompts[i]] * G
            kept["responses"] += [responses[j] for j in rows]
            kept["group"] += [group_id] * G
            kept["rewards"] += rewards[i * G:(i + 1) * G].tolist()
            kept["correct"] += correct[i * G:(i + 1) * G].tolist()
        if len(kept["prompts"]) == P * G:
            break
    device = next(policy.parameters()).device
    metrics = dict(reward=statistics.fmean(seen_rewards), acc=statistics.fmean(seen_correct),
                   resp_len=statistics.fmean(seen_len), groups_kept=len(kept["group"]) // G, gen_batches=gen_batch)
    rollouts = None
    if kept["group"]:
        rollouts = pack(kept["prompts"], kept["responses"], kept["group"], tokenizer.pad_token_id, device)
    return Scored(rollouts, torch.tensor(kept["rewards"], dtype=torch.float64, device=device),
                  torch.tensor(kept["correct"], dtype=torch.bool, device=device), metrics)


def score(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase, task: AdditionTask, problems: list[Problem],
          responses: list[list[int]]) -> tuple[Tensor, Tensor]:
    """float64 rewards ``[N]`` (1 if correct, plus the overlong penalty) and bool correct ``[N]``."""
    texts = decode_answers(tokenizer, responses)
    correct = torch.tensor([task.is_correct(t, p) for t, p in zip(texts, problems)], dtype=torch.bool)
    lengths = torch.tensor([len(r) for r in responses])
    penalty = overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_factor)
    return correct.to(torch.float64) + penalty, correct


def compute_advantages(cfg: TrainConfig, batch: Scored) -> tuple[Tensor, float]:
    """float32 ``[N, L]`` token advantages and the seconds spent in ``token_advantage`` (0 for GRPO).

    Both arms share the rollout advantage ``A_i`` (group z-score of the shaped reward). KTAE adds the
    key-token score of each token; its correct / wrong split is the verifier's ``correct`` flag (passed
    as a 0/1 reward), so reward shaping such as the overlong penalty does not move a rollout across.
    """
    ro = batch.rollouts
    base = grpo_advantage(batch.rewards, ro.group, norm_by_std=cfg.norm_adv_by_std)
    if cfg.adv == "grpo":
        return (base[:, None] * ro.response_mask).float(), 0.0
    start = time.perf_counter()
    advantages = token_advantage(ro.responses, ro.response_mask, batch.correct.to(torch.float64), ro.group,
                                 config=cfg.ktae_config(), backend=cfg.ktae_backend, rollout_advantage=base)
    return advantages, time.perf_counter() - start


def update_policy(cfg: TrainConfig, policy: PreTrainedModel, ref: PreTrainedModel | None,
                  optimizer: torch.optim.Optimizer, rollouts: Rollouts, advantages: Tensor) -> dict:
    """``ppo_epochs`` passes over ``mini_batches`` shuffled mini-batches; returns mean loss / clip_frac / kl."""
    with torch.no_grad():
        old_logp = token_logprobs(policy, rollouts, cfg.temperature)
        ref_logp = token_logprobs(ref, rollouts, cfg.temperature) if ref is not None else None
    policy.train()
    n = rollouts.group.shape[0]
    stats: list[dict] = []
    for _ in range(cfg.ppo_epochs):
        for index in torch.randperm(n).to(rollouts.group.device).chunk(cfg.mini_batches):
            mb = rollouts.rows(index)
            logp = token_logprobs(policy, mb, cfg.temperature)
            loss, s = policy_loss(logp, old_logp[index], advantages[index], mb.response_mask,
                                  eps_low=cfg.eps_low, eps_high=cfg.eps_high, loss_agg=cfg.loss_agg,
                                  ref_logp=None if ref_logp is None else ref_logp[index], kl_coef=cfg.kl_coef)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            optimizer.step()
            stats.append(dict(s, loss=loss.item()))
    return {k: statistics.fmean(s[k] for s in stats) for k in stats[0]}


@torch.no_grad()
def evaluate(engine: Engine, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: AdditionTask) -> float:
    """Greedy accuracy on the task's held-out eval set (NaN when it is empty)."""
    if not task.eval_set:
        return float("nan")
    prompts = [encode_prompt(tokenizer, p.prompt) for p in task.eval_set]
    texts = decode_answers(tokenizer, engine.generate(policy, prompts, 1, greedy=True))
    return statistics.fmean(task.is_correct(t, p) for t, p in zip(texts, task.eval_set))


def make_engine(cfg: TrainConfig, policy: PreTrainedModel,
                tokenizer: PreTrainedTokenizerBase) -> Engine:
    if cfg.rollout == "vllm":
        return VLLMRollout(policy, tokenizer, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.seed)
    return HFRollout(tokenizer, cfg.max_new_tokens, cfg.temperature, cfg.top_p)


def summarise(cfg: TrainConfig, history: list[dict], warmup_losses: list[float]) -> dict:
    """The run's config, the eval accuracy before / after RL and the median step timings.

    Timings are medians over the steps that trained (all steps when none did): a step whose dynamic
    sampling kept no group runs no KTAE and no update, and the first ``token_advantage`` call pays
    one-off set-up (loading the backend) that a mean would spread over a short run.
    """
    steps = [r for r in history if r["step"] > 0]
    timed = [r for r in steps if "loss" in r] or steps
    evals = [r for r in history if "eval_acc" in r]
    median = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    return dict(
        config=dataclasses.asdict(cfg), warmup_final_loss=warmup_losses[-1] if warmup_losses else None,
        eval_acc_start=evals[0]["eval_acc"], eval_acc_end=evals[-1]["eval_acc"],
        reward_first20=statistics.fmean(r["reward"] for r in steps[:20]),
        reward_last20=statistics.fmean(r["reward"] for r in steps[-20:]),
        step_s=median("step_s"), gen_s=median("gen_s"), update_s=median("update_s"), ktae_s=median("ktae_s"),
        ktae_share=median("ktae_share"),
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends a flag's default unless it is None, a switch, or already stated in the help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0 or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m training.train", description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--adv", choices=ADVANTAGES, default=d.adv, help="advantage estimator: plain GRPO or GRPO + KTAE")
    g.add_argument("--preset", choices=tuple(PRESETS), default=d.preset,
                   help="grpo: symmetric clip, seq-mean-token-mean loss; dapo: clip-higher 0.2/0.28, token-mean "
                        "loss, dynamic sampling, overlong penalty (flags below override a preset)")
    g.add_argument("--name", default=d.name, help="run name (default: <preset>-<adv>-s<seed>)")
    g.add_argument("--out-dir", default=d.out_dir, help="output dir (default: training/runs/<name>, git-ignored)")
    g.add_argument("--seed", type=int, default=d.seed, help="seeds model init, warm-up data, prompts and sampling")
    g.add_argument("--steps", type=int, default=d.steps, help="RL steps")
    g.add_argument("--device", default=d.device, help="torch device (default: cuda if available, else cpu)")
    g.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="policy dtype (bfloat16 for a real model on a GPU)")
    g.add_argument("--threads", type=int, default=d.threads,
                   help="torch CPU threads (default: 1 for --model tiny, whose small matmuls more threads slow "
                        "down; torch's choice otherwise)")
    g.add_argument("--report-every", type=int, default=d.report_every, metavar="N",
                   help="every N steps write <out-dir>/report-stepNNNN.html (the step, 4 digits): the step's rollouts "
                        "coloured by KTAE key-token score (ktae_kernels.viz); 0: off")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="hide the tqdm progress bar")
    g = p.add_argument_group("model, task and rollouts")
    g.add_argument("--model", default=d.model, help="'tiny' (random Qwen2 built in code + char tokenizer) or a "
                                                    "local HF checkpoint directory, e.g. a Qwen2.5-Math path")
    g.add_argument("--task", choices=tuple(TASKS), default=d.task, help="verifiable task (exact-match reward)")
    g.add_argument("--digits", type=int, default=d.digits, help="operand digits of the addition task")
    g.add_argument("--rollout", choices=ROLLOUTS, default=d.rollout, help="hf: transformers generate; vllm: vLLM (GPU)")
    g.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step, help="prompts (groups) per step")
    g.add_argument("--group-size", type=int, default=d.group_size, help="rollouts per prompt (G)")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="max response tokens")
    g.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling")
    g.add_argument("--eval-every", type=int, default=d.eval_every, help="greedy eval every N steps")
    g.add_argument("--eval-size", type=int, default=d.eval_size, help="held-out eval problems")
    g = p.add_argument_group("supervised warm-up (not RL; gives a random tiny model mixed groups)")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help="SFT steps before RL (default: 300 for --model tiny, 0 for a checkpoint)")
    g.add_argument("--warmup-lr", type=float, default=d.warmup_lr, help="SFT learning rate")
    g.add_argument("--warmup-batch", type=int, default=d.warmup_batch, help="SFT batch size")
    g = p.add_argument_group("policy update")
    g.add_argument("--lr", type=float, default=d.lr, help="RL learning rate (AdamW, no weight decay)")
    g.add_argument("--mini-batches", type=int, default=d.mini_batches, help="optimizer steps per batch per epoch")
    g.add_argument("--ppo-epochs", type=int, default=d.ppo_epochs, help="passes over each batch")
    g.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="gradient clipping")
    g.add_argument("--no-std-norm", dest="norm_adv_by_std", action="store_false",
                   help="rollout advantage r - mean (Dr. GRPO) instead of the group z-score")
    g.add_argument("--eps-low", type=float, help="lower clip range (preset)")
    g.add_argument("--eps-high", type=float, help="upper clip range (preset)")
    g.add_argument("--loss-agg", choices=LOSS_AGGS, help="loss aggregation (preset)")
    g.add_argument("--kl-coef", type=float,
                   help="k3 KL to the frozen initial policy; > 0 keeps a reference copy (preset: 0)")
    g.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction,
                   help="drop all-correct / all-wrong groups and resample (preset)")
    g.add_argument("--max-gen-batches", type=int, default=d.max_gen_batches,
                   help="generation rounds per step with dynamic sampling")
    g.add_argument("--overlong-buffer", type=int, help="soft overlong penalty over the last N tokens; 0: off (preset)")
    g.add_argument("--overlong-factor", type=float, default=d.overlong_factor, help="overlong penalty at max length")
    g = p.add_argument_group("KTAE (ktae_kernels.KTAEConfig)")
    g.add_argument("--ktae-backend", default=d.ktae_backend, choices=("auto", *backend_names()),
                   help="ktae_kernels backend (default auto: the fastest this machine runs)")
    g.add_argument("--ktae-weight", type=float, default=d.ktae_weight, help="advantage = A + weight * score")
    g.add_argument("--ktae-alpha", type=float, default=d.ktae_alpha, help="weight of the Fisher term")
    g.add_argument("--ktae-beta", type=float, default=d.ktae_beta, help="weight of the information gain")
    g.add_argument("--ktae-top", type=float, default=d.ktae_top, help="scores lie in (-top, top)")
    g.add_argument("--ktae-fisher", choices=("exact", "upstream"), default=d.ktae_fisher, help="Fisher test mode")
    g.add_argument("--ktae-ignore-ids", type=int, nargs="*", default=list(d.ktae_ignore_ids), help="token ids scored 0")
    return p


def main(argv: list[str] | None = None) -> RunResult:
    args = vars(build_parser().parse_args(argv))
    args["ktae_ignore_ids"] = tuple(args["ktae_ignore_ids"])
    result = train(TrainConfig(**args))
    summary = summarise(result.config, result.history, result.warmup_losses)
    print(f"{result.config.name}: eval accuracy {summary['eval_acc_start']:.3f} -> {summary['eval_acc_end']:.3f}, "
          f"reward first/last 20 steps {summary['reward_first20']:.3f} -> {summary['reward_last20']:.3f}, "
          f"median step {summary['step_s']:.3f} s, KTAE {1e3 * summary['ktae_s']:.2f} ms ({100 * summary['ktae_share']:.2f}%); "
          f"logs in {result.out_dir}")
    return result


if __name__ == "__main__":
    main()
