"""Run outputs: the per-step CSV log, a JSON summary and a PNG plot of reward over steps."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

#: CSV columns, in order. Times are seconds; ktae_s is the token_advantage call (0 for --adv grpo).
COLUMNS = ("step", "reward", "acc", "resp_len", "loss", "clip_frac", "kl", "groups_kept", "gen_batches",
           "gen_s", "ktae_s", "update_s", "step_s", "ktae_share", "eval_acc")


def write_csv(rows: list[dict], path: Path) -> None:
    """One row per step (step 0 holds the evaluation before RL); missing values are left empty."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(row.get(k)) for k in COLUMNS})


def read_csv(path: Path) -> list[dict]:
    """Rows of a log written by ``write_csv``, numbers as floats (empty cells as NaN)."""
    with open(path, newline="") as f:
        return [{k: float(v) if v != "" else math.nan for k, v in row.items()} for row in csv.DictReader(f)]


def write_json(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def plot_run(rows: list[dict], path: Path, title: str) -> None:
    """Training reward and accuracy (sampled rollouts) and greedy eval accuracy over steps.

    Reward and sampled accuracy coincide whenever no reward shaping applies (reward = 1 if correct),
    so reward is a wide pale band and accuracy a thin dashed line on top: both stay visible. The
    legend sits below the axes, off the curves.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r["step"] > 0]
    evals = [r for r in rows if _is_number(r.get("eval_acc"))]
    steps = [r["step"] for r in train]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(steps, [r["reward"] for r in train], color="tab:blue", lw=4, alpha=0.35, solid_capstyle="butt",
            label="reward (mean over rollouts)")
    ax.plot(steps, [r["acc"] for r in train], color="black", lw=1, ls="--",
            label="accuracy of sampled rollouts")
    ax.plot([r["step"] for r in evals], [r["eval_acc"] for r in evals], "s-", color="tab:orange", ms=5, lw=1.5,
            label="eval accuracy (greedy, held-out)")
    ax.set(xlabel="RL step (0: before RL)", ylabel="reward / accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_step_report(path: Path, step_tensors: dict, tokenizer, ktae_config, title: str,
                      backend: str = "auto") -> Path:
    """The key-token HTML report (``ktae_kernels.viz.write_report``) of one step's batch.

    ``step_tensors``: ``rl_step``'s dict (``rollouts`` with ``responses``, ``response_mask`` ``[N, L]``
    and ``group`` ``[N]``; bool ``correct`` ``[N]``). The correct / wrong split is the verifier's flag,
    as in ``compute_advantages``; tokens and prompts are decoded with the run's tokenizer.
    """
    from ktae_kernels.viz import write_report

    ro = step_tensors["rollouts"]
    prompts = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(ro.prompts.cpu(), ro.prompt_mask.cpu())],
                                     skip_special_tokens=True)
    return write_report(path, ro.responses, ro.response_mask, step_tensors["correct"].double(), ro.group,
                        decode=tokenizer, config=ktae_config, max_groups=8, title=title, prompts=prompts,
                        backend=backend)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value)


def _fmt(value: object) -> object:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.6g}" if isinstance(value, float) else value
