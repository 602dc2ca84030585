"""``python -m training.compare``: GRPO vs GRPO + KTAE over the same seeds, one comparison plot.

Every flag not listed here is passed to ``training.train`` (e.g. ``--preset dapo --steps 150``).
Writes ``<results-dir>/<tag>-<adv>-s<seed>.csv`` (the per-step logs), ``<tag>-summary.json``
(per-run summaries and the per-arm means) and ``<tag>.png``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from pathlib import Path

from .config import TrainConfig
from .logs import read_csv, write_csv, write_json
from .train import HelpFormatter, build_parser, summarise, train

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def run_grid(train_args: list[str], advs: list[str], seeds: list[int], results_dir: Path, tag: str) -> dict:
    """Train every (adv, seed), copy each log to ``results_dir`` and return the summary dict."""
    results_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in seeds:
        for adv in advs:
            args = vars(build_parser().parse_args([*train_args, "--adv", adv, "--seed", str(seed)]))
            args["ktae_ignore_ids"] = tuple(args["ktae_ignore_ids"])
            result = train(TrainConfig(**args))
            write_csv(result.history, results_dir / f"{tag}-{adv}-s{seed}.csv")
            summary = summarise(result.config, result.history, result.warmup_losses)
            runs.append(dict(adv=adv, seed=seed, **{k: v for k, v in summary.items() if k != "config"}))
            print(f"{tag} {adv} seed {seed}: eval {summary['eval_acc_start']:.3f} -> {summary['eval_acc_end']:.3f}, "
                  f"reward {summary['reward_first20']:.3f} -> {summary['reward_last20']:.3f}, "
                  f"step {summary['step_s']:.3f} s, KTAE share {100 * summary['ktae_share']:.2f}%", flush=True)
    arms = {adv: {k: statistics.fmean(r[k] for r in runs if r["adv"] == adv)
                  for k, v in runs[0].items() if isinstance(v, float)} for adv in advs}
    return dict(train_args=train_args, seeds=seeds, runs=runs, mean_over_seeds=arms,
                config=summary_config(result.config))


def summary_config(config: TrainConfig) -> dict:
    """The run config without the per-run fields (adv, seed, name, out_dir)."""
    skip = {"adv", "seed", "name", "out_dir", "progress"}
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in skip}


def plot_comparison(results_dir: Path, tag: str, advs: list[str], seeds: list[int], path: Path,
                    window: int = 10) -> None:
    """Left: training reward (moving average over ``window`` steps, mean over seeds, thin lines per
    seed). Right: greedy eval accuracy on the held-out set (mean over seeds, thin lines per seed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for colour, adv in zip(("tab:blue", "tab:red"), advs):
        logs = [read_csv(results_dir / f"{tag}-{adv}-s{seed}.csv") for seed in seeds]
        label = "GRPO advantage" if adv == "grpo" else "GRPO + KTAE advantage"
        steps = [r["step"] for r in logs[0] if r["step"] > 0]
        rewards = [_moving_average([r["reward"] for r in log if r["step"] > 0], window) for log in logs]
        for curve in rewards:
            left.plot(steps, curve, color=colour, alpha=0.25, lw=0.8)
        left.plot(steps, [statistics.fmean(v) for v in zip(*rewards)], color=colour, lw=2, label=label)
        evals = [[(r["step"], r["eval_acc"]) for r in log if not math.isnan(r["eval_acc"])] for log in logs]
        for curve in evals:
            right.plot(*zip(*curve), color=colour, alpha=0.25, lw=0.8)
        right.plot([s for s, _ in evals[0]], [statistics.fmean(v[1] for v in col) for col in zip(*evals)],
                   "o-", color=colour, lw=2, ms=3, label=label)
    left.set(xlabel="RL step", ylabel=f"training reward (moving avg, {window} steps)",
             title="reward of sampled rollouts")
    right.set(xlabel="RL step", ylabel="accuracy", title="greedy accuracy, held-out problems")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    # one legend for both panels, below them, off the curves
    fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncols=len(advs), fontsize=9, frameon=False)
    fig.suptitle(f"{tag}: mean of seeds {seeds} (thin: each seed)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _moving_average(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.compare", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="seeds, each run for every arm")
    p.add_argument("--advs", nargs="+", choices=("grpo", "ktae"), default=["grpo", "ktae"], help="arms")
    p.add_argument("--tag", default="grpo", help="file-name prefix of this comparison")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where logs, summary and plot go")
    args, train_args = p.parse_known_args(argv)
    train_args = [*train_args, "--no-progress"]
    summary = run_grid(train_args, args.advs, args.seeds, args.results_dir, args.tag)
    write_json(summary, args.results_dir / f"{args.tag}-summary.json")
    plot_comparison(args.results_dir, args.tag, args.advs, args.seeds, args.results_dir / f"{args.tag}.png")
    for adv, means in summary["mean_over_seeds"].items():
        print(f"{adv}: eval {means['eval_acc_start']:.3f} -> {means['eval_acc_end']:.3f}, "
              f"reward {means['reward_first20']:.3f} -> {means['reward_last20']:.3f}")


if __name__ == "__main__":
    main()
