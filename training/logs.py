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
    """Training reward and accuracy (sampled rollouts) and greedy eval accuracy over steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r["step"] > 0]
    evals = [r for r in rows if _is_number(r.get("eval_acc"))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in train], [r["reward"] for r in train], label="reward (mean)")
    ax.plot([r["step"] for r in train], [r["acc"] for r in train], label="accuracy (sampled)", alpha=0.6)
    ax.plot([r["step"] for r in evals], [r["eval_acc"] for r in evals], "o-", label="eval accuracy (greedy)")
    ax.set_xlabel("RL step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value)


def _fmt(value: object) -> object:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.6g}" if isinstance(value, float) else value
