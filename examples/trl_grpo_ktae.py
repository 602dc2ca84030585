"""GRPO + KTAE with TRL's GRPOTrainer on a 2-core CPU, nothing downloaded.

A tiny randomly initialised Qwen2 model (``training/model.py``) and a character tokenizer
(``training/tokenizer.py``) learn two-digit addition: prompt ``"07+85="``, answer ``"092"``, reward 1
for an exact match. A short supervised warm-up (plain cross-entropy, not RL) first brings accuracy to a
middling level so groups mix correct and wrong rollouts, which is where KTAE's token scores are
non-zero. Then ``KTAEGRPOTrainer`` (a drop-in ``GRPOTrainer``) trains with per-token advantages and
logs its ``ktae/*`` metrics through TRL's own metrics, printed here at every logging step.

    python examples/trl_grpo_ktae.py                 # about two minutes on 2 CPU cores
    python examples/trl_grpo_ktae.py --max-steps 3   # a smoke run

For a real model, replace ``build_model`` with ``AutoModelForCausalLM.from_pretrained(...)`` and the
task with your dataset and reward functions; the KTAE lines are the ``KTAEGRPOTrainer(...)`` call.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the tiny model and tokenizer live in the repository's training/ package
    sys.path.insert(0, str(REPO))

from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from ktae_kernels import KTAEConfig  # noqa: E402
from ktae_kernels.integrations.trl import KTAEGRPOTrainer  # noqa: E402
from training.model import build_tiny_model  # noqa: E402
from training.tasks import AdditionTask  # noqa: E402
from training.tokenizer import build_char_tokenizer  # noqa: E402


def exact_match(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """TRL reward function: 1.0 when the completion is the answer (the dataset's ``answer`` column)."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def warm_up(model, tokenizer, task: AdditionTask, steps: int, rng: random.Random, batch: int = 64) -> None:
    """Teacher-forced cross-entropy on prompt -> answer + eos, tokenized as TRL tokenizes prompts."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        rows = []
        for p in task.sample(rng, batch):
            prompt = tokenizer.encode(p.prompt, add_special_tokens=False)
            answer = tokenizer.encode(p.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
            rows.append((prompt + answer, len(prompt)))
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        labels = torch.full((batch, width), -100)
        for i, (seq, start) in enumerate(rows):
            ids[i, :len(seq)] = torch.tensor(seq)
            labels[i, start:len(seq)] = torch.tensor(seq[start:])
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


class PrintKTAE(TrainerCallback):
    """Prints the reward and the ``ktae/*`` metrics TRL logs (``trainer.state.log_history`` keeps them)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            ktae = "  ".join(f"{k}={v:.3g}" for k, v in logs.items() if k.startswith("ktae/"))
            print(f"step {state.global_step:3d}  reward={logs['reward']:.3f}  {ktae}", flush=True)


def build_model(tokenizer, seed: int):
    torch.manual_seed(seed)
    return build_tiny_model(tokenizer, hidden=64, layers=2, heads=4, max_positions=32)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=300, help="GRPO steps (default 300: about two minutes with the warm-up)")
    parser.add_argument("--warmup-steps", type=int, default=600, help="supervised warm-up steps before RL")
    parser.add_argument("--num-generations", type=int, default=8, help="rollouts per prompt (G)")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--metrics", default="scores", choices=("advantages", "scores", "off"),
                        help="ktae/ metrics: 'scores' adds distinct tokens per group at one extra scoring pass")
    parser.add_argument("--output-dir", default=None, help="TRL output dir (default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # a 0.1M-parameter model runs fastest on one thread
    rng = random.Random(args.seed)
    task = AdditionTask(digits=2, eval_size=100)
    tokenizer = build_char_tokenizer()
    model = build_model(tokenizer, args.seed)
    start = time.perf_counter()
    warm_up(model, tokenizer, task, args.warmup_steps, rng)

    n_prompts = args.max_steps * args.prompts_per_step
    problems = task.sample(rng, n_prompts)
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="ktae_trl_")
    config = GRPOConfig(
        output_dir=output_dir, max_steps=args.max_steps, learning_rate=5e-4, seed=args.seed,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations, max_completion_length=5, temperature=1.0,
        beta=0.0, loss_type="dapo", logging_steps=max(1, min(10, args.max_steps)), report_to="none", use_cpu=True,
        save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = KTAEGRPOTrainer(
        model, reward_funcs=exact_match, args=config, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[PrintKTAE()],
        ktae_config=KTAEConfig(ignore_token_ids=(tokenizer.pad_token_id, tokenizer.eos_token_id)),
        ktae_metrics=args.metrics,
    )
    trainer.remove_callback(PrinterCallback)  # PrintKTAE prints the lines that matter here
    print(f"warm-up done in {time.perf_counter() - start:.0f} s; GRPO + KTAE for {args.max_steps} steps", flush=True)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    summary = {k: v for k, v in logged[-1].items() if k.startswith("ktae/") or k == "reward"} if logged else {}
    print(f"done in {time.perf_counter() - start:.0f} s; last logged: "
          + ", ".join(f"{k}={v:.3g}" for k, v in summary.items()), flush=True)
    return summary


if __name__ == "__main__":
    main()
