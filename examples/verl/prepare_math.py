"""MATH levels 3-5 (train) and MATH-500 (validation) as verl parquet files, the paper's data setting.

    python examples/verl/prepare_math.py --out ~/data/ktae_math

writes ``train.parquet`` (MATH train split, levels 3-5: about 5.6k problems after the level filter)
and ``test.parquet`` (MATH-500), plus ``train.jsonl`` / ``test.jsonl`` with ``prompt`` and ``label``
for OpenRLHF (``--data.input_key prompt --data.label_key label``; examples/openrlhf/run_ktae.sh). Each row is what verl's ``RLHFDataset`` and its rule reward expect:
``data_source`` (verl's ``default_compute_score`` scores "DigitalLearningGmbH/MATH-lighteval" and
"HuggingFaceH4/MATH-500" with its MATH checker: 1.0 when the last ``\\boxed{}`` matches),
``prompt`` (chat messages), ``ability``, ``reward_model.ground_truth`` and ``extra_info``.

Needs ``datasets`` and network access to the Hugging Face hub (run it where you train).
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Iterable

TRAIN_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
TEST_SOURCE = "HuggingFaceH4/MATH-500"
LEVELS = ("Level 3", "Level 4", "Level 5")
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def boxed_answer(solution: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of a MATH solution (verl's own MATH helpers)."""
    from verl.utils.reward_score.math_reward import last_boxed_only_string, remove_boxed

    boxed = last_boxed_only_string(solution)
    return None if boxed is None else remove_boxed(boxed)


def to_verl_row(problem: str, answer: str, *, data_source: str, split: str, index: int,
                level: str | None = None, subject: str | None = None) -> dict[str, Any]:
    """One verl RL row."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "level": level or "", "type": subject or ""},
    }


def train_rows(records: Iterable[dict[str, Any]], levels: tuple[str, ...] = LEVELS) -> list[dict[str, Any]]:
    """MATH train records (``problem``, ``solution``, ``level``, ``type``) -> verl rows of the given levels."""
    rows = []
    for record in records:
        if record["level"] not in levels:
            continue
        answer = boxed_answer(record["solution"])
        if answer is None:
            continue
        rows.append(to_verl_row(record["problem"], answer, data_source=TRAIN_SOURCE, split="train", index=len(rows),
                                level=record["level"], subject=record["type"]))
    return rows


def test_rows(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """MATH-500 records (``problem``, ``answer``, ``level``, ``subject``) -> verl rows."""
    return [to_verl_row(r["problem"], r["answer"], data_source=TEST_SOURCE, split="test", index=i,
                        level=str(r.get("level", "")), subject=r.get("subject")) for i, r in enumerate(records)]


def openrlhf_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, str]]:
    """verl rows -> OpenRLHF prompt-dataset rows: the user message as ``prompt``, the answer as ``label``."""
    return [{"prompt": r["prompt"][0]["content"], "label": r["reward_model"]["ground_truth"]} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description="MATH levels 3-5 + MATH-500 as verl parquet files")
    parser.add_argument("--out", default=os.path.expanduser("~/data/ktae_math"))
    args = parser.parse_args()
    import datasets

    os.makedirs(args.out, exist_ok=True)
    train = train_rows(datasets.load_dataset(TRAIN_SOURCE, split="train"))
    test = test_rows(datasets.load_dataset(TEST_SOURCE, split="test"))
    datasets.Dataset.from_list(train).to_parquet(os.path.join(args.out, "train.parquet"))
    datasets.Dataset.from_list(test).to_parquet(os.path.join(args.out, "test.parquet"))
    datasets.Dataset.from_list(openrlhf_rows(train)).to_json(os.path.join(args.out, "train.jsonl"))
    datasets.Dataset.from_list(openrlhf_rows(test)).to_json(os.path.join(args.out, "test.jsonl"))
    print(f"wrote {len(train)} train rows (levels 3-5) and {len(test)} test rows to {args.out}")


if __name__ == "__main__":
    main()
